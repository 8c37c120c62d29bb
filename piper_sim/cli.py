"""The `piper-sim` command line: a thin layer over `piper_sim.api`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from piper_sim.plan import Plan, PlanError

COMPUTE_LETTER = {"F": "F", "B": "B", "BI": "I", "BW": "W"}


def compute_order(plan: Plan, pp_rank: int) -> str:
    """A rank's compute actions in torch.distributed.pipelining notation."""
    slots: dict[int, list[str]] = {}
    for ins in plan.classes[pp_rank].streams.get("compute", []):
        if ins.kind not in COMPUTE_LETTER or ins.slot < 0:
            continue
        action = f"{ins.stage}{COMPUTE_LETTER[ins.kind]}{ins.mb}"
        acts = slots.setdefault(ins.slot, [])
        if action not in acts:
            acts.append(action)
    return " ".join(a[0] if len(a) == 1 else "(" + ";".join(a) + ")" for _, a in sorted(slots.items()))


def cmd_models(args: argparse.Namespace) -> None:
    from piper_sim.models import ZOO

    print(f"{'name':<14} {'layers':>6} {'hidden':>6} {'experts':>9} {'params':>9} {'active':>9}")
    for name, cfg in ZOO.items():
        experts = f"{cfg.n_experts}/top{cfg.top_k}" if cfg.is_moe else "-"
        print(f"{name:<14} {cfg.n_layers:>6} {cfg.hidden:>6} {experts:>9} "
              f"{_human(cfg.param_count()):>9} {_human(cfg.active_param_count()):>9}")


def _human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


def cmd_compile(args: argparse.Namespace) -> None:
    from piper_sim.api import compile

    plan = compile(args.strategy)
    out = args.output or args.strategy.rsplit(".", 1)[0] + ".plan.json"
    plan.save(out)
    n = sum(len(lst) for c in plan.classes for lst in c.streams.values())
    print(f"wrote {out}: {plan.world_size} ranks in {len(plan.classes)} classes, {n} instructions, "
          f"hash {plan.content_hash()}")


def cmd_expand(args: argparse.Namespace) -> None:
    from piper_sim.directives import expand
    from piper_sim.strategy import load_strategy

    strategy = load_strategy(args.strategy)
    print(json.dumps({**strategy.to_json(), "directives": expand(strategy)}, indent=1))


def cmd_show(args: argparse.Namespace) -> None:
    plan = Plan.load(args.plan, check_hash=not args.no_hash_check)
    ranks = range(len(plan.classes)) if args.rank is None else [plan.layout.coords(args.rank)[0]]
    if args.compute_order:
        for r in ranks:
            print(f"rank {r}: {compute_order(plan, r)}")
        return
    m = plan.meta
    print(f"plan {plan.content_hash()}: {m.get('model')} on {m.get('cluster')}, "
          f"pp={plan.layout.pp} dp={plan.layout.dp} ep={plan.layout.ep}{_tp(plan)}, schedule {m.get('schedule')}, "
          f"{m.get('microbatches')} micro-batches of {m.get('micro_batch_size')}")
    for r in ranks:
        c = plan.classes[r]
        print(f"\npipeline rank {r} (global ranks {_span(c.ranks)}), stages {c.stages}")
        for stream, lst in c.streams.items():
            print(f"  {stream:<8} " + " ".join(i.id for i in lst))


def _tp(plan) -> str:
    tp = plan.meta.get("tensor_parallel")
    return f" tp={tp['degree']}" + (" (sequence parallel)" if tp["sequence_parallel"] else "") if tp else ""


def _span(ranks: list[int]) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def cmd_validate(args: argparse.Namespace) -> None:
    from piper_sim.demo import CALIBRATION
    from piper_sim.validation import format_report, suite, validate

    strategies = list(args.strategies) + (suite() if args.suite else [])
    if not strategies:
        raise ValueError("validate: give strategy files, or --suite for the built-in validation suite")
    costmodel = args.costmodel or (CALIBRATION if os.path.exists(CALIBRATION) else "analytic")

    def show(row) -> None:
        print(f"  {row.name}: predicted {row.predicted_s * 1e3:.1f} ms, measured {row.measured_s * 1e3:.1f} ms "
              f"({row.error_pct:+.1f}%)", file=sys.stderr, flush=True)

    summary = validate(strategies, costmodel, steps=args.steps, warmup=args.warmup, out_dir=args.out, progress=show)
    print(format_report(summary))
    print(f"wrote {args.out}/validation.csv, validation.json, overlay.png and the plans and measured traces")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="piper-sim", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("models", help="list the model zoo").set_defaults(func=cmd_models)
    c = sub.add_parser("compile", help="compile a strategy JSON into a plan JSON")
    c.add_argument("strategy")
    c.add_argument("-o", "--output")
    c.set_defaults(func=cmd_compile)
    e = sub.add_parser("expand", help="print a strategy with its directives expanded to the low-level set")
    e.add_argument("strategy")
    e.set_defaults(func=cmd_expand)
    s = sub.add_parser("show", help="print a plan's per-rank order")
    s.add_argument("plan")
    s.add_argument("--compute-order", action="store_true",
                   help="one line per pipeline rank in torch.distributed.pipelining notation")
    s.add_argument("--rank", type=int, help="only this global rank's class")
    s.add_argument("--no-hash-check", action="store_true", help="accept a plan edited after compiling")
    s.set_defaults(func=cmd_show)
    v = sub.add_parser("validate", help="simulate and execute strategies; report predicted vs measured")
    v.add_argument("strategies", nargs="*", metavar="STRATEGY.json")
    v.add_argument("--suite", action="store_true", help="add the built-in suite (10 strategies on cpu:2/cpu:4)")
    v.add_argument("--costmodel", help="default: traces/calibration/cpu-2core.json when present")
    v.add_argument("--steps", type=int, default=6)
    v.add_argument("--warmup", type=int, default=2, help="steps left out of the measured median")
    v.add_argument("--out", default="validation")
    v.set_defaults(func=cmd_validate)
    from piper_sim.explore_cli import add_explore_parser
    from piper_sim.simulate_cli import add_simulate_parser

    add_simulate_parser(sub)
    add_explore_parser(sub)
    from executor.cli import add_run_parser

    add_run_parser(sub)
    from piper_sim.calibrate_cli import add_calibrate_parser

    add_calibrate_parser(sub)
    from piper_sim.demo import add_demo_parser

    add_demo_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = lambda msg, *a, **k: f"piper-sim: warning: {msg}\n"
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, PlanError, FileNotFoundError) as e:  # StrategyError & co are ValueErrors
        print(f"piper-sim: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
