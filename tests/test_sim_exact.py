"""The simulator's numbers stay bit-identical: step time, per-rank peak memory, the event count
and a digest of every event's timing for a handful of varied strategies, against values the
simulator produced before its speed work (issue 28 item 5). A change to the cost model or the
simulator's semantics that moves them on purpose regenerates the golden file with

    python tests/test_sim_exact.py --update
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "data", "sim_exact.json")
CPU_CALIBRATION = os.path.join(HERE, "..", "traces", "calibration", "cpu-2core.json")


def _strategy(model: str, cluster: str, gb: int, seq: int, m: int, *directives: dict) -> dict[str, Any]:
    return {"model": model, "cluster": cluster, "global_batch": gb, "seq_len": seq, "microbatches": m,
            "directives": list(directives)}


def _pp(n: int, v: int | None = None) -> dict:
    return {"op": "pipeline", "degree": n, **({"stages_per_rank": v} if v else {})}


def _sched(name: str) -> dict:
    return {"op": "schedule", "name": name}


def _dp(n: int, zero: int) -> dict:
    return {"op": "data_parallel", "degree": n, "zero": zero}


# name -> (strategy, simulate keyword arguments)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # GPU clusters, the analytic cost model (links shared, folded)
    "llama3-8b h100:8x8 PP4 1f1b DP16 ZeRO-1": (
        _strategy("llama3-8b", "h100:8x8", 128, 4096, 8, _pp(4), _sched("1f1b"), _dp(16, 1)), {}),
    "llama3-8b h100:8x8 PP4 1f1b DP16 ZeRO-1 unfolded": (
        _strategy("llama3-8b", "h100:8x8", 128, 4096, 8, _pp(4), _sched("1f1b"), _dp(16, 1)), {"fold": False}),
    "llama3-8b h100:4x8 TP4 SP PP4 interleaved v2 DP2 ZeRO-1": (
        _strategy("llama3-8b", "h100:4x8", 16, 4096, 8, _pp(4, 2), _sched("interleaved_1f1b"), _dp(2, 1),
                  {"op": "tensor_parallel", "degree": 4, "sequence_parallel": True}), {}),
    "qwen3-moe-9b h100:4x8 PP2 dualpipev EP8 DP16 ZeRO-1": (
        _strategy("qwen3-moe-9b", "h100:4x8", 64, 4096, 4, _pp(2, 2), _sched("dualpipev"), _dp(16, 1),
                  {"op": "expert_parallel", "degree": 8}), {}),
    "llama3-8b h100:2x8 PP2 1f1b DP8 ZeRO-3, rank 3 twice as slow": (
        _strategy("llama3-8b", "h100:2x8", 32, 4096, 4, _pp(2), _sched("1f1b"), _dp(8, 3)), {"slow_ranks": {3: 2.0}}),
    # CPU clusters on the 2-core calibration: comm/compute slowdowns, ranks sharing the cores
    "gpt-tiny cpu:4 PP2 1f1b DP2 ZeRO-1 calibrated, unfolded": (
        _strategy("gpt-tiny", "cpu:4", 8, 64, 4, _pp(2), _sched("1f1b"), _dp(2, 1)),
        {"costmodel": CPU_CALIBRATION, "fold": False}),
    "moe-tiny cpu:4 PP2 zb1p EP2 DP2 ZeRO-3 calibrated": (
        _strategy("moe-tiny", "cpu:4", 8, 64, 4, _pp(2), _sched("zb1p"), _dp(2, 3),
                  {"op": "expert_parallel", "degree": 2}), {"costmodel": CPU_CALIBRATION}),
    # host-bound ranks posting comm (a unit model with post and host times), unfolded
    "gpt-tiny cpu:8 PP2 interleaved v2 DP4 ZeRO-2 unit host-bound": (
        _strategy("gpt-tiny", "cpu:8", 16, 64, 4, _pp(2, 2), _sched("interleaved_1f1b"), _dp(4, 2)),
        {"costmodel": "unit:F=1,BI=1,BW=1,comm=0.3,post=0.05,host=1", "fold": False}),
}


def measure(name: str) -> dict[str, Any]:
    from piper_sim.api import compile
    from piper_sim.simulator import simulate

    strategy, kwargs = CASES[name]
    r = simulate(compile(strategy), **kwargs)
    rows = hashlib.sha256(repr(sorted(r.rows)).encode()).hexdigest()
    memory = hashlib.sha256(repr(sorted(r.memory_samples)).encode()).hexdigest()
    return {"step_time_s": r.step_time_s, "num_events": r.num_events, "folded": r.folded,
            "peak_memory_bytes": {str(s.rank): s.peak_memory_bytes for s in r.rank_stats},
            "rows_sha256": rows, "memory_sha256": memory}


def _golden() -> dict[str, Any]:
    with open(GOLDEN) as f:
        return json.load(f)


def test_golden_covers_the_cases():
    assert sorted(_golden()) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_simulated_numbers_unchanged(name):
    want, got = _golden()[name], measure(name)
    assert got["num_events"] == want["num_events"]
    assert got["folded"] == want["folded"]
    assert got["step_time_s"] == want["step_time_s"]  # bit-identical, no tolerance
    assert got["peak_memory_bytes"] == want["peak_memory_bytes"]
    assert got["rows_sha256"] == want["rows_sha256"], "an event's timing changed"
    assert got["memory_sha256"] == want["memory_sha256"], "a memory sample changed"


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    with open(GOLDEN, "w") as f:
        json.dump({name: measure(name) for name in sorted(CASES)}, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {GOLDEN}")
