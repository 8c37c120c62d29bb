"""ZeRO-1/2 parameter all-gathers overlapped with the next step's forward (Megatron's
``overlap_param_gather``): plan fields, plan checks, the simulator's gated forward, and
the executor against the single-process reference."""

from __future__ import annotations

import copy

import pytest

from piper_sim.api import compile
from piper_sim.simulator import simulate
from piper_sim.strategy import StrategyError
from piper_sim.validate import PlanValidationError, validate_plan
from test_executor import json_lines, save_plan, strategy, torchrun


def zero_strategy(zero: int = 1, overlap: bool | None = True, pp: int = 1, m: int = 2) -> dict:
    dp = {"op": "data_parallel", "degree": 2, "zero": zero}
    if overlap is not None:
        dp["overlap_param_gather"] = overlap
    pipe = [{"op": "pipeline", "degree": pp}, {"op": "schedule", "name": "1f1b"}] if pp > 1 else []
    return {"model": "gpt-tiny", "cluster": f"cpu:{2 * pp}", "global_batch": 2 * m, "seq_len": 16,
            "microbatches": m, "directives": [*pipe, dp]}


def ops(plan, pp_rank: int = 0) -> dict:
    c = next(c for c in plan.classes if c.pp_rank == pp_rank)
    return {i.id: i for lst in c.streams.values() for i in lst}


@pytest.mark.parametrize("zero", [1, 2])
def test_gathers_open_the_step_and_gate_the_first_forward(zero):
    plan = compile(zero_strategy(zero))
    by_id = ops(plan)
    gathers = sorted((i for i in by_id.values() if i.kind == "ALL_GATHER"), key=lambda i: i.bucket)
    assert len(gathers) > 2
    assert all(g.deps == [] and g.needed_by == "F.s0.mb0" for g in gathers)
    shares = [g.needed_at for g in gathers]
    assert shares[0] == 0.0 and shares == sorted(shares) and shares[-1] < 1.0  # model order, embedding first
    assert {g.id for g in gathers} <= set(by_id["OPT.s0"].deps)  # a shard is not stepped while it goes
    assert "F.s0.mb0" not in {d for g in gathers for d in g.deps} and not set(by_id["F.s0.mb0"].deps)
    dp = next(c for c in plan.classes if c.pp_rank == 0).streams["dp"]
    assert [i.kind for i in dp[:len(gathers)]] == ["ALL_GATHER"] * len(gathers)  # first on their stream


def test_without_overlap_the_gathers_follow_the_optimizer():
    by_id = ops(compile(zero_strategy(1, overlap=False)))
    gathers = [i for i in by_id.values() if i.kind == "ALL_GATHER"]
    assert gathers and all(g.deps == ["OPT.s0"] and not g.needed_by for g in gathers)


def test_each_pipeline_stage_gates_its_own_first_forward():
    plan = compile(zero_strategy(1, pp=2, m=4))
    for r in (0, 1):
        gathers = [i for i in ops(plan, r).values() if i.kind == "ALL_GATHER"]
        assert gathers and {g.needed_by for g in gathers} == {f"F.s{r}.mb0"}


def test_bad_field_is_a_one_line_error():
    s = zero_strategy(1)
    s["directives"][0]["overlap_param_gather"] = "yes"
    with pytest.raises(StrategyError, match="field 'overlap_param_gather' must be true or false"):
        compile(s)


def test_plan_check_names_a_gate_on_no_compute_op():
    plan = compile(zero_strategy(1))
    bad = copy.deepcopy(plan)
    g = next(i for lst in bad.classes[0].streams.values() for i in lst if i.kind == "ALL_GATHER")
    g.needed_by = "F.s0.mb9"
    with pytest.raises(PlanValidationError, match=r"AG\.s0\.b\d+ field 'needed_by' names 'F.s0.mb9'"):
        validate_plan(bad)


def test_plan_check_refuses_a_gate_behind_another_op_on_its_stream():
    """A compute op waiting part-way for a gather posts only the gathers heading their
    stream (the executor's one thread is inside that op): one listed behind another op
    would hang the executor and the simulator alike, so the check refuses it."""
    bad = copy.deepcopy(compile(zero_strategy(1)))
    dp = bad.classes[0].streams["dp"]
    first = next(k for k, i in enumerate(dp) if i.kind == "REDUCE_SCATTER")
    dp.insert(0, dp.pop(first))
    with pytest.raises(PlanValidationError, match=r"op AG\.s0\.b0 \(needed_by F\.s0\.mb0\) sits behind RS\.s0\.b\d+ "
                                                   r"on stream 'dp'"):
        validate_plan(bad)


@pytest.mark.parametrize("comm", [0.0, 0.07, 0.25])
def test_simulated_forward_waits_for_each_bucket_where_it_is_needed(comm):
    """Exact under unit costs: the forward runs until a bucket's share, waits for its gather,
    goes on; so it ends at max(start + F, max over buckets of gather end + the rest of F)."""
    plan = compile(zero_strategy(1))
    res = simulate(plan, f"unit:F=1,BI=1,BW=1,comm={comm}")
    ev = res.events[res.events["rank"] == 0].set_index("op_id")
    gates = [i for i in ops(plan).values() if i.needed_by == "F.s0.mb0"]
    f = ev.loc["F.s0.mb0"]
    want = max(f["start"] + 1.0, *(ev.loc[g.id, "end"] + (1.0 - g.needed_at) for g in gates))
    assert f["end"] == pytest.approx(want, abs=1e-9)
    if comm == 0.0:  # nothing to wait for: the same step as gathering after the optimizer
        assert res.step_time_s == pytest.approx(
            simulate(compile(zero_strategy(1, overlap=False)), "unit:F=1,BI=1,BW=1,comm=0").step_time_s)


def test_overlap_hides_the_gathers_the_optimizer_would_expose():
    cm = "unit:F=1,BI=1,BW=1,comm=0.05"
    overlapped = simulate(compile(zero_strategy(1)), cm)
    after_step = simulate(compile(zero_strategy(1, overlap=False)), cm)
    assert overlapped.step_time_s < after_step.step_time_s


@pytest.mark.slow
def test_executor_overlapped_gathers_train_like_the_reference_and_like_gathering_after_the_step(tmp_path):
    """ZeRO-1 and ZeRO-2 (PP2 x DP2), overlapped and not: --check against the reference, and
    the same losses step by step; a checkpoint taken after the last step holds the gathered
    parameters (resuming from it continues with the uninterrupted run's loss)."""
    def plan(z: int, overlap: bool) -> str:
        s = strategy(pp=2, dp=2, zero=z, m=4)
        next(d for d in s["directives"] if d["op"] == "data_parallel")["overlap_param_gather"] = overlap
        return save_plan(tmp_path, f"z{z}{overlap}", s)

    paths = {(z, o): plan(z, o) for z in (1, 2) for o in (True, False)}
    losses = {}
    for key, path in paths.items():
        r = torchrun(4, [path, "--steps", "3", "--json", "--check"])
        assert r.returncode == 0, r.stderr[-2000:]
        rows = json_lines(r.stdout)
        check = next(x for x in rows if "max_rel_param_diff" in x)
        assert check["within_tolerance"] and check["max_rel_grad_diff"] <= 1e-5, check
        losses[key] = [x["loss"] for x in rows if "loss" in x]
    for z in (1, 2):
        assert losses[(z, True)] == pytest.approx(losses[(z, False)], rel=1e-6)
    ckpt = str(tmp_path / "ckpt")
    r = torchrun(4, [paths[(1, True)], "--steps", "2", "--json", "--save", ckpt])
    assert r.returncode == 0, r.stderr[-2000:]
    r = torchrun(4, [paths[(1, True)], "--steps", "1", "--json", "--resume", ckpt, "--check"])
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json_lines(r.stdout)
    assert [x["loss"] for x in rows if "loss" in x] == pytest.approx(losses[(1, True)][2:], rel=1e-6)
    assert next(x for x in rows if "max_rel_param_diff" in x)["within_tolerance"]
