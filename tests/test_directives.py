"""Directives: expansion to the low-level set, user overrides, recompute, streams."""

from __future__ import annotations

import pytest

from piper_sim.api import compile
from piper_sim.pipelining import compute_order
from piper_sim.directives import expand
from piper_sim.strategy import StrategyError, parse_strategy


def base(**kw):
    s = {"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 4, "seq_len": 16, "microbatches": 4,
         "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"}]}
    s.update(kw)
    return s


def test_expanded_low_level_strategy_compiles_to_the_same_plan():
    s = base()
    s["directives"].append({"op": "data_parallel", "degree": 1})
    low = {**s, "directives": expand(parse_strategy(s))}
    assert {d["op"] for d in low["directives"]} >= {"split", "place", "order", "replicate"}
    assert compile(low).content_hash() != ""
    assert [compute_order(compile(low), r) for r in range(2)] == [compute_order(compile(s), r) for r in range(2)]


def test_user_order_overrides_the_schedule_row():
    s = base()
    s["directives"].append({"op": "order", "pp_rank": 1,
                            "slots": ["1F0", "1F1", "1B0", "1B1", "1F2", "1F3", "1B2", "1B3"]})
    plan = compile(s)
    assert compute_order(plan, 1) == "1F0 1F1 1B0 1B1 1F2 1F3 1B2 1B3"


def test_low_level_split_backward_on_one_rank():
    s = base()
    s["directives"].append({"op": "order", "pp_rank": 1,
                            "slots": ["1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1W1", "1F3", "1I3",
                                      "1W2", "1W3"]})
    plan = compile(s)
    kinds = [i.kind for i in plan.classes[1].streams["compute"]]
    assert "BI" in kinds and "BW" in kinds and "B" not in kinds
    assert "B" in [i.kind for i in plan.classes[0].streams["compute"]]


def test_recompute_moves_forward_flops_into_backward_and_saves_memory():
    plain = compile(base())
    rec = compile(base(directives=base()["directives"] + [{"op": "recompute"}]))
    f = next(i for i in plain.classes[0].streams["compute"] if i.id == "F.s0.mb0")
    b = next(i for i in plain.classes[0].streams["compute"] if i.id == "B.s0.mb0")
    rb = next(i for i in rec.classes[0].streams["compute"] if i.id == "B.s0.mb0")
    rf = next(i for i in rec.classes[0].streams["compute"] if i.id == "F.s0.mb0")
    assert rb.recompute and rb.flops == pytest.approx(b.flops + f.flops)
    assert rf.alloc < f.alloc / 4


def test_stream_directive_renames_a_stream():
    s = base(cluster="cpu:4")
    s["directives"] += [{"op": "data_parallel", "degree": 2}, {"op": "stream", "kind": "ALLREDUCE", "name": "grads"}]
    s["global_batch"] = 8
    plan = compile(s)
    assert "grads" in plan.classes[0].streams
    assert all(i.kind == "ALLREDUCE" for i in plan.classes[0].streams["grads"])


def test_place_must_cover_every_stage_and_rank():
    s = base()
    s["directives"] = [{"op": "split", "microbatches": 4}, {"op": "place", "stage": 0, "pp_rank": 0},
                       {"op": "place", "stage": 2, "pp_rank": 1},
                       {"op": "order", "pp_rank": 0, "slots": []}]
    with pytest.raises(StrategyError, match=r"stage\(s\) \[1\] are not placed"):
        compile(s)


def test_schedule_constraint_messages_name_the_schedule():
    s = base(microbatches=6, global_batch=6)
    s["directives"] = [{"op": "pipeline", "degree": 4, "stages_per_rank": 2},
                       {"op": "schedule", "name": "interleaved_1f1b"}]
    s["cluster"] = "cpu:4"
    with pytest.raises(StrategyError, match="interleaved_1f1b needs microbatches to be a multiple"):
        compile(s)


def test_uneven_layers_per_stage():
    s = base()
    s["directives"][0]["layers_per_stage"] = [5, 3]
    plan = compile(s)
    assert plan.meta["stage_units"][0] == ["embed"] + [f"layers.{i}" for i in range(5)]
    assert plan.meta["stage_units"][1] == [f"layers.{i}" for i in range(5, 8)] + ["head"]
    s["directives"][0]["layers_per_stage"] = [5, 4]
    with pytest.raises(StrategyError, match="summing to the 8 layers"):
        compile(s)
