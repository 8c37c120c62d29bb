"""Property-based: random valid strategies compile, validate and simulate with invariants.

Every strategy is valid by construction (the generator follows each schedule's rules), so a
StrategyError is a failure. For each: the plan validates; the unfolded simulation runs every
op of every rank exactly once; ops on one stream never overlap; the bubble fraction is in
[0, 1); the step is at least the busiest rank's compute; the folded simulation (one rank per
class) gives the unfolded step time and bubble.
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from piper_sim.api import compile
from piper_sim.simulator import simulate
from piper_sim.validate import validate_plan

pytestmark = pytest.mark.filterwarnings("ignore")

EXAMPLES = int(__import__("os").environ.get("PIPER_PROPERTY_EXAMPLES", 300))
COSTMODELS = ("unit:F=1,BI=0.5,BW=0.5,comm=0.25", "unit:F=1,BI=1,BW=1,comm=0,p2p=0.5", "analytic")


def _microbatches(draw, sched: str, pp: int) -> int:
    if sched == "dualpipe":
        return draw(st.sampled_from([2 * pp, 2 * pp + 2, 4 * pp]))
    if sched in ("dualpipev", "zbv"):
        return draw(st.sampled_from([2 * pp, 3 * pp, 4 * pp]))
    if sched in ("interleaved_1f1b",):
        return pp * draw(st.integers(1, 3))
    return draw(st.integers(max(1, pp if sched == "1f1b" else 1), 3 * pp))


@st.composite
def valid_strategies(draw) -> tuple[dict, str]:
    moe = draw(st.booleans())
    sched = draw(st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv", "dualpipe", "dualpipev"]))
    pp = draw(st.sampled_from([2, 4] if sched == "dualpipe" else [1, 2, 4] if sched in ("gpipe", "1f1b", "zb1p")
                              else [2, 4]))
    v = 2 if sched in ("interleaved_1f1b", "zbv", "dualpipev") else 1
    if moe and pp * v > 4:  # moe-tiny has 4 layers
        pp = 2 if v == 2 or sched == "dualpipe" else 4
        v = 2 if sched in ("interleaved_1f1b", "zbv", "dualpipev") else 1
    m = _microbatches(draw, sched, pp)
    dp = draw(st.sampled_from([1, 2]))
    directives = [{"op": "pipeline", "degree": pp, **({"stages_per_rank": v} if v > 1 else {})},
                  {"op": "schedule", "name": sched}]
    if dp > 1:
        directives.append({"op": "data_parallel", "degree": dp, "zero": draw(st.integers(0, 3)),
                           **({"bucket_mb": draw(st.sampled_from([0.25, 1.0]))} if draw(st.booleans()) else {})})
        if moe and draw(st.booleans()):
            directives.append({"op": "expert_parallel", "degree": 2})
    if draw(st.booleans()):
        directives.append({"op": "recompute"})
    mbs = draw(st.integers(1, 2))
    strategy = {"model": "moe-tiny" if moe else "gpt-tiny", "cluster": f"cpu:{pp * dp}",
                "global_batch": dp * m * mbs, "seq_len": draw(st.sampled_from([8, 16])), "microbatches": m,
                "directives": directives}
    return strategy, draw(st.sampled_from(COSTMODELS))


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(valid_strategies())
def test_random_valid_strategies_compile_validate_simulate(case):
    strategy, costmodel = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = compile(strategy)
    validate_plan(plan)
    full = simulate(plan, costmodel, fold=False)
    rows = full.rows
    for r in range(plan.world_size):
        want = Counter(i.id for lst in plan.program(r).streams.values() for i in lst)
        got = Counter(row[2] for row in rows if row[0] == r)
        assert got == want, (r, want - got, got - want)
    by_stream: dict = {}
    for row in rows:
        by_stream.setdefault((row[0], row[1]), []).append((row[11], row[6], row[7], row[2]))
    for key, ops in by_stream.items():
        ops.sort()
        for (_, _, end_a, a), (_, start_b, _, b) in zip(ops, ops[1:]):
            assert start_b >= end_a - 1e-12, (key, a, b)
    assert 0.0 <= full.bubble_fraction < 1.0
    assert full.step_time_s >= max(s.compute_s for s in full.rank_stats) * (1 - 1e-9)
    folded = simulate(plan, costmodel, fold=True)
    if folded.folded:
        assert folded.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
        assert folded.bubble_fraction == pytest.approx(full.bubble_fraction, rel=1e-9, abs=1e-12)
