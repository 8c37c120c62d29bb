"""Executor speed against PyTorch on the same model, data and machine, in one run:

* DP2 (ZeRO-0, bucketed all-reduce)       vs  torch DDP
* DP2 ZeRO-1 (reduce-scatter, all-gather after the optimizer step) vs torch DDP, and vs
  DDP + ``ZeroRedundancyOptimizer`` (torch's own ZeRO-1); ``zero1-overlap``: the gathers
  during the next forward instead (Megatron's ``--overlap-param-gather``), which on a
  2-core CPU is no faster: gloo's transfers then take the cores the forward computes on
  (all with DDP's bucket size: 25 MiB, torch's default ``bucket_cap_mb``, buckets filled
  from the model's end as DDP fills them; DDP's first bucket is 1 MiB)
* PP2 GPipe / 1F1B / interleaved 1F1B     vs  torch.distributed.pipelining's class of each
* DP2 ZeRO-3 (per-unit gathers)           vs  FSDP2 ``fully_shard`` (one unit per layer)

    python benchmarks/bench_executor.py [--model gpt-small] [--seq 128] [--batch 16] [--mb 4] [--steps 10]
                                        [--cases dp2,zero1,pp2-1f1b,...]

It launches itself under torchrun (2 ranks, gloo on CPU) and prints the median step time
of each, executor and torch steps taking turns, the median of the paired ratios
executor / torch (target <= 1.00) and that median's 95 % bootstrap interval (how far
this machine's noise moves it).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from executor.baselines import DDP_BUCKET_MB, TorchDDP, TorchFSDP2, TorchPipeline, TorchZeRO1  # noqa: E402
from executor.collectives import Comms  # noqa: E402
from executor.runtime import Runtime  # noqa: E402
from piper_sim.api import compile  # noqa: E402


def strategy(args, directives: list[dict]) -> dict:
    return {"model": args.model, "cluster": "cpu:2", "global_batch": args.batch, "seq_len": args.seq,
            "microbatches": args.mb, "dtype": "fp32", "directives": directives}


def timed(fns, steps: int, warmup: int = 2) -> tuple[list[float], tuple[float, float, float]]:
    """Median wall time of one step of each function, and the median of the per-step
    ratios first / second with its 95 % interval. Steps alternate between the functions (all ranks aligned by
    barriers), so background load hits both alike."""
    times: list[list[float]] = [[] for _ in fns]
    for k in range(warmup + steps):
        for i, fn in enumerate(fns):
            dist.barrier()
            t = time.perf_counter()
            fn(k)
            dist.barrier()
            if k >= warmup:
                times[i].append(time.perf_counter() - t)
    ratios = [a / b for a, b in zip(times[0], times[1])]
    return [statistics.median(t) for t in times], (statistics.median(ratios), *bootstrap_interval(ratios))


def bootstrap_interval(xs: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of the median of ``xs``."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def worker(args) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    pp = lambda name: [{"op": "pipeline", "degree": 2, **({"stages_per_rank": 2} if "interleaved" in name else {})},
                       {"op": "schedule", "name": name}]
    # DP / ZeRO-1 buckets of DDP's size (torch's default, 25 MiB), ZeRO-3 one unit per layer as FSDP2
    dp = lambda zero: [{"op": "data_parallel", "degree": 2, "zero": zero,
                        **({"bucket_mb": DDP_BUCKET_MB} if zero < 3 else {})}]
    cases = {
        "dp2": (dp(0), lambda plan: TorchDDP(plan, rank), "DDP"),
        "zero1": (dp(1), lambda plan: TorchDDP(plan, rank), "DDP"),
        "zero1-zro": (dp(1), lambda plan: TorchZeRO1(plan, rank), "DDP+ZeroRedundancyOptimizer"),
        # parameter gathers overlapped with the next forward (Megatron's --overlap-param-gather)
        "zero1-overlap": ([{**dp(1)[0], "overlap_param_gather": True}], lambda plan: TorchDDP(plan, rank), "DDP"),
        "pp2-gpipe": (pp("gpipe"), lambda plan: TorchPipeline(plan, rank), "pipelining ScheduleGPipe"),
        "pp2-1f1b": (pp("1f1b"), lambda plan: TorchPipeline(plan, rank), "pipelining Schedule1F1B"),
        "pp2-interleaved": (pp("interleaved_1f1b"), lambda plan: TorchPipeline(plan, rank),
                            "pipelining Interleaved1F1B"),
        "zero3": (dp(3), lambda plan: TorchFSDP2(plan, rank), "FSDP2 fully_shard"),
    }
    wanted = args.cases.split(",") if args.cases else list(cases)
    for name in wanted:
        directives, make_torch, torch_name = cases[name]
        plan = compile(strategy(args, directives))
        comms = Comms.create(plan, timeout_s=120)
        rt = Runtime(plan, rank, comms, torch.device("cpu"), timeout_s=120)
        peer = make_torch(plan)
        (ours, theirs), ratio = timed([rt.run_step, peer.step], args.steps)
        comms.destroy()
        results[name] = (ours, theirs, torch_name, ratio)
    if rank == 0:
        print(f"model {args.model}, global batch {args.batch} x seq {args.seq}, {args.mb} micro-batches, "
              f"2 ranks (gloo, {torch.get_num_threads()} thread(s) each), median of {args.steps} steps")
        for name, (ours, theirs, torch_name, (ratio, lo, hi)) in results.items():
            print(f"{name:>15}: executor {ours * 1e3:8.1f} ms   torch {torch_name:<27} {theirs * 1e3:8.1f} ms   "
                  f"ratio {ratio:5.2f} [{lo:.2f}, {hi:.2f}]")
    dist.destroy_process_group()


def add_run_args(p: argparse.ArgumentParser, steps: int) -> None:
    """The model and batch options of the two-rank benchmarks (this one, bench_exposed_comm)."""
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--mb", type=int, default=4)
    p.add_argument("--steps", type=int, default=steps)


def run_on_two_ranks(script: str, worker, args) -> int:
    """Inside torchrun: ``worker(args)``; else launch ``script`` again under torchrun (2 ranks)."""
    if "RANK" in os.environ:
        worker(args)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
           os.path.abspath(script), *sys.argv[1:]]
    return subprocess.call(cmd)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p, steps=10)
    p.add_argument("--cases", help="comma-separated subset of: dp2, zero1, zero1-zro, zero1-overlap, pp2-gpipe, "
                                   "pp2-1f1b, pp2-interleaved, zero3")
    return run_on_two_ranks(__file__, worker, p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
