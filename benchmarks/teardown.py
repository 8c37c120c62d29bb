"""Clean shutdown: N consecutive small 2-rank torchrun jobs; count non-zero exits and
teardown aborts ("terminate called ...", SIGABRT/SIGSEGV of a worker).

    python benchmarks/teardown.py [-n 100] [--plan PLAN.json] [--steps 1]

Without --plan it compiles a 2-rank gpt-tiny DP2 ZeRO-1 plan (4 micro-batches of one
sequence of 16 tokens). Exit status 1 when any job failed.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ABORT_MARKS = ("terminate called", "Aborted", "Segmentation fault", "SIGABRT", "SIGSEGV", "core dumped")


def small_plan(path: str) -> None:
    from piper_sim.api import compile

    s = {"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 8, "seq_len": 16, "microbatches": 4,
         "dtype": "fp32", "directives": [{"op": "data_parallel", "degree": 2, "zero": 1}]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compile(s).save(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_jobs(plan: str, n: int, steps: int = 1, timeout: float = 300) -> dict:
    fails, aborts, times, notes = 0, 0, [], []
    for k in range(n):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-backend=c10d", f"--rdzv-id=td{k}",
               "-m", "executor", plan, "--steps", str(steps)]
        t = time.perf_counter()
        try:
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                               env={**os.environ, "PYTHONWARNINGS": "ignore"})
            rc, err = r.returncode, r.stderr
        except subprocess.TimeoutExpired as e:
            rc, err = -999, f"timeout: {e}"
        times.append(time.perf_counter() - t)
        abort = any(m in err for m in ABORT_MARKS)
        if rc != 0 or abort:
            fails += rc != 0
            aborts += abort
            notes.append(f"job {k}: rc {rc}{' (abort)' if abort else ''}: {err.strip().splitlines()[-1:] }")
        print(f"job {k + 1}/{n}: rc {rc}{'  ABORT' if abort else ''}  {times[-1]:.1f} s", flush=True)
    return {"jobs": n, "nonzero_exits": fails, "aborts": aborts, "mean_s": sum(times) / max(n, 1), "notes": notes}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=100, help="jobs (default 100)")
    p.add_argument("--plan", help="a 2-rank plan (default: a small DP2 ZeRO-1 plan)")
    p.add_argument("--steps", type=int, default=1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        plan = args.plan or os.path.join(d, "dp2z1.json")
        if not args.plan:
            small_plan(plan)
        res = run_jobs(plan, args.n, args.steps)
    for note in res["notes"]:
        print(note)
    print(f"{res['jobs']} jobs: {res['nonzero_exits']} non-zero exits, {res['aborts']} teardown aborts, "
          f"{res['mean_s']:.1f} s a job")
    return 1 if res["nonzero_exits"] or res["aborts"] else 0


if __name__ == "__main__":
    sys.exit(main())
