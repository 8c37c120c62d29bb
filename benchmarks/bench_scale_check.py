"""The executor's rank logic for every family of `executor.scale_check.FAMILIES` at scale.

    python benchmarks/bench_scale_check.py [--ranks 1024] [--workers 2] [--family NAME ...]

Per family: compile the plan for ``--ranks`` ranks, run every rank's set-up and one step over
torch's fake process group (``--workers`` processes, each a share of the ranks), check the
recorded calls; prints ranks, calls recorded, compile and check seconds, and ok or the first
mismatch. Exits 1 if any family fails.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

from executor.options import refuse_unrunnable
from executor.scale_check import FAMILIES, scale_check
from piper_sim.compiler import compile_strategy


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--family", nargs="*", choices=sorted(FAMILIES), help="default: every family")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    print(f"{'family':30} {'ranks':>6} {'calls':>9} {'compile s':>9} {'check s':>8}  result", flush=True)
    failed = 0
    t_all = time.perf_counter()
    for name in args.family or FAMILIES:
        t0 = time.perf_counter()
        plan = compile_strategy(FAMILIES[name].strategy(args.ranks)).plan
        refuse_unrunnable(plan, name)  # families are plans the executor runs
        compile_s = time.perf_counter() - t0
        r = scale_check(plan, workers=args.workers)
        failed += not r.ok
        print(f"{name:30} {r.ranks:6d} {r.calls:9d} {compile_s:9.1f} {r.seconds:8.1f}  "
              + ("ok" if r.ok else f"MISMATCH: {r.mismatch}"), flush=True)
    print(f"total {time.perf_counter() - t_all:.0f} s, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
