"""The `piper-sim` command line: a thin layer over `piper_sim.api`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

from piper_sim.checks import arg_int
from piper_sim.plan import Plan, PlanError

log = logging.getLogger("piper_sim.cli")


def cmd_models(args: argparse.Namespace) -> None:
    """The zoo (and a folder's model files) as a table, or one resolved model as JSON (torch-free)."""
    from piper_sim.configs import ZOO, ModelConfig, config_to_dict
    from piper_sim.sources import model_files, resolve_model

    if args.json:
        cfg = resolve_model(args.json)
        if not isinstance(cfg, ModelConfig):  # a user's nn.Module (py:, `annotate.UserModel`): all params active
            print(json.dumps({"source": args.json, "name": cfg.name, "params": cfg.param_count(),
                              "active_params": cfg.param_count(), "units": list(cfg.units)}, indent=1))
            return
        print(json.dumps({"source": args.json, "name": cfg.name, "params": cfg.param_count(),
                          "active_params": cfg.active_param_count(),
                          "active_params_no_embedding": cfg.active_param_count(embedding=False),
                          "config": config_to_dict(cfg)}, indent=1))
        return
    rows = list(ZOO.items())
    for source in model_files(args.dir) if args.dir else []:
        try:
            rows.append((source, resolve_model(source)))
        except ValueError as e:
            log.warning(_one_line(str(e)))
    width = max(14, *(len(name) for name, _ in rows))
    print(f"{'name':<{width}} {'layers':>6} {'hidden':>6} {'experts':>9} {'params':>9} {'active':>9}")
    for name, cfg in rows:
        experts = f"{cfg.n_experts}/top{cfg.top_k}" if cfg.is_moe else "-"
        print(f"{name:<{width}} {cfg.n_layers:>6} {cfg.hidden:>6} {experts:>9} "
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
    from piper_sim.validate import check_layout

    plan = Plan.load(args.plan, check_hash=not args.no_hash_check)
    check_layout(plan)
    if args.rank is not None and args.rank >= plan.world_size:
        raise ValueError(f"--rank {args.rank}: the plan has ranks 0..{plan.world_size - 1}")
    ranks = range(len(plan.classes)) if args.rank is None else [plan.layout.coords(args.rank)[0]]
    if args.csv:
        from piper_sim.pipelining import write_schedule_csv

        write_schedule_csv(plan, args.csv, comms=args.comms)
        print(f"wrote {args.csv}: {len(plan.classes)} pipeline ranks, "
              f"{'compute and comms' if args.comms else 'compute only'} (torch _load_csv format="
              f"{'compute_comms' if args.comms else 'compute_only'})")
        if not args.compute_order:
            return
    if args.compute_order:
        from piper_sim.pipelining import compute_order

        for r in ranks:
            print(f"rank {r}: {compute_order(plan, r)}")
        return
    m = plan.meta
    print(f"plan {plan.content_hash()}: {m.get('model')} on {m.get('cluster')}, "
          f"pp={plan.layout.pp} dp={plan.layout.dp} ep={plan.layout.ep}{_tp(plan)}, schedule {m.get('schedule')}, "
          f"{m.get('microbatches')} micro-batches of {m.get('micro_batch_size')}")
    if isinstance(m.get("stack"), dict):
        from costmodel.stack import parse_stack

        print(f"stack: {parse_stack(m['stack']).describe()}")
    for r in ranks:
        c = plan.classes[r]
        print(f"\npipeline rank {r} (global ranks {_span(c.ranks)}), stages {c.stages}")
        for stream, lst in c.streams.items():
            print(f"  {stream:<8} " + " ".join(i.id for i in lst))


def _tp(plan) -> str:
    tp = plan.meta.get("tensor_parallel")
    cp = plan.meta.get("context_parallel")
    out = f" cp={cp['degree']} ({cp['style']})" if cp else ""
    return out + (f" tp={tp['degree']}" + (" (sequence parallel)" if tp["sequence_parallel"] else "")
                  + _tp_selection(tp) if tp else "")


def _tp_selection(tp: dict) -> str:
    """shard_tensor's partial selection, e.g. `` sharded: embed, layers 0-3 (others replicated)``."""
    if "layers" not in tp:
        return ""
    from piper_sim.strategy import format_layers

    layers = format_layers(tp["layers"])
    parts = (["embed"] if tp["embedding"] else []) + ([f"layers {layers}"] if layers else []) \
        + (["head"] if tp["head"] else [])
    return f" sharded: {', '.join(parts)} (others replicated)"


def _span(ranks: list[int]) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def cmd_validate(args: argparse.Namespace) -> None:
    from piper_sim.cli.demo import CALIBRATION
    from piper_sim.cli.validation import format_report, spread_suite, suite, validate

    strategies = (list(args.strategies) + (suite() if args.suite else [])
                  + (spread_suite() if args.spread_suite else []))
    if not strategies:
        raise ValueError("validate: give strategy files, or --suite / --spread-suite for a built-in suite")
    costmodel = args.costmodel or (CALIBRATION if os.path.exists(CALIBRATION) else "analytic")

    def show(row) -> None:
        log.info(f"  {row.name}: predicted {row.predicted_s * 1e3:.1f} ms, measured {row.measured_s * 1e3:.1f} ms "
                 f"({row.error_pct:+.1f}%)")

    summary = validate(strategies, costmodel, steps=args.steps, warmup=args.warmup, out_dir=args.out, progress=show,
                       rounds=args.rounds)
    print(format_report(summary))
    print(f"wrote {args.out}/validation.csv, validation.json, overlay.png and the plans and measured traces")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage is one ``-h`` away) and descriptions printed as
    written (their example lines); sub-commands inherit it."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


DESCRIPTION = """Plan, simulate and run distributed training strategies.

examples:
  piper-sim demo                                   the whole journey on a built-in example
  piper-sim explore --model llama3-8b --cluster h100:1x8 --global-batch 64 --seq-len 8192
  piper-sim compile strategy.json -o plan.json && piper-sim simulate plan.json

-v/-q/--no-progress work before or after the subcommand; `piper-sim SUBCOMMAND -h` for its options."""


def _about(text: str) -> str:
    """A subcommand's --help description from an indented triple-quoted block."""
    import textwrap

    return textwrap.dedent(text).strip("\n")


def _build_parser() -> argparse.ArgumentParser:
    from piper_sim import __version__

    p = Parser(prog="piper-sim", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"piper-sim {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="more log output on stderr (-v: debug); before or after the subcommand")
    p.add_argument("-q", "--quiet", dest="log_quiet", action="count", default=0,
                   help="less output: warnings and errors only and no progress bars (-qq: errors only, "
                        "no warnings); before or after the subcommand")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (logging unchanged)")
    sub = p.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    mo = sub.add_parser("models", help="list the model zoo, or print one model's parameter counts as JSON",
                        description=_about("""
        List the model zoo (layers, hidden size, experts, parameters), or print one model
        resolved (a zoo name, a model file or a Hugging Face config.json) as JSON.

        example:  piper-sim models --json hf:path/to/config.json"""))
    mo.add_argument("--json", metavar="SPEC", help="a zoo name, model file (PATH.yaml/.json, file:PATH) or "
                                                  "hf:PATH to a Hugging Face config.json: print it resolved, as JSON")
    mo.add_argument("--dir", metavar="DIR", help="also list the model files (and hf:DIR/NAME folders) found in DIR")
    mo.set_defaults(func=cmd_models)
    c = sub.add_parser("compile", help="compile a strategy JSON into a plan JSON", description=_about("""
        Compile a strategy (model, cluster, batch, directives) into a validated per-rank plan
        file, which `simulate`, `show` and `run` read.

        example:  piper-sim compile strategy.json -o plan.json"""))
    c.add_argument("strategy", metavar="STRATEGY.json", help="strategy file (model, cluster, batch, directives)")
    c.add_argument("-o", "--output", metavar="PLAN.json", help="plan file to write (default: STRATEGY.plan.json)")
    c.set_defaults(func=cmd_compile)
    e = sub.add_parser("expand", help="print a strategy with its directives expanded to the low-level set",
                       description=_about("""
        Print the strategy with its high-level directives (pipeline, schedule, data_parallel,
        ...) expanded to the low-level ones they stand for (split, place, order, replicate, ...).

        example:  piper-sim expand strategy.json"""))
    e.add_argument("strategy", metavar="STRATEGY.json", help="strategy file")
    e.set_defaults(func=cmd_expand)
    s = sub.add_parser("show", help="print a plan's per-rank order", description=_about("""
        Print a plan's per-rank, per-stream instruction order, or its pipeline order in
        torch.distributed.pipelining notation (--compute-order), or write torch's schedule CSV.

        examples:  piper-sim show plan.json --rank 0
                   piper-sim show plan.json --compute-order"""))
    s.add_argument("plan", metavar="PLAN.json", help="plan file from `piper-sim compile`")
    s.add_argument("--compute-order", action="store_true",
                   help="one line per pipeline rank in torch.distributed.pipelining notation")
    s.add_argument("--csv", metavar="OUT.csv",
                   help="write the per-rank action CSV that torch's _load_csv and torchtitan's "
                        "--parallelism.pipeline_parallel_schedule_csv load (one row per pipeline rank)")
    s.add_argument("--comms", action="store_true",
                   help="with --csv: add the plan's SEND/RECV and REDUCE_GRAD actions "
                        "(torch's compute_comms format)")
    s.add_argument("--rank", type=arg_int(0), help="only this global rank's class")
    s.add_argument("--no-hash-check", action="store_true", help="accept a plan edited after compiling")
    s.set_defaults(func=cmd_show)
    v = sub.add_parser("validate", help="simulate and execute strategies; report predicted vs measured",
                       description=_about("""
        Simulate each strategy, run it for real on this machine's CPU processes, and report
        predicted vs measured step times (CSV, JSON, an overlay picture and the traces in --out).

        example:  piper-sim validate --suite --out validation"""))
    v.add_argument("strategies", nargs="*", metavar="STRATEGY.json", help="strategy files to validate")
    v.add_argument("--suite", action="store_true", help="add the built-in suite (10 strategies on cpu:2/cpu:4)")
    v.add_argument("--spread-suite", action="store_true",
                   help="add the spread suite (9 strategies on cpu:1/cpu:2 whose step times differ by more "
                        "than the machine's noise: the ranking check)")
    v.add_argument("--costmodel", help="default: traces/calibration/cpu-2core.json when present")
    v.add_argument("--steps", type=arg_int(1), default=6, help="measured training steps per strategy (default 6)")
    v.add_argument("--warmup", type=arg_int(0), default=2, help="steps left out of the measured median")
    v.add_argument("--rounds", type=arg_int(1), default=1,
                   help="measure the list this many times, round after round; each strategy keeps its fastest "
                        "round (a machine shared with other jobs: the least disturbed one; default 1)")
    v.add_argument("--out", default="validation", metavar="DIR",
                   help="folder for the report, plans and measured traces (default: validation)")
    v.set_defaults(func=cmd_validate)
    from piper_sim.cli.calibrate import add_calibrate_parser
    from piper_sim.cli.compare import add_compare_parser
    from piper_sim.cli.demo import add_demo_parser
    from piper_sim.cli.explain import add_explain_parser
    from piper_sim.cli.explore import add_explore_parser
    from piper_sim.cli.interop import add_interop_parsers
    from piper_sim.cli.run import add_run_parser
    from piper_sim.cli.simulate import add_simulate_parser

    add_simulate_parser(sub)
    add_explore_parser(sub)
    add_explain_parser(sub)
    add_run_parser(sub)
    add_calibrate_parser(sub)
    add_demo_parser(sub)
    add_interop_parsers(sub)
    add_compare_parser(sub)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The `piper-sim` parser, with `-v`, `-q` and `--no-progress` on every subcommand too
    (`piper_sim.cli.common`)."""
    p = _build_parser()
    from piper_sim.cli.common import add_to_subcommands

    for action in p._subparsers._group_actions:
        add_to_subcommands(action)
    return p


class _Stderr(logging.Handler):
    """Writes to the sys.stderr of the moment (pytest's capsys, a notebook's stream)."""

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if record.levelno >= logging.WARNING or record.levelno < logging.INFO:
            msg = f"piper-sim: {record.levelname.lower()}: {msg}"
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()


def setup_logging(verbose: int = 0, quiet: int = 0) -> None:
    """Log records of piper_sim, costmodel and executor to stderr: info by default, debug
    with -v, warnings with -q, errors only with -qq. Idempotent (notebooks call main())."""
    level = {-1: logging.DEBUG, 0: logging.INFO, 1: logging.WARNING}.get(max(-1, min(2, quiet - verbose)),
                                                                         logging.ERROR)
    for name in ("piper_sim", "costmodel", "executor"):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not any(isinstance(h, _Stderr) for h in logger.handlers):
            logger.addHandler(_Stderr())
            logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    # the command line only writes picture files: a non-interactive matplotlib backend for this
    # process and the ranks it starts (the library itself never selects one)
    os.environ.setdefault("MPLBACKEND", "Agg")
    warnings.formatwarning = lambda msg, *a, **k: f"piper-sim: warning: {msg}\n"
    from piper_sim.cli.common import merge_common

    args = merge_common(build_parser().parse_args(argv))
    setup_logging(args.verbose, args.log_quiet)
    try:
        with warnings.catch_warnings():
            if args.log_quiet >= 2:
                warnings.simplefilter("ignore")
            rc = args.func(args)
    except (ValueError, PlanError) as e:  # StrategyError, PlanValidationError & co are ValueErrors
        print(f"piper-sim: error: {_one_line(str(e))}", file=sys.stderr)  # always, whatever -q says
        return 2
    except BrokenPipeError:  # `piper-sim ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # unreadable input, a directory, a full disk: name the file
        where = f"{e.filename}: " if e.filename else ""
        print(f"piper-sim: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    return rc if isinstance(rc, int) else 0  # a command may return an exit status (simulate --strict)


def _one_line(text: str) -> str:
    return " ".join(text.split()) if "\n" in text else text

