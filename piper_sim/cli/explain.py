"""`piper-sim explain PLAN.json [--against PLAN2.json]`: where a plan's step goes, and why it beats
another; `explore --explain K` does the same for the top K strategies of a search.

The breakdown and the comparison are `piper_sim.explain`'s; this module loads the plans,
prints, and writes the stacked-bar figure (``--figure``).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from piper_sim.checks import arg_int
from piper_sim.files import check_output_file


def load_plan(path: str, check_hash: bool = True):
    """A plan file (checked as every back end checks it), or a strategy file compiled."""
    from piper_sim.api import compile
    from piper_sim.validate import load_valid_plan

    with open(path) as f:
        try:
            d = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not JSON ({e}); give a plan from `piper-sim compile` or a strategy file") from None
    if isinstance(d, dict) and "directives" in d and "classes" not in d:
        return compile(path)
    return load_valid_plan(path, check_hash=check_hash)


def explain_plans(named: list[tuple[str, Any]], costmodel: str = "analytic", rank: int | None = None) -> list:
    """`StepBreakdown` of each ``(name, plan)``, simulated on ``costmodel``."""
    from piper_sim.simulator import simulate

    return [simulate(plan, costmodel).explain(name, rank=rank) for name, plan in named]


def report(breakdowns: list, figure: str | None = None, title: str = "", tables: int | None = None) -> list[str]:
    """The lines that explain ``breakdowns`` (the first is the reference, usually the winner):
    the breakdown of each (of the first ``tables`` when given), then each other one against
    the faster of the two; writes the figure."""
    from piper_sim.explain import compare, plot_breakdowns

    lines: list[str] = []
    for b in breakdowns[:tables]:
        lines += [str(b), ""]
    if len(breakdowns) > 1:
        lines.append("why the ranking:")
        first = breakdowns[0]
        for b in breakdowns[1:]:
            fast, slow = (first, b) if first.step_time_s <= b.step_time_s else (b, first)
            lines.append(f"  {compare(fast, slow)}")
    if figure:
        plot_breakdowns(breakdowns, figure, title=title)
        lines.append(f"wrote {figure}")
    return lines


def explain_top(result, k: int, costmodel: str = "analytic") -> list:
    """`StepBreakdown` of the top ``k`` fitting strategies of an `ExploreResult`, best first,
    each compiled and simulated again (explore keeps only their totals)."""
    from piper_sim.api import compile

    s = result.settings
    named = []
    for i, row in enumerate(result.ok[:k], 1):
        strategy = row.candidate.strategy(s["model"], row.cluster or s["cluster"], s["global_batch"], s["seq_len"],
                                          *([s["stack"]] if s.get("stack") is not None else []))
        named.append((f"#{i} {row.candidate.short()}", compile(strategy)))
    return explain_plans(named, costmodel)


def cmd_explain(args: argparse.Namespace) -> None:
    if args.figure:
        check_output_file(args.figure, "--figure")
    paths = [args.plan] + list(args.against or [])
    named = [(os.path.basename(p), load_plan(p, check_hash=not args.no_hash_check)) for p in paths]
    try:
        breakdowns = explain_plans(named, args.costmodel, rank=args.rank)
    except ValueError as e:
        if args.rank is not None and str(e).startswith(f"rank {args.rank} is not"):
            raise ValueError(f"--rank: {e}") from None
        raise
    if args.json:
        from piper_sim.explain import compare

        out: dict[str, Any] = {"breakdowns": [b.to_json() for b in breakdowns]}
        out["comparisons"] = [compare(*sorted((breakdowns[0], b), key=lambda x: x.step_time_s)).to_json()
                              for b in breakdowns[1:]]
        if args.figure:
            from piper_sim.explain import plot_breakdowns

            plot_breakdowns(breakdowns, args.figure)
        print(json.dumps(out))
        return
    print("\n".join(report(breakdowns, args.figure)))


def add_explain_parser(sub) -> None:
    p = sub.add_parser("explain", help="where a plan's step goes (compute, recompute, exposed comm, bubble), "
                                       "and the terms that decide it against another plan",
                       description="Split a plan's simulated step into compute by kind, recompute, optimizer, "
                                   "exposed communication per stream and bubble/idle (they add up to the step), "
                                   "and say which terms make one plan faster than another.")
    p.add_argument("plan", metavar="PLAN.json", help="plan from `piper-sim compile` (or a strategy file)")
    p.add_argument("--against", action="append", metavar="PLAN2.json",
                   help="a plan (or strategy) to compare with; repeatable")
    p.add_argument("--costmodel", default="analytic",
                   help="'analytic' (default, on the plan's cluster), 'unit:...', or a calibration .json")
    p.add_argument("--rank", type=arg_int(0), default=None,
                   help="one simulated rank's split (default: the mean over every GPU)")
    p.add_argument("--figure", metavar="OUT.png", help="write one stacked bar per plan")
    p.add_argument("--json", action="store_true", help="print the breakdowns and comparisons as one JSON object")
    p.add_argument("--no-hash-check", action="store_true", help="accept a plan whose cost estimates were edited")
    p.set_defaults(func=cmd_explain)
