"""``piper-sim run PLAN.json``: start the plan's ranks through torchrun.

The plan is checked here first (format version, content hash, the compiler's validation,
world size against the launch and this node's GPUs/cores, the checkpoint to resume), so a
bad plan is refused with one line (exit 2) before any process starts; then this is just::

    python -m executor.launch --nproc-per-node N [--nnodes ...] -m executor PLAN.json ...

(`executor.launch` is torchrun without its warnings and traceback unless ``-v``). torchrun
dies with this process and receives its SIGTERM/SIGINT/SIGHUP (`executor.lifetime`).
Exit status: 0 done; 2 refused before launching (one line); 1 a rank failed (each failing
rank's line, then one naming the first); 128+N stopped by signal N.

Register it with ``add_run_parser(subparsers)``; ``python -m executor.cli run ...`` works too.
This module imports no torch, so registering it keeps ``piper-sim --help`` fast.
"""

from __future__ import annotations

import argparse
import os
import sys

from piper_sim.checks import MAX_CPU_RANKS_PER_CORE, arg_float, arg_int
from piper_sim.plan import Plan, PlanError


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Options shared by the worker and ``piper-sim run``."""
    p.add_argument("--steps", type=arg_int(1), default=1, help="training steps (default 1)")
    p.add_argument("--trace", metavar="OUT.json", help="Chrome trace of the last step, all ranks")
    p.add_argument("--timeline", metavar="OUT.png", help="timeline picture of the last step")
    p.add_argument("--kineto", metavar="DIR",
                   help="Kineto-shaped trace per rank of the last step in DIR (HolisticTraceAnalysis, Perfetto)")
    p.add_argument("--json", action="store_true", help="one JSON object per line: loss and step time per step")
    p.add_argument("--check", action="store_true",
                   help="also train a single-process reference and print max_abs/max_rel_param_diff")
    p.add_argument("--save", metavar="DIR", help="checkpoint after the last step into DIR/step-N "
                   "(torch.distributed.checkpoint, written atomically)")
    p.add_argument("--save-every", type=arg_int(0), default=0, metavar="K",
                   help="with --save: also checkpoint every K steps")
    p.add_argument("--keep", type=arg_int(1), default=2, metavar="N",
                   help="with --save: keep the newest N checkpoints (2)")
    p.add_argument("--resume", metavar="DIR", help="start from the newest complete checkpoint in DIR (same plan)")
    p.add_argument("--end-step", type=arg_int(1), metavar="T",
                   help="stop after step T-1 (set by `run --max-restarts`: a restarted worker resumes from the "
                        "newest checkpoint in --save and trains up to the same step)")
    p.add_argument("--timeout", type=arg_float(0.0), default=60.0,
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
    p.add_argument("--nproc", type=arg_int(1), help="ranks on this node (default: the plan's world size / nnodes)")
    p.add_argument("--nnodes", type=arg_int(1), default=1, help="number of nodes (run this command on each)")
    p.add_argument("--node-rank", type=arg_int(0), help="this node's rank (optional with the c10d rendezvous)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="rendezvous endpoint for multi-node runs (c10d backend); default: standalone")
    p.add_argument("--rdzv-id", default="piper-sim", help="rendezvous id shared by the nodes of one run")
    p.add_argument("--max-restarts", type=arg_int(0), default=0, metavar="N",
                   help="restart the workers up to N times after a rank fails; they resume from the newest "
                        "checkpoint in --save (use --save-every) and finish the same steps")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show torchrun's warnings and failure report (default: one line per failure)")
    add_run_options(p)
    p.set_defaults(func=cmd_run)
    return p


def local_gpus() -> int:
    """GPUs this node shows (without importing torch): CUDA_VISIBLE_DEVICES, else the driver's list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def check_local_capacity(nproc: int, plan: Plan, device: str) -> None:
    """Refuse to start more ranks on this node than it can hold: one per GPU, or
    MAX_CPU_RANKS_PER_CORE per core for CPU ranks."""
    gpus = local_gpus()
    cpu_cluster = str(plan.meta.get("cluster", "cpu")).startswith("cpu")
    if device == "cuda" or (device == "auto" and not cpu_cluster and gpus):
        if nproc > gpus:
            raise PlanError(f"{nproc} ranks per node need {nproc} GPUs but this node has {gpus}; "
                            "use more nodes (--nnodes) or --device cpu")
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if nproc > MAX_CPU_RANKS_PER_CORE * cores:
        raise PlanError(f"{nproc:,} CPU ranks on this node exceed the limit of {MAX_CPU_RANKS_PER_CORE} per core "
                        f"({cores} cores; piper_sim.checks.MAX_CPU_RANKS_PER_CORE); use more nodes (--nnodes)")


def torchrun_command(args, plan: Plan) -> list[str]:
    nproc = args.nproc or plan.world_size // args.nnodes
    if nproc * args.nnodes != plan.world_size:
        raise PlanError(f"{args.plan} was compiled for {plan.world_size} ranks but --nnodes {args.nnodes} x "
                        f"--nproc {nproc} = {nproc * args.nnodes} would be launched; change --nproc/--nnodes "
                        f"or recompile for {nproc * args.nnodes} ranks")
    check_local_capacity(nproc, plan, args.device)
    cmd = [sys.executable, "-m", "executor.launch", f"--nproc-per-node={nproc}",
           f"--max-restarts={args.max_restarts}"]
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
    if args.end_step:
        cmd += ["--end-step", str(args.end_step)]
    for flag in ("save_every", "keep"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for flag in ("json", "check", "no_hash_check"):
        if getattr(args, flag):
            cmd.append("--" + flag.replace("_", "-"))
    return cmd


def refuse_tensor_parallel(plan: Plan, path: str) -> None:
    """The executor runs no tensor parallelism yet: refuse such a plan before any process group starts."""
    if plan.layout.tp > 1:
        raise PlanError(f"{path}: tensor parallel plans are simulate-only in this version (tp {plan.layout.tp}); "
                        "use `piper-sim simulate`")


def refuse_tied_embeddings(plan: Plan, path: str) -> None:
    """A model with tied embeddings runs only with its embedding and head on one stage, full
    backward passes (no BI/BW split) and without ZeRO-3: the executor shares no weight between
    stages, pieces or gathered units. Refused before any process group starts."""
    from piper_sim.configs import config_from_meta

    if not config_from_meta(plan.meta).tie_embeddings:
        return
    units = plan.meta["stage_units"]
    stages = {u: s for s, names in enumerate(units) for u in names if u in ("embed", "head")}
    why = ""
    if stages.get("embed") != stages.get("head"):
        why = f"its embedding (stage {stages.get('embed')}) and head (stage {stages.get('head')}) are on two stages"
    elif plan.meta.get("zero") == 3:
        why = "ZeRO-3 gathers the head's unit without the embedding it reuses"
    elif any(i.id.startswith("BW") for c in plan.classes for i in c.instructions()):
        why = f"schedule {plan.meta.get('schedule')} splits the backward (BI/BW) of the head's piece"
    if why:
        raise PlanError(f"{path}: model {plan.meta['model']} ties its embeddings (tie_embeddings) and {why}; "
                        "the executor cannot share that weight: simulate it, or untie the model")


def preflight(args, plans: list[Plan]) -> int:
    """What a launch needs beyond valid plans, checked by ``piper-sim run`` before torchrun
    and by every worker before its process group: the checkpoint to resume, and that the
    test hooks PIPER_FAULT / PIPER_CKPT_KILL name a rank, step and op of this run.
    Returns the step the run starts from."""
    from executor import checkpoint

    checkpoint.check_kill_spec()
    start = checkpoint.find(args.resume, plans[0].content_hash(), plans[0].world_size)[1] if args.resume else 0
    if args.end_step is not None and args.end_step <= start:
        raise PlanError(f"--end-step {args.end_step} is not after the resumed step {start}")
    if not os.environ.get("PIPER_FAULT"):
        return start
    from executor.runtime import Fault  # imports torch: only when a fault is injected

    try:
        fault = Fault.from_env()
        if fault.rank < 0 or fault.step < 0:
            raise ValueError("negative rank or step")
    except ValueError as e:
        msg = str(e) if str(e).startswith("PIPER_FAULT") else f"PIPER_FAULT={os.environ['PIPER_FAULT']!r}: {e}"
        if "expected" not in msg:
            msg += "; expected rank:step:op_id[:raise|kill|hang]"
        raise PlanError(msg) from None
    world = plans[0].world_size
    if fault.rank >= world:
        raise PlanError(f"PIPER_FAULT names rank {fault.rank}; the plan has ranks 0..{world - 1}")
    if not start <= fault.step < start + args.steps:
        raise PlanError(f"PIPER_FAULT names step {fault.step}; this run does steps {start}..{start + args.steps - 1}")
    if not any(fault.op_id == i.id for p in plans for i in p.class_of(fault.rank).instructions()):
        raise PlanError(f"PIPER_FAULT names op {fault.op_id}, which rank {fault.rank} does not run")
    return start


def cmd_run(args: argparse.Namespace) -> None:
    from executor import lifetime
    from piper_sim.validate import load_valid_plan

    plan = load_valid_plan(args.plan, check_hash=not args.no_hash_check)  # refuse before launching
    refuse_tensor_parallel(plan, args.plan)
    refuse_tied_embeddings(plan, args.plan)
    start = preflight(args, [plan])
    if args.max_restarts:
        if not args.save:
            raise PlanError("--max-restarts needs --save DIR: restarted workers resume from its checkpoints")
        args.end_step = args.end_step or start + args.steps
    env = {**os.environ, "PIPER_VERBOSE": "1"} if args.verbose else None
    rc = lifetime.run_launcher(torchrun_command(args, plan), env=env)
    if rc:
        raise SystemExit(rc)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: the same as `piper-sim` (one error handler for all commands)."""
    from piper_sim.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
