"""Executor: real context parallelism (allgather and ring) against the single-process reference
(torchrun, gloo on CPU, gpt-tiny, seq 32, 2 steps), the plan's CP ops matched to the
collectives the attention performed, and what is still refused."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_executor_tp import assert_matches_reference, reference_losses, run_checks, tp_strategy  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

# a GQA model with sliding-window layers (8 of 32 tokens: windows cross the chunk boundaries) and qk_norm
WINDOWED = {"name": "win", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256,
            "sliding_window": 8, "window_pattern": 2, "qk_norm": True}


def cp_strategy(cp: int = 2, style: str = "allgather", tp: int = 1, sp: bool = False, pp: int = 1, dp: int = 1,
                zero: int = 0, m: int = 2, model: str = "gpt-tiny", sched: str = "1f1b", extra: list | None = None,
                seq: int = 32) -> dict:
    s = tp_strategy(tp=tp, sp=sp, pp=pp, dp=dp, zero=zero, m=m, model=model, sched=sched, extra=extra)
    if tp == 1:
        s["directives"] = [d for d in s["directives"] if d["op"] != "tensor_parallel"]
    s["seq_len"], s["cluster"] = seq, f"cpu:{pp * dp * cp * tp}"
    s["directives"] = [{"op": "context_parallel", "degree": cp, "style": style}, *s["directives"]]
    return s


def full(extra: list | None = None) -> list:
    return [{"op": "recompute"}, *(extra or [])]


def test_cp2_allgather_and_ring_match_the_reference(tmp_path):
    model = tmp_path / "win.json"
    model.write_text(json.dumps(WINDOWED))
    configs = {"cp2": cp_strategy(), "cp2-selective": cp_strategy(extra=[{"op": "recompute", "mode": "selective"}]),
               # full recomputation: allgather keeps the recomputed gather for its backward
               "cp2-full": cp_strategy(extra=full()), "cp2-ring": cp_strategy(style="ring"),
               "cp2-win": cp_strategy(model=str(model)), "cp2-ring-win": cp_strategy(style="ring", model=str(model))}
    res, _ = run_checks(tmp_path, 2, configs)
    windowed = {k: res.pop(k) for k in ("cp2-win", "cp2-ring-win")}
    ref = reference_losses(tmp_path, configs["cp2"])
    assert_matches_reference(res, ref)
    assert_matches_reference(windowed, reference_losses(tmp_path, configs["cp2-win"]))


def test_cp2_ring_full_recompute_clipped_traces_every_cp_op(tmp_path):
    from executor.reference import reference_training
    from piper_sim.plan import Plan

    s = cp_strategy(style="ring", extra=full())  # the recomputed forward runs the ring again (CP.R ops)
    trace = str(tmp_path / "trace.json")
    # the global gradient norm (~2) counts every gradient once: a replicated one on its dp x cp group's first rank
    res, path = run_checks(tmp_path, 2, {"cp2-ring-full": s}, "--trace", trace, "--clip-grad-norm", "0.05")
    plan = Plan.load(path)
    assert_matches_reference(res, reference_training(plan, 2, clip_grad_norm=0.05)[1])
    want = {(r, i.id) for r in range(2) for i in plan.program(r).streams["cp"]}
    assert any(op.startswith("CP.R.") for _, op in want)
    with open(trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("CP.")]
    assert {(e["pid"], e["name"]) for e in events} == want  # every plan CP op of every rank, measured
    assert all(e["dur"] >= 0 for e in events)


@pytest.mark.slow  # ~24 s; the fast set keeps CP2 all-gather and ring, and MLA under CP2
def test_cp2_with_data_pipeline_tensor_and_expert_parallel_and_cp4_match_the_reference(tmp_path):
    model = tmp_path / "win.json"
    model.write_text(json.dumps(WINDOWED))
    configs = {"cp2-dp2-zero1": cp_strategy(dp=2, zero=1),
               "cp2-dp2-zero3-ring": cp_strategy(dp=2, zero=3, style="ring"),
               "cp2-pp2": cp_strategy(pp=2, m=4),
               # zero-bubble: BI runs the attention's backward collectives, BW weight gradients only
               "cp2-pp2-zbv-ring-full": cp_strategy(pp=2, m=4, sched="zbv", style="ring", extra=full()),
               "tp2-cp2": cp_strategy(tp=2), "tp2-sp-cp2-ring": cp_strategy(tp=2, sp=True, style="ring"),
               # four ranks in a ring (windows of 8 span chunks of 4 tokens)
               "cp4": cp_strategy(cp=4),
               "cp4-ring-full-win": cp_strategy(cp=4, style="ring", model=str(model), extra=full()),
               "cp2-dp2-ep2-moe": cp_strategy(model="moe-tiny", dp=2, extra=[{"op": "expert_parallel", "degree": 2}])}
    res, _ = run_checks(tmp_path, 4, configs)
    two = {k: res.pop(k) for k in ("tp2-cp2", "tp2-sp-cp2-ring", "cp4")}
    own = {k: {k: res.pop(k)} for k in ("cp2-dp2-ep2-moe", "cp4-ring-full-win")}
    # 4 sequences per step (dp 2 x 2 micro-batches, or 4 micro-batches); TP x CP and CP4: 2
    assert_matches_reference(res, reference_losses(tmp_path, configs["cp2-pp2"]))
    assert_matches_reference(two, reference_losses(tmp_path, configs["cp4"]))
    for k, row in own.items():
        assert_matches_reference(row, reference_losses(tmp_path, configs[k]))


def test_mla_under_cp2_allgather_and_ring_matches_the_reference(tmp_path):
    """Multi-head latent attention under CP2: the collectives move the up-projected per-head K
    (``qk_nope + qk_rope``, the rotary key expanded per head) and V (``v_head_dim``, narrower)
    side by side, the bytes the plan prices; rotary at the true positions; allgather and ring."""
    from piper_sim.api import compile
    from test_executor_tp import MLA_TINY, _model

    mla = _model(tmp_path, MLA_TINY)
    configs = {"mla-cp2": cp_strategy(model=mla), "mla-cp2-ring": cp_strategy(model=mla, style="ring")}
    seq = configs["mla-cp2"]["seq_len"]
    ops = {i.id: i for i in compile(configs["mla-cp2"]).program(0).streams["cp"]}
    # micro-batch 1, 4 heads x (8 + 4 + 8) per token, fp32: the executor's packed K|V buffer, gathered
    assert ops["CP.F.s0.mb0.l0.kv.ag"].bytes == ops["CP.B.s0.mb0.l0.dkv.rs"].bytes == seq * 4 * (8 + 4 + 8) * 4
    res, _ = run_checks(tmp_path, 2, configs)
    assert_matches_reference(res, reference_losses(tmp_path, configs["mla-cp2"]))


@pytest.mark.slow
def test_mla_under_cp2_with_full_recompute_and_tensor_parallel_matches_the_reference(tmp_path):
    """MLA under CP: ring and allgather with full recomputation (CP.R ops; allgather keeps the
    recomputed gather), without a query latent, and TP2 x CP2 with and without SP (the TP
    rank's heads' K/V: half the bytes)."""
    from piper_sim.api import compile
    from test_executor_tp import MLA_TINY, _model

    mla, no_q = _model(tmp_path, MLA_TINY), _model(tmp_path, {**MLA_TINY, "name": "mla-noq", "q_lora": 0})
    two = {"mla-cp2-ring-full": cp_strategy(model=mla, style="ring", extra=full()),
           "mla-noq-cp2-full": cp_strategy(model=no_q, extra=full())}
    four = {"mla-tp2-cp2": cp_strategy(model=mla, tp=2), "mla-tp2-sp-cp2-ring": cp_strategy(model=mla, tp=2, sp=True,
                                                                                             style="ring")}
    seq = four["mla-tp2-cp2"]["seq_len"]
    ops = {i.id: i for i in compile(four["mla-tp2-cp2"]).program(0).streams["cp"]}
    assert ops["CP.F.s0.mb0.l0.kv.ag"].bytes == seq * 2 * (8 + 4 + 8) * 4
    res, _ = run_checks(tmp_path, 2, two)
    noq = {"mla-noq-cp2-full": res.pop("mla-noq-cp2-full")}
    assert_matches_reference(res, reference_losses(tmp_path, two["mla-cp2-ring-full"]))
    assert_matches_reference(noq, reference_losses(tmp_path, two["mla-noq-cp2-full"]))
    res, _ = run_checks(tmp_path, 4, four)
    assert_matches_reference(res, reference_losses(tmp_path, four["mla-tp2-cp2"]))


# ------------------------------------------------------------------ in process: chunks, attention, ops, refusals


def test_each_rank_holds_its_load_balanced_chunks():
    from executor.parallel.context import cp_positions

    assert cp_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    both = torch.cat([cp_positions(24, 3, i) for i in range(3)])
    assert sorted(both.tolist()) == list(range(24))


def test_ring_merge_of_chunks_equals_causal_attention_and_its_gradients():
    """The ring's pieces (partial attention per key chunk, log-sum-exp merge, per-chunk
    backward) give causal GQA attention and its gradients over a permuted sequence."""
    from executor.parallel.context import cp_positions, merge, partial_attention, partial_attention_backward
    from piper_sim.models import attention

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, s, d = 2, 4, 2, 16, 8
    q, k, v = (torch.randn(B, h, s, d, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    want = attention(q, k, v)
    dout = torch.randn_like(want)
    want.backward(dout)
    scale = d ** -0.5
    chunks = [cp_positions(s, 2, i) for i in range(2)]
    for r, pos in enumerate(chunks):
        qr = q.detach()[:, :, pos]
        out = lse = None
        for kpos in (chunks[r], chunks[1 - r]):
            o, l = partial_attention(qr, k.detach()[:, :, kpos], v.detach()[:, :, kpos], pos, kpos, scale)
            out, lse = (o, l) if out is None else merge(out, lse, o, l)
        torch.testing.assert_close(out, want.detach()[:, :, pos])
        dq = torch.zeros_like(qr)
        delta = (dout[:, :, pos] * out).sum(-1, keepdim=True)
        for kpos in chunks:
            dq += partial_attention_backward(qr, k.detach()[:, :, kpos], v.detach()[:, :, kpos], pos, kpos, scale,
                                             lse, dout[:, :, pos], delta)[0]
        torch.testing.assert_close(dq, q.grad[:, :, pos])


def test_cp_ops_wait_for_the_pieces_that_perform_them(tmp_path):
    from executor.parallel.context import is_cp, reorder_after_pieces
    from piper_sim.api import compile

    def programs(s: dict):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = compile(s)
        prog = plan.program(0)
        before = {i.id: i for lst in prog.streams.values() for i in lst}
        reorder_after_pieces(prog.streams, plan.meta["stage_parts"])
        return before, {i.id: i for lst in prog.streams.values() for i in lst}

    before, after = programs(cp_strategy())
    assert "CP.F.s0.mb0.l0.kv.ag" in before["F.s0.mb0.p1"].deps  # the plan gathers before the piece
    assert "F.s0.mb0.p1" in after["CP.F.s0.mb0.l0.kv.ag"].deps
    assert not any(is_cp(before[d]) for d in after["F.s0.mb0.p1"].deps)
    # what the gather waited for, the piece waits for now
    assert set(before["CP.F.s0.mb0.l0.kv.ag"].deps) <= set(after["F.s0.mb0.p1"].deps)
    before, after = programs(cp_strategy(style="ring", extra=full()))
    assert "B.s0.mb0.p8" not in before["CP.R.s0.mb0.l7.kv.ag"].deps  # a ring runs beside its piece
    assert "B.s0.mb0.p8" in after["CP.R.s0.mb0.l7.kv.ag"].deps  # the recomputed ring runs in layer 7's backward


def test_a_collective_the_plan_does_not_list_is_named():
    from collections import deque

    from executor.parallel.context import CPComm
    from executor.parallel.axis import Logged

    cp = CPComm(None, 2, 0, False)
    cp.log[("B", 0, 1)] = deque([Logged("l3.kv.ag", "ALL_GATHER", 0, 1)])
    with pytest.raises(RuntimeError, match=r"context parallel: the plan expects l3.dkv.rs \(REDUCE_SCATTER\)"):
        cp.take(("B", 0, 1), "l3.dkv.rs", "REDUCE_SCATTER")


def test_refused_cp_plans_name_the_field(tmp_path):
    """MLA passes the refusals now; a user nn.Module model under CP (the compiler refuses it
    too) is refused in one line."""
    from executor.options import refuse_tensor_parallel
    from piper_sim.api import compile
    from piper_sim.plan import PlanError
    from test_executor_tp import MLA_TINY, _model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        refuse_tensor_parallel(compile(cp_strategy(model=_model(tmp_path, MLA_TINY))), "p.json")
        plan = compile(cp_strategy())
    plan.meta["user_model"] = {"name": "m", "source": "py:m:build"}
    with pytest.raises(PlanError, match=r"^p.json: context_parallel \(cp 2\) with a user nn.Module model is "
                       r"simulate-only in this version; use `piper-sim simulate`$"):
        refuse_tensor_parallel(plan, "p.json")


@pytest.mark.slow
def test_tp2_cp2_save_and_resume_give_the_uninterrupted_losses(tmp_path):
    """A TP2 x CP2 run checkpointed after step 2 and resumed trains steps 2 and 3 to the
    uninterrupted run's losses, bit for bit (one key per TP shard; CP peers hold the same
    parameters and write them once)."""
    from test_checkpoint import assert_resumes_bit_exact

    assert_resumes_bit_exact(tmp_path, cp_strategy(tp=2, sp=True), 4)
