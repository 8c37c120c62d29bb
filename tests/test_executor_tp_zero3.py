"""Executor: ZeRO-3 under tensor parallelism with partial replicated gradients (sequence
parallelism's norms, a qk_norm model's query/key norms): ``TP.s{S}.norms`` sums them in the
reduced shard, after the stage's per-unit reduce-scatters (torchrun, gloo on CPU, 4 ranks)."""

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


def test_zero3_under_tp_with_sequence_parallel_and_qk_norm_match_the_reference(tmp_path):
    model = str(tmp_path / "qwen3-tiny.json")
    with open(model, "w") as f:
        json.dump(QWEN3_TINY, f)
    configs = {"tp2-sp-dp2-zero3": tp_strategy(sp=True, dp=2, zero=3),
               "qwen3-tp2-dp2-zero3": {**tp_strategy(dp=2, zero=3), "model": model}}
    res, _ = run_checks(tmp_path, 4, configs)
    assert_matches_reference({k: res[k] for k in ("tp2-sp-dp2-zero3",)}, reference_losses(tmp_path, configs["tp2-sp-dp2-zero3"]))
    assert_matches_reference({k: res[k] for k in ("qwen3-tp2-dp2-zero3",)},
                             reference_losses(tmp_path, configs["qwen3-tp2-dp2-zero3"]))
