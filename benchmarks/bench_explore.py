"""Explorer throughput: strategies decided per second per worker core.

    python benchmarks/bench_explore.py [--workers 1,2] [--model llama3-70b --cluster h100:16x8]

Explores every candidate (all schedules, ZeRO levels, recompute, tensor parallel 1-8) and
prints, per worker count (after one warm-up run: imports, profiles on disk and in memory):
candidates, how many were screened out of memory, pruned, simulated (and of those found out
of memory only by the simulation), wall time, strategies/s/core and the ratio to the target (issue 12: >= 50), then
the speed-up of the last worker count over the first (target: > 1, more workers faster).
The best strategy must be the same for every worker count (the search is exact).
"""

from __future__ import annotations

import argparse
import time

from piper_sim.explore import explore

TARGET_PER_CORE = 50.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--cluster", default="h100:16x8")
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    args = ap.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    t0 = time.perf_counter()
    explore(args.model, args.cluster, args.global_batch, args.seq_len, workers=max(counts))
    print(f"{args.model} on {args.cluster}, batch {args.global_batch} x {args.seq_len} "
          f"(warm-up run, imports and profiles: {time.perf_counter() - t0:.1f} s)")
    print(f"{'workers':>7} {'strategies':>10} {'oom screened':>12} {'pruned':>6} {'simulated':>9} {'sim oom':>7} "
          f"{'wall s':>7} {'strat/s/core':>12} {'target':>6} {'ratio':>6}  best")
    walls, best = {}, set()
    for w in counts:
        r = explore(args.model, args.cluster, args.global_batch, args.seq_len, workers=w)
        simulated = [x for x in r.rows if x.status in ("ok", "invalid") or x.step_time_s == x.step_time_s]
        sim_oom = sum(1 for x in simulated if x.status == "oom")
        rate = len(r.rows) / r.wall_s / w
        walls[w] = r.wall_s
        best.add((r.best.candidate.short(), r.best.step_time_s) if r.best else None)
        print(f"{w:>7} {len(r.rows):>10} {r.counts.get('oom', 0) - sim_oom:>12} {r.counts.get('pruned', 0):>6} "
              f"{len(simulated):>9} {sim_oom:>7} {r.wall_s:>7.1f} {rate:>12.1f} {TARGET_PER_CORE:>6.0f} "
              f"{rate / TARGET_PER_CORE:>5.2f}x  {r.best.candidate.short() if r.best else '-'}")
    ws = sorted(walls)
    if len(ws) > 1:
        print(f"workers {ws[-1]} vs {ws[0]}: {walls[ws[0]] / walls[ws[-1]]:.2f}x faster (target > 1)")
    assert len(best) == 1, f"the best differs between worker counts: {best}"


if __name__ == "__main__":
    main()
