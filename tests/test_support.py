"""The README's feature x back-end table (`executor.support.FEATURES`) is what the code does:
each row's strategy compiles, the simulator runs it, and the executor's refusals
(`executor.support.unrunnable`) refuse exactly the rows marked simulate-only, naming the reason."""

from __future__ import annotations

import json
import os
import warnings

import pytest

from executor.support import FEATURES, feature_table, unrunnable
from piper_sim.api import compile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("feature", FEATURES, ids=[f.name for f in FEATURES])
def test_each_row_is_what_the_executor_does(feature, tmp_path):
    strategy = dict(feature.strategy)
    if feature.model_file is not None:
        path = tmp_path / "model.json"
        path.write_text(json.dumps(feature.model_file))
        strategy["model"] = str(path)
    if feature.user_model:
        strategy["model"] = "py:" + os.path.join(ROOT, feature.user_model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = compile(strategy)
    why = unrunnable(plan)
    if feature.runs:
        assert why == "", why
    else:
        assert why and (feature.match or feature.why) in why, why


def test_the_readme_shows_the_table():
    with open(os.path.join(ROOT, "README.md")) as f:
        assert feature_table() in f.read(), "README.md: paste executor.support.feature_table() under 'What runs where'"


def test_explore_runnable_keeps_to_plans_the_executor_runs(tmp_path):
    """``explore --runnable``: a model whose vocabulary (255) TP 2 does not divide, on 4 CPU ranks
    with TP 1 or 2 — TP2 is simulate-only (listed with why, never ranked); the best plan runs."""
    from piper_sim.explore import explore

    model = tmp_path / "odd.json"
    model.write_text(json.dumps({"name": "odd", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128,
                                 "vocab": 255}))
    kw = dict(tp_degrees=(1, 2), zero_levels=(0, 1), recompute=(False,), workers=1, prune=False)
    free = explore(str(model), "cpu:4", 8, 32, **kw)
    kept = explore(str(model), "cpu:4", 8, 32, refusal=unrunnable, **kw)
    refused = [r for r in kept.rows if r.status == "simulate-only"]
    assert refused and all("vocab 255 not divisible by tp 2 are simulate-only" in r.reason for r in refused)
    assert len(kept.rows) == len(free.rows)
    assert all(r.candidate.tp > 1 for r in refused) and any(r.candidate.tp == 1 for r in kept.rows)
    assert kept.best is not None and kept.best.status == "ok"
    assert unrunnable(compile(kept.best.candidate.strategy(str(model), "cpu:4", 8, 32))) == ""
