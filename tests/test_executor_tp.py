"""Executor: real tensor (and sequence) parallelism against the single-process reference
(torchrun, gloo on CPU, gpt-tiny, 2 steps), the plan's TP ops matched to the collectives the
modules performed, and what is still refused."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_executor import GRAD_TOL, TOL, json_lines, save_plan, strategy, torchrun  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def tp_strategy(tp: int = 2, sp: bool = False, pp: int = 1, dp: int = 1, zero: int = 0, m: int = 2,
                model: str = "gpt-tiny", sched: str = "1f1b", extra: list | None = None) -> dict:
    s = strategy(model, pp=pp, sched=sched, dp=dp, zero=zero, m=m, mbs=1)
    s["cluster"] = f"cpu:{pp * dp * tp}"
    s["directives"] = [{"op": "tensor_parallel", "degree": tp, "sequence_parallel": sp}, *s["directives"],
                       *(extra or [])]
    return s


def run_checks(tmp_path, nproc: int, configs: dict[str, dict], *extra: str) -> tuple[dict[str, dict], str]:
    paths = {save_plan(tmp_path, k, s): k for k, s in configs.items()}
    r = torchrun(nproc, [*paths, "--steps", "2", "--check", "--json", *extra])
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, dict] = {}
    for row in json_lines(r.stdout):
        step = {f"loss{row['step']}": row["loss"], **({f"grad_norm{row['step']}": row["grad_norm"]}
                                                       if "grad_norm" in row else {})} if "loss" in row else row
        out.setdefault(paths[row["plan"]], {}).update(step)
    assert set(out) == set(configs)
    return out, next(iter(paths))


def reference_losses(tmp_path, s: dict) -> list[float]:
    from executor.reference import reference_training
    from piper_sim.plan import Plan

    return reference_training(Plan.load(save_plan(tmp_path, "ref", s)), 2)[1]


def assert_matches_reference(res: dict[str, dict], ref: list[float]) -> None:
    for name, row in res.items():
        assert row["within_tolerance"] is True and row["max_rel_param_diff"] <= TOL, (name, row)
        # the first step's gradients: the fp32 1e-5 (parameters after Adam: round-off amplified)
        assert row["max_rel_grad_diff"] <= GRAD_TOL, (name, row)
        assert row["max_abs_param_diff"] <= 1e-4, (name, row)
        for step, want in enumerate(ref):  # the loss of the whole global batch, counted once per TP group
            assert row[f"loss{step}"] == pytest.approx(want, rel=1e-5), (name, step, row)


def test_tp2_and_sequence_parallel_match_the_reference(tmp_path):
    configs = {"tp2": tp_strategy(), "tp2-sp": tp_strategy(sp=True),
               # full recomputation re-runs the forward's collectives in backward (TP.R ops)
               "tp2-sp-full": tp_strategy(sp=True, extra=[{"op": "recompute"}]),
               "tp2-selective": tp_strategy(extra=[{"op": "recompute", "mode": "selective"}])}
    res, _ = run_checks(tmp_path, 2, configs)
    assert_matches_reference(res, reference_losses(tmp_path, configs["tp2"]))


@pytest.mark.slow  # ~22 s; the fast set runs TP2 x DP2 and PP2 x TP2 in tests/test_user_tp.py
def test_tp2_with_pipeline_and_data_parallel_match_the_reference(tmp_path):
    configs = {"tp2-pp2": tp_strategy(pp=2, m=4), "tp2-sp-pp2": tp_strategy(sp=True, pp=2, m=4),
               "tp2-sp-pp2-interleaved": tp_strategy(sp=True, pp=2, m=4, sched="interleaved_1f1b"),
               # zero-bubble: BI runs the TP collectives, BW only weight gradients
               "tp2-pp2-zb1p": tp_strategy(pp=2, m=4, sched="zb1p"), "tp2-pp2-zbv": tp_strategy(pp=2, m=4, sched="zbv"),
               "tp2-dp2-zero1": tp_strategy(dp=2, zero=1), "tp2-sp-dp2-zero1": tp_strategy(sp=True, dp=2, zero=1),
               "tp2-sp-dp2-zero2": tp_strategy(sp=True, dp=2, zero=2), "tp2-dp2-zero3": tp_strategy(dp=2, zero=3),
               # MoE: experts split by expert_ffn over TP and by expert over EP (router replicated)
               "tp2-ep2-moe": tp_strategy(model="moe-tiny", dp=2, extra=[{"op": "expert_parallel", "degree": 2}])}
    res, _ = run_checks(tmp_path, 4, configs)
    moe = res.pop("tp2-ep2-moe")
    # the same global batch everywhere: 4 sequences per step (dp 2 x 2 micro-batches, or 4 micro-batches)
    assert_matches_reference(res, reference_losses(tmp_path, configs["tp2-pp2"]))
    assert_matches_reference({"tp2-ep2-moe": moe}, reference_losses(tmp_path, configs["tp2-ep2-moe"]))


# a Qwen3-shaped tiny model: RMSNorm on each head's queries and keys (qk_norm), grouped-query attention
QWEN3_TINY = {"name": "qwen3-tiny", "n_layers": 4, "hidden": 64, "n_heads": 4, "n_kv_heads": 2, "ffn": 128,
              "vocab": 512, "max_seq": 128, "qk_norm": True}


def test_qk_norm_under_tp_all_reduces_the_query_key_norm_gradients(tmp_path):
    """Each TP rank normalises only its heads, so holds part of the q/k norms' gradient: the
    plan's ``TP.s{S}.norms`` sums it over the group, with or without sequence parallelism."""
    from piper_sim.api import compile

    model = str(tmp_path / "qwen3-tiny.json")
    with open(model, "w") as f:
        json.dump(QWEN3_TINY, f)
    configs = {"qwen3-tp2": {**tp_strategy(), "model": model}, "qwen3-tp2-sp": {**tp_strategy(sp=True), "model": model}}
    norms = [i for c in compile(configs["qwen3-tp2"]).classes for i in c.instructions() if i.name == "norms"]
    assert norms and norms[0].bytes == 4 * 2 * (64 // 4) * 4  # 4 layers x (q, k) x head_dim, fp32
    res, _ = run_checks(tmp_path, 2, {k: configs[k] for k in ("qwen3-tp2", "qwen3-tp2-sp")})
    assert_matches_reference(res, reference_losses(tmp_path, configs["qwen3-tp2"]))


@pytest.mark.slow
def test_qk_norm_under_tp_with_a_pipeline(tmp_path):
    model = str(tmp_path / "qwen3-tiny.json")
    with open(model, "w") as f:
        json.dump(QWEN3_TINY, f)
    s = {**tp_strategy(pp=2, m=4), "model": model}
    res, _ = run_checks(tmp_path, 4, {"qwen3-tp2-pp2": s})
    assert_matches_reference(res, reference_losses(tmp_path, s))


def test_tied_embeddings_under_tp_share_the_vocabulary_shard(tmp_path):
    """A tied model (Llama 3.2 1B/3B, small Qwen2.5) under TP: the head projects with the
    embedding's vocabulary rows on each rank, one parameter with both gradients."""
    model = str(tmp_path / "tied-tiny.json")
    with open(model, "w") as f:
        json.dump({**QWEN3_TINY, "name": "tied-tiny", "qk_norm": False, "tie_embeddings": True}, f)
    configs = {"tied-tp2": {**tp_strategy(), "model": model}, "tied-tp2-sp": {**tp_strategy(sp=True), "model": model}}
    res, _ = run_checks(tmp_path, 2, configs)
    assert_matches_reference(res, reference_losses(tmp_path, configs["tied-tp2"]))


@pytest.mark.slow
def test_tied_embeddings_under_tp_with_zero1(tmp_path):
    model = str(tmp_path / "tied-tiny.json")
    with open(model, "w") as f:
        json.dump({**QWEN3_TINY, "name": "tied-tiny", "qk_norm": False, "tie_embeddings": True}, f)
    s = {**tp_strategy(dp=2, zero=1), "model": model}
    res, _ = run_checks(tmp_path, 4, {"tied-tp2-dp2-zero1": s})
    assert_matches_reference(res, reference_losses(tmp_path, s))


@pytest.mark.slow
def test_3d_tp2_pp2_dp2_on_eight_ranks_traces_every_tp_op(tmp_path):
    from piper_sim.plan import Plan

    s = tp_strategy(sp=True, pp=2, dp=2, zero=1, m=2)
    trace = str(tmp_path / "trace.json")
    res, path = run_checks(tmp_path, 8, {"3d": s}, "--trace", trace)
    assert_matches_reference(res, reference_losses(tmp_path, s))
    plan = Plan.load(path)
    want = {(r, i.id) for r in range(8) for i in plan.program(r).streams["tp"]}
    with open(trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("TP.")]
    got = {(e["pid"], e["name"]) for e in events}
    assert got == want  # every plan TP op of every rank has its measured event
    assert all(e["dur"] >= 0 for e in events)


# DeepSeek-V3-shaped tiny models: multi-head latent attention (with and without a query latent),
# one shared expert beside 4 routed ones (top-2), a dense first layer
MLA_TINY = {"name": "mla-tiny", "layers": 2, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 256, "attention": "mla",
            "q_lora": 32, "kv_lora": 16, "qk_nope_dim": 8, "qk_rope_dim": 4, "v_head_dim": 8}
DSV3_TINY = {**MLA_TINY, "name": "dsv3-tiny", "experts": 4, "top_k": 2, "shared_experts": 1, "expert_ffn": 64,
             "dense_first_layers": 1}


def _model(tmp_path, spec: dict) -> str:
    path = str(tmp_path / f"{spec['name']}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


def test_mla_under_tp_shards_the_heads(tmp_path):
    """MLA under TP2: up-projections column-parallel over heads, o-proj row-parallel, the
    down-projections and their norms whole on every rank (whole gradients: no TP.norms); the
    backward all-reduce carries the latents' gradients (q latent + KV latent + rotary key)."""
    from piper_sim.api import compile

    mla, no_q = _model(tmp_path, MLA_TINY), _model(tmp_path, {**MLA_TINY, "name": "mla-noq", "q_lora": 0})
    configs = {"mla-tp2": {**tp_strategy(), "model": mla}, "mla-noq-tp2": {**tp_strategy(), "model": no_q},
               # full recomputation: the re-run forward's collectives come before the backward's (TP.R ops)
               "mla-tp2-full": {**tp_strategy(extra=[{"op": "recompute"}]), "model": mla}}
    ops = {i.name: i for c in compile(configs["mla-tp2"]).classes for i in c.instructions() if i.stream == "tp"
           and i.mb == 0}
    assert "norms" not in ops
    seq = configs["mla-tp2"]["seq_len"]
    assert [i.bytes for i in compile(configs["mla-tp2"]).classes[0].instructions()
            if i.id == "TP.B.s0.mb0.l0.attn.ar"] == [seq * (32 + 16 + 4) * 4]
    assert [i.bytes for i in compile(configs["mla-noq-tp2"]).classes[0].instructions()
            if i.id == "TP.B.s0.mb0.l0.attn.ar"] == [seq * (64 + 16 + 4) * 4]
    res, _ = run_checks(tmp_path, 2, configs)
    noq = {"mla-noq-tp2": res.pop("mla-noq-tp2")}
    assert_matches_reference(res, reference_losses(tmp_path, configs["mla-tp2"]))
    assert_matches_reference(noq, reference_losses(tmp_path, configs["mla-noq-tp2"]))


def test_shared_experts_and_mla_under_tp_and_ep(tmp_path):
    """DeepSeek-V3-shaped: TP2 x EP2 (x DP2), the shared expert a column/row-parallel MLP on the
    routed experts' input: its own forward all-reduce (``l1.shared.ar``), its input gradient
    summed with the routed experts' in the one ``l1.moe.ar``; every plan TP op has its event."""
    from piper_sim.plan import Plan

    s = {**tp_strategy(dp=2, extra=[{"op": "expert_parallel", "degree": 2}]), "model": _model(tmp_path, DSV3_TINY)}
    trace = str(tmp_path / "trace.json")
    res, path = run_checks(tmp_path, 4, {"dsv3-tp2-ep2": s}, "--trace", trace)
    assert_matches_reference(res, reference_losses(tmp_path, s))
    plan = Plan.load(path)
    names = [(i.direction, i.name) for i in plan.program(0).streams["tp"] if i.mb == 0]
    assert [n for n in names if n[1].startswith("l1.")] == [("F", "l1.attn.ar"), ("F", "l1.shared.ar"),
                                                            ("F", "l1.moe.ar"), ("B", "l1.moe.ar"),
                                                            ("B", "l1.attn.ar")]
    want = {(r, i.id) for r in range(4) for i in plan.program(r).streams["tp"]}
    with open(trace) as f:
        got = {(e["pid"], e["name"]) for e in json.load(f)["traceEvents"] if e.get("ph") == "X"
               and e["name"].startswith("TP.")}
    assert got == want


def test_moe_under_tp_sp_and_ep_routes_each_shard(tmp_path):
    """MoE under TP2+SP with EP2 (x DP2), as Megatron-Core's all-to-all dispatcher with SP: each
    TP rank routes and dispatches its own sequence shard, the experts' tokens are all-gathered over
    TP after the dispatch (``l{L}.moe.ag``) and their partial outputs reduce-scattered before the
    combine (``l{L}.moe.rs``); DeepSeek-V3-shaped (MLA, a shared expert: column/row-parallel with
    SP's ``l{L}.shared.ag|rs``); the router's partial gradient joins ``TP.s0.norms``."""
    from piper_sim.plan import Plan

    ep = {"op": "expert_parallel", "degree": 2}
    dsv3 = {**tp_strategy(sp=True, dp=2, extra=[ep]), "model": _model(tmp_path, DSV3_TINY)}
    moe = tp_strategy(model="moe-tiny", sp=True, dp=2, extra=[ep])
    res, _ = run_checks(tmp_path, 4, {"dsv3-tp2-sp-ep2": dsv3, "moe-tp2-sp-ep2": moe})
    assert_matches_reference({"moe-tp2-sp-ep2": res.pop("moe-tp2-sp-ep2")}, reference_losses(tmp_path, moe))
    assert_matches_reference(res, reference_losses(tmp_path, dsv3))
    plan = Plan.load(save_plan(tmp_path, "dsv3-tp2-sp-ep2", dsv3))
    names = [(i.direction, i.name) for i in plan.program(0).streams["tp"] if i.mb == 0]
    assert [n for n in names if n[1].startswith("l1.")] == [
        ("F", "l1.attn.ag"), ("F", "l1.attn.rs"), ("F", "l1.shared.ag"), ("F", "l1.shared.rs"),
        ("F", "l1.moe.ag"), ("F", "l1.moe.rs"), ("B", "l1.moe.ag"), ("B", "l1.moe.rs"),
        ("B", "l1.shared.ag"), ("B", "l1.shared.regather"), ("B", "l1.shared.rs"),
        ("B", "l1.attn.ag"), ("B", "l1.attn.regather"), ("B", "l1.attn.rs")]
    ops = {i.id: i for i in plan.program(0).streams["tp"]}
    seq, act = dsv3["seq_len"], dsv3["seq_len"] * 64 * 4  # micro-batch 1, fp32
    assert ops["TP.F.s0.mb0.l1.moe.ag"].bytes == 2 * act and ops["TP.F.s0.mb0.l1.attn.ag"].bytes == act  # top-2
    router = 64 * 4  # and the MLA down-projections, their norms, the layers' norms: partial per rank under SP
    mla = 64 * 32 + 32 + 64 * (16 + 4) + 16
    assert ops["TP.s0.norms"].bytes == (2 * (2 * 64 + mla) + router + 64) * 4 and seq


def test_mla_under_tp_and_sequence_parallel(tmp_path):
    """MLA under TP2+SP: the down-projections (and ``wq`` without a query latent) read the gathered
    sequence (``l{L}.attn.ag``; backward ``.regather`` and ``.rs``), their norms and the replicated
    down-projections get this rank's heads' share of the gradient (summed by ``TP.s0.norms``), the
    o-proj reduce-scatters; with and without a query latent, and under full recomputation."""
    mla, no_q = _model(tmp_path, MLA_TINY), _model(tmp_path, {**MLA_TINY, "name": "mla-noq", "q_lora": 0})
    configs = {"mla-tp2-sp": {**tp_strategy(sp=True), "model": mla},
               "mla-noq-tp2-sp": {**tp_strategy(sp=True), "model": no_q},
               "mla-tp2-sp-full": {**tp_strategy(sp=True, extra=[{"op": "recompute"}]), "model": mla}}
    res, _ = run_checks(tmp_path, 2, configs)
    noq = {"mla-noq-tp2-sp": res.pop("mla-noq-tp2-sp")}
    assert_matches_reference(res, reference_losses(tmp_path, configs["mla-tp2-sp"]))
    assert_matches_reference(noq, reference_losses(tmp_path, configs["mla-noq-tp2-sp"]))


# a GELU-expert MoE (GPT-style experts fc1/fc2, biased: a row-parallel expert adds its bias once per
# TP group, `executor.parallel.tensor.TPExpert`) with a shared expert
GELU_MOE = {"name": "gelu-moe", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256,
            "mlp": "gelu", "mlp_bias": True, "experts": 4, "top_k": 2, "shared_experts": 1, "expert_ffn": 64}


def test_moe_under_tp_without_expert_parallelism(tmp_path):
    """MoE under TP2 without EP (Megatron-Core expert TP = TP at EP 1): every expert keeps its
    ``expert_ffn / T`` columns and runs on the rank's tokens; without SP the routed output is
    all-reduced once before the routing weights multiply it (``l{L}.moe.ar``: one row per routed
    copy, top_k·b·s·h; the router's gradient needs whole outputs) and the experts' input gradient
    once (b·s·h), with SP each rank routes its shard, the routed copies gathered over TP and
    scattered back; moe-tiny (SwiGLU) and biased GELU experts with a shared expert."""
    from piper_sim.plan import Plan

    gelu = _model(tmp_path, GELU_MOE)
    configs = {"moe-tp2": tp_strategy(model="moe-tiny"), "moe-tp2-sp": tp_strategy(model="moe-tiny", sp=True),
               "gelu-moe-tp2": tp_strategy(model=gelu)}
    plan = Plan.load(save_plan(tmp_path, "moe-tp2", configs["moe-tp2"]))
    ops = [(i.direction, i.name, i.bytes) for i in plan.program(0).streams["tp"] if i.mb == 0
           and i.name.startswith("l1.")]
    act = configs["moe-tp2"]["seq_len"] * 64 * 4
    assert ops == [("F", "l1.attn.ar", act), ("F", "l1.moe.ar", 2 * act), ("B", "l1.moe.ar", act),
                   ("B", "l1.attn.ar", act)]
    res, _ = run_checks(tmp_path, 2, configs)
    ref = reference_losses(tmp_path, configs["moe-tp2"])
    assert_matches_reference({k: res.pop(k) for k in ("moe-tp2", "moe-tp2-sp")}, ref)
    assert_matches_reference(res, reference_losses(tmp_path, configs["gelu-moe-tp2"]))


@pytest.mark.slow
def test_moe_under_tp_without_ep_with_recompute_pipeline_and_gelu_experts_under_ep(tmp_path):
    """MoE under TP2 without EP: full recompute (the layer's TP.R ops), x PP2, GELU experts
    with SP, and (4 ranks) GELU experts with a shared expert under TP2 x EP2 (x DP2), with SP."""
    gelu = _model(tmp_path, GELU_MOE)
    ep = {"op": "expert_parallel", "degree": 2}
    two = {"moe-tp2-full": tp_strategy(model="moe-tiny", extra=[{"op": "recompute"}]),
           "moe-tp2-sp-full": tp_strategy(model="moe-tiny", sp=True, extra=[{"op": "recompute"}]),
           "gelu-moe-tp2-sp": tp_strategy(model=gelu, sp=True)}
    four = {"moe-tp2-pp2": tp_strategy(model="moe-tiny", pp=2, m=4),
            "gelu-moe-tp2-ep2": tp_strategy(model=gelu, dp=2, extra=[ep]),
            "gelu-moe-tp2-sp-ep2": tp_strategy(model=gelu, sp=True, dp=2, extra=[ep])}
    res, _ = run_checks(tmp_path, 2, two)
    assert_matches_reference({"gelu-moe-tp2-sp": res.pop("gelu-moe-tp2-sp")},
                             reference_losses(tmp_path, two["gelu-moe-tp2-sp"]))
    assert_matches_reference(res, reference_losses(tmp_path, two["moe-tp2-full"]))
    res, _ = run_checks(tmp_path, 4, four)
    assert_matches_reference({"moe-tp2-pp2": res.pop("moe-tp2-pp2")}, reference_losses(tmp_path, four["moe-tp2-pp2"]))
    assert_matches_reference(res, reference_losses(tmp_path, four["gelu-moe-tp2-ep2"]))


@pytest.mark.slow
def test_shared_experts_under_tp_with_full_recompute_and_zero1(tmp_path):
    """Full recomputation re-runs the MoE block's forward collectives (``l{L}.attn.ar``,
    ``l{L}.shared.ar``, the experts' ``l{L}.moe.ar``: TP.R ops) before its backward's, as the
    plan orders them (with or without shared experts; with SP its gathers and scatters)."""
    ep = {"op": "expert_parallel", "degree": 2}
    s = {**tp_strategy(dp=2, zero=1, extra=[ep, {"op": "recompute"}]),
         "model": _model(tmp_path, {**DSV3_TINY, "layers": 3})}
    moe = tp_strategy(model="moe-tiny", dp=2, extra=[ep, {"op": "recompute"}])
    # with SP: the experts' gather and scatter over TP re-run too (TP.R.*.moe.ag|rs)
    sp = {**tp_strategy(sp=True, dp=2, zero=1, extra=[ep, {"op": "recompute"}]), "model": s["model"]}
    res, _ = run_checks(tmp_path, 4, {"dsv3-tp2-ep2-zero1-full": s, "moe-tp2-ep2-full": moe,
                                      "dsv3-tp2-sp-ep2-zero1-full": sp})
    assert_matches_reference({"moe-tp2-ep2-full": res.pop("moe-tp2-ep2-full")}, reference_losses(tmp_path, moe))
    assert_matches_reference(res, reference_losses(tmp_path, s))


# ------------------------------------------------------------------ in process: shards, matching, refusals


def test_shards_are_exact_slices_of_the_reference_weights():
    from executor.stage import Stage
    from executor.parallel.tensor import TPComm, shard_stage
    from piper_sim.models import build_model, get_config

    cfg = get_config("gpt-tiny")
    full = dict(build_model(cfg, device="cpu", seed=3).named_parameters())
    names = ["embed", "layers.0", "layers.1", "head"]
    for index in range(2):
        stage = Stage(cfg, 0, 1, names, [names], 1, 0, torch.device("cpu"), torch.float32, 3)
        shard = shard_stage(stage, TPComm(None, 2, index, sp=False))
        params = dict(stage.named_parameters()[0])
        assert set(params) == {n for n in full if n.split(".")[0] in ("embed", "head") or n.split(".")[1] in "01"}
        for name, p in params.items():
            want = shard.reference_view(name, full[name])
            assert torch.equal(p, want), name
        # column-parallel rows, row-parallel columns, vocabulary rows; norms whole
        assert params["layers.0.attn.wq.weight"].shape == (32, 64)
        assert params["layers.0.attn.wo.weight"].shape == (64, 32)
        assert params["layers.1.mlp.w2.weight"].shape == (64, 128)
        assert params["head.out.weight"].shape == (256, 64) and params["embed.weight"].shape == (256, 64)
        assert [n for n in params if n not in shard.slices] == [
            "layers.0.attn_norm.weight", "layers.0.mlp_norm.weight", "layers.1.attn_norm.weight",
            "layers.1.mlp_norm.weight", "head.norm.weight"]


def test_plan_tp_ops_must_match_the_collectives_performed():
    from collections import deque

    from executor.parallel.axis import Logged
    from executor.parallel.tensor import TPComm

    tp = TPComm(None, 2, 0, sp=False)
    tp.log[("F", 0, 1)] = deque([Logged("l0.attn.ar", "ALLREDUCE", 1.0, 2.0), Logged("l0.mlp.ar", "ALLREDUCE", 2, 3)])
    assert tp.take(("F", 0, 1), "l0.attn.ar", "ALLREDUCE").end == 2.0
    with pytest.raises(RuntimeError, match="plan expects l1.attn.ar .* performed l0.mlp.ar"):
        tp.take(("F", 0, 1), "l1.attn.ar", "ALLREDUCE")
    with pytest.raises(RuntimeError, match="performed no further collective"):
        tp.take(("B", 0, 1), "l0.mlp.ar", "ALLREDUCE")
    tp.log[("B", 0, 0)] = deque([Logged("head.ar", "ALLREDUCE", 0, 1)])
    assert tp.leftover() == ["B.s0.mb0:head.ar"] and tp.leftover() == []


@pytest.mark.parametrize("s, why", [
    ({**tp_strategy(), "stack": {"tp_overlap": True}}, "with the stack's tp_overlap (collectives overlapped"),
])
def test_refused_tp_plans_name_why(tmp_path, s, why):
    from executor.options import refuse_tensor_parallel
    from piper_sim.api import compile
    from piper_sim.plan import PlanError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = compile(s)
    with pytest.raises(PlanError, match=why.replace("(", r"\(").replace(")", r"\)")):
        refuse_tensor_parallel(plan, "p.json")


def test_moe_without_expert_parallel_and_gelu_experts_pass_the_refusals_a_bad_vocab_does_not(tmp_path):
    """MoE without expert parallelism (with or without SP), GELU experts and MLA run under TP;
    a vocabulary TP does not divide is refused in one line."""
    from executor.options import refuse_tensor_parallel
    from piper_sim.api import compile
    from piper_sim.plan import PlanError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for sp in (False, True):
            for model in ("moe-tiny", _model(tmp_path, DSV3_TINY), _model(tmp_path, GELU_MOE)):
                refuse_tensor_parallel(compile({**tp_strategy(sp=sp), "model": model}), "p.json")
        plan = compile({**tp_strategy(), "model": _model(tmp_path, {**MLA_TINY, "name": "odd", "vocab": 255})})
    with pytest.raises(PlanError, match=r"^p.json: tensor parallel plans \(tp 2\) with vocab 255 not divisible by "
                       r"tp 2 are simulate-only in this version; use `piper-sim simulate`$"):
        refuse_tensor_parallel(plan, "p.json")


def test_clip_grad_norm_under_tp_counts_replicated_weights_once(tmp_path):
    """--clip-grad-norm under TP: each shard's slice counted once, a weight every TP rank holds
    whole (norms) 1/tp per rank; clipping active, and equal to the reference's
    torch.nn.utils.clip_grad_norm_."""
    configs = {"tp2": tp_strategy(), "tp2-sp": tp_strategy(sp=True)}
    _check_clipped(tmp_path, 2, {k: configs[k] for k in ("tp2", "tp2-sp")})


@pytest.mark.slow
def test_clip_grad_norm_under_tp_with_zero(tmp_path):
    # ZeRO-3 + SP: TP.norms sums the reduced shard's norm gradients before the norm is taken
    _check_clipped(tmp_path, 4, {"tp2-dp2-zero1": tp_strategy(dp=2, zero=1), "tp2-dp2-zero3": tp_strategy(dp=2, zero=3),
                                 "tp2-sp-dp2-zero3": tp_strategy(sp=True, dp=2, zero=3)})


def _check_clipped(tmp_path, nproc: int, configs: dict) -> None:
    from executor.reference import reference_training
    from piper_sim.plan import Plan

    res, _ = run_checks(tmp_path, nproc, configs, "--clip-grad-norm", "0.05")
    for name, row in res.items():
        assert row["within_tolerance"] is True and row["max_rel_param_diff"] <= TOL, (name, row)
        assert row["max_rel_grad_diff"] <= GRAD_TOL, (name, row)
        first: dict = {}  # the reference's first-step gradients: their norm is the one to clip by
        reference_training(Plan.load(save_plan(tmp_path, "ref", configs[name])), 1, first_grads=first)
        want = sum(float(g.double().pow(2).sum()) for g in first.values()) ** 0.5
        assert want > 0.05 and row["grad_norm0"] == pytest.approx(want, rel=1e-5), (name, row["grad_norm0"], want)


@pytest.mark.slow
def test_tp2_pp2_save_and_resume_give_the_uninterrupted_losses(tmp_path):
    """TP2 x PP2 checkpointed after step 2, resumed: steps 2 and 3 bit for bit as uninterrupted."""
    from test_checkpoint import assert_resumes_bit_exact

    assert_resumes_bit_exact(tmp_path, tp_strategy(sp=True, pp=2, m=4), 4)
