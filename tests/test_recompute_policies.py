"""Recompute policies as real runs write them (`piper_sim.recompute`): activation bytes per layer
equal closed forms written here, for a dense and a MoE layer; peak memory and recompute flops
order as the policies say; the directive's fields are checked one line at a time."""

from __future__ import annotations

import itertools
import warnings

import pytest

from piper_sim.api import compile
from piper_sim.compiler import compile_strategy
from piper_sim.memory import model_memory, piece_memory
from piper_sim.models import get_config
from piper_sim.profiling import profile_model
from piper_sim.recompute import Recompute
from piper_sim.simulator import simulate
from piper_sim.strategy import StrategyError

B, S = 2, 16  # micro-batch and sequence of the per-layer checks (bf16: 2 bytes)


@pytest.fixture(scope="module")
def tiny():
    out = {}
    for name in ("gpt-tiny", "moe-tiny"):
        cfg = get_config(name)
        segs = profile_model(cfg, B, S, "bf16")
        out[name] = (cfg, segs, model_memory(cfg, segs, B, S, "bf16"))
    return out


def layer_kept(tiny, name: str, policy: Recompute, ep: int = 1) -> list[float]:
    """Bytes each layer keeps F -> B under ``policy`` (one stage holding the whole model)."""
    _, segs, mems = tiny[name]
    units = list(dict.fromkeys(s.unit for s in segs))
    modes = policy.unit_modes(units)
    layers = [u for u in units if u.startswith("layers.")]
    kept = [piece_memory([(s.unit, mems[s.name]) for s in segs if s.unit in layers[:i]], policy.mode, ep > 1,
                         policy, modes).kept for i in range(len(layers) + 1)]  # the layers so far, one piece
    return [b - a for a, b in itertools.pairwise(kept)]


def test_table_is_what_autograd_keeps(tiny):
    """The closed-form saved-tensor table adds up to the meta-measured profile (GQA, fused
    norms, flash attention), for a dense layer and both segments of a MoE layer."""
    for name in ("gpt-tiny", "moe-tiny"):
        _, segs, mems = tiny[name]
        for s in segs:
            if mems[s.name].table is not None:
                assert mems[s.name].table.saved == s.saved_act_bytes, s.name


def test_dense_layer_closed_forms(tiny):
    cfg, _, mems = tiny["gpt-tiny"]
    h, H, hd, F, L = cfg.hidden, cfg.n_heads, cfg.head_dim, cfg.ffn, cfg.n_layers
    KV = cfg.n_kv_heads
    T = B * S
    sbh = T * h * 2
    none = mems["layers.0"].saved
    assert layer_kept(tiny, "gpt-tiny", Recompute()) == [none] * L
    # full: the layer's input only; Megatron uniform N: one input per chunk of N; block N: the first N
    assert layer_kept(tiny, "gpt-tiny", Recompute("full", "uniform", 1)) == [sbh] * L
    assert layer_kept(tiny, "gpt-tiny", Recompute("full", "uniform", 4)) == ([sbh] + [0.0] * 3) * (L // 4)
    assert layer_kept(tiny, "gpt-tiny", Recompute("full", "block", 3)) == [sbh] * 3 + [none] * (L - 3)
    # torchtitan every N-th block (selective_ac_option = "3"): layers 2, 5 are checkpoints
    assert layer_kept(tiny, "gpt-tiny", Recompute("every", every=3)) == \
        [sbh if (i + 1) % 3 == 0 else none for i in range(L)]
    # torchtitan op-SAC: input + outputs of mm 1, 3, 5, 7 (wq, wv, w1, w2) + SDPA out, lse, rng state
    op = sbh + T * H * hd * 2 + T * KV * hd * 2 + T * F * 2 + sbh + T * H * hd * 2 + T * H * 4 + 24
    assert layer_kept(tiny, "gpt-tiny", Recompute("op")) == [op] * L
    # Megatron selective modules: core_attn frees the lse and rng state (flash), layernorm both
    # norms' outputs and fp32 rstd, mlp its four SwiGLU internals (input stays)
    core = T * H * 4 + 24
    norms = 2 * (sbh + T * 4)
    mlp = 4 * T * F * 2
    assert layer_kept(tiny, "gpt-tiny", Recompute("selective")) == [none - core] * L
    for mods, freed in [(("core_attn",), core), (("layernorm",), norms), (("mlp",), mlp),
                        (("core_attn", "layernorm", "mlp"), core + norms + mlp), (("moe_act",), 0)]:
        assert layer_kept(tiny, "gpt-tiny", Recompute("selective", modules=mods)) == [none - freed] * L, mods
    assert none > op > none - core - norms - mlp > sbh


def test_moe_layer_closed_forms(tiny):
    cfg, _, mems = tiny["moe-tiny"]
    h, H, hd, KV, Fe, k, L = cfg.hidden, cfg.n_heads, cfg.head_dim, cfg.n_kv_heads, cfg.expert_ffn, cfg.top_k, cfg.n_layers
    T = B * S
    sbh = T * h * 2
    pre, experts = mems["layers.0.pre"].saved, mems["layers.0.experts"].saved
    assert experts == T * k * h * 2 + 4 * T * k * Fe * 2  # dispatched tokens + SwiGLU internals
    none = pre + experts
    assert layer_kept(tiny, "moe-tiny", Recompute()) == [none] * L
    # full without expert parallelism: the layer's input; with it the expert block keeps its dispatched tokens
    assert layer_kept(tiny, "moe-tiny", Recompute("full", "uniform", 1)) == [sbh] * L
    assert layer_kept(tiny, "moe-tiny", Recompute("full", "uniform", 1), ep=2) == [sbh + T * k * h * 2] * L
    assert layer_kept(tiny, "moe-tiny", Recompute("every", every=2)) == [none, sbh] * (L // 2)
    # op-SAC: wq, wv (mm 1, 3; the router gate is recomputed uncounted, routed experts run
    # _grouped_mm, not saved) + SDPA out, lse, rng state
    op = sbh + T * H * hd * 2 + T * KV * hd * 2 + T * H * hd * 2 + T * H * 4 + 24
    assert layer_kept(tiny, "moe-tiny", Recompute("op")) == [op] * L
    # moe_act: the experts' activation outputs (silu and the gated product); moe: the whole
    # block's internals, router state included (the dispatched tokens too), not the attention half
    act = 2 * T * k * Fe * 2
    router = T * cfg.n_experts * 4 + T * k * 4 + T * k * 8 + T * 4
    assert layer_kept(tiny, "moe-tiny", Recompute("selective", modules=("moe_act",))) == [none - act] * L
    assert layer_kept(tiny, "moe-tiny", Recompute("selective", modules=("moe",))) == [none - experts - router] * L
    assert layer_kept(tiny, "moe-tiny", Recompute("selective", modules=("mlp",))) == [none] * L  # dense MLPs only


def _llama8b(rc: list[dict]) -> dict:
    return {"model": "llama3-8b", "cluster": "h100:1x8", "global_batch": 16, "seq_len": 8192, "microbatches": 1,
            "directives": [{"op": "data_parallel", "degree": 8, "zero": 3}] + rc}


@pytest.fixture(scope="module")
def llama_runs():
    policies = {"none": [], "selective": [{"op": "recompute", "mode": "selective"}],
                "every2": [{"op": "recompute", "mode": "every", "every": 2}],
                "op": [{"op": "recompute", "mode": "op"}],
                "megatron": [{"op": "recompute", "mode": "selective", "modules": ["core_attn", "layernorm", "mlp"]}],
                "block16": [{"op": "recompute", "method": "block", "num_layers": 16}],
                "full": [{"op": "recompute"}]}
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, rc in policies.items():
            plan = compile_strategy(_llama8b(rc)).plan
            r = simulate(plan)
            bflops = sum(i.flops for c in plan.classes for i in c.instructions() if i.kind in ("B", "BI"))
            out[k] = (max(s.peak_memory_bytes for s in r.rank_stats), bflops)
    return out


def test_peak_memory_and_recompute_flops_order(llama_runs):
    """Llama 3 8B, FSDP on 8 H100: what each policy keeps per layer orders the peaks (none
    ~20.5 sbh, every other layer ~10.75, op-SAC ~7.75, Megatron core_attn+layernorm+mlp ~4.5,
    full 1); what each re-runs orders the backward flops."""
    peak = {k: v[0] for k, v in llama_runs.items()}
    flops = {k: v[1] for k, v in llama_runs.items()}
    assert peak["none"] > peak["selective"] > peak["every2"] > peak["op"] > peak["megatron"] > peak["full"]
    assert peak["block16"] == pytest.approx(peak["every2"])  # 16 of 32 layers recomputed either way
    # re-run: full every forward; Megatron the attention cores (s = 8192) and MLPs; every other layer
    # half the forward; op-SAC wk, wo, w3 and the elementwise ops (no attention); selective the cores
    assert flops["full"] > flops["megatron"] > flops["every2"] > flops["op"] > flops["selective"] > flops["none"]
    assert flops["every2"] == pytest.approx(flops["block16"])


def test_plan_header_records_the_policy_only_when_set():
    base = {"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 4, "seq_len": 16, "microbatches": 4,
            "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"}]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = compile({**base, "directives": base["directives"] + [{"op": "recompute"}]})
        op = compile({**base, "directives": base["directives"] + [{"op": "recompute", "mode": "op"}]})
        meg = compile({**base, "directives": base["directives"] + [
            {"op": "recompute", "method": "block", "num_layers": 2, "stages": [0]},
            {"op": "recompute", "mode": "selective", "modules": ["mlp"], "stages": [1]}]})
    assert "recompute_policy" not in plain.meta
    assert op.meta["recompute"] == {"0": "op", "1": "op"} and "recompute_policy" not in op.meta
    assert meg.meta["recompute_policy"] == {"0": {"method": "block", "num_layers": 2}, "1": {"modules": ["mlp"]}}
    assert meg.header.recompute_policy == {0: {"method": "block", "num_layers": 2}, 1: {"modules": ["mlp"]}}


@pytest.mark.parametrize("bad, msg", [
    ({"mode": "sac"}, "field 'mode' must be one of full, selective, op, every"),
    ({"mode": "every"}, "mode 'every' needs field 'every'"),
    ({"mode": "every", "every": 0}, "field 'every'"),
    ({"every": 2}, "field 'every' needs mode 'every'"),
    ({"method": "block"}, "field 'method' needs field 'num_layers'"),
    ({"method": "chunks", "num_layers": 2}, "field 'method' must be 'uniform' or 'block'"),
    ({"mode": "op", "num_layers": 2}, "field 'num_layers' (Megatron --recompute-num-layers) needs mode 'full'"),
    ({"num_layers": -1}, "field 'num_layers'"),
    ({"mode": "full", "modules": ["mlp"]}, "field 'modules' (Megatron --recompute-modules) needs mode 'selective'"),
    ({"mode": "selective", "modules": ["attn"]}, "field 'modules' entry 'attn' is not one of"),
    ({"mode": "selective", "modules": []}, "field 'modules' must be a non-empty list"),
    ({"mode": "selective", "modules": ["mlp", "mlp"]}, "names a module twice"),
])
def test_directive_fields_one_line_errors(bad, msg):
    s = {"model": "gpt-tiny", "cluster": "cpu:1", "global_batch": 2, "seq_len": 16, "microbatches": 1,
         "directives": [{"op": "recompute", **bad}]}
    with pytest.raises(StrategyError) as e:
        compile(s)
    assert msg in str(e.value) and "\n" not in str(e.value) and "recompute" in str(e.value)


def test_unpriced_combinations_are_refused():
    """Under TP: op-SAC, every-N, method block and the mlp module are priced (their re-run
    collectives are R ops: tests/test_recompute_tp_cp.py); Megatron uniform chunks of several
    layers and the whole MoE block are not."""
    s = {"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 2, "seq_len": 16, "microbatches": 1,
         "directives": [{"op": "tensor_parallel", "degree": 2}, {"op": "recompute", "method": "uniform",
                                                                 "num_layers": 2}]}
    with pytest.raises(StrategyError, match="num_layers 2 with tensor or context parallelism is not priced yet"):
        compile(s)
    s["directives"][1] = {"op": "recompute", "mode": "selective", "modules": ["moe"]}
    with pytest.raises(StrategyError, match=r"field 'modules' \['moe'\]"):
        compile({**s, "model": "moe-tiny"})
    for rc in ({"mode": "op"}, {"mode": "every", "every": 2}, {"method": "block", "num_layers": 2},
               {"mode": "selective", "modules": ["core_attn", "layernorm", "mlp"]}):
        s["directives"][1] = {"op": "recompute", **rc}
        compile(s)  # priced


def test_executor_refuses_what_it_cannot_run_in_one_line():
    """The executor runs full, selective, op-SAC, every-N, Megatron's method/num_layers and
    selective modules, under tensor parallelism too, and with a split backward (the modules
    that drop outputs, layernorm, moe_act and mla_up_proj, included); what it refuses it
    refuses in one line, before any process group starts."""
    from executor.options import refuse_tensor_parallel
    from piper_sim.plan import PlanError

    base = {"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 4, "seq_len": 16, "microbatches": 2,
            "directives": [{"op": "data_parallel", "degree": 2}]}
    pp2 = [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "zb1p"}]
    for rc in ({}, {"mode": "op"}, {"mode": "every", "every": 2}, {"method": "block", "num_layers": 2},
               {"method": "uniform", "num_layers": 2}, {"mode": "selective", "modules": ["core_attn"]},
               {"mode": "selective", "modules": ["layernorm", "mlp", "moe_act", "moe", "shared_experts", "mla_up_proj"]}):
        refuse_tensor_parallel(compile({**base, "directives": base["directives"] + [{"op": "recompute", **rc}]}),
                               "p.json")
    tp2 = [{"op": "tensor_parallel", "degree": 2}]
    for rc in ({"mode": "selective", "modules": ["layernorm", "mlp"]}, {"mode": "op"}):
        refuse_tensor_parallel(compile({**base, "directives": tp2 + [{"op": "recompute", **rc}]}), "p.json")
    for rc in ({"mode": "op"}, {"mode": "every", "every": 2}, {"method": "block", "num_layers": 2},
               {"mode": "selective", "modules": ["core_attn", "mlp"]}):
        refuse_tensor_parallel(compile({**base, "directives": pp2 + [{"op": "recompute", **rc}]}), "p.json")
    for rc in ({"mode": "selective", "modules": ["mlp", "layernorm"]}, {"mode": "selective", "modules": ["moe_act"]}):
        with warnings.catch_warnings():  # the modules that drop outputs, with a split backward: run too
            warnings.simplefilter("ignore")
            plan = compile({**base, "directives": pp2 + [{"op": "recompute", **rc}]})
        refuse_tensor_parallel(plan, "p.json")
    with pytest.raises(PlanError, match="simulate-only"):  # what the executor still refuses, in one line
        refuse_tensor_parallel(compile({**base, "directives": [{"op": "tensor_parallel", "degree": 2}],
                                        "stack": {"tp_overlap": True}}), "p.json")


def _backward_reruns(policy) -> tuple[int, list]:
    """(matmuls a gpt-tiny stage's backward runs beyond plain autograd's, its gradients)."""
    import torch
    from mm_count import CountMM

    from executor.stage import Stage
    from piper_sim.models import get_config

    cfg = get_config("gpt-tiny")
    units = ["embed"] + [f"layers.{i}" for i in range(cfg.n_layers)] + ["head"]
    stage = Stage(cfg, 0, 1, units, [units], 1, 0, torch.device("cpu"), torch.float32, seed=0)
    stage.set_recompute(policy)
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, cfg.vocab, (2, 32), generator=g) for _ in range(2))
    rec = stage.forward_piece(0, {"tokens": tokens}, {}, targets, 1.0)
    with CountMM() as count:
        rec.outputs["loss"].backward()
    return count.n, [p.grad for p in rec.params]


def test_executor_stage_recomputes_what_each_policy_says():
    """Counted at the dispatcher: the backward re-runs every matmul of every block and the
    head under full recompute, every second one of each block under op-SAC (torchtitan's rule:
    wq, wv, w1... kept), the whole blocks of every N-th layer, the first num_layers under
    Megatron's block method, every layer under uniform chunks, none under selective (the
    attention core has no matmul); the gradients are plain autograd's, bit for bit."""
    base, grads = _backward_reruns(Recompute("none"))
    L = 8  # gpt-tiny
    full, _ = _backward_reruns(Recompute("full"))
    per_block = (full - base - 1) // L  # the head's one matmul
    assert per_block >= 4 and full - base == L * per_block + 1
    expected = {Recompute("op"): L * (per_block // 2), Recompute("every", every=2): (L // 2) * per_block,
                Recompute("full", method="block", num_layers=3): 3 * per_block,
                Recompute("selective"): 0}
    for policy, reruns in expected.items():
        n, g = _backward_reruns(policy)
        assert n - base == reruns, policy
        assert all(a.equal(b) for a, b in zip(g, grads)), policy
    n, g = _backward_reruns(Recompute("full", method="uniform", num_layers=2))
    assert n - base >= L * per_block and all(a.equal(b) for a, b in zip(g, grads))


def test_executor_runs_the_policies_equal_to_the_reference(tmp_path):
    """`run --check` (the single-process reference, fp32) for op-SAC, every 2nd layer and
    Megatron's block/uniform methods under DP2 ZeRO-1 and a PP2 1F1B, in one launch."""
    from test_executor import GRAD_TOL, TOL, check_all, strategy

    configs = {}
    for name, rc in {"op": {"mode": "op"}, "every2": {"mode": "every", "every": 2},
                     "block3": {"method": "block", "num_layers": 3}, "uniform2": {"method": "uniform", "num_layers": 2}
                     }.items():
        dp = strategy(dp=2, zero=1, m=2, mbs=2)
        dp["directives"].append({"op": "recompute", **rc})
        configs[f"dp2-{name}"] = dp
    pp = strategy(pp=2, sched="1f1b", m=4, mbs=1)
    pp["directives"].append({"op": "recompute", "mode": "op"})
    configs["pp2-op"] = pp
    out = check_all(tmp_path, 2, configs)
    assert set(out) == set(configs)
    for name, row in out.items():
        assert row["within_tolerance"] is True and row["max_rel_param_diff"] <= TOL, (name, row)
        assert row["max_rel_grad_diff"] <= GRAD_TOL, (name, row)
    # one model, one batch: every DP2 policy reports the same losses
    assert len({round(row["loss2"], 4) for name, row in out.items() if name.startswith("dp2")}) == 1
