"""Compile time and plan size for full-size strategies.

    python benchmarks/bench_compile.py

Prints, per strategy: compile time, validation time, DAG nodes, the folded plan's
size on disk, and the ratio against a baseline measured in the same run: the size an
unfolded plan would take (every rank's lists written out), estimated from one class.
"""

from __future__ import annotations

import json
import time

from piper_sim.compiler import compile_strategy
from piper_sim.validate import validate_plan

STRATEGIES = {
    "deepseek-v3 h800:256x8 PP16 dualpipe EP64 DP128 ZeRO-1": {
        "model": "deepseek-v3", "cluster": "h800:256x8", "global_batch": 4096, "seq_len": 4096,
        "microbatches": 32,
        "directives": [{"op": "pipeline", "degree": 16}, {"op": "schedule", "name": "dualpipe"},
                       {"op": "data_parallel", "degree": 128, "zero": 1}, {"op": "expert_parallel", "degree": 64}]},
    "llama3-405b h100:1024x8 PP16 1f1b DP512 ZeRO-3": {
        "model": "llama3-405b", "cluster": "h100:1024x8", "global_batch": 16384, "seq_len": 4096,
        "microbatches": 32,
        "directives": [{"op": "pipeline", "degree": 16}, {"op": "schedule", "name": "1f1b"},
                       {"op": "data_parallel", "degree": 512, "zero": 3}]},
    "llama3-70b h100:128x8 PP8 1f1b DP128 ZeRO-1": {
        "model": "llama3-70b", "cluster": "h100:128x8", "global_batch": 4096, "seq_len": 4096,
        "microbatches": 32,
        "directives": [{"op": "pipeline", "degree": 8}, {"op": "schedule", "name": "1f1b"},
                       {"op": "data_parallel", "degree": 128, "zero": 1}]},
}


def main() -> None:
    print(f"{'strategy':<56} {'ranks':>6} {'compile s':>9} {'validate s':>10} {'nodes':>7} "
          f"{'plan MB':>8} {'unfolded MB':>11} {'ratio':>6}")
    for name, s in STRATEGIES.items():
        t0 = time.perf_counter()
        compiled = compile_strategy(s)
        t1 = time.perf_counter()
        validate_plan(compiled.plan)
        t2 = time.perf_counter()
        plan = compiled.plan
        size = len(plan.dumps())
        per_class = [len(json.dumps({k: [i.to_json() for i in v] for k, v in c.streams.items()}))
                     for c in plan.classes]
        unfolded = sum(n * len(c.ranks) for n, c in zip(per_class, plan.classes))
        print(f"{name:<56} {plan.world_size:>6} {t1 - t0:>9.2f} {t2 - t1:>10.2f} "
              f"{compiled.dag.g.number_of_nodes():>7} {size / 1e6:>8.2f} {unfolded / 1e6:>11.1f} "
              f"{unfolded / size:>5.0f}x")


if __name__ == "__main__":
    main()
