"""FP8 as real runs write it (the stack's ``fp8``: costmodel.fp8, piper_sim.fp8): only the
transformer blocks' linears run in FP8, and the recipe's quantisation kernels are priced."""

from __future__ import annotations

import os

import pytest

from costmodel.stack import Stack, StackError, parse_stack
from piper_sim.api import compile
from piper_sim.configs import ZOO, get_config, tp_shard
from piper_sim.fp8 import block_linears
from piper_sim.profiling import profile_model, segment_kind
from piper_sim.simulator import simulate
from piper_sim.strategy import StrategyError

T = 2048  # tokens of one profiled micro-batch (1 x 2048)


def _calls(rows, dtype: str, cls: str = "gemm") -> int:
    return sum(r[4] for r in rows if r[0] == cls and r[3] == dtype)


def _passes(seg):
    return {"F": seg.kernels_f, "BI": seg.kernels_bi, "BW": seg.kernels_bw}


def _check_moved(cfg, recipe: str, family: str, fp8_calls: dict[str, int], kept_calls: dict[str, int]):
    """Per segment kind: the FP8 GEMM calls of each pass, the GEMM calls left in bf16; flops and
    the number of GEMM calls as without FP8."""
    plain = profile_model(cfg, 1, T, "bf16")
    fp8 = profile_model(cfg, 1, T, "bf16", Stack(fp8=recipe), family)
    seen = set()
    for a, b in zip(plain, fp8):
        kind = b.name.split(".")[-1] if b.name.endswith((".pre", ".experts")) else b.name.split(".")[0]
        seen.add(kind)
        for name, rows in _passes(b).items():
            assert _calls(rows, "fp8") == fp8_calls[kind], (b.name, name)
            assert _calls(rows, "bf16") == kept_calls[kind], (b.name, name)
            assert _calls(rows, "fp8") + _calls(rows, "bf16") == _calls(_passes(a)[name], "bf16")
            assert sum(r[5] for r in rows) == pytest.approx(sum(r[5] for r in _passes(a)[name]))
        if kind in ("embed", "head"):
            assert _passes(a) == _passes(b)  # untouched
    assert seen == set(fp8_calls)


def test_fp8_moves_exactly_the_block_linears_llama():
    """Llama 3 8B: the 7 linears of each layer (q, k, v, o, gate, up, down) in every pass; the
    embedding and the 128k-vocabulary output head stay bf16."""
    _check_moved(get_config("llama3-8b"), "tensorwise", "hopper",
                 {"embed": 0, "layers": 7, "head": 0}, {"embed": 0, "layers": 0, "head": 1})


def test_fp8_moves_exactly_the_block_linears_moe():
    """moe-tiny: attention's 4 linears in the pre segment, the router's GEMM stays bf16; the
    routed experts' 3 linears x 4 experts in FP8."""
    _check_moved(get_config("moe-tiny"), "blockwise", "hopper",
                 {"embed": 0, "pre": 4, "experts": 12, "head": 0}, {"embed": 0, "pre": 1, "experts": 0, "head": 1})


def test_fp8_moves_exactly_the_block_linears_deepseek_v3():
    """DeepSeek-V3 (MLA, 1 shared + 256 routed experts): MLA's 5 projections and the dense or
    shared MLP's 3 linears; the gate stays bf16 (DSV3 §3.3)."""
    _check_moved(get_config("deepseek-v3"), "mxfp8", "blackwell",
                 {"embed": 0, "layers": 8, "pre": 8, "experts": 3 * 256, "head": 0},
                 {"embed": 0, "layers": 0, "pre": 1, "experts": 0, "head": 1})


@pytest.mark.parametrize("name, tp", [(n, 1) for n in sorted(ZOO)] + [("llama3-70b", 8), ("qwen3-moe-9b", 4)])
def test_every_zoo_layer_matches_its_linears(name, tp):
    """Every linear of the closed-form layer list (piper_sim.recompute.layer_table) finds its GEMM
    in the profile, in each pass, for every zoo model (and a tensor-parallel shard)."""
    cfg = tp_shard(get_config(name), tp, tp > 1)
    for seg in profile_model(cfg, 1, 256, "bf16", Stack(fp8="tensorwise")):
        kind = segment_kind(cfg, seg.name)
        if kind in ("dense", "moe_pre"):
            want = len(block_linears(cfg, kind, 1, 256))
            assert [_calls(rows, "fp8") for rows in _passes(seg).values()] == [want] * 3, seg.name


def test_unfused_attention_bmms_stay_in_the_model_dtype():
    """Megatron's unfused attention core (two bmms per layer) keeps the model dtype."""
    layer = profile_model(get_config("gpt-tiny"), 2, 64, "bf16", Stack(attention="unfused", fp8="tensorwise"))[1]
    for name, rows in _passes(layer).items():
        bmm = [r for r in rows if r[1] in ("bmm", "baddbmm")]
        assert all(r[3] == "bf16" for r in bmm) and (name == "BW" or len(bmm) >= 2)  # BW: no attention
        assert _calls(rows, "fp8") == 7  # q, k, v, o, gate, up, down


# closed forms of one cast of a [rows, cols] bf16 tensor (2 bytes an element), from each format's
# definition: source reads, FP8 copies at one byte an element, and their scales
def _cast(recipe: str, family: str, elements: int, weight: bool = False) -> float:
    if recipe == "tensorwise":  # amax pass + cast pass; one fp32 scale per copy; Hopper: + transposed copy
        copies = 2 if family == "hopper" else 1
        return 2 * 2 * elements + copies * (elements + 4)
    if recipe == "blockwise":  # one read; rowwise + columnwise; fp32 per 1x128 (weights: 128x128) block
        return 2 * elements + 2 * (elements + 4 * elements / (128 * 128 if weight else 128))
    assert recipe == "mxfp8"  # one read; rowwise + columnwise; one E8M0 byte per 32 elements
    return 2 * elements + 2 * (elements + elements / 32)


@pytest.mark.parametrize("recipe, family", [("tensorwise", "hopper"), ("tensorwise", "blackwell"),
                                            ("blockwise", "hopper"), ("mxfp8", "blackwell")])
def test_quantisation_bytes_per_linear_are_the_formats(recipe, family):
    """Llama 3 8B layer, T tokens: the forward casts each distinct input once (q/k/v read the
    attention norm's output, gate/up the MLP norm's: T x h each; o reads T x h, down T x ffn);
    the input-gradient pass casts each linear's output gradient."""
    cfg = get_config("llama3-8b")
    h, ffn, kv = cfg.hidden, cfg.ffn, cfg.n_kv_heads * cfg.head_dim
    layer = profile_model(cfg, 1, T, "bf16", Stack(fp8=recipe), family)[1]
    quant = lambda rows, name: sum(r[6] for r in rows if r[1] == name)  # noqa: E731
    inputs = [T * h] * 3 + [T * ffn]
    assert quant(layer.kernels_f, "fp8_quantize_input") == pytest.approx(
        sum(_cast(recipe, family, e) for e in inputs), abs=8)
    grads = [T * h, T * kv, T * kv, T * h, T * ffn, T * ffn, T * h]
    assert quant(layer.kernels_bi, "fp8_quantize_grad_output") == pytest.approx(
        sum(_cast(recipe, family, e) for e in grads), abs=8)
    assert not [r for r in layer.kernels_bw if r[1].startswith("fp8_quantize")]


def _opt_bytes(plan) -> float:
    """Bytes the optimizer steps of rank 0 move."""
    return sum(i.bytes for i in plan.class_of(0).instructions() if i.kind == "OPT")


@pytest.mark.parametrize("recipe, cluster", [("tensorwise", "h100:1x2"), ("mxfp8", "b200:1x2")])
def test_weights_are_cast_once_per_step_in_the_optimizer_step(recipe, cluster):
    """The FP8 weights of the rank's ZeRO shard, once per step (not per micro-batch): the OPT op
    moves the casts' bytes on top of AdamW's."""
    cfg = get_config("gpt-tiny")
    s = {"model": "gpt-tiny", "cluster": cluster, "global_batch": 8, "seq_len": 64, "microbatches": 4,
         "directives": [{"op": "data_parallel", "degree": 2, "zero": 1}]}
    plain, fp8 = compile(s), compile({**s, "stack": {"fp8": recipe}})
    family = "hopper" if cluster.startswith("h100") else "blackwell"
    h, ffn = cfg.hidden, cfg.ffn
    per_layer = 4 * _cast(recipe, family, h * h, weight=True) + 3 * _cast(recipe, family, h * ffn, weight=True)
    # q, k, v, o (h x h, n_kv_heads = n_heads) and gate, up, down (h x ffn); a rank casts its ZeRO-1 half
    assert _opt_bytes(fp8) - _opt_bytes(plain) == pytest.approx(cfg.n_layers * per_layer / 2, rel=1e-9)
    s8 = {**s, "microbatches": 8, "global_batch": 16}
    assert _opt_bytes(compile({**s8, "stack": {"fp8": recipe}})) - _opt_bytes(compile(s8)) == \
        pytest.approx(_opt_bytes(fp8) - _opt_bytes(plain))  # per step, whatever the micro-batches


@pytest.mark.parametrize("value, match", [({"fp8": "fp4"}, "fp8 must be one of none, tensorwise, blockwise, mxfp8"),
                                          ({"fp8": True}, "fp8 must be one of")])
def test_bad_recipe_is_one_line(value, match):
    with pytest.raises(StackError, match=match) as e:
        parse_stack(value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("recipe, cluster, match", [
    ("mxfp8", "h100:1x1", "fp8 'mxfp8' runs on Blackwell GPUs only, not H100 .hopper.; use fp8 tensorwise or "
                          "blockwise or none"),
    ("blockwise", "b200:1x1", "runs on Hopper GPUs only, not B200"),
    ("tensorwise", "a100:1x1", "runs on Hopper or Blackwell GPUs only, not A100-80G .ampere.; use fp8 none"),
    ("tensorwise", "cpu:1", "not CPU"),
])
def test_recipe_on_a_gpu_without_it_is_one_line(recipe, cluster, match):
    with pytest.raises(StrategyError, match=match) as e:
        compile({"model": "gpt-tiny", "cluster": cluster, "global_batch": 8, "seq_len": 64, "stack": {"fp8": recipe}})
    assert "\n" not in str(e.value)


def test_fp8_is_faster_on_h100_but_not_twice():
    """Llama 3 8B on 8 H100s: FP8 linears at twice the peak, but the head, attention, norms and
    the casts stay: faster, by much less than 2x."""
    s = {"model": "llama3-8b", "cluster": "h100:1x8", "global_batch": 8, "seq_len": 8192,
         "directives": [{"op": "data_parallel", "degree": 8, "zero": 3}]}
    fp8 = compile({**s, "stack": {"preset": "megatron-te", "fp8": "tensorwise"}})
    bf16 = simulate(compile({**s, "stack": "megatron-te"})).step_time_s
    assert 1.1 < bf16 / simulate(fp8).step_time_s < 1.6  # 1.28x at the time of writing
    assert fp8.header.stack["fp8"] == "tensorwise"
    assert "fp8 tensorwise" in parse_stack(fp8.header.stack).describe()


def test_every_gemm_override_still_prices_the_head_in_fp8():
    """The old cost-model key ``gemm_dtype`` (back-compat) prices every GEMM in FP8, the head's
    included: faster than the stack's recipe, which keeps the head and adds casts."""
    from costmodel.hardware import parse_cluster
    from costmodel.model import AnalyticCostModel

    s = {"model": "llama3-8b", "cluster": "h100:1x8", "global_batch": 8, "seq_len": 4096,
         "directives": [{"op": "data_parallel", "degree": 8, "zero": 3}]}
    every = simulate(compile(s), AnalyticCostModel(parse_cluster("h100:1x8"), {"gemm_dtype": "fp8"})).step_time_s
    assert every < simulate(compile({**s, "stack": {"fp8": "tensorwise"}})).step_time_s


def test_stack_json_omits_fp8_none_and_round_trips():
    assert "fp8" not in Stack().to_json() and "fp8" not in parse_stack("megatron-te").to_json()
    from piper_sim.strategy import parse_strategy

    st = parse_strategy({"model": "gpt-tiny", "cluster": "h100:1x1", "global_batch": 1, "seq_len": 8,
                         "stack": {"preset": "megatron-te", "fp8": "blockwise"}})
    assert parse_strategy(st.to_json()).stack == st.stack and st.stack.fp8 == "blockwise"


def test_fp8_with_tensor_and_expert_parallel():
    """A shard's linears (TP) and a rank's regrouped experts (EP) are FP8 too."""
    tp = compile({"model": "llama3-8b", "cluster": "h100:1x8", "global_batch": 8, "seq_len": 4096,
                  "stack": {"fp8": "tensorwise"},
                  "directives": [{"op": "tensor_parallel", "degree": 8, "sequence_parallel": True}]})
    rows = [r for t in tp.kernels.values() for r in t if r[0] == "gemm"]
    assert {r[3] for r in rows} == {"fp8", "bf16"} and simulate(tp).step_time_s > 0
    ep = compile({"model": "moe-tiny", "cluster": "h100:1x4", "global_batch": 8, "seq_len": 64,
                  "stack": {"fp8": "blockwise"},
                  "directives": [{"op": "data_parallel", "degree": 4}, {"op": "expert_parallel", "degree": 4}]})
    assert simulate(ep).step_time_s > 0


def test_user_model_with_fp8_is_refused():
    models = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "user_models.py")
    with pytest.raises(StrategyError, match="fp8 'tensorwise' applies to the transformer blocks") as e:
        compile({"model": f"py:{models}:residual_mlp", "cluster": "h100:1x1", "global_batch": 2, "seq_len": 8,
                 "dtype": "fp32", "stack": {"fp8": "tensorwise"}})
    assert "\n" not in str(e.value)


def test_executor_says_fp8_is_simulate_only():
    from executor.options import stack_settings

    plan = compile({"model": "gpt-tiny", "cluster": "h100:1x2", "global_batch": 4, "seq_len": 32,
                    "stack": {"fp8": "tensorwise"}, "directives": [{"op": "data_parallel", "degree": 2}]})
    _, notice = stack_settings(plan)
    assert "fp8 tensorwise (simulate-only: the linears run in the plan's dtype)" in notice


def test_op_sac_keeps_fp8_linear_outputs_like_bf16_ones():
    """torchtitan's op-SAC policy sees a torchao float8 linear's ``aten.mm`` (the mode runs before
    the Float8 tensor's __torch_dispatch__, torchao float8_ops.py:351): it keeps the 1st, 3rd, ...
    mm output in bf16 as for bf16 linears (benchmarks/probe_saved_tensors.py). Under torch.compile
    the w2 output, which no backward reads, is not saved."""
    from piper_sim.memory import segment_memory

    cfg = get_config("llama3-8b")
    b, s = 1, 2048
    segs = {x.name: x for x in profile_model(cfg, b, s, "bf16", Stack(fp8="tensorwise"), "hopper")}
    bf16 = segment_memory(cfg, segs["layers.1"], b, s, "bf16", Stack())
    fp8 = segment_memory(cfg, segs["layers.1"], b, s, "bf16", Stack(fp8="tensorwise"))
    fp8_compiled = segment_memory(cfg, segs["layers.1"], b, s, "bf16", Stack(fp8="tensorwise", compile=True))
    t, h, ffn, kv = b * s, cfg.hidden, cfg.ffn, cfg.n_kv_heads * cfg.head_dim
    x = t * h * 2                      # the layer input (bf16)
    sdpa = t * h * 2 + t * cfg.n_heads * 4 + 24  # attention output, fp32 log-sum-exp, rng seed/offset
    wq, wv, w1, w2 = t * h * 2, t * kv * 2, t * ffn * 2, t * h * 2
    assert fp8.kept_under("op", (), True) == bf16.kept_under("op", (), True) == x + sdpa + wq + wv + w1 + w2
    assert fp8_compiled.kept_under("op", (), True) == x + sdpa + wq + wv + w1


def test_compiled_loss_keeps_model_dtype_logits():
    """torchtitan compiles the loss with --training.compile (components/loss.py:25-30 @e7c0cae):
    the head keeps the bf16 logits and two fp32 numbers per token instead of the fp32
    log-probabilities, and no fp32 copy of the logits exists (benchmarks/probe_saved_tensors.py)."""
    from piper_sim.memory import segment_memory

    cfg = get_config("llama3-8b")
    b, s = 1, 2048
    head = {x.name: x for x in profile_model(cfg, b, s, "bf16", Stack(), "hopper")}["head"]
    eager = segment_memory(cfg, head, b, s, "bf16", Stack())
    compiled = segment_memory(cfg, head, b, s, "bf16", Stack(compile=True))
    t, v = b * s, cfg.vocab
    assert eager.temp == t * v * (2 + 4)  # bf16 logits + their fp32 copy
    assert compiled.saved == eager.saved - t * v * 4 + t * v * 2 + t * 8
    assert compiled.temp == t * v * 2
