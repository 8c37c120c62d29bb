"""Simulated vs measured: predict a strategy's step, run it for real, report the error.

For each strategy: compile; simulate with a (calibrated) cost model; execute with the
executor through torchrun (warm-up steps excluded, the median of the rest); match the
last measured step's ops to the simulated ones by op id. The report holds predicted and
measured step times, the error, the per-op error distribution, and Kendall's tau between
the predicted and the measured ranking of the strategies.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from piper_sim.api import as_strategy, compile
from piper_sim.files import atomic_write, check_output_dir
from piper_sim.plan import COMPUTE_KINDS
from piper_sim.strategy import Strategy
from piper_sim.trace import save_figure


@dataclass
class ValidationRow:
    name: str
    strategy: str
    cluster: str
    predicted_s: float
    measured_s: float
    error_pct: float
    ops_matched: int
    op_error_median_pct: float
    op_error_p90_pct: float
    compute_error_median_pct: float
    measured_min_s: float = float("nan")  # fastest and slowest measured step after warm-up: the noise
    measured_max_s: float = float("nan")
    rounds_s: list[float] = field(default_factory=list)  # each round's median (validate(rounds=N))


class MeasurementError(RuntimeError):
    """The executor run failed; the message carries its last error line."""


def measure(plan_path: str, steps: int, warmup: int, trace: str, timeout_s: float = 900) -> tuple[float, list]:
    """Run a plan with the executor; the median step time after warm-up, and all steps."""
    cmd = [sys.executable, "-m", "piper_sim.cli", "run", plan_path, "--steps", str(steps), "--json",
           "--trace", trace, "--force"]  # its own trace: a rerun into the same folder replaces it
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode:
        lines = r.stderr.strip().splitlines() or ["no output"]
        last = next((x for x in reversed(lines) if "error" in x), lines[-1])  # a rank's line, not the summary
        raise MeasurementError(f"{plan_path}: executor exited {r.returncode}: {last}")
    steps_out = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{") and "step_time_s" in x]
    times = [s["step_time_s"] for s in steps_out[warmup:]] or [s["step_time_s"] for s in steps_out]
    return statistics.median(times), steps_out


def op_errors(sim, meas) -> tuple[list[float], list[float]]:
    """Relative duration errors (%) of ops matched by (rank, op id): all, and compute only."""
    s = sim.set_index(["rank", "op_id"])
    m = meas.set_index(["rank", "op_id"])
    common = s.index.intersection(m.index)
    errs, comp = [], []
    for key in common:
        ds = float(s.loc[key, "end"] - s.loc[key, "start"])
        dm = float(m.loc[key, "end"] - m.loc[key, "start"])
        if dm <= 0:
            continue
        e = 100.0 * (ds - dm) / dm
        errs.append(e)
        if s.loc[key, "kind"] in COMPUTE_KINDS:
            comp.append(e)
    return errs, comp


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(abs(x) for x in values)
    return v[min(len(v) - 1, int(q * len(v)))]


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a between two orderings of the same items."""
    n = len(a)
    if n < 2:
        return float("nan")
    score = 0
    for i in range(n):
        for j in range(i + 1, n):
            x, y = a[i] - a[j], b[i] - b[j]
            score += (x * y > 0) - (x * y < 0)
    return score / (n * (n - 1) / 2)


def overlay_timeline(sim, meas, path: str | None = None, title: str = "", *, ax: Any = None) -> Any:
    """Simulated and measured timelines of one step, one pair of rows per rank. Returns the
    Figure; writes ``path`` when given; draws into ``ax`` when given."""
    from matplotlib.patches import Patch

    from piper_sim.trace import COMPUTE_KINDS, KIND_COLORS, new_figure, time_scale

    ranks = sorted(set(sim["rank"]) | set(meas["rank"]))
    own = ax is None
    fig, ax = new_figure(ax, figsize=(13, 0.9 * len(ranks) * 2 + 1.2))
    t_end = max(float((df["end"] - df["start"].min()).max()) if len(df) else 0.0 for df in (sim, meas))
    scale, xlabel = time_scale(t_end)
    labels = []
    for i, r in enumerate(ranks):
        for j, (name, df) in enumerate((("simulated", sim), ("measured", meas))):
            y = -(2 * i + j)
            rows = df[(df["rank"] == r) & df["kind"].isin(COMPUTE_KINDS)]
            t0 = df["start"].min()
            for kind, s, e, mb in rows[["kind", "start", "end", "mb"]].itertuples(index=False):
                ax.barh(y, (e - s) * scale, left=(s - t0) * scale, height=0.8, color=KIND_COLORS.get(kind, "#cccccc"),
                        edgecolor="black", linewidth=0.3)
            labels.append((y, f"rank {r} {name}"))
    ax.set_yticks([y for y, _ in labels], [t for _, t in labels], fontsize=8)
    ax.set_xlabel(xlabel.replace("time", "time in step"))
    ax.set_title(title or "simulated vs measured")
    ax.legend(handles=[Patch(color=KIND_COLORS[k], label=k) for k in COMPUTE_KINDS],
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=5, fontsize=8)
    if own:
        fig.tight_layout()
    if path:
        save_figure(fig, path, dpi=110)
    return fig


def slug(name: str) -> str:
    """A strategy name as the base of its file names: ``pp2 1f1b`` -> ``pp2_1f1b``."""
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def validate_one(strategy: Strategy | dict | str, costmodel: str, steps: int, warmup: int, out_dir: str,
                 name: str | None = None, tag: str = "") -> tuple[ValidationRow, Any, Any]:
    """Simulate and measure one strategy; the measured trace is ``out_dir/SLUG{tag}.measured.json``."""
    from piper_sim.simulator import simulate
    from piper_sim.trace import read_chrome_trace

    s = as_strategy(strategy)
    name = name or s.name or s.short()
    base = slug(name)
    plan = compile(s)
    plan_path = os.path.join(out_dir, f"{base}.plan.json")
    plan.save(plan_path)
    sim = simulate(plan, costmodel)
    trace = os.path.join(out_dir, f"{base}{tag}.measured.json")
    measured, steps_out = measure(plan_path, steps, warmup, trace)
    after = [x["step_time_s"] for x in steps_out[warmup:]] or [measured]
    meas = read_chrome_trace(trace)
    errs, comp = op_errors(sim.events, meas)
    row = ValidationRow(name=name, strategy=s.short(), cluster=s.cluster, predicted_s=sim.step_time_s,
                        measured_s=measured, error_pct=100.0 * (sim.step_time_s - measured) / measured,
                        ops_matched=len(errs), op_error_median_pct=_pct(errs, 0.5),
                        op_error_p90_pct=_pct(errs, 0.9), compute_error_median_pct=_pct(comp, 0.5),
                        measured_min_s=min(after), measured_max_s=max(after))
    return row, sim.events, meas


def validate(strategies: list, costmodel: str, steps: int = 6, warmup: int = 2, out_dir: str = "validation",
             progress=None, rounds: int = 1) -> dict[str, Any]:
    """Validate several strategies; write CSV, JSON and an overlay picture of the first.
    With ``rounds`` > 1 the whole list is measured that many times, round after round, and
    each strategy keeps its fastest round (median step time) and that round's trace: on a
    machine shared with other jobs the least disturbed measurement, as the calibration keeps
    each point's fastest time (`costmodel.fit.merge_raw`); ``rounds_s`` lists every round's.
    Returns the summary written to validation.json plus ``table``: its rows as a DataFrame."""
    import pandas as pd

    strategies = [as_strategy(s) for s in strategies]  # every file read and checked before out_dir exists
    check_output_dir(out_dir, "--out")
    os.makedirs(out_dir, exist_ok=True)
    best: dict[int, tuple[ValidationRow, Any, Any, str]] = {}
    medians: dict[int, list[float]] = {}
    for r in range(rounds):
        tag = f".round{r + 1}" if rounds > 1 else ""
        for i, s in enumerate(strategies):
            row, sim, meas = validate_one(s, costmodel, steps, warmup, out_dir, tag=tag)
            medians.setdefault(i, []).append(row.measured_s)
            if i not in best or row.measured_s < best[i][0].measured_s:
                best[i] = (row, sim, meas, tag)
            if progress:
                progress(row)
    rows = []
    for i in range(len(strategies)):
        row, sim, meas, tag = best[i]
        row.rounds_s = medians[i]
        rows.append(row)
        if tag:  # keep the fastest round's trace under the plain name
            base = os.path.join(out_dir, slug(row.name))
            os.replace(f"{base}{tag}.measured.json", f"{base}.measured.json")
            for r in range(rounds):
                if os.path.exists(f"{base}.round{r + 1}.measured.json"):
                    os.remove(f"{base}.round{r + 1}.measured.json")
        if i == 0:
            overlay_timeline(sim, meas, os.path.join(out_dir, "overlay.png"),
                             f"{row.name}: simulated {row.predicted_s * 1e3:.1f} ms, "
                             f"measured {row.measured_s * 1e3:.1f} ms")
    table = pd.DataFrame([asdict(r) for r in rows])
    with atomic_write(os.path.join(out_dir, "validation.csv"), newline="") as f:
        table.to_csv(f, index=False)
    errors = [abs(r.error_pct) for r in rows]
    summary = {"costmodel": costmodel, "steps": steps, "warmup": warmup, "rounds": rounds,
               "median_abs_error_pct": statistics.median(errors) if errors else float("nan"),
               "kendall_tau": kendall_tau([r.predicted_s for r in rows], [r.measured_s for r in rows]),
               "rows": [asdict(r) for r in rows]}
    with atomic_write(os.path.join(out_dir, "validation.json")) as f:
        json.dump(summary, f, indent=1)
    summary["table"] = table  # the rows as a DataFrame (not in the JSON file)
    return summary


def format_report(summary: dict[str, Any]) -> str:
    lines = [f"{'strategy':<34} {'cluster':<7} {'predicted ms':>12} {'measured ms':>12} {'error':>8} "
             f"{'ops':>5} {'op err med':>10} {'op err p90':>10} {'step range':>10}"]
    for r in summary["rows"]:
        spread = (r.get("measured_max_s", float("nan")) - r.get("measured_min_s", float("nan"))) / r["measured_s"]
        lines.append(f"{r['name'][:34]:<34} {r['cluster']:<7} {r['predicted_s'] * 1e3:>12.1f} "
                     f"{r['measured_s'] * 1e3:>12.1f} {r['error_pct']:>+7.1f}% {r['ops_matched']:>5} "
                     f"{r['op_error_median_pct']:>9.0f}% {r['op_error_p90_pct']:>9.0f}% {100 * spread:>9.0f}%")
    lines.append(f"median |step-time error| {summary['median_abs_error_pct']:.1f}%, "
                 f"Kendall tau {summary['kendall_tau']:.2f} (cost model: {summary['costmodel']})")
    return "\n".join(lines)


def _s(name: str, model: str, cluster: str, directives: list, m: int = 4, batch: int = 8,
       seq: int = 128) -> dict[str, Any]:
    return {"name": name, "model": model, "cluster": cluster, "global_batch": batch, "seq_len": seq,
            "microbatches": m, "dtype": "fp32", "directives": directives}


def suite() -> list[dict[str, Any]]:
    """The validation suite: 10 strategies on cpu:2 and cpu:4 (fp32, gloo)."""
    pp = lambda d, name, v=None: [{"op": "pipeline", "degree": d, **({"stages_per_rank": v} if v else {})},  # noqa
                                  {"op": "schedule", "name": name}]
    return [
        _s("dp2 zero0", "gpt-small", "cpu:2", [{"op": "data_parallel", "degree": 2, "zero": 0}], m=2),
        _s("dp2 zero3", "gpt-small", "cpu:2", [{"op": "data_parallel", "degree": 2, "zero": 3}], m=2),
        _s("pp2 1f1b", "gpt-small", "cpu:2", pp(2, "1f1b")),
        _s("pp2 zb1p", "gpt-small", "cpu:2", pp(2, "zb1p")),
        _s("pp2 gpipe", "gpt-small", "cpu:2", pp(2, "gpipe")),
        _s("pp2 interleaved v2", "gpt-small", "cpu:2", pp(2, "interleaved_1f1b", 2)),
        _s("pp2 dualpipev", "gpt-small", "cpu:2", pp(2, "dualpipev", 2)),
        _s("ep2 moe", "moe-small", "cpu:2", [{"op": "expert_parallel", "degree": 2}], m=2),
        _s("pp2 x dp2 zero1", "gpt-small", "cpu:4", pp(2, "1f1b") + [{"op": "data_parallel", "degree": 2, "zero": 1}],
           batch=16),
        _s("pp4 1f1b", "gpt-small", "cpu:4", pp(4, "1f1b"), m=8),
    ]


# Neighbouring strategies of the spread suite differ by at least this factor in predicted step
# time (tests/test_validation_suites.py), well above this VM's run-to-run noise (~5-10 %).
SPREAD_MIN_RATIO = 1.15


def spread_suite() -> list[dict[str, Any]]:
    """The spread suite: 9 strategies on cpu:1 and cpu:2 (fp32, gloo), fastest first, whose
    predicted step times differ pairwise by more than the machine's noise, so that Kendall's
    tau measures the ranking and not the noise. They vary the model size, sequence length,
    batch, data vs pipeline parallelism, ZeRO 0/3, the schedule and recompute."""
    dp = lambda z: [{"op": "data_parallel", "degree": 2, "zero": z}]  # noqa
    pp = lambda name: [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": name}]  # noqa
    full = [{"op": "recompute", "mode": "full"}]
    return [
        _s("tiny dp2 zero3", "gpt-tiny", "cpu:2", dp(3), m=1),
        _s("tiny pp2 gpipe", "gpt-tiny", "cpu:2", pp("gpipe")),
        _s("tiny 1 rank", "gpt-tiny", "cpu:1", [], m=1),
        _s("small 1 rank b2", "gpt-small", "cpu:1", [], m=1, batch=2),
        _s("small dp2 zero0", "gpt-small", "cpu:2", dp(0), m=1),
        _s("small pp2 zb1p", "gpt-small", "cpu:2", pp("zb1p")),
        _s("small pp2 1f1b recompute", "gpt-small", "cpu:2", pp("1f1b") + full),
        _s("small dp2 seq512", "gpt-small", "cpu:2", dp(0), m=1, seq=512),
        _s("small 1 rank seq512", "gpt-small", "cpu:1", [], m=1, seq=512),
    ]
