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

from full_size import STRATEGIES  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


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
