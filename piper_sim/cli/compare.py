"""`piper-sim compare PLAN.json --trace DIR`: a real run's torch.profiler traces vs the plan.

`add_compare_parser(subparsers)` registers the subcommand; the work is
`piper_sim.trace_compare.compare_traces` (the mapping convention is in `piper_sim.measured`).
Bad input is a ValueError the CLI prints as one line (exit 2).
"""

from __future__ import annotations

import argparse
import json

from piper_sim.checks import arg_int


def add_compare_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    c = subparsers.add_parser(
        "compare", help="why is my real run slower than the plan: torch.profiler traces vs the simulation",
        description="Read torch.profiler (Kineto) traces of a real run, one file per rank, map what they "
                    "recorded onto the plan's ops (record_function(op_id) ranges, else forward/backward/"
                    "optimizer phases by order) and report measured vs simulated per op and per category, "
                    "exposed comm, idle and the biggest gaps.")
    c.add_argument("plan", metavar="PLAN.json", help="plan file from `piper-sim compile` (the traced run's layout)")
    c.add_argument("--trace", required=True, metavar="DIR",
                   help="folder of the run's traces (*.pt.trace.json, *.json, *.json.gz; one per rank), or one file")
    c.add_argument("--costmodel", default="analytic",
                   help="'analytic' (default, on the plan's cluster) or a calibration .json")
    c.add_argument("--step", type=arg_int(0), metavar="N",
                   help="compare ProfilerStep#N (default: per rank, the step with the most plan ops found)")
    c.add_argument("--top", type=arg_int(1), default=5, metavar="N", help="biggest gaps to list (default 5)")
    c.add_argument("--max-ops", type=arg_int(0), default=30, metavar="N",
                   help="per-op rows to print (default 30; --csv writes them all)")
    c.add_argument("--csv", metavar="OUT.csv", help="write the per-op table")
    c.add_argument("--json", metavar="OUT.json", help="write the whole report (ranks, categories, ops, gaps)")
    c.add_argument("--no-hash-check", action="store_true", help="accept a plan edited after compiling")
    c.set_defaults(func=cmd_compare)
    return c


def cmd_compare(args: argparse.Namespace) -> int:
    from piper_sim.files import atomic_write, check_output_file
    from piper_sim.trace_compare import compare_traces
    from piper_sim.validate import load_valid_plan

    for flag, path in (("--csv", args.csv), ("--json", args.json)):
        if path:
            check_output_file(path, flag)
    plan = load_valid_plan(args.plan, check_hash=not args.no_hash_check)
    result = compare_traces(plan, args.trace, costmodel=args.costmodel, step=args.step, top=args.top,
                            plan_name=args.plan)
    print(result.to_text(max_ops=args.max_ops))
    if args.csv:
        with atomic_write(args.csv, newline="") as f:
            result.ops.to_csv(f, index=False)
        print(f"wrote {args.csv}")
    if args.json:
        with atomic_write(args.json) as f:
            json.dump(result.to_json(), f, indent=1)
        print(f"wrote {args.json}")
    return 0
