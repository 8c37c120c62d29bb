"""Megatron-Core's combined 1F1B (``overlap_moe_expert_parallel_comm``): interleaved 1F1B
with one more warm-up forward and every steady-state forward and backward run as one
overlapped pair, so one micro-batch's expert all-to-alls hide behind the other's compute."""

from __future__ import annotations

import pytest

from piper_sim.api import compile
from piper_sim.checks import StrategyError
from piper_sim.schedules import build_schedule
from piper_sim.simulator import simulate
from tests.test_tied_embeddings import check

pytestmark = pytest.mark.filterwarnings("ignore")


def strategy(sched: str = "combined_1f1b", *extra: dict, model: str = "moe-tiny", m: int = 4,
             cluster: str = "cpu:4", ep: int = 2) -> dict:
    d = [{"op": "pipeline", "degree": 2, "stages_per_rank": 2}, {"op": "schedule", "name": sched},
         {"op": "data_parallel", "degree": 2, "zero": 1}, *extra]
    if ep > 1:
        d.append({"op": "expert_parallel", "degree": ep})
    return {"model": model, "cluster": cluster, "global_batch": 2 * m, "seq_len": 32, "microbatches": m,
            "dtype": "fp32", "directives": d}


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 3)])
def test_order_is_interleaved_1f1b_with_one_more_warmup_forward_and_paired_steady_state(pp, m, v):
    ours, base = build_schedule("combined_1f1b", pp, m, v), build_schedule("interleaved_1f1b", pp, m, v)
    for r in range(pp):
        flat = [a for slot in ours.orders[r] for a in slot]
        assert sorted(map(str, flat)) == sorted(str(s[0]) for s in base.orders[r])  # the same actions
        warm = next(i for i, s in enumerate(ours.orders[r]) if s[0].kind != "F" or len(s) == 2)
        # Megatron-Core get_pp_rank_microbatches: (pp - r - 1) * 2 + (v - 1) * group, plus one
        assert warm == min((pp - r - 1) * 2 + (v - 1) * pp + 1, v * m)
        pairs = [s for s in ours.orders[r] if len(s) == 2]
        assert len(pairs) == v * m - warm  # every steady-state step is one F&B pair
        assert all(s[0].kind == "F" and s[1].kind == "B" for s in pairs)


def test_refused_without_expert_parallel_with_full_recompute_or_without_virtual_stages():
    with pytest.raises(StrategyError, match="needs expert_parallel degree > 1"):
        compile(strategy(model="gpt-tiny", ep=1))
    with pytest.raises(StrategyError, match="full recompute is refused"):
        compile(strategy("combined_1f1b", {"op": "recompute"}))
    s = strategy()
    s["directives"][0]["stages_per_rank"] = 1
    with pytest.raises(StrategyError, match="needs virtual stages"):
        compile(s)
    compile(strategy("combined_1f1b", {"op": "recompute", "mode": "selective"}))  # selective is fine


def test_the_expert_all_to_all_hides_behind_the_paired_compute():
    """On two H100 nodes with EP across them, the all-to-alls exposed under interleaved 1F1B
    shrink when each is paired with another micro-batch's compute."""
    kw = dict(model="moe-small", m=8, cluster="h100:2x8", ep=4)
    runs = {}
    for sched in ("interleaved_1f1b", "combined_1f1b"):
        s = strategy(sched, **kw)
        s["directives"][2]["degree"] = 8
        s["global_batch"], s["dtype"] = 8 * 8, "bf16"
        runs[sched] = simulate(compile(s))
    plain, combined = runs["interleaved_1f1b"], runs["combined_1f1b"]
    assert combined.step_time_s < plain.step_time_s, (combined.step_time_s, plain.step_time_s)


def test_executor_runs_it_equal_to_the_reference(tmp_path):
    """PP2 x 2 stages per rank x DP2 x EP2 on 4 gloo ranks, --check against the single process."""
    check(tmp_path, 4, {"combined": strategy()})
