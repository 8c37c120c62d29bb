"""`piper-sim explore`: which strategy should I run on my cluster, and why."""

from __future__ import annotations

import argparse
import json
import os

from costmodel.stack import PRESETS
from piper_sim.checks import arg_int, arg_int_list
from piper_sim.cli.common import progress_enabled
from piper_sim.files import check_output_dir, check_output_file


DESCRIPTION = """Enumerate the strategies (pipeline schedules, data parallel with ZeRO 0-3, tensor, context
and expert parallelism, recompute, micro-batch counts) that fit a model on a cluster, simulate
them and print them ranked by throughput, with the best one's plan and timeline on request.

examples:
  piper-sim explore --model llama3-8b --cluster h100:1x8 --global-batch 64 --seq-len 8192
  piper-sim explore --model hf:path/to/config.json --cluster h100:4x8 --global-batch 256 \\
      --seq-len 4096 --csv all.csv --emit-best best/
  piper-sim explore ... --tokens 1T --rank-by cost --price-per-gpu-hour 2.5"""


def progress_printer(enabled: bool = True):
    """A `progress(stage, done, total)` callback drawing one bar per stage on stderr
    (``screen``, then ``simulate``; none when stderr is not a terminal: `piper_sim.progress`);
    each bar closes when it reaches its total."""
    from piper_sim.progress import progress_bar

    bars: dict = {}

    def show(stage: str, i: int, n: int) -> None:
        if not enabled:
            return
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = progress_bar(n, f"{stage:<8}", "strategy", mininterval=0.2)
        bar.update(int(i) - bar.n)
        if i >= n:
            bar.close()
    return show


def emit_best(result, out_dir: str, costmodel: str = "analytic") -> dict[str, str]:
    """Write the best strategy, its plan, its simulated trace and timeline into out_dir."""
    from piper_sim.api import compile
    from piper_sim.simulator import simulate

    os.makedirs(out_dir, exist_ok=True)
    strategy = result.best_strategy()
    strategy["name"] = "best: " + result.best.candidate.short()
    paths = {k: os.path.join(out_dir, f) for k, f in
             (("strategy", "best_strategy.json"), ("plan", "best_plan.json"), ("trace", "best_trace.json"),
              ("timeline", "best_timeline.png"), ("memory", "best_memory.png"))}
    from piper_sim.files import atomic_write

    with atomic_write(paths["strategy"]) as f:
        json.dump(strategy, f, indent=1)
    plan = compile(strategy)
    plan.save(paths["plan"])
    sim = simulate(plan, costmodel)
    sim.write_trace(paths["trace"])
    sim.plot_timeline(paths["timeline"], title=strategy["name"])
    sim.plot_memory(paths["memory"], title=strategy["name"])
    return paths


def stack_arg(value: str | None):
    """``--stack``: a preset name or a JSON mapping (costmodel.stack); one-line ValueError when bad."""
    if value is None or isinstance(value, dict) or not str(value).strip().startswith("{"):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise ValueError(f"--stack: not a preset name or a JSON mapping ({e})") from None


def cmd_explore(args: argparse.Namespace) -> None:
    from piper_sim.explore import explore, format_table, plot_pareto, write_csv

    kw = {}
    if args.schedules:
        kw["schedules"] = args.schedules.split(",")
    if args.zero:
        kw["zero_levels"] = args.zero
    if args.no_recompute:
        kw["recompute"] = (False,)
    if args.tp:
        kw["tp_degrees"] = args.tp
    if args.cp:
        kw["cp_degrees"] = args.cp
    check_outputs(args)
    from piper_sim.cli.simulate import memory_headroom_bytes
    from piper_sim.cli.training import run_options
    from piper_sim.explore import add_training_runs

    headroom = memory_headroom_bytes(args.memory_headroom)
    opts = run_options(args)
    rank_by = getattr(args, "rank_by", "tokens_per_s")
    if opts is None and rank_by != "tokens_per_s":
        raise ValueError(f"--rank-by {rank_by} needs --tokens (the tokens to train)")
    result = explore(args.model, args.cluster, args.global_batch, args.seq_len, costmodel=args.costmodel,
                     workers=args.workers, prune=not args.no_prune, use_ray=args.ray, stack=stack_arg(args.stack),
                     memory_headroom_bytes=headroom, refusal=_executor_refusal() if args.runnable else None,
                     slow_ranks=dict.fromkeys(args.slow_ranks or (), args.slowdown),
                     progress=progress_printer(progress_enabled(args)), **kw)
    if opts is not None:
        add_training_runs(result, opts, rank_by)
    print(format_table(result, args.top))
    if args.csv:
        write_csv(result, args.csv)
        print(f"wrote {args.csv}")
    if args.plot:
        plot_pareto(result, args.plot)
        print(f"wrote {args.plot}")
    if args.emit_best and result.best:
        paths = emit_best(result, args.emit_best, args.costmodel)
        print("wrote " + ", ".join(paths.values()))
    if args.explain:
        from piper_sim.cli.explain import explain_top, report

        print(f"\n== why #1 wins: the top {min(args.explain, len(result.ok))}, each against #1")
        print("\n".join(report(explain_top(result, args.explain, args.costmodel), args.explain_figure)))


def _executor_refusal():
    """`executor.support.unrunnable`: why ``piper-sim run`` would refuse a plan."""
    from executor.support import unrunnable

    return unrunnable


def check_outputs(args: argparse.Namespace) -> None:
    """``--csv``, ``--plot`` (files) and ``--emit-best`` (a folder) checked before the search:
    one line naming the flag, nothing created."""
    if getattr(args, "explain_figure", None) and not getattr(args, "explain", None):
        raise ValueError("--explain-figure needs --explain K (the strategies to draw)")
    for flag, path in (("--csv", args.csv), ("--plot", args.plot),
                       ("--explain-figure", getattr(args, "explain_figure", None))):
        if path:
            check_output_file(path, flag)
    if args.emit_best:
        check_output_dir(args.emit_best, "--emit-best")


def add_explore_arguments(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    d = defaults or {}
    p.add_argument("--model", required="model" not in d, default=d.get("model"),
                   help="a zoo name (`piper-sim models`), a model file or hf:PATH")
    p.add_argument("--cluster", required="cluster" not in d, default=d.get("cluster"),
                   help="cpu:N, a100|h100|h200|h800|b200|mi300x:NODESxGPUS, or a YAML/JSON cluster file; "
                        "several, comma-separated (h100:1x8,h100:4x8), are searched and ranked together")
    p.add_argument("--global-batch", type=arg_int(1), required="global_batch" not in d, default=d.get("global_batch"),
                   help="sequences per training step")
    p.add_argument("--seq-len", type=arg_int(1), required="seq_len" not in d, default=d.get("seq_len"),
                   help="tokens per sequence")
    p.add_argument("--costmodel", default="analytic", help="analytic, unit:..., or a calibration JSON")
    p.add_argument("--stack", default=d.get("stack"),
                   help="the training stack the run executes: a preset (" + ", ".join(PRESETS) + ") or a JSON "
                        "mapping, e.g. '{\"preset\": \"torchtitan\", \"compile\": true}' (default: FA2, fused kernels)")
    p.add_argument("--top", type=arg_int(1), default=10, help="rows of the printed table (default 10)")
    p.add_argument("--csv", metavar="OUT.csv", help="write every candidate with its status and numbers")
    p.add_argument("--plot", help="throughput-vs-memory Pareto PNG")
    p.add_argument("--emit-best", metavar="DIR", help="write the best strategy, plan and timeline here")
    p.add_argument("--explain", type=arg_int(1), metavar="K", default=None,
                   help="after the table, explain the top K: where each step goes and, against #1, the terms "
                        "that decide the ranking (`piper-sim explain`)")
    p.add_argument("--explain-figure", metavar="OUT.png", help="with --explain: one stacked bar per explained plan")
    p.add_argument("--schedules", default=d.get("schedules"), help="comma-separated subset of schedules")
    p.add_argument("--zero", type=arg_int_list(0, 3), default=d.get("zero"),
                   help="comma-separated ZeRO levels (default 0,1,2,3)")
    p.add_argument("--no-recompute", action="store_true", default=d.get("no_recompute", False),
                   help="leave activation recomputation out of the search")
    p.add_argument("--tp", type=arg_int_list(1), default=d.get("tp"), help="comma-separated tensor-parallel degrees (default: the "
                   "divisors of the GPUs per node; sequence parallelism on when > 1)")
    p.add_argument("--cp", type=arg_int_list(1), default=d.get("cp"), help="comma-separated context-parallel degrees (default: from "
                   "seq_len 16384 on, the divisors of GPUs per node / TP; else 1)")
    p.add_argument("--workers", type=arg_int(1), default=None, help="processes (default: all cores)")
    p.add_argument("--ray", action="store_true", help="run the sweep on Ray when installed")
    p.add_argument("--no-prune", action="store_true", help="simulate every strategy (exhaustive)")
    p.add_argument("--memory-headroom", type=float, default=d.get("memory_headroom"), metavar="GIB",
                   help="GiB a plan must leave free to rank as fitting (default 2); plans within it are 'tight' "
                        "and ranked after every fitting one")
    p.add_argument("--runnable", action="store_true",
                   help="keep to plans `piper-sim run` executes: the others are listed simulate-only, with why")
    p.add_argument("--slow-ranks", type=arg_int_list(0), default=None, metavar="R,R...",
                   help="what-if: these ranks compute --slowdown times slower in every plan (which plans degrade "
                        "gracefully when a GPU is slow)")
    p.add_argument("--slowdown", type=float, default=1.2, metavar="X",
                   help="how many times slower the --slow-ranks compute (default 1.2)")
    from piper_sim.cli.training import add_training_arguments
    from costmodel.training_run import RANK_BY

    p.add_argument("--rank-by", choices=RANK_BY, default="tokens_per_s",
                   help="order of the table and the best plan: tokens_per_s (default, the step), or with --tokens "
                        "time_to_train, cost ($ with --price-per-gpu-hour, else GPU-hours) or energy (kWh)")
    add_training_arguments(p)


def add_explore_parser(sub) -> None:
    p = sub.add_parser("explore", help="enumerate, simulate and rank strategies for a model and cluster",
                       description=DESCRIPTION)
    add_explore_arguments(p)
    p.set_defaults(func=cmd_explore)
