"""`piper-sim simulate PLAN.json`: run the simulator on a plan file and report.

`add_simulate_parser(subparsers)` registers the subcommand on the main CLI; errors are
ValueErrors that the CLI prints as one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys

from costmodel.stack import parse_stack
from piper_sim.checks import arg_int_list
from piper_sim.cli.training import add_training_arguments, describe_run, plan_run, run_json, run_options


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    s = subparsers.add_parser("simulate", help="simulate one training step of a plan",
                              description="""Simulate one training step of a compiled plan: step time with its error band,
per-rank compute, exposed communication, bubble and peak memory; optionally traces and pictures.

examples:
  piper-sim simulate plan.json
  piper-sim simulate plan.json --costmodel traces/calibration/mybox.json --timeline step.png
  piper-sim simulate plan.json --tokens 1T --json""")
    s.add_argument("plan", help="plan JSON from `piper-sim compile`")
    s.add_argument("--costmodel", default="analytic",
                   help="'analytic' (default, on the plan's cluster), 'unit:F=1,BI=1,BW=1,comm=0', "
                        "or a calibration .json")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    s.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace (Perfetto, chrome://tracing)")
    s.add_argument("--kineto", metavar="DIR",
                   help="write Kineto-shaped traces, one per simulated rank, in DIR (HolisticTraceAnalysis, Perfetto): "
                        "each compute op as the kernels of its operator profile")
    s.add_argument("--kineto-ops", action="store_true",
                   help="with --kineto: one kernel per plan op (smaller files, written faster)")
    s.add_argument("--timeline", metavar="OUT.png", help="write a timeline picture")
    s.add_argument("--memory", metavar="OUT.png", help="write a memory-over-time picture")
    s.add_argument("--no-fold", action="store_true", help="simulate every rank, not one per rank class")
    s.add_argument("--no-hash-check", action="store_true",
                   help="accept a plan whose cost estimates (flops, memory) were edited after "
                        "compiling; an edit to what runs is still refused")
    s.add_argument("--memory-headroom", type=float, default=None, metavar="GIB",
                   help="GiB a plan must leave free to be 'fits' rather than 'tight' (default 2: NCCL and "
                        "libraries grow after start-up)")
    s.add_argument("--strict", action="store_true", help="exit 1 unless the plan fits with the headroom")
    s.add_argument("--slow-ranks", type=arg_int_list(0), default=None, metavar="R,R...",
                   help="what-if: these ranks compute --slowdown times slower (a throttled or faulty GPU); "
                        "every GPU cluster already has the fleet's speed spread (speed_spread, 1%%)")
    s.add_argument("--slowdown", type=float, default=1.2, metavar="X",
                   help="how many times slower the --slow-ranks compute (default 1.2)")
    add_training_arguments(s)
    s.set_defaults(func=cmd_simulate)
    return s


def memory_headroom_bytes(gib: float | None) -> float:
    """``--memory-headroom GIB`` in bytes (the default when not given); one line when it is bad."""
    import math

    from costmodel.memory import DEFAULT_HEADROOM_BYTES

    if gib is None:
        return DEFAULT_HEADROOM_BYTES
    if not math.isfinite(gib) or gib < 0:
        raise ValueError(f"--memory-headroom must be a finite number of GiB >= 0, got {gib:g}")
    return gib * 2**30


def cmd_simulate(args: argparse.Namespace) -> int:
    from piper_sim.simulator import simulate
    from piper_sim.validate import load_valid_plan

    headroom = memory_headroom_bytes(args.memory_headroom)
    if args.kineto_ops and not args.kineto:
        raise ValueError("--kineto-ops needs --kineto DIR (the folder to write the traces in)")
    opts = run_options(args)
    plan = load_valid_plan(args.plan, check_hash=not args.no_hash_check)
    slow = dict.fromkeys(args.slow_ranks or (), args.slowdown)
    result = simulate(plan, costmodel=args.costmodel, fold=not args.no_fold, memory_headroom_bytes=headroom,
                      slow_ranks=slow)
    failed = 1 if args.strict and result.memory_verdict not in (None, "fits") else 0
    m = plan.meta
    title = (f"{m.get('model', '?')} on {m.get('cluster', '?')}: pp={plan.layout.pp} dp={plan.layout.dp} "
             f"ep={plan.layout.ep}, {m.get('schedule', '?')}, m={m.get('microbatches', '?')} ({result.costmodel})")
    if args.trace:
        result.write_trace(args.trace)
    if args.kineto:
        result.write_kineto(args.kineto, kernels=not args.kineto_ops)
    if args.timeline:
        result.plot_timeline(args.timeline, title=title)
    if args.memory:
        result.plot_memory(args.memory, title=title)
    _warn_if_over_memory(result)
    runs, gpu = plan_run(result, opts) if opts else (None, "")
    if args.json:
        out = result.to_json()
        if runs:
            out["training_run"] = run_json(*runs, opts=opts)
        print(json.dumps(out))
        return failed
    print(title)
    u = "u" if result.time_unit == "units" else "s"  # a unit cost model counts in its own time units
    print(f"step {result.step_time_s:.6g} {'units' if u == 'u' else 's'}, {result.tokens_per_s:.6g} tokens/"
          f"{'unit' if u == 'u' else 's'}, MFU {100 * result.mfu:.1f}%, "
          f"bubble {100 * result.bubble_fraction:.1f}% "
          f"({result.num_events} events in {result.sim_wall_s:.3f} s, {'folded' if result.folded else 'unfolded'})")
    if result.band is not None:
        print(result.band.describe(result.step_time_s))
    elif u == "s":
        print("no error band: bands are measured for the analytic cost model on GPU clusters only")
    stack = m.get("stack")
    if isinstance(stack, dict):
        print(f"stack: {parse_stack(stack).describe()}")
    print(f"{'rank':>6} {'x':>5} {'compute ' + u:>11} {'comm exp ' + u:>11} {'idle ' + u:>11} {'peak GiB':>9} "
          f"{'states GiB':>10} {'act GiB':>8}")
    for s in result.rank_stats:
        states = s.params_bytes + s.grads_bytes + s.optimizer_bytes
        print(f"{s.rank:>6} {s.represents:>5} {s.compute_s:>11.5g} {s.comm_exposed_s:>11.5g} {s.idle_s:>11.5g} "
              f"{s.peak_memory_bytes / 2**30:>9.2f} {states / 2**30:>10.2f} {s.activations_bytes / 2**30:>8.2f}")
    if result.memory_verdict is not None:
        print(memory_line(result))
    print(f"{result.tokens_per_s / (result.world_size or 1):.6g} tokens/{'unit' if u == 'u' else 's'} per GPU "
          f"on {result.world_size}; `piper-sim explain` says where the step goes")
    if runs:
        print("\n".join(describe_run(*runs, opts=opts, gpu=gpu)))
    for label, path in (("trace", args.trace), ("Kineto traces", args.kineto), ("timeline", args.timeline),
                        ("memory", args.memory)):
        if path:
            print(f"wrote {label} {path}")
    if failed:
        print(f"piper-sim: --strict: the plan is {result.memory_verdict} in memory (needs "
              f"{_worst(result).device_bytes / 2**30:.1f} GiB, {result.memory_capacity_bytes / 2**30:.1f} GiB per GPU "
              f"with {result.memory_headroom_bytes / 2**30:g} GiB headroom)", file=sys.stderr)
    return failed


def _worst(result):
    return max(result.rank_stats, key=lambda s: s.device_bytes)


def memory_line(result) -> str:
    """``memory: fits (rank 3: allocated 41.2 GiB, reserved 45.3 + runtime 1.7 = 47.0 GiB of 79.6 GiB, 2 GiB headroom)``."""
    w = _worst(result)
    gib = 2**30
    return (f"memory: {result.memory_verdict} (rank {w.rank}: allocated {w.peak_memory_bytes / gib:.1f} GiB, "
            f"reserved {w.reserved_bytes / gib:.1f} + runtime {w.runtime_bytes / gib:.1f} = {w.device_bytes / gib:.1f} "
            f"GiB of {result.memory_capacity_bytes / gib:.1f} GiB, {result.memory_headroom_bytes / gib:g} GiB headroom)")


def _warn_if_over_memory(result) -> None:
    over = result.over_memory()
    if not over:
        return
    worst = max(over, key=lambda s: s.device_bytes)
    ranks = sum(s.represents for s in over)
    print(f"piper-sim: warning: the plan does not fit in memory: {ranks} of {result.world_size} ranks exceed "
          f"{result.memory_capacity_bytes / 2**30:.0f} GiB per GPU (rank {worst.rank} needs "
          f"{worst.device_bytes / 2**30:.1f} GiB: {worst.peak_memory_bytes / 2**30:.1f} GiB allocated)", file=sys.stderr)

