"""Model sources (`piper_sim.sources`): model files, Hugging Face configs, plans that carry
their model, and the translation checked three ways: published parameter counts, the costs of
the zoo model of the same shape, and logits equal to transformers' own modules.

The Hugging Face fixtures (tests/data/hf/<name>/config.json) hold the published config.json
values of each model; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from piper_sim.configs import ZOO, config_from_meta, get_config
from piper_sim.sources import register_model, resolve_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF = os.path.join(ROOT, "tests", "data", "hf")
FILES = os.path.join(ROOT, "tests", "data", "models")

pytestmark = pytest.mark.filterwarnings("ignore")


# ------------------------------------------------------------------ published counts

# (total, active, active counts the input embedding table, published digits of active)
PUBLISHED = {
    "Llama-3.1-8B": (8.03e9, None, True),
    "Llama-3.1-70B": (70.6e9, None, True),
    # Qwen: "30.5B in total and 3.3B activated" (their active count includes both embeddings)
    "Qwen3-30B-A3B": (30.5e9, 3.3e9, True),
    # DeepSeek-V3 report: 671B total, 37B activated (no MTP module)
    "DeepSeek-V3": (671e9, 37e9, True),
    # OpenAI model card: 116.8B total, 5.1B active (the embedding lookup is not counted)
    "gpt-oss-120b": (116.8e9, 5.1e9, False),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts_of_hf_configs_equal_the_published_totals(name):
    total, active, with_embedding = PUBLISHED[name]
    cfg = resolve_model(f"hf:{HF}/{name}")
    assert cfg.name == name
    assert cfg.param_count() == pytest.approx(total, rel=0.005)
    if active is None:
        assert cfg.active_param_count() == cfg.param_count()
    else:
        # two published digits: within half a unit of the last one, and 2%
        got = cfg.active_param_count(embedding=with_embedding)
        assert abs(got - active) <= max(0.02 * active, 0.05e9 if active < 10e9 else 0.5e9), got


def test_hf_translation_of_each_family():
    gpt = resolve_model(f"hf:{HF}/gpt-oss-120b/config.json")
    assert (gpt.n_experts, gpt.top_k, gpt.head_dim, gpt.sliding_window, gpt.window_pattern) == (128, 4, 64, 128, 2)
    assert [gpt.layer_window(i) for i in range(4)] == [128, 0, 128, 0]
    assert gpt.attn_bias and gpt.o_bias and gpt.router_bias and gpt.mlp_bias and not gpt.tie_embeddings
    qwen = resolve_model(f"hf:{HF}/Qwen3-30B-A3B")
    assert qwen.qk_norm and qwen.head_dim == 128 and qwen.hidden // qwen.n_heads == 64  # explicit head dim
    assert qwen.norm_topk and qwen.first_dense == 0 and qwen.sliding_window == 0
    ds = resolve_model(f"hf:{HF}/DeepSeek-V3")
    assert dataclasses.replace(ds, name="deepseek-v3", max_seq=4096) == get_config("deepseek-v3")
    llama = resolve_model(f"hf:{HF}/Llama-3.1-8B")
    assert dataclasses.replace(llama, name="llama3-8b", max_seq=8192) == get_config("llama3-8b")


def test_model_files_and_dicts():
    cfg = resolve_model(os.path.join(FILES, "llama3-8b.yaml"))
    assert dataclasses.replace(cfg, name="llama3-8b") == get_config("llama3-8b")
    assert resolve_model(f"file:{FILES}/qwen3-30b-a3b.yaml").param_count() == \
        resolve_model(f"hf:{HF}/Qwen3-30B-A3B").param_count()
    mistral = resolve_model(os.path.join(FILES, "mistral-7b-v0.1.yaml"))
    assert mistral.param_count() == pytest.approx(7.24e9, rel=0.005)  # Mistral 7B: 7.24B
    assert all(mistral.layer_window(i) == 4096 for i in range(32))
    assert resolve_model({"name": "d", "layers": 2, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 100}).n_kv_heads == 4
    assert resolve_model(ZOO["gpt-tiny"]) is ZOO["gpt-tiny"]


def test_transformers_config_objects():
    from transformers import GptOssConfig, Qwen3MoeConfig

    a = resolve_model(Qwen3MoeConfig(num_hidden_layers=48, num_experts=128, num_experts_per_tok=8,
                                     norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1e6, head_dim=128))
    b = resolve_model(f"hf:{HF}/Qwen3-30B-A3B")
    assert a.param_count() == b.param_count() and a.active_param_count() == b.active_param_count()
    assert resolve_model(GptOssConfig()).param_count() == resolve_model(f"hf:{HF}/gpt-oss-120b").param_count()


@pytest.mark.parametrize("source,message", [
    ({"model_type": "bert", "hidden_size": 8}, "unsupported model_type 'bert'"),
    ({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2}, "missing key 'num_hidden_layers'"),
    ({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "intermediate_size": 128, "vocab_size": 100, "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 32, "mlp_only_layers": [1]}, "'mlp_only_layers'"),
    ({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "intermediate_size": 128, "vocab_size": 100, "hidden_act": "gelu"}, "'hidden_act'"),
    ({"name": "x", "layers": 2, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 100, "hiden": 3}, "unknown key 'hiden'"),
    ({"name": "x", "layers": "2", "hidden": 64, "heads": 4, "ffn": 128, "vocab": 100}, "field 'n_layers' must be an integer"),
    ({"name": "x", "layers": 2, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 100, "activation": "relu"},
     "field 'mlp' must be one of"),
    ({"name": "x", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 3, "ffn": 128, "vocab": 100}, "'n_kv_heads'"),
    ({"name": "x", "layers": 2, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 100, "attention": "mla",
      "kv_lora_rank": 8, "qk_nope_dim": 8, "qk_rope_dim": 4, "v_head_dim": 8, "sliding_window": 4}, "'sliding_window'"),
    ("py:mymodels:build", "cannot import mymodels"),
    ("no-such-model", "unknown model 'no-such-model'"),
    ("hf:/no/such/dir", "no such file"),
])
def test_bad_sources_are_one_line_errors_naming_the_key(source, message):
    with pytest.raises(ValueError, match=message) as e:
        resolve_model(source)
    assert "\n" not in str(e.value)


TINY_HF = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 100}
TINY_FILE = {"name": "tiny", "layers": 2, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 100}


@pytest.mark.parametrize("hf,edit,message", [
    (True, {"hidden_size": 2**40}, "key 'hidden_size' must be an integer in 1..1048576 (got 1.1e+12)"),
    (True, {"num_hidden_layers": 4.7}, "key 'num_hidden_layers' must be an integer in 1..4096 (got 4.7)"),
    (True, {"num_hidden_layers": "4"}, "key 'num_hidden_layers' must be an integer in 1..4096 (got '4')"),
    (True, {"num_attention_heads": True}, "key 'num_attention_heads' must be an integer in 1..1048576 (got True)"),
    (True, {"rope_theta": "abc"}, "key 'rope_theta' must be a finite number > 0 (got 'abc')"),
    (True, {"rms_norm_eps": float("nan")}, "key 'rms_norm_eps' must be a finite number > 0 (got nan)"),
    (True, {"tie_word_embeddings": "yes"}, "key 'tie_word_embeddings' must be true or false (got 'yes')"),
    (True, {"vocab_size": 2**30}, "key 'vocab_size' must be an integer in 1..16777216"),
    (True, {"max_position_embeddings": 10**15}, "key 'max_position_embeddings' must be an integer in 0..134217728"),
    (True, {"sliding_window": 3.5}, "key 'sliding_window' must be an integer"),
    (True, {"rope_parameters": {"rope_theta": -1}}, "key 'rope_parameters.rope_theta' must be a finite number > 0"),
    (True, {"model_type": "qwen3_moe", "num_experts": 2**20, "num_experts_per_tok": 2, "moe_intermediate_size": 8},
     "key 'num_experts' must be an integer in 0..4096"),
    (True, {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
            "mlp_only_layers": "0"}, "key 'mlp_only_layers' must be a list of layer indices"),
    (False, {"hidden": 2**40}, "field 'hidden' must be an integer in 1..1048576"),
    (False, {"layers": 4.7}, "field 'n_layers' must be an integer in 1..4096 (got 4.7)"),
    (False, {"heads": True}, "field 'n_heads' must be an integer in 1..1048576 (got True)"),
    (False, {"rope_theta": "abc"}, "field 'rope_theta' must be a finite number > 0 (got 'abc')"),
    (False, {"rope_theta": float("inf")}, "field 'rope_theta' must be a finite number > 0 (got inf)"),
    (False, {"dropout": 1.5}, "field 'dropout' must be a finite number below 1 (got 1.5)"),
    (False, {"experts": 8, "top_k": 2.0, "expert_ffn": 8}, "field 'top_k' must be an integer"),
    (False, {"tied_embeddings": 1}, "field 'tie_embeddings' must be true or false (got 1)"),
])
def test_bad_model_fields_name_the_file_and_key(tmp_path, hf, edit, message):
    """Every model-file and config.json field is checked for type and range: one line naming
    the file and the key (no truncation of 4.7, no "4" or true read as a count)."""
    if hf:
        (tmp_path / "config.json").write_text(json.dumps({**TINY_HF, **edit}))
        source, where = f"hf:{tmp_path}", f"hf config {tmp_path / 'config.json'}: "
    else:
        (tmp_path / "m.json").write_text(json.dumps({**TINY_FILE, **edit}))
        source, where = str(tmp_path / "m.json"), f"model file {tmp_path / 'm.json'}: "
    with pytest.raises(ValueError) as e:
        resolve_model(source)
    assert str(e.value).startswith(where) and message in str(e.value) and "\n" not in str(e.value)


def test_every_model_field_has_a_checked_type():
    """A new `ModelConfig` field needs a range (or is a flag, a choice or the name)."""
    from piper_sim.configs import _CHOICES, FIELDS, FLOAT_RANGES, INT_RANGES

    for name, f in FIELDS.items():
        checked = name in INT_RANGES or name in FLOAT_RANGES or name in _CHOICES or name == "name"
        assert checked or f.default in (True, False), name
    for c in ZOO.values():
        assert resolve_model(dataclasses.asdict(c)) == c


def _unreadable(tmp_path, kind: str) -> tuple[str, str]:
    if kind == "binary":
        (tmp_path / "m.json").write_bytes(b"\x82\x00\xff" * 50)
        return str(tmp_path / "m.json"), "not a text file (byte 0x82 at offset 0 is not UTF-8)"
    if kind == "folder":
        (tmp_path / "m.yaml").mkdir()
        return str(tmp_path / "m.yaml"), "is a folder, not a file"
    if kind == "hf folder":
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "config.json").write_text(json.dumps(TINY_HF))
        return f"file:{tmp_path / 'hf'}", f"is a folder, not a file; give the file's path, or hf:{tmp_path / 'hf'}"
    (tmp_path / "config.json").write_bytes(b"{" + b" " * (2**24))
    return f"hf:{tmp_path}", "bytes is not a model description (the limit is 16,777,216)"


@pytest.mark.parametrize("kind", ["binary", "folder", "hf folder", "huge"])
def test_unreadable_model_files_are_one_line_at_the_command_line(tmp_path, capsys, kind):
    from piper_sim.cli.commands import main

    source, message = _unreadable(tmp_path, kind)
    (tmp_path / "s.json").write_text(json.dumps(_strategy(source)))
    assert main(["compile", str(tmp_path / "s.json"), "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


def test_register_model():
    import piper_sim

    try:
        cfg = piper_sim.register_model("my-qwen", f"hf:{HF}/Qwen3-30B-A3B")
        assert cfg.name == "my-qwen" and resolve_model("my-qwen") == cfg
        assert piper_sim.register_model("my-qwen", cfg) == cfg  # the same again: fine
        with pytest.raises(ValueError, match="already a different model"):
            register_model("my-qwen", "gpt-tiny")
        with pytest.raises(ValueError, match="already a different model"):
            register_model("gpt-tiny", "moe-tiny")
    finally:
        ZOO.pop("my-qwen", None)


# ------------------------------------------------------------------ costs


def _forward_flops(cfg, batch=1, seq=2048):
    from piper_sim.profiling import profile_model

    return sum(x.fwd_flops for x in profile_model(cfg, batch, seq, torch.bfloat16))


def test_hf_models_cost_what_the_zoo_model_of_the_same_shape_costs():
    for hf, zoo in (("Llama-3.1-8B", "llama3-8b"), ("DeepSeek-V3", "deepseek-v3")):
        assert _forward_flops(resolve_model(f"hf:{HF}/{hf}")) == pytest.approx(_forward_flops(get_config(zoo)), rel=0.01)


def test_dense_forward_flops_are_2N_per_token_plus_attention():
    cfg, seq = resolve_model(f"hf:{HF}/Llama-3.1-8B"), 2048
    from piper_sim.profiling import profile_model

    segs = profile_model(cfg, 1, seq, torch.bfloat16)
    n_matmul = cfg.param_count() - cfg.vocab * cfg.hidden  # the embedding is a lookup
    # causal attention counted as full s x s (FlopCounterMode's convention): QK^T and PV
    attn = 4 * seq * cfg.n_heads * cfg.head_dim * cfg.n_layers
    fwd = sum(x.fwd_flops for x in segs) / seq
    assert fwd == pytest.approx(2 * n_matmul + attn, rel=0.01)
    train = sum(x.fwd_flops + x.bwd_flops for x in segs) / seq
    assert train == pytest.approx(6 * n_matmul + 3.5 * attn, rel=0.01)  # flash backward: 2.5x its forward


def test_sliding_window_layers_cost_s_times_window_attention():
    from piper_sim.kernels import totals
    from piper_sim.profiling import profile_model

    base = dict(name="win", layers=4, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=256)
    full = resolve_model(base)
    win = resolve_model({**base, "sliding_window": 64, "window_pattern": 2})
    B, s = 2, 512
    a, b = profile_model(full, B, s, torch.bfloat16), profile_model(win, B, s, torch.bfloat16)
    diff = {x.name: x.fwd_flops - y.fwd_flops for x, y in zip(a, b)}
    per_layer = 4 * B * full.n_heads * full.head_dim * s * (s - 64)
    assert diff == {**{x.name: 0 for x in a}, "layers.0": per_layer, "layers.2": per_layer}
    for x, y in zip(a, b):  # flash attention keeps no s x s or s x window tensor either way
        assert x.saved_act_bytes == y.saved_act_bytes
    attn = [r for r in b[1].kernels_f if r[0] == "attn_fwd"]
    assert attn and attn[0][2][3] == 64 and totals(b[2].kernels_bw)[0] > 0  # seq_kv = window


def test_tied_embeddings_are_counted_once():
    from piper_sim.profiling import profile_model

    base = dict(name="t", layers=2, hidden=64, heads=4, ffn=128, vocab=512)
    untied, tied = resolve_model(base), resolve_model({**base, "tied_embeddings": True})
    assert untied.param_count() - tied.param_count() == 512 * 64
    a, b = profile_model(untied, 1, 32, torch.float32), profile_model(tied, 1, 32, torch.float32)
    assert sum(x.param_count for x in b) == tied.param_count()
    assert (a[-1].fwd_flops, a[-1].bwd_flops) == (b[-1].fwd_flops, b[-1].bwd_flops)  # the same matmuls


# ------------------------------------------------------------------ numerics vs transformers


def _hf_to_ours(hf_sd: dict, cfg) -> dict:
    """A transformers Llama/Mistral/Qwen2/Qwen3/Qwen3-MoE state dict in our units' names."""
    out = {}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm", "self_attn.q_proj": "attn.wq",
             "self_attn.k_proj": "attn.wk", "self_attn.v_proj": "attn.wv", "self_attn.o_proj": "attn.wo",
             "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm", "mlp.gate_proj": "mlp.w1",
             "mlp.up_proj": "mlp.w3", "mlp.down_proj": "mlp.w2", "mlp.gate": "moe.router"}
    for key, t in hf_sd.items():
        if key == "model.embed_tokens.weight":
            out["embed.weight"] = t
        elif key == "model.norm.weight":
            out["head.norm.weight"] = t
        elif key == "lm_head.weight":
            if not cfg.tie_embeddings:
                out["head.out.weight"] = t
        elif key.endswith("mlp.experts.gate_up_proj"):
            i, f = key.split(".")[2], cfg.expert_ffn
            for e in range(cfg.n_experts):
                out[f"layers.{i}.moe.experts.{e}.w1.weight"] = t[e, :f]
                out[f"layers.{i}.moe.experts.{e}.w3.weight"] = t[e, f:]
        elif key.endswith("mlp.experts.down_proj"):
            for e in range(cfg.n_experts):
                out[f"layers.{key.split('.')[2]}.moe.experts.{e}.w2.weight"] = t[e]
        else:
            _, _, i, *rest = key.split(".")
            module, leaf = ".".join(rest[:-1]), rest[-1]
            out[f"layers.{i}.{names[module]}.{leaf}"] = t
    return out


def _tiny(kind: str):
    import transformers as tf

    common = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager")
    if kind == "llama":
        return tf.LlamaConfig(**common), tf.LlamaForCausalLM
    if kind == "llama-bias-tied":
        return tf.LlamaConfig(**common, attention_bias=True, mlp_bias=True, tie_word_embeddings=True), \
            tf.LlamaForCausalLM
    if kind == "mistral-window":
        return tf.MistralConfig(**common, sliding_window=5), tf.MistralForCausalLM
    if kind == "qwen2":
        return tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    if kind == "qwen3":
        return tf.Qwen3Config(**common, head_dim=24), tf.Qwen3ForCausalLM  # head_dim != hidden / heads
    return tf.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             norm_topk_prob=True, mlp_only_layers=[]), tf.Qwen3MoeForCausalLM


@pytest.mark.parametrize("kind", ["llama", "llama-bias-tied", "mistral-window", "qwen2", "qwen3", "qwen3-moe"])
def test_logits_and_loss_equal_transformers(kind):
    from piper_sim.models import build_model, lm_loss

    hf_cfg, cls = _tiny(kind)
    torch.manual_seed(0)
    hf = cls(hf_cfg).float().eval()
    with torch.no_grad():  # random norms and biases too, so a swapped tensor cannot hide
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name or p.ndim == 1 else 0.05)
    cfg = resolve_model(hf_cfg)
    ours = build_model(cfg, device="cpu", dtype=torch.float32)
    missing = ours.load_state_dict(_hf_to_ours(hf.state_dict(), cfg), strict=True)
    assert not missing.missing_keys
    tokens = torch.randint(97, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    targets = torch.roll(tokens, -1, 1)
    ref = torch.nn.functional.cross_entropy(want.flatten(0, 1), targets.flatten())
    assert lm_loss(got, targets).item() == pytest.approx(ref.item(), rel=1e-6)
    if cfg.tie_embeddings:
        assert ours.head.tied_weight is ours.embed.weight


# ------------------------------------------------------------------ plans and the executor


def _strategy(model: str, pp: int = 1, dp: int = 1, zero: int = 0, ep: int = 0, sched: str = "1f1b") -> dict:
    d: list[dict] = [{"op": "pipeline", "degree": pp}, {"op": "schedule", "name": sched}] if pp > 1 else []
    if dp > 1:
        d.append({"op": "data_parallel", "degree": dp, "zero": zero})
    if ep:
        d.append({"op": "expert_parallel", "degree": ep})
    return {"model": model, "cluster": f"cpu:{pp * dp}", "global_batch": dp * 4, "seq_len": 16,
            "microbatches": 4, "dtype": "fp32", "directives": d}


def _write_hf(tmp_path, kind: str, **extra) -> str:
    hf_cfg, _ = _tiny(kind)
    for k, v in extra.items():
        setattr(hf_cfg, k, v)
    folder = tmp_path / kind
    hf_cfg.save_pretrained(folder)
    return f"hf:{folder}"


def _compile(tmp_path, name: str, s: dict) -> str:
    from piper_sim.api import compile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = compile(s)
    path = str(tmp_path / f"{name}.plan.json")
    plan.save(path)
    return path


def test_the_plan_carries_the_model(tmp_path):
    from piper_sim.plan import Plan

    src = _write_hf(tmp_path, "qwen3-moe")
    path = _compile(tmp_path, "moe", _strategy(src, pp=2, dp=2, ep=2))
    plan = Plan.load(path)
    assert config_from_meta(plan.meta) == resolve_model(src)
    assert plan.meta["model"] == "qwen3-moe" and plan.meta["model_spec"]["qk_norm"] is True
    # the spec is part of the hash: a model edited in the plan is caught
    raw = json.loads(open(path).read())
    raw["meta"]["model_spec"]["hidden"] = 128
    with pytest.raises(Exception, match="hash"):
        Plan.from_json(raw) if hasattr(Plan, "from_json") else Plan.loads(json.dumps(raw))
    # plans of older versions name a zoo model only
    old = {**plan.meta, "model": "gpt-tiny"}
    del old["model_spec"]
    assert config_from_meta(old) is ZOO["gpt-tiny"]
    # built-in zoo models are named only (their plans are as before); any other carries its spec
    assert "model_spec" not in Plan.load(_compile(tmp_path, "zoo", _strategy("moe-tiny", pp=2))).meta
    mine = register_model("my-moe-tiny", dataclasses.replace(ZOO["moe-tiny"], name="x"))
    try:
        assert Plan.load(_compile(tmp_path, "mine", _strategy("my-moe-tiny", pp=2))).meta["model_spec"]["name"] == \
            "my-moe-tiny"
    finally:
        del ZOO["my-moe-tiny"]


def _torchrun(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-backend=c10d", "--rdzv-id=t", "-m", "executor", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_executor_runs_hf_models_and_matches_the_reference(tmp_path):
    from executor.worker import CHECK_TOLERANCE

    llama, moe = _write_hf(tmp_path, "llama"), _write_hf(tmp_path, "qwen3-moe")
    tied = _write_hf(tmp_path, "llama-bias-tied")
    plans = {_compile(tmp_path, "llama-pp2-dp2-zero1", _strategy(llama, pp=2, dp=2, zero=1)): "llama",
             _compile(tmp_path, "moe-pp2-ep2", _strategy(moe, pp=2, dp=2, ep=2)): "moe",
             _compile(tmp_path, "tied-dp4-zero1", _strategy(tied, dp=4, zero=1)): "tied"}
    r = _torchrun(4, [*plans, "--steps", "2", "--check", "--json"])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    checks = {plans[row["plan"]]: row for row in rows if "max_rel_param_diff" in row}
    assert set(checks) == {"llama", "moe", "tied"}
    for name, row in checks.items():
        assert row["max_rel_param_diff"] <= CHECK_TOLERANCE["fp32"] and row["within_tolerance"], (name, row)
        assert row["max_rel_grad_diff"] <= 1e-5, (name, row)


@pytest.mark.slow
def test_executor_runs_tied_embeddings_across_stages(tmp_path):
    """The last stage's own copy of the tied matrix (Megatron's embedding group) runs and checks."""
    tied = _write_hf(tmp_path, "llama-bias-tied")
    path = _compile(tmp_path, "tied-pp2", _strategy(tied, pp=2))
    r = subprocess.run([sys.executable, "-m", "piper_sim", "run", path, "--nproc", "2", "--steps", "2", "--check"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_executor_refuses_tied_embeddings_reduced_every_micro_batch(tmp_path):
    """Two stages with ZeRO-2 reduce-scattering every micro-batch: refused in one line."""
    tied = _write_hf(tmp_path, "llama-bias-tied")
    path = _compile(tmp_path, "tied-z2", _strategy(tied, pp=2, dp=2, zero=2))
    r = subprocess.run([sys.executable, "-m", "piper_sim", "run", path, "--nproc", "4"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "tie_embeddings" in r.stderr and "reduce-scatters every micro-batch" in r.stderr


# ------------------------------------------------------------------ command line


def test_cli_models_json_and_dir():
    run = lambda *a: subprocess.run([sys.executable, "-m", "piper_sim", "models", *a], cwd=ROOT,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    r = run("--json", f"hf:{HF}/gpt-oss-120b")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    cfg = resolve_model(f"hf:{HF}/gpt-oss-120b")
    assert (out["params"], out["active_params"]) == (cfg.param_count(), cfg.active_param_count())
    assert out["config"]["sliding_window"] == 128
    r = run("--dir", FILES)
    assert r.returncode == 0 and "mistral-7b-v0.1.yaml" in r.stdout and "gpt-tiny" in r.stdout
    r = run("--json", "hf:/no/such/config.json")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no such file" in r.stderr


def test_models_listing_does_not_import_torch():
    code = ("import sys; from piper_sim.cli import main; main(['models', '--json', 'llama3-8b']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr


@pytest.mark.slow  # ~27 s each (CI budget): the fast set keeps the single-node model-file runs
@pytest.mark.parametrize("source", ["hf", "py"])
def test_two_nodes_run_a_plan_whose_model_file_is_gone(tmp_path, source):
    """The plan carries the model: two "nodes" (torchrun --nnodes 2 on loopback) run a plan of
    a Hugging Face config that no longer exists (or of a user nn.Module factory, which every
    node imports again), and match the reference."""
    import shutil
    import socket

    from executor.worker import CHECK_TOLERANCE

    if source == "hf":
        src = _write_hf(tmp_path, "qwen3")
        plan = _compile(tmp_path, "qwen3-pp2", _strategy(src, pp=2, sched="zb1p"))
        shutil.rmtree(src[3:])
    else:
        s = _strategy("py:tests/data/user_models.py:residual_mlp", pp=2, sched="1f1b")
        plan = _compile(tmp_path, "mlp-pp2", {**s, "seq_len": 8})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    procs = [subprocess.Popen([sys.executable, "-m", "piper_sim", "run", plan, "--nnodes", "2", "--nproc", "1",
                               "--node-rank", str(node), "--rdzv-endpoint", endpoint, "--steps", "2", "--json",
                               "--check"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
             for node in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    rows = [json.loads(line) for o in outs for line in o[0].splitlines() if line.startswith("{")]
    check = [r for r in rows if "max_rel_param_diff" in r]
    assert len(check) == 1 and check[0]["max_rel_param_diff"] <= CHECK_TOLERANCE["fp32"]
