"""Why is my real run slower than the plan: measured (torch.profiler traces) vs simulated.

`compare_traces(plan, trace_dir)` reads one trace per rank (`piper_sim.measured`: the
mapping convention and its fallback by order are documented there), simulates the plan (a
folded simulation: each traced rank is compared with its rank class's simulated replica,
``ranks.simulated_as``) and returns a `Comparison`:

- ``ops``: one row per plan op on the traced ranks: measured and simulated seconds, their
  ratio (measured / simulated) and the plan's error (100 x (simulated - measured) /
  measured, as `piper-sim validate` reports it); ops the trace did not show have NaN;
- ``categories``: per category, the mean over the traced ranks of the matched ops' time:
  forward (F), backward (B, BI, BW), optimizer (OPT), ``comm <kind>`` per collective kind,
  then ``exposed comm`` (comm while no compute runs: `trace.exposed_comm`), ``idle`` (step
  time with neither compute nor exposed comm) and ``step``; on GPU traces these three count
  the ops' kernels (``ops.busy_s``: a compute op's without the NCCL kernels it launched), not
  their spans;
- ``ranks``: per rank, the mapping used, step, compute, exposed comm and idle both ways;
- ``gaps``: the biggest absolute differences (ops, and idle / exposed comm per rank) in words.

`Comparison.to_text()` is what ``piper-sim compare PLAN --trace DIR`` prints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from piper_sim.measured import RankMapping, map_rank, plan_ops_of, read_rank_traces
from piper_sim.plan import COMPUTE_KINDS
from piper_sim.trace import exposed_comm, union_intervals

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from piper_sim.plan import Plan

__all__ = ["Comparison", "compare_traces", "category_of"]

CATEGORY_ORDER = ("forward", "backward", "optimizer")


def category_of(kind: str) -> str:
    """forward, backward, optimizer, or ``comm <kind>`` (``comm allreduce``...)."""
    if kind == "F":
        return "forward"
    if kind in ("B", "BI", "BW"):
        return "backward"
    if kind == "OPT":
        return "optimizer"
    return f"comm {kind.lower()}"


def _ratio(meas: float, sim: float) -> float:
    return meas / sim if sim > 0 and meas == meas else float("nan")


def _err(meas: float, sim: float) -> float:
    return 100.0 * (sim - meas) / meas if meas > 0 else float("nan")


def _ms(x: float) -> str:
    return "-" if x != x else f"{x * 1e3:.3f}"


@dataclass
class Comparison:
    """Measured vs simulated, per op, per category and per rank (see the module doc)."""

    plan: str
    trace: str
    costmodel: str
    ops: "pd.DataFrame"
    categories: "pd.DataFrame"
    ranks: "pd.DataFrame"
    mappings: list[RankMapping]
    gaps: list[str] = field(default_factory=list)
    world_size: int = 0

    @property
    def matched(self) -> int:
        return int(self.ops["measured_s"].notna().sum())

    def to_json(self) -> dict[str, Any]:
        def rows(df: "pd.DataFrame") -> list[dict[str, Any]]:
            return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
                    for r in df.to_dict(orient="records")]

        return {"plan": self.plan, "trace": self.trace, "costmodel": self.costmodel, "world_size": self.world_size,
                "matched_ops": self.matched, "planned_ops": len(self.ops), "ranks": rows(self.ranks),
                "categories": rows(self.categories), "ops": rows(self.ops), "gaps": self.gaps}

    def to_text(self, max_ops: int = 30) -> str:
        lines = [f"{self.plan} vs {self.trace} ({len(self.mappings)} of {self.world_size} ranks traced; "
                 f"simulated with {self.costmodel})"]
        for m in self.mappings:
            step = m.describe_step()
            left = (", trace phases left unmatched: " + ", ".join(f"{k} x{v}" for k, v in sorted(m.unmatched_phases
                                                                                              .items()))
                    if m.unmatched_phases else "")
            how = f"mapped by {m.mapping}, {len(m.ops)}" if m.ops else "no plan op found, 0"
            lines.append(f"rank {m.rank}: {how} of {m.planned} plan ops in {step} ({m.step_s * 1e3:.3f} ms){left}")
        lines.append("")
        lines.append(f"{'category (mean per rank)':<26} {'measured ms':>12} {'simulated ms':>13} {'ratio':>7} "
                     f"{'ops':>9}")
        for r in self.categories.itertuples(index=False):
            ratio = "-" if r.ratio != r.ratio else f"{r.ratio:.2f}x"
            ops = f"{r.ops_matched}/{r.ops_planned}" if r.ops_planned else ""
            lines.append(f"{r.category:<26} {_ms(r.measured_s):>12} {_ms(r.simulated_s):>13} {ratio:>7} {ops:>9}")
        lines.append("")
        lines.append(f"{'rank':>4} {'op':<28} {'measured ms':>12} {'simulated ms':>13} {'ratio':>7} {'error':>8}")
        shown = self.ops[self.ops["measured_s"].notna()]
        for r in shown.head(max_ops).itertuples(index=False):
            ratio = "-" if r.ratio != r.ratio else f"{r.ratio:.2f}x"
            err = "-" if r.error_pct != r.error_pct else f"{r.error_pct:+.0f}%"
            lines.append(f"{r.rank:>4} {r.op_id[:28]:<28} {_ms(r.measured_s):>12} {_ms(r.simulated_s):>13} "
                         f"{ratio:>7} {err:>8}")
        if len(shown) > max_ops:
            lines.append(f"... {len(shown) - max_ops} more matched ops (--csv writes them all)")
        missing = len(self.ops) - len(shown)
        if missing:
            lines.append(f"{missing} plan ops not found in the traces (the convention: README, compare; "
                         "piper_sim.measured)")
        if self.gaps:
            lines.append("")
            lines.append("biggest gaps:")
            lines += [f"  {g}" for g in self.gaps]
        return "\n".join(lines)


def _rank_totals(rank: int, rows: list[tuple[str, float, float]], step_s: float) -> tuple[float, float, float]:
    """(compute, exposed comm, idle) seconds of one rank's ``(kind, start, end)`` rows over a step."""
    compute = sum(e - s for s, e in union_intervals((s, e) for k, s, e in rows if k in COMPUTE_KINDS))
    exposed = exposed_comm((rank, k, s, e) for k, s, e in rows).get(rank, 0.0)
    return compute, exposed, max(0.0, step_s - compute - exposed)


def compare_traces(plan: "Plan | str", trace_dir: str, costmodel: str = "analytic", step: int | None = None,
                   top: int = 5, plan_name: str | None = None) -> Comparison:
    """Measured (the traces in ``trace_dir``) vs simulated (``plan`` under ``costmodel``);
    see the module doc. ``step``: the ``ProfilerStep#N`` to compare (default: per rank, the
    step with the most mapped ops). Raises ValueError (one line) for unusable traces, a
    world size that differs from the plan's, no plan op found in any trace, or a cost model
    that does not count seconds."""
    import pandas as pd

    from piper_sim.plan import Plan
    from piper_sim.simulator import simulate

    name = plan_name or (plan if isinstance(plan, str) else str(plan.meta.get("model", "plan")))
    if isinstance(plan, str):
        plan = Plan.load(plan)
    world = plan.world_size
    traces = read_rank_traces(trace_dir)
    sizes = {t.world_size for t in traces if t.world_size is not None}
    ranks_word = f"{world} rank{'s' if world > 1 else ''}"
    if sizes and sizes != {world}:
        raise ValueError(f"--trace {trace_dir}: the traces are of a {'/'.join(map(str, sorted(sizes)))}-rank run "
                         f"(distributedInfo.world_size) but the plan has {ranks_word}; compare against a plan "
                         "of the traced run's parallel layout")
    if len(traces) > world or any(t.rank >= world for t in traces):
        bad = max(t.rank for t in traces)
        raise ValueError(f"--trace {trace_dir}: {len(traces)} trace files (ranks up to {bad}) but the plan has "
                         f"{ranks_word}; compare against a plan of the traced run's parallel layout")
    sim = simulate(plan, costmodel)
    rep = _representatives(plan, [t.rank for t in traces], {s.rank for s in sim.rank_stats})
    if rep is None:  # a traced rank whose class the folded simulation does not show: simulate every rank
        sim = simulate(plan, costmodel, fold=False)
        rep = {t.rank: t.rank for t in traces}
    if sim.time_unit == "units":
        raise ValueError(f"--costmodel {costmodel}: counts in its own units, not seconds; measured times need "
                         "'analytic' or a calibration .json")
    ev = sim.events
    sim_dur = {(int(r), o): float(e - s) for r, o, s, e in ev[["rank", "op_id", "start", "end"]]
               .itertuples(index=False)}
    sim_rows: dict[int, list[tuple[str, float, float]]] = {}
    for r, k, s, e in ev[["rank", "kind", "start", "end"]].itertuples(index=False):
        sim_rows.setdefault(int(r), []).append((k, float(s), float(e)))
    stats = {s.rank: s for s in sim.rank_stats}

    mappings: list[RankMapping] = []
    op_rows: list[dict[str, Any]] = []
    rank_rows: list[dict[str, Any]] = []
    for t in traces:
        plan_ops = plan_ops_of(plan, t.rank)
        m = map_rank(t, plan_ops, step, stages=plan.program(t.rank).stages)
        mappings.append(m)
        got = {o.op_id: o for o in m.ops}
        r_sim = rep[t.rank]
        for op, kind in plan_ops:
            mo = got.get(op)
            meas = mo.measured_s if mo else float("nan")
            simd = sim_dur.get((r_sim, op), float("nan"))
            op_rows.append({"rank": t.rank, "op_id": op, "kind": kind, "category": category_of(kind),
                            "mapping": mo.mapping if mo else "none", "measured_s": meas, "simulated_s": simd,
                            "ratio": _ratio(meas, simd), "error_pct": _err(meas, simd),
                            "measured_start_s": mo.start if mo else float("nan"),
                            "host_s": mo.host_s if mo else float("nan"),
                            "device_s": mo.device_s if mo else float("nan"),
                            "busy_s": mo.busy_s if mo else float("nan"),
                            "trace_name": mo.trace_name if mo else ""})
        mc, me, mi = _rank_totals(t.rank, [(o.kind, a, b) for o in m.ops for a, b in o.busy], m.step_s)
        st = stats.get(r_sim)
        sc, se, si = (st.compute_s, st.comm_exposed_s, st.idle_s) if st else _rank_totals(
            r_sim, sim_rows.get(r_sim, []), sim.step_time_s)
        rank_rows.append({"rank": t.rank, "simulated_as": r_sim, "file": t.path, "rank_from": t.rank_from,
                          "mapping": m.mapping, "step": m.step, "ops_matched": len(m.ops), "ops_planned": m.planned,
                          "measured_step_s": m.step_s, "simulated_step_s": sim.step_time_s,
                          "measured_compute_s": mc, "simulated_compute_s": sc,
                          "measured_exposed_comm_s": me, "simulated_exposed_comm_s": se,
                          "measured_idle_s": mi, "simulated_idle_s": si})
    if not any(m.ops for m in mappings):
        raise ValueError(f"--trace {trace_dir}: no plan op found in the traces; name each op with "
                         "torch.profiler.record_function(op_id) (`piper-sim show PLAN` lists them), or profile "
                         "whole training steps (forward, loss.backward(), optimizer.step()) for the fallback by order")
    ops = pd.DataFrame(op_rows)
    ranks = pd.DataFrame(rank_rows)
    categories = _categories(ops, ranks)
    gaps = _gaps(ops, ranks, top)
    return Comparison(name, trace_dir, sim.costmodel, ops, categories, ranks, mappings, gaps, world)


def _representatives(plan: "Plan", ranks: list[int], simulated: set[int]) -> dict[int, int] | None:
    """The simulated rank that stands for each traced rank: itself, or in a folded simulation
    the one of its rank class (same pipeline rank); None when some class is not simulated."""
    by_class: dict[int, int] = {}
    for s in sorted(simulated):
        by_class.setdefault(plan.layout.coords(s)[0], s)
    out = {}
    for r in ranks:
        rep = r if r in simulated else by_class.get(plan.layout.coords(r)[0])
        if rep is None:
            return None
        out[r] = rep
    return out


def _categories(ops: "pd.DataFrame", ranks: "pd.DataFrame") -> "pd.DataFrame":
    import pandas as pd

    n = max(len(ranks), 1)
    present = list(dict.fromkeys(ops["category"]))
    order = [c for c in CATEGORY_ORDER if c in present] + sorted(c for c in present if c not in CATEGORY_ORDER)
    rows = []
    for c in order:
        sub = ops[ops["category"] == c]
        hit = sub[sub["measured_s"].notna()]
        meas, simd = float(hit["measured_s"].sum()) / n, float(hit["simulated_s"].fillna(0).sum()) / n
        rows.append({"category": c, "measured_s": meas, "simulated_s": simd, "ratio": _ratio(meas, simd),
                     "error_pct": _err(meas, simd), "ops_matched": len(hit), "ops_planned": len(sub)})
    for c, col in (("exposed comm", "exposed_comm_s"), ("idle", "idle_s"), ("step", "step_s")):
        meas, simd = float(ranks[f"measured_{col}"].mean()), float(ranks[f"simulated_{col}"].mean())
        rows.append({"category": c, "measured_s": meas, "simulated_s": simd, "ratio": _ratio(meas, simd),
                     "error_pct": _err(meas, simd), "ops_matched": 0, "ops_planned": 0})
    return pd.DataFrame(rows)


def _gaps(ops: "pd.DataFrame", ranks: "pd.DataFrame", top: int) -> list[str]:
    """The ``top`` biggest |measured - simulated| among ops and each rank's idle / exposed comm."""
    cands: list[tuple[float, str]] = []
    for r in ops[ops["measured_s"].notna()].itertuples(index=False):
        sim = r.simulated_s if r.simulated_s == r.simulated_s else 0.0
        cands.append((r.measured_s - sim, f"rank {r.rank} {r.op_id} ({r.category})", r.measured_s, sim))
    for r in ranks.itertuples(index=False):
        cands.append((r.measured_idle_s - r.simulated_idle_s, f"rank {r.rank} idle", r.measured_idle_s,
                      r.simulated_idle_s))
        cands.append((r.measured_exposed_comm_s - r.simulated_exposed_comm_s, f"rank {r.rank} exposed comm",
                      r.measured_exposed_comm_s, r.simulated_exposed_comm_s))
    out = []
    for diff, what, meas, sim in sorted(cands, key=lambda c: -abs(c[0]))[:top]:
        if diff == 0:
            break
        how = (f"{meas / sim:.2f}x the plan" if sim > 0 else "not in the plan's time") if diff > 0 else \
            (f"{sim / meas:.2f}x faster than planned" if meas > 0 else "took no measured time")
        out.append(f"{what}: measured {meas * 1e3:.3f} ms, simulated {sim * 1e3:.3f} ms "
                   f"({'+' if diff > 0 else '-'}{abs(diff) * 1e3:.3f} ms, {how})")
    return out
