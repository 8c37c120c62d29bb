"""``piper-sim run PLAN.json``: start the plan's ranks through torchrun.

The plan is checked here first (format version, content hash, the compiler's validation,
world size against the launch and this node's GPUs/cores, the memory it needs against the
node's, the options and output paths, the checkpoint to resume), so a
bad plan is refused with one line (exit 2) before any process starts; then this is just::

    python -m executor.launch --nproc-per-node N [--nnodes ...] -m executor PLAN.json ...

(`executor.launch` is torchrun without its warnings and traceback unless ``-v``). torchrun
dies with this process and receives its SIGTERM/SIGINT/SIGHUP (`executor.lifetime`).
Exit status: 0 done; 2 refused before launching (one line); 1 a rank failed (each failing
rank's line, then one naming the first); 128+N stopped by signal N.

Register it with ``add_run_parser(subparsers)``. The options the workers share and the checks
before any process starts are `executor.options`. This module imports no torch, so registering
it keeps ``piper-sim --help`` fast.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from executor.options import add_run_options, preflight, refuse_unrunnable, stack_settings
from piper_sim.checks import MAX_CPU_RANKS_PER_CORE, arg_int
from piper_sim.plan import Plan, PlanError, RankClass

GiB = 2**30
DESCRIPTION = """Run a compiled plan for real: one process per rank through torchrun (gloo on CPU, NCCL on
GPUs), then print the measured step times and losses. The plan is checked first (its hash,
the world size against this node's GPUs or cores, the memory it needs), so a bad plan is
refused with one line before any process starts. -v also shows torchrun's warnings and
failure report (default: one line per failing rank).

examples:
  piper-sim run plan.json --steps 10
  piper-sim run plan.json --check                  compare the losses with one unsharded process
  piper-sim run plan.json --save ckpt/ --save-every 5 --max-restarts 2

exit status: 0 done; 2 refused before launching; 1 a rank failed; 128+N stopped by signal N."""


def add_run_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("run", help="execute a plan with torch.distributed (one process per rank, torchrun)",
                              description=DESCRIPTION)
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


def on_gpus(plan: Plan, device: str) -> bool:
    """Whether the ranks run on GPUs (``--device``; auto: a GPU plan on a node with GPUs)."""
    cpu_cluster = str(plan.meta.get("cluster", "cpu")).startswith("cpu")
    return device == "cuda" or (device == "auto" and not cpu_cluster and local_gpus() > 0)


def check_local_capacity(nproc: int, plan: Plan, device: str) -> None:
    """Refuse to start more ranks on this node than it can hold: one per GPU, or
    MAX_CPU_RANKS_PER_CORE per core for CPU ranks."""
    gpus = local_gpus()
    if on_gpus(plan, device):
        if nproc > gpus:
            raise PlanError(f"{nproc} ranks per node need {nproc} GPUs but this node has {gpus}; "
                            "use more nodes (--nnodes) or --device cpu")
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if nproc > MAX_CPU_RANKS_PER_CORE * cores:
        raise PlanError(f"{nproc:,} CPU ranks on this node exceed the limit of {MAX_CPU_RANKS_PER_CORE} per core "
                        f"({cores} cores; piper_sim.checks.MAX_CPU_RANKS_PER_CORE); use more nodes (--nnodes)")


def least_need_bytes(cls: RankClass) -> float:
    """Bytes a rank of this class holds at least at its peak: its static memory (parameters,
    gradients, optimizer state) plus its largest single allocation (an op's ``alloc`` is live
    while it runs). A lower bound of the simulated peak, in one pass over the instructions."""
    def finite(v) -> float:
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else 0.0

    static = sum(finite(v) for k, v in cls.static_memory.items() if k.endswith("_bytes") and k != "total_bytes")
    return static + max((finite(i.alloc) for i in cls.instructions()), default=0.0)


def node_memory_bytes() -> float:
    """This node's physical memory (RAM)."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_memory(nproc: int, plan: Plan, device: str) -> None:
    """Refuse a plan that cannot fit this machine whatever happens: on GPUs a rank needing
    more than the cluster's GPU memory, on CPU the ranks of one node (`least_need_bytes`,
    summed over the busiest node's ``nproc`` consecutive ranks) more than its RAM."""
    needs = [least_need_bytes(c) for c in plan.classes]
    if on_gpus(plan, device):
        from costmodel.hardware import parse_cluster

        gpu = parse_cluster(plan.header.cluster).gpu
        worst = max(range(len(needs)), key=needs.__getitem__)
        if needs[worst] > gpu.hbm_bytes:
            raise PlanError(f"pipeline rank {worst} needs at least {needs[worst] / GiB:,.1f} GiB (model states and "
                            f"its largest activation) but a {gpu.name} has {gpu.hbm_bytes / GiB:,.1f} GiB; "
                            "`piper-sim simulate` shows the peak: shard or split the model further")
        return
    per_rank = [needs[c] for c in range(len(needs)) for _ in range(plan.layout.class_size)]
    node = max(sum(per_rank[i:i + nproc]) for i in range(0, len(per_rank), nproc))
    ram = node_memory_bytes()
    if node > ram:
        raise PlanError(f"{nproc} CPU rank(s) per node need at least {node / GiB:,.1f} GiB (model states and the "
                        f"largest activation of each) but this node has {ram / GiB:,.1f} GiB of RAM; "
                        "`piper-sim simulate` shows the peak: use fewer tokens per micro-batch or more nodes")


def torchrun_command(args, plan: Plan) -> list[str]:
    nproc = args.nproc or plan.world_size // args.nnodes
    if nproc * args.nnodes != plan.world_size:
        raise PlanError(f"{args.plan} was compiled for {plan.world_size} ranks but --nnodes {args.nnodes} x "
                        f"--nproc {nproc} = {nproc * args.nnodes} would be launched; change --nproc/--nnodes "
                        f"or recompile for {nproc * args.nnodes} ranks")
    check_local_capacity(nproc, plan, args.device)
    check_memory(nproc, plan, args.device)
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
    if getattr(args, "lr", None) is not None:
        cmd += ["--lr", repr(args.lr)]
    for flag in ("warmup_steps", "lr_decay", "decay_steps", "min_lr_ratio"):
        if hasattr(args, flag):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for flag in ("trace", "timeline", "kineto", "save", "resume", "profile"):
        value = getattr(args, flag)
        if value:
            cmd += [f"--{flag}", os.path.abspath(value)]
    if args.end_step:
        cmd += ["--end-step", str(args.end_step)]
    for flag in ("save_every", "keep"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for flag in ("json", "check", "no_hash_check", "override_lr_schedule", "force"):
        if getattr(args, flag):
            cmd.append("--" + flag.replace("_", "-"))
    return cmd


def launch_env(verbose: bool = False) -> dict[str, str]:
    """The workers' environment: this one, with one intra-op thread per rank unless
    $OMP_NUM_THREADS says otherwise. torchrun sets that only when it starts more than one
    process, so a single-rank run took every core (10x slower than one thread per rank on this
    busy 2-core VM, from OpenMP threads spinning against other processes) and did not match the
    calibration, which measures one thread per rank (`calibration.microbench.make_config`)."""
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", "1")
    if verbose:
        env["PIPER_VERBOSE"] = "1"
    return env


def cmd_run(args: argparse.Namespace) -> None:
    from executor import lifetime
    from piper_sim.validate import load_valid_plan

    plan = load_valid_plan(args.plan, check_hash=not args.no_hash_check)  # refuse before launching
    refuse_unrunnable(plan, args.plan)
    start = preflight(args, [plan])
    if args.max_restarts:
        if not args.save:
            raise PlanError("--max-restarts needs --save DIR: restarted workers resume from its checkpoints")
        args.end_step = args.end_step or start + args.steps
    stack_env, notice = stack_settings(plan)
    if notice:
        print(f"piper-sim run: {notice}", file=sys.stderr, flush=True)
    rc = lifetime.run_launcher(torchrun_command(args, plan), env={**launch_env(args.verbose), **stack_env})
    if rc:
        raise SystemExit(rc)

