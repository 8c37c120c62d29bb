"""Start-up cost of the command line: what a user waits for before any work.

    python benchmarks/bench_startup.py [--repeat N]

Each number is the median wall time of N fresh processes (default 3): ``import piper_sim``,
``piper-sim models``, ``import torch`` (the yardstick), and ``piper-sim compile`` of a tiny
strategy with an empty profile cache (first) and with the cache it left (cached). Printed with
its target, where there is one, and its ratio to ``import torch``. The profile cache lives in a
temporary folder (PIPER_SIM_CACHE_DIR), never the user's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 4, "seq_len": 32, "microbatches": 4,
        "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"}]}
TARGETS = {"piper-sim models": 0.3, "piper-sim compile (cached)": 1.0}


def wall(argv: list[str], env: dict[str, str], before=None) -> float:
    """Seconds a fresh process takes (after `before()`, which is not timed)."""
    if before is not None:
        before()
    t = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="fresh processes per number (median; default 3)")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="piper-sim-bench-startup-")
    try:
        cache = os.path.join(work, "cache")
        strategy = os.path.join(work, "tiny.json")
        with open(strategy, "w") as f:
            json.dump(TINY, f)
        # as an installed user runs: bytecode cached (a shell with PYTHONDONTWRITEBYTECODE=1 recompiles
        # every module on each start, ~0.3 s here)
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "PIPER_SIM_CACHE_DIR": cache,
               "PYTHONPATH": os.pathsep.join(x for x in (ROOT, os.environ.get("PYTHONPATH")) if x)}
        py, cli = [sys.executable], [sys.executable, "-m", "piper_sim"]
        compile_argv = cli + ["compile", strategy, "-o", os.path.join(work, "tiny.plan.json")]
        runs = {
            "import piper_sim": lambda: wall(py + ["-c", "import piper_sim"], env),
            "piper-sim models": lambda: wall(cli + ["models"], env),
            "import torch": lambda: wall(py + ["-c", "import torch"], env),
            "piper-sim compile (first)": lambda: wall(compile_argv, env,
                                                      before=lambda: shutil.rmtree(cache, ignore_errors=True)),
            "piper-sim compile (cached)": lambda: wall(compile_argv, env),
        }
        wall(py + ["-c", "import torch"], env)  # warm the file cache once
        times = {}
        for name, run in runs.items():
            times[name] = statistics.median(run() for _ in range(args.repeat))
        torch_s = times["import torch"]
        print(f"{'what':<28} {'wall s':>7} {'target s':>9} {'vs target':>10} {'vs import torch':>16}")
        for name, t in times.items():
            target = TARGETS.get(name)
            versus = f"{t / target:.2f}x" if target else "-"
            print(f"{name:<28} {t:>7.3f} {target if target else '-':>9} {versus:>10} {t / torch_s:>15.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
