"""`piper-sim demo`: the user's journey on a built-in default, end to end.

1. explore strategies for a realistic model and cluster (qwen3-moe-9b on h100:4x8),
   print the ranked table, write the CSV, the Pareto picture and the best plan with its
   simulated timeline, and say why the winner wins: where its step goes and the terms that
   put it ahead of the runner-up (`piper_sim.explain`, why.png);
2. run a small plan of the winner's kinds (`small_strategy`: its pipeline schedule, expert,
   data, tensor or context parallelism, two ranks each, up to two kinds) for real on this
   machine (`cpu:2` or `cpu:4`, gloo, torchrun) and print simulated vs measured.
   The simulation uses a calibration of *this* machine: measured once (`calibrate
   --quick`, ~15 s) and cached per machine fingerprint under $XDG_CACHE_HOME/piper-sim
   (else ~/.cache/piper-sim); `--no-calibrate` simulates with the uncalibrated analytic
   CPU placeholders instead, and says so.

Everything is written into ``--out DIR``, by default ``demo`` in piper-sim's cache folder
(`default_out`), never into the current folder.
"""

from __future__ import annotations

import argparse
import os
import subprocess

from piper_sim.checks import arg_int
from piper_sim.cli.common import progress_enabled
from piper_sim.cli.explore import emit_best, progress_printer
from typing import TYPE_CHECKING

from piper_sim.schedules import SCHEDULE_TABLE

if TYPE_CHECKING:
    from piper_sim.explore import Candidate

DEFAULT = {"model": "qwen3-moe-9b", "cluster": "h100:4x8", "global_batch": 256, "seq_len": 4096}
# the project's 2-core dev VM, committed (traces/calibration/README.md): `validate`'s default
CALIBRATION = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "traces", "calibration", "cpu-2core.json")
UNCALIBRATED = ("this machine is uncalibrated (--no-calibrate): simulating with the analytic CPU placeholders "
                "of costmodel/hardware.py, not measurements, so expect a large error; run without "
                "--no-calibrate to calibrate it once (~15 s)")


DESCRIPTION = """The user's journey on a built-in example, end to end (a few minutes on 2 cores):
1. explore strategies for qwen3-moe-9b on h100:4x8 (simulated), print the ranked table and
   write the CSV, the Pareto picture and the best plan with its simulated timeline;
2. run a small plan of the winner's kinds for real on this machine's CPU processes and print
   simulated vs measured step time (this machine is calibrated once, ~15 s, and cached).
Files go to piper-sim's cache folder unless --out DIR is given; the first line says where.

examples:
  piper-sim demo
  piper-sim demo --out demo-out/ --no-run"""

# the winner's parallelism kinds, in the order the two-rank-per-kind demo keeps them (at most
# `DEMO_KINDS` of them, 2 ranks each: 4 CPU processes)
DEMO_KINDS = 2


def small_strategy(best: Candidate | None) -> dict:
    """A plan of the winner's kinds that runs on this machine's CPU processes: each
    parallelism kind the winner uses (pipeline with its schedule, expert parallel with data
    parallel, data parallel with its ZeRO level, tensor parallel with its sequence
    parallelism, context parallel), degree 2, the first `DEMO_KINDS` of them; moe-tiny when
    the winner is expert-parallel, else gpt-tiny. A kind whose combination the executor does
    not run (`executor.options`) is left out, later kinds first."""
    kinds = _kinds(best)
    while True:
        small = _small(best, kinds)
        why = _unrunnable(small)
        if not why or len(kinds) <= 1:
            return small
        kinds = kinds[:-1]


def _kinds(best: Candidate | None) -> list[str]:
    if best is None:
        return ["pp"]
    present = {"pp": best.pp > 1, "ep": best.ep > 1, "dp": best.dp > 1 and best.ep == 1, "tp": best.tp > 1,
               "cp": best.cp > 1}
    return [k for k, on in present.items() if on][:DEMO_KINDS] or ["dp"]


def _small(best: Candidate | None, kinds: list[str]) -> dict:
    model = "moe-tiny" if "ep" in kinds else "gpt-tiny"
    d: list[dict] = []
    pp, dp, m = 1, 1, 2
    if "pp" in kinds:
        sched = (SCHEDULE_TABLE[best.schedule].demo_as or best.schedule) if best else "1f1b"
        if SCHEDULE_TABLE[sched].needs_ep and "ep" not in kinds:  # combined 1F1B without its all-to-alls
            sched = "interleaved_1f1b"
        pp, m = 2, 8
        d += [{"op": "pipeline", "degree": 2, "stages_per_rank": SCHEDULE_TABLE[sched].stages_per_rank},
              {"op": "schedule", "name": sched}]
    if "ep" in kinds or "dp" in kinds:
        dp = 2
        d.append({"op": "data_parallel", "degree": 2, "zero": best.zero if best else 0})
    if "ep" in kinds:
        d.append({"op": "expert_parallel", "degree": 2})
    if "tp" in kinds:
        d.append({"op": "tensor_parallel", "degree": 2, "sequence_parallel": bool(best and best.sp)})
    if "cp" in kinds:
        d.append({"op": "context_parallel", "degree": 2})
    world = pp * dp * (2 if "tp" in kinds else 1) * (2 if "cp" in kinds else 1)
    return {"model": model, "cluster": f"cpu:{world}", "seq_len": 64, "dtype": "fp32", "name": f"demo on cpu:{world}",
            "global_batch": dp * m, "microbatches": m, "directives": d}


def _unrunnable(small: dict) -> str:
    """Why the executor would refuse this small plan ('' when it runs it: `executor.support.unrunnable`)."""
    from executor.support import unrunnable
    from piper_sim.api import compile
    from piper_sim.plan import PlanError
    from piper_sim.strategy import StrategyError

    try:
        return unrunnable(compile(small), "demo")
    except (PlanError, StrategyError) as e:
        return str(e)


def machine_costmodel(no_calibrate: bool, progress: bool = True) -> tuple[str, str]:
    """(cost model for `simulate`, a line saying what it is): this machine's cached
    calibration (measured now on first use), or the analytic placeholders."""
    from piper_sim.cli.calibrate import cached_calibration

    if no_calibrate:
        return "analytic", UNCALIBRATED
    try:
        path, fresh = cached_calibration(quick=True, progress=progress, announce=print)
    except (ValueError, RuntimeError, OSError, subprocess.SubprocessError) as e:
        return "analytic", f"calibrating this machine failed ({e}); simulating uncalibrated (analytic placeholders)"
    return path, f"{'measured' if fresh else 'cached'} calibration of this machine: {path}"


def default_out() -> str:
    """The demo's folder when no ``--out`` is given: ``demo`` in piper-sim's cache folder
    (`piper_sim.files.cache_dir`), never the current folder."""
    from piper_sim.files import cache_dir

    return os.path.join(cache_dir(), "demo")


def cmd_demo(args: argparse.Namespace) -> None:
    from piper_sim.api import compile
    from piper_sim.explore import explore, format_table, plot_pareto, write_csv
    from piper_sim.simulator import simulate
    from piper_sim.cli.validation import MeasurementError, measure

    quiet = not progress_enabled(args)
    args.out = args.out or default_out()
    os.makedirs(args.out, exist_ok=True)
    print(f"writing into {args.out} (--out DIR to choose)")
    print(f"== 1. exploring strategies for {DEFAULT['model']} on {DEFAULT['cluster']}, "
          f"batch {DEFAULT['global_batch']}x{DEFAULT['seq_len']} (simulated)")
    # tensor parallelism does not help this 9B MoE (searched, the best is TP1): left out to keep the demo quick
    result = explore(**DEFAULT, workers=args.workers, zero_levels=(1, 3), recompute=(False,),
                     microbatch_factors=(2,), tp_degrees=(1,), progress=progress_printer(not quiet))
    print(format_table(result, 8))
    write_csv(result, os.path.join(args.out, "strategies.csv"))
    plot_pareto(result, os.path.join(args.out, "pareto.png"))
    paths = emit_best(result, args.out)
    print(f"wrote {args.out}/strategies.csv, pareto.png, " + ", ".join(os.path.basename(p) for p in paths.values()))
    if len(result.ok) > 1:
        from piper_sim.cli.explain import explain_top, report

        print("\n== why #1 wins, against the runner-up (`piper-sim explain`, `explore --explain K`)")
        print("\n".join(report(explain_top(result, 2), os.path.join(args.out, "why.png"), tables=1)))
    if args.no_run:
        return
    small = small_strategy(result.best.candidate if result.best else None)
    print(f"\n== 2. a plan of the winner's kinds for real on this machine: {small['model']} on {small['cluster']}, "
          + " ".join(f"{d['op']}={d.get('name', d.get('degree'))}" for d in small["directives"]))
    plan = compile(small)
    plan_path = os.path.join(args.out, "small_plan.json")
    plan.save(plan_path)
    costmodel, what = machine_costmodel(args.no_calibrate, progress=not quiet)
    print(what)
    sim = simulate(plan, costmodel)
    sim.plot_timeline(os.path.join(args.out, "small_simulated_timeline.png"), title="simulated (cpu:2)")
    label = "uncalibrated" if costmodel == "analytic" else os.path.basename(costmodel)
    print(f"simulated step time ({label}): {sim.step_time_s * 1e3:.1f} ms")
    try:
        step, steps = measure(plan_path, steps=4, warmup=2, trace=os.path.join(args.out, "measured_trace.json"))
    except (MeasurementError, subprocess.TimeoutExpired) as e:
        print(f"measured run failed: {e}")
        return
    print(f"measured step time (executor, gloo, median after 2 warm-up steps): {step * 1e3:.1f} ms, "
          f"loss {steps[-1]['loss']:.4f}; error {100 * (sim.step_time_s - step) / step:+.1f}%")
    busy = _busy_note()
    if busy:
        print(busy)


def _busy_note() -> str:
    """A warning when other processes share the cores (they slow the measured run)."""
    try:
        load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return ""
    if load <= 0.5 * cores:
        return ""
    return (f"note: load average {load:.1f} on {cores} cores: other processes slowed the measured run, "
            "so the error above is partly theirs")


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="explore a built-in default, then run a small plan of its kind for real",
                       description=DESCRIPTION)
    p.add_argument("--out", metavar="DIR", help="folder for the table, pictures and plans (default: demo/ in "
                                                "piper-sim's cache folder, $PIPER_SIM_CACHE_DIR or ~/.cache/piper-sim)")
    p.add_argument("--workers", type=arg_int(1), default=None, help="processes for the exploration (default: all cores)")
    p.add_argument("--no-run", action="store_true", help="skip the measured run on this machine")
    p.add_argument("--no-calibrate", action="store_true",
                   help="do not calibrate this machine: simulate the small plan uncalibrated (and say so)")
    p.set_defaults(func=cmd_demo)
