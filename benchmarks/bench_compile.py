"""Compile time and plan size for full-size strategies.

    python benchmarks/bench_compile.py

Prints, per strategy: compile time, validation time, time to write the plan (content hash
and packed JSON), DAG nodes, the folded plan's size on disk, and the ratio against a
baseline measured in the same run: the size an unfolded plan would take (every rank's lists
written out), estimated from one class. Then the issue 12 targets for the 16K-GPU strategy
(`TARGET`): compile <= 5 s, plan file <= 5 MB, each with its ratio.
"""

from __future__ import annotations

import json
import time

from piper_sim.compiler import compile_strategy
from piper_sim.validate import validate_plan

from full_size import STRATEGIES  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

TARGET = "llama3-405b h100:2048x8 TP8 PP16 1f1b DP128 ZeRO-1"
TARGET_COMPILE_S, TARGET_PLAN_MB = 5.0, 5.0


def main() -> None:
    compile_strategy({"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 4, "seq_len": 32,
                      "microbatches": 2, "directives": [{"op": "pipeline", "degree": 2}]})  # warm-up: imports
    print(f"{'strategy':<56} {'ranks':>6} {'compile s':>9} {'validate s':>10} {'write s':>7} {'nodes':>7} "
          f"{'plan MB':>8} {'unfolded MB':>11} {'ratio':>6}")
    measured = {}
    for name, s in STRATEGIES.items():
        t0 = time.perf_counter()
        compiled = compile_strategy(s)
        t1 = time.perf_counter()
        validate_plan(compiled.plan)
        t2 = time.perf_counter()
        plan = compiled.plan
        size = len(plan.dumps())
        t3 = time.perf_counter()
        measured[name] = (t1 - t0, size)
        per_class = [len(json.dumps({k: [i.to_json() for i in v] for k, v in c.streams.items()}))
                     for c in plan.classes]
        unfolded = sum(n * len(c.ranks) for n, c in zip(per_class, plan.classes))
        print(f"{name:<56} {plan.world_size:>6} {t1 - t0:>9.2f} {t2 - t1:>10.2f} {t3 - t2:>7.2f} "
              f"{compiled.dag.g.number_of_nodes():>7} {size / 1e6:>8.2f} {unfolded / 1e6:>11.1f} "
              f"{unfolded / size:>5.0f}x")
    compile_s, size = measured[TARGET]
    print(f"target {TARGET}: compile {compile_s:.2f} s (target <= {TARGET_COMPILE_S:g} s, "
          f"{compile_s / TARGET_COMPILE_S:.2f}x of it), plan {size / 1e6:.2f} MB "
          f"(target <= {TARGET_PLAN_MB:g} MB, {size / 1e6 / TARGET_PLAN_MB:.2f}x of it)")


if __name__ == "__main__":
    main()
