"""Executor, tensor parallelism (torchrun, gloo on CPU, 4 ranks, against the single-process
reference): ZeRO-3 with partial replicated gradients (sequence parallelism's norms, a qk_norm
model's query/key norms), which ``TP.s{S}.norms`` sums in the reduced shard after the stage's
per-unit reduce-scatters; split-backward (BI/BW) schedules with sequence parallelism (BI keeps
the input shard, the plan's ``.regather`` gathers it for BW) or full recompute."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_executor_tp import QWEN3_TINY, assert_matches_reference, reference_losses, run_checks, tp_strategy  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def _norms(plan):
    return next(i for i in plan.class_of(0).instructions() if i.name == "norms")


def test_zero3_norms_all_reduce_follows_the_reduce_scatters():
    """The lowering orders TP.s0.norms after every dense reduce-scatter of its stage, and
    prices the shard of the norm weights (1/dp of them), not all of them."""
    from piper_sim.api import compile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        z3, z1 = compile(tp_strategy(sp=True, dp=2, zero=3)), compile(tp_strategy(sp=True, dp=2, zero=1))
    norms = _norms(z3)
    scatters = {i.id for i in z3.class_of(0).instructions() if i.kind == "REDUCE_SCATTER" and i.bucket >= 0}
    assert scatters and scatters <= set(norms.deps)
    assert norms.bytes == _norms(z1).bytes / 2
    assert not scatters & set(_norms(z1).deps)  # ZeRO-1: unchanged, the syncs wait for it (executor)
    hsdp = tp_strategy(sp=True, dp=4, zero=3)
    next(d for d in hsdp["directives"] if d["op"] == "data_parallel")["shard_degree"] = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = compile(hsdp)
    replicas = {i.id for i in plan.class_of(0).instructions() if i.kind == "ALLREDUCE" and i.bucket >= 0}
    assert replicas and replicas <= set(_norms(plan).deps)


def test_zero3_under_tp_with_sequence_parallel_and_qk_norm_match_the_reference(tmp_path):
    model = str(tmp_path / "qwen3-tiny.json")
    with open(model, "w") as f:
        json.dump(QWEN3_TINY, f)
    configs = {"tp2-sp-dp2-zero3": tp_strategy(sp=True, dp=2, zero=3),
               "qwen3-tp2-dp2-zero3": {**tp_strategy(dp=2, zero=3), "model": model}}
    res, _ = run_checks(tmp_path, 4, configs)
    for name, s in configs.items():
        assert_matches_reference({name: res[name]}, reference_losses(tmp_path, s))


def test_split_backward_under_sp_lists_the_regathers_before_bw_and_the_embedding_after_it():
    from piper_sim.api import compile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = compile(tp_strategy(sp=True, pp=2, m=4, sched="zb1p"))
    ops = {i.id: i for i in plan.class_of(0).instructions()}
    assert "TP.B.s0.mb0.l0.attn.regather" in ops["BW.s0.mb0"].deps
    assert "BW.s0.mb0" in ops["TP.B.s0.mb0.embed.ag"].deps  # the embedding's backward is all weight gradient
    assert "TP.B.s0.mb0.embed.ag" in ops["OPT.s0"].deps


@pytest.mark.slow  # ~16 s; the fast set splits the backward under TP in tests/test_recompute_tp_cp.py
def test_split_backward_under_tp_with_sp_or_full_recompute_matches_the_reference(tmp_path):
    configs = {"tp2-sp-pp2-zb1p": tp_strategy(sp=True, pp=2, m=4, sched="zb1p"),
               # BI re-runs the layers and the head (TP.R ops), not the embedding (kept)
               "tp2-pp2-zbv-full": tp_strategy(pp=2, m=4, sched="zbv", extra=[{"op": "recompute"}])}
    res, _ = run_checks(tmp_path, 4, configs)
    assert_matches_reference(res, reference_losses(tmp_path, configs["tp2-sp-pp2-zb1p"]))


@pytest.mark.slow
def test_split_backward_under_sp_with_zbv_dualpipev_and_full_recompute(tmp_path):
    configs = {"tp2-sp-pp2-zbv": tp_strategy(sp=True, pp=2, m=4, sched="zbv"),
               "tp2-sp-pp2-dualpipev": tp_strategy(sp=True, pp=2, m=4, sched="dualpipev"),
               "tp2-sp-pp2-zb1p-full": tp_strategy(sp=True, pp=2, m=4, sched="zb1p", extra=[{"op": "recompute"}])}
    res, _ = run_checks(tmp_path, 4, configs)
    assert_matches_reference(res, reference_losses(tmp_path, configs["tp2-sp-pp2-zbv"]))


@pytest.mark.slow
def test_zero3_sp_qk_norm_and_split_backward_together_on_eight_ranks(tmp_path):
    model = str(tmp_path / "qwen3-tiny.json")
    with open(model, "w") as f:
        json.dump(QWEN3_TINY, f)
    configs = {"tp2-sp-pp2-dp2-zero3-zb1p": tp_strategy(sp=True, pp=2, dp=2, zero=3, m=4, sched="zb1p"),
               "qwen3-tp2-sp-pp2-dp2-zero3-zbv-full": {**tp_strategy(sp=True, pp=2, dp=2, zero=3, m=4, sched="zbv",
                                                                      extra=[{"op": "recompute"}]), "model": model}}
    hsdp = tp_strategy(sp=True, dp=4, zero=3)  # TP.norms after the replica all-reduces too
    next(d for d in hsdp["directives"] if d["op"] == "data_parallel")["shard_degree"] = 2
    configs["tp2-sp-hsdp2x2-zero3"] = hsdp
    res, _ = run_checks(tmp_path, 8, configs)
    for name, s in configs.items():
        assert_matches_reference({name: res[name]}, reference_losses(tmp_path, s))
