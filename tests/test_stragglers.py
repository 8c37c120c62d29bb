"""Stragglers: the fleet's speed spread slows a synchronous step to its slowest GPU, and the
slow-rank what-if (`costmodel.stragglers`, `simulate(slow_ranks=...)`)."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest

from costmodel.hardware import H100, parse_cluster
from costmodel.model import AnalyticCostModel
from costmodel.stragglers import GPU_SPEED_SPREAD, expected_max_z, slowest_factor
from piper_sim.api import compile
from piper_sim.simulator import SimulationError, simulate

DP8 = {"model": "llama3-8b", "cluster": "h100:1x8", "global_batch": 16, "seq_len": 2048, "microbatches": 2,
       "directives": [{"op": "data_parallel", "degree": 8, "zero": 1}]}
PP2 = {"model": "gpt-small", "cluster": "h100:1x8", "global_batch": 16, "seq_len": 1024, "microbatches": 4,
       "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"},
                      {"op": "data_parallel", "degree": 4, "zero": 1}]}


def exact_max_z(n: int) -> float:
    """E[max of n standard normals] = ∫ x · n φ(x) Φ(x)^(n-1) dx, by the midpoint rule."""
    h, total = 1e-3, 0.0
    for i in range(int(16 / h)):
        x = -8 + (i + 0.5) * h
        phi = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        total += x * n * phi * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1) * h
    return total


@pytest.mark.parametrize("n,rel", [(2, 0.05), (8, 0.02), (20, 0.01), (512, 0.01), (8192, 0.01)])
def test_blom_approximation_is_close_to_the_exact_expected_maximum(n, rel):
    assert expected_max_z(n) == pytest.approx(exact_max_z(n), rel=rel)


def test_the_slowest_of_more_gpus_is_slower():
    factors = [slowest_factor(n) for n in (1, 8, 64, 512, 4096, 65536)]
    assert factors[0] == 1.0 and factors == sorted(factors) and len(set(factors)) == len(factors)
    assert 1.01 < slowest_factor(8) < slowest_factor(512) < 1.04  # spread 1%: 1.4% and 3.0%
    with pytest.raises(ValueError, match="speed_spread"):
        slowest_factor(8, -0.1)


def _without_spread(cluster: str) -> AnalyticCostModel:
    c = parse_cluster(cluster)
    return AnalyticCostModel(dataclasses.replace(c, gpu=dataclasses.replace(c.gpu, speed_spread=0.0)))


def test_every_compute_op_runs_at_the_pace_of_the_worlds_slowest_gpu():
    plan = compile(DP8)
    spread, flat = simulate(plan), simulate(plan, _without_spread("h100:1x8"))
    assert H100.speed_spread == GPU_SPEED_SPREAD
    factor = slowest_factor(8)
    # forwards and the optimizer (the last backward overlaps gradient buckets: its slowdown
    # while they run depends on timing)
    compute = lambda r: r.events[r.events.kind.isin(["F", "OPT"])]  # noqa: E731
    a, b = compute(spread), compute(flat)
    assert list(a.op_id) == list(b.op_id)
    assert ((a.end - a.start).to_numpy() == pytest.approx((b.end - b.start).to_numpy() * factor, rel=1e-6))
    assert flat.step_time_s < spread.step_time_s < flat.step_time_s * factor * (1 + 1e-9)


def test_a_cpu_cluster_has_no_spread():
    plan = compile({**DP8, "model": "gpt-tiny", "cluster": "cpu:2", "seq_len": 64,
                    "directives": [{"op": "data_parallel", "degree": 2}]})
    c = parse_cluster("cpu:2")
    assert c.gpu.speed_spread == 0.0
    assert simulate(plan).step_time_s == simulate(plan, AnalyticCostModel(c)).step_time_s


@pytest.mark.parametrize("strategy", [DP8, PP2], ids=["dp8", "pp2xdp4"])
def test_one_slow_rank_slows_the_step_and_folding_agrees_with_every_rank(strategy):
    plan = compile(strategy)
    base = simulate(plan)
    folded = simulate(plan, slow_ranks={5: 1.5})
    unfolded = simulate(plan, fold=False, slow_ranks={5: 1.5})
    assert folded.folded and not unfolded.folded
    assert folded.step_time_s == pytest.approx(unfolded.step_time_s, rel=1e-9)
    assert base.step_time_s * 1.2 < folded.step_time_s < base.step_time_s * 1.5 * (1 + 1e-9)
    # the slow rank computes 1.5x; in a pipeline the other stage waits for it, it does not slow
    slow = unfolded.per_rank.set_index("rank").compute_s
    fast_rank = 0 if strategy is DP8 else 1
    assert slow[5] == pytest.approx(1.5 * slow[fast_rank], rel=0.02) if strategy is DP8 else slow[5] > slow[1]


@pytest.mark.parametrize("slow,match", [({8: 1.5}, "slow rank 8 is outside"), ({1: 0.5}, "slowdown of rank 1"),
                                        ({1: float("nan")}, "slowdown of rank 1")])
def test_bad_slow_ranks_are_one_line(slow, match):
    with pytest.raises(SimulationError, match=match):
        simulate(compile(DP8), slow_ranks=slow)


def test_cli_slow_ranks(tmp_path):
    plan = tmp_path / "p.json"
    compile(DP8).save(str(plan))
    run = lambda *a: subprocess.run([sys.executable, "-m", "piper_sim", "simulate", str(plan), "--json", *a],  # noqa: E731
                                    capture_output=True, text=True)
    import json

    base, slow = run(), run("--slow-ranks", "2,3", "--slowdown", "1.3")
    assert base.returncode == slow.returncode == 0, slow.stderr
    assert json.loads(slow.stdout)["step_time_s"] > 1.2 * json.loads(base.stdout)["step_time_s"]
    bad = run("--slow-ranks", "99")
    assert bad.returncode == 2 and "slow rank 99 is outside the plan's ranks 0..7" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_explore_ranks_plans_with_a_slow_gpu():
    """With rank 0 1.5x slower every plan is slower; a data-parallel one computes at that
    rank's pace (a pipeline hides part of one slow stage in its bubble); a rank outside the
    cluster is one line."""
    from piper_sim.explore import explore

    kw = dict(zero_levels=(1,), microbatch_factors=(2,), tp_degrees=(1,), prune=False, workers=1)
    base = explore("gpt-small", "h100:1x4", 16, 512, **kw)
    slow = explore("gpt-small", "h100:1x4", 16, 512, slow_ranks={0: 1.5}, **kw)
    before = {r.candidate: r.step_time_s for r in base.rows if r.status == "ok"}
    after = {r.candidate: r.step_time_s for r in slow.rows if r.status == "ok"}
    assert before and before.keys() == after.keys()
    assert all(after[c] > before[c] for c in before)
    assert all(after[c] > 1.3 * before[c] for c in before if c.pp == 1) and any(c.pp > 1 for c in before)
    assert slow.settings["slow_ranks"] == {0: 1.5}
    with pytest.raises(ValueError, match="slow rank 4 is outside"):
        explore("gpt-small", "h100:1x4", 16, 512, slow_ranks={4: 1.5}, **kw)
