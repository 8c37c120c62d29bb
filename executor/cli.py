"""``piper-sim run PLAN.json``: start the plan's ranks through torchrun.

The plan is checked here first (format version, content hash, world size against the
launch), so a bad plan is refused before any process starts; then this is just::

    python -m torch.distributed.run --nproc-per-node N [--nnodes ...] -m executor PLAN.json ...

Register it with ``add_run_parser(subparsers)``; ``python -m executor.cli run ...`` works too.
This module imports no torch, so registering it keeps ``piper-sim --help`` fast.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from piper_sim.plan import Plan, PlanError


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Options shared by the worker and ``piper-sim run``."""
    p.add_argument("--steps", type=int, default=1, help="training steps (default 1)")
    p.add_argument("--trace", metavar="OUT.json", help="Chrome trace of the last step, all ranks")
    p.add_argument("--timeline", metavar="OUT.png", help="timeline picture of the last step")
    p.add_argument("--kineto", metavar="DIR",
                   help="Kineto-shaped trace per rank of the last step in DIR (HolisticTraceAnalysis, Perfetto)")
    p.add_argument("--json", action="store_true", help="one JSON object per line: loss and step time per step")
    p.add_argument("--check", action="store_true",
                   help="also train a single-process reference and print max_abs/max_rel_param_diff")
    p.add_argument("--save", metavar="DIR", help="checkpoint after the last step (torch.distributed.checkpoint)")
    p.add_argument("--resume", metavar="DIR", help="start from a checkpoint of the same plan")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds without progress before a rank gives up (default 60)")
    p.add_argument("--profile", metavar="DIR",
                   help="save a torch.profiler (Kineto) trace per rank in DIR: steps are ProfilerStep#N, "
                        "every plan op a record_function(op_id) range")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA for GPU clusters when available, else CPU")
    p.add_argument("--clip-grad-norm", type=float, metavar="X",
                   help="clip gradients to global L2 norm X over all shards and stages (as clip_grad_norm_)")
    p.add_argument("--no-hash-check", action="store_true", help="accept a plan edited after compiling")


def add_run_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("run", help="execute a plan with torch.distributed (one process per rank, torchrun)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", metavar="PLAN.json", help="plan file from `piper-sim compile`")
    p.add_argument("--nproc", type=int, help="ranks on this node (default: the plan's world size / nnodes)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (run this command on each)")
    p.add_argument("--node-rank", type=int, help="this node's rank (optional with the c10d rendezvous)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="rendezvous endpoint for multi-node runs (c10d backend); default: standalone")
    p.add_argument("--rdzv-id", default="piper-sim", help="rendezvous id shared by the nodes of one run")
    add_run_options(p)
    p.set_defaults(func=cmd_run)
    return p


def torchrun_command(args, plan: Plan) -> list[str]:
    nproc = args.nproc or plan.world_size // args.nnodes
    if nproc * args.nnodes != plan.world_size:
        raise PlanError(f"{args.plan} was compiled for {plan.world_size} ranks but --nnodes {args.nnodes} x "
                        f"--nproc {nproc} = {nproc * args.nnodes} would be launched; change --nproc/--nnodes "
                        f"or recompile for {nproc * args.nnodes} ranks")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if args.rdzv_endpoint:
        cmd += [f"--nnodes={args.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}",
                f"--rdzv-id={args.rdzv_id}"]
        if args.node_rank is not None:
            cmd.append(f"--node-rank={args.node_rank}")
    elif args.nnodes > 1:
        raise PlanError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    else:
        cmd.append("--standalone")
    cmd += ["-m", "executor", os.path.abspath(args.plan), "--steps", str(args.steps),
            "--timeout", str(args.timeout), "--device", args.device]
    if getattr(args, "clip_grad_norm", None) is not None:
        cmd += ["--clip-grad-norm", str(args.clip_grad_norm)]
    for flag in ("trace", "timeline", "kineto", "save", "resume", "profile"):
        value = getattr(args, flag)
        if value:
            cmd += [f"--{flag}", os.path.abspath(value)]
    for flag in ("json", "check", "no_hash_check"):
        if getattr(args, flag):
            cmd.append("--" + flag.replace("_", "-"))
    return cmd


def cmd_run(args: argparse.Namespace) -> None:
    plan = Plan.load(args.plan, check_hash=not args.no_hash_check)  # refuse before launching
    rc = subprocess.call(torchrun_command(args, plan))
    if rc:
        raise SystemExit(rc)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: the same as `piper-sim` (one error handler for all commands)."""
    from piper_sim.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
