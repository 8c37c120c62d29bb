"""Why a plan's step takes what it takes, and why one plan beats another.

`explain(result)` splits a simulated step (`piper_sim.simulator.SimResult`) into terms that
add up to ``step_time_s``: compute by kind (forward, backward, backward input / weight),
recompute, optimizer, the exposed communication of each stream (the time a comm op is in
flight while the rank computes nothing: pipeline send/recv, data-parallel / ZeRO,
expert all-to-all, tensor- and context-parallel collectives) and the rest, bubble/idle
(nothing runs: waiting on a pipeline peer, on a dependency, or done early).

How one rank's step is split: the step [0, step_time_s] is cut at every op start and end;
a piece where compute ops run goes to them (shared equally when two overlap, as DualPipe's
F&B pairs); a piece with no compute but comm in flight goes to the in-flight comm ops'
streams (shared equally); a piece with neither is bubble/idle. The terms therefore sum to
the step exactly. The default breakdown is the mean over every GPU (each simulated rank
weighted by the ranks it stands for, `RankStats.represents`); ``rank=`` gives one rank's.

Recompute: the plan prices the re-run forward inside its backward op (``Instruction.recompute``,
its ``flops`` include the re-run). The recompute term is that op's time times the re-run's
share of its flops (`rerun_flops`): under plain full recompute the re-run is the matching
forward's flops (exact, `piper_sim.ir._compute`); under selective and the other policies the
plan keeps no split, so the re-run is estimated as the backward's flops beyond twice its
forward's (the usual backward = 2 x forward), at most one forward; ``recompute_estimated``
says so.

`compare(a, b)` gives the terms that decide the ranking: every term's difference in seconds
(they add up to the step difference), and the few largest that carry its sign, in words.
`plot_breakdowns` draws one stacked bar per plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from costmodel.memory import GiB as GIB
from piper_sim.plan import COMPUTE_KINDS, INPUT_GRAD_KINDS, P2P_KINDS, Plan

__all__ = ["Comparison", "StepBreakdown", "compare", "explain", "plot_breakdowns", "rerun_flops"]

IDLE = "idle"
RECOMPUTE = "recompute"
P2P = "comm:pp"
# the compute terms, in print order (a kind of `COMPUTE_KINDS`, or RECOMPUTE)
COMPUTE_WORDS = {"F": "forward compute", "B": "backward compute", "BI": "backward-input compute",
                 "BW": "backward-weight compute", RECOMPUTE: "recompute (re-run forward)", "OPT": "optimizer step"}
TERM_COLORS = {"F": "#f6b26b", "B": "#6fa8dc", "BI": "#9fc5e8", "BW": "#93c47d", RECOMPUTE: "#ffd966",
               "OPT": "#999999", P2P: "#e06666", IDLE: "#eeeeee"}
COMM_COLORS = ("#8e7cc3", "#c27ba0", "#76a5af", "#b4a7d6", "#a64d79", "#45818e")


def _stream_words() -> dict[str, str]:
    """Words for a comm stream: the compiler's default streams (`piper_sim.directives`) and the
    techniques' own (`piper_sim.axes.STREAM_WORDS`)."""
    from piper_sim.axes import STREAM_WORDS
    from piper_sim.directives import DEFAULT_STREAMS

    words = {DEFAULT_STREAMS["ALLREDUCE"]: "data-parallel", DEFAULT_STREAMS["ALL_TO_ALL"]: "expert all-to-all"}
    return {**words, **STREAM_WORDS}


def comm_term(kind: str, stream: str) -> str:
    """The term of a comm op: ``comm:pp`` for pipeline send/recv (by kind), else ``comm:<stream>``."""
    return P2P if kind in P2P_KINDS else f"comm:{stream}"


def term_words(term: str) -> str:
    """A term in words: "forward compute", "exposed data-parallel communication", "bubble/idle"."""
    if term in COMPUTE_WORDS:
        return COMPUTE_WORDS[term]
    if term == IDLE:
        return "bubble/idle"
    if term == P2P:
        return "exposed pipeline send/recv"
    stream = term.split(":", 1)[1]
    return f"exposed {_stream_words().get(stream, repr(stream) + ' stream')} communication"


def term_order(terms: Iterable[str]) -> list[str]:
    """Compute terms first (`COMPUTE_WORDS` order), then pipeline p2p, other comm by name, idle last."""
    compute = list(COMPUTE_WORDS)

    def key(t: str) -> tuple:
        if t in compute:
            return 0, compute.index(t), t
        return (1 if t == P2P else 2 if t.startswith("comm:") else 3), 0, t
    return sorted(set(terms), key=key)


def fmt_time(seconds: float, unit: str = "s") -> str:
    """``0.41 s``, ``12.3 ms``, ``45.6 µs`` (or ``3 units`` for a unit cost model)."""
    if unit == "units":
        return f"{seconds:.3g} units"
    for scale, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {name}"
    return f"{seconds / 1e-9:.3g} ns"


# ----------------------------------------------------------------------------- recompute


def rerun_flops(plan: Plan) -> tuple[dict[tuple[int, str], float], bool]:
    """((pipeline rank, op id) -> the re-run forward's flops of each backward op that
    recomputes, whether any is an estimate): see the module docstring, exact under plain full
    recompute. Empty for a plan without recompute."""
    if not plan.meta.get("recompute"):
        return {}, False
    estimated = False
    modes = plan.meta.get("recompute") or {}
    policies = plan.meta.get("recompute_policy") or {}
    out: dict[tuple[int, str], float] = {}
    for cls in plan.classes:
        fwd: dict[tuple[int, int, int], float] = {}
        backs = []
        for ins in cls.instructions():
            if ins.kind == "F":
                fwd[(ins.stage, ins.mb, ins.part)] = ins.flops
            elif ins.kind in INPUT_GRAD_KINDS and ins.recompute:
                backs.append(ins)
        for ins in backs:
            f = fwd.get((ins.stage, ins.mb, ins.part), 0.0)
            exact = modes.get(str(ins.stage)) == "full" and str(ins.stage) not in policies
            base = f * (2.0 if ins.kind == "B" else 1.0)  # backward ~ 2x forward; its input half ~ 1x
            out[(cls.pp_rank, ins.id)] = f if exact else min(f, max(0.0, ins.flops - base))
            estimated = estimated or not exact
    return out, estimated


# ----------------------------------------------------------------------------- breakdown


@dataclass
class StepBreakdown:
    """Where one simulated step goes: ``terms`` (term -> seconds, `term_words` names them) add
    up to ``step_time_s``. ``rank``: the rank split, or None for the mean over every GPU."""

    name: str
    step_time_s: float
    terms: dict[str, float]
    rank: int | None = None
    world_size: int = 0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    peak_memory_gib: float = 0.0  # the worst rank's device memory at the peak (reserved + runtime), GiB
    recompute_estimated: bool = False
    time_unit: str = "s"

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.world_size if self.world_size else 0.0

    @property
    def total_s(self) -> float:
        return sum(self.terms.values())

    def get(self, term: str) -> float:
        return self.terms.get(term, 0.0)

    def rows(self) -> list[tuple[str, float, float]]:
        """(words, seconds, share of the step) per term, in `term_order`."""
        step = self.step_time_s or 1.0
        return [(term_words(t), self.terms[t], self.terms[t] / step) for t in term_order(self.terms)]

    def __str__(self) -> str:
        from piper_sim.trace import time_scale

        u = self.time_unit
        factor, label = time_scale(self.step_time_s, "units" if u == "units" else None)
        tu = "units" if u == "units" else label[len("time ("):-1]
        who = "mean over all GPUs" if self.rank is None else f"rank {self.rank}"
        per = "unit" if u == "units" else u
        head = (f"{self.name}: step {fmt_time(self.step_time_s, u)}, {self.tokens_per_s:,.0f} tok/{per} "
                f"({self.tokens_per_s_per_gpu:,.0f} tok/{per}/GPU on {self.world_size}), MFU {self.mfu:.1%}, "
                f"peak memory {self.peak_memory_gib:.2f} GiB; where the step goes ({who}):")
        lines = [head] + [f"  {w:<42} {s * factor:>10.4g} {tu:<5} {p:>6.1%}" for w, s, p in self.rows()]
        if self.recompute_estimated:
            lines.append("  (recompute estimated: the backward's flops beyond 2x its forward's (1x for BI); "
                         "the plan keeps no split for this policy)")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "step_time_s": self.step_time_s, "rank": self.rank, "terms": dict(self.terms),
                "words": {t: term_words(t) for t in self.terms}, "world_size": self.world_size,
                "tokens_per_s": self.tokens_per_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "mfu": self.mfu, "peak_memory_gib": self.peak_memory_gib,
                "recompute_estimated": self.recompute_estimated}


def rank_terms(rows: Sequence[tuple], step: float, rerun: dict[str, float],
               holding: frozenset[str] = frozenset()) -> dict[str, float]:
    """One rank's terms (seconds, summing to ``step``) from its event rows (`EVENT_COLUMNS`
    order: rank, stream, op_id, kind, stage, mb, start, end, bytes, flops, ...) and its
    backward ops' re-run flops (op id -> flops). A ``holding`` op (`Instruction.holds`, by id)
    pauses the compute it runs beside: its time is exposed communication."""
    marks: list[tuple[float, int, int]] = []  # (time, 0 end / 1 start, row index)
    share: list[tuple[tuple[str, float], ...]] = []  # per row: its (term, fraction) pairs
    compute: list[bool] = []
    holds = [row[2] in holding for row in rows] if holding else []  # per row: pauses the compute beside it
    for i, row in enumerate(rows):
        kind, start, end = row[3], max(0.0, row[6]), min(step, row[7])
        if kind in COMPUTE_KINDS:
            flops, again = row[9], rerun.get(row[2], 0.0)
            r = min(1.0, again / flops) if flops > 0 and again > 0 else 0.0
            share.append(((kind, 1.0 - r), (RECOMPUTE, r)) if r else ((kind, 1.0),))
            compute.append(True)
        else:
            share.append(((comm_term(kind, row[1]), 1.0),))
            compute.append(False)
        if end > start:
            marks += [(start, 1, i), (end, 0, i)]
    marks.sort()
    terms: dict[str, float] = {}
    active_c: dict[int, None] = {}
    active_m: dict[int, None] = {}
    t = 0.0
    for when, start, i in marks + [(step, -1, -1)]:
        dt = when - t
        if dt > 0:
            held = [j for j in active_m if holds[j]] if holding else []
            active = held or active_c or active_m
            if not active:
                terms[IDLE] = terms.get(IDLE, 0.0) + dt
            else:
                each = dt / len(active)
                for j in active:
                    for term, frac in share[j]:
                        terms[term] = terms.get(term, 0.0) + each * frac
            t = when
        if i < 0:
            break
        target = active_c if compute[i] else active_m
        if start:
            target[i] = None
        else:
            target.pop(i, None)
    terms.setdefault(IDLE, 0.0)
    return {k: v for k, v in terms.items() if v != 0.0 or k == IDLE}


def explain(result: Any, name: str = "", rank: int | None = None) -> StepBreakdown:
    """The `StepBreakdown` of a simulated step (a `piper_sim.simulator.SimResult`; not imported
    here: the simulator imports this module): the mean over every GPU, or ``rank``'s (one of
    the simulated ranks, `SimResult.rank_stats`)."""
    step = result.step_time_s
    stats = {s.rank: s for s in result.rank_stats}
    if rank is not None and rank not in stats:
        raise ValueError(f"rank {rank} is not a simulated rank of this result (simulated: "
                         f"{', '.join(map(str, sorted(stats)))}; a folded simulation runs one rank per class)")
    by_rank: dict[int, list[tuple]] = {r: [] for r in stats}
    for row in result.rows:
        by_rank.setdefault(row[0], []).append(row)
    plan = getattr(result, "plan", None)  # the re-run flops of its recomputing backwards, from the plan
    rerun, rerun_estimated = rerun_flops(plan) if plan is not None else ({}, False)
    per_pp: dict[int, dict[str, float]] = {}
    for (pp, op), flops in rerun.items():
        per_pp.setdefault(pp, {})[op] = flops
    holding = {c.pp_rank: frozenset(i.id for i in c.instructions() if i.holds) for c in plan.classes} \
        if plan is not None else {}
    ranks = [rank] if rank is not None else list(stats)
    total: dict[str, float] = {}
    weight = 0
    for r in ranks:
        w = 1 if rank is not None else stats[r].represents
        pp = stats[r].pp_rank
        for term, s in rank_terms(by_rank[r], step, per_pp.get(pp, {}), holding.get(pp, frozenset())).items():
            total[term] = total.get(term, 0.0) + w * s
        weight += w
    terms = {t: s / weight for t, s in total.items()} if weight else {IDLE: step}
    peak = max((s.device_bytes or s.peak_memory_bytes for s in result.rank_stats), default=0.0)
    return StepBreakdown(name=name or str(result.meta.get("name") or result.meta.get("model") or "plan"),
                         step_time_s=step, terms=terms, rank=rank, world_size=result.world_size,
                         tokens_per_s=result.tokens_per_s, mfu=result.mfu, peak_memory_gib=peak / GIB,
                         recompute_estimated=rerun_estimated,
                         time_unit="units" if result.time_unit == "units" else "s")


# ----------------------------------------------------------------------------- compare


@dataclass
class Comparison:
    """Plan ``b`` against plan ``a``: ``diffs`` (term -> b's seconds minus a's, largest first)
    add up to the step difference; ``deciding``: the few largest that carry its sign."""

    a: StepBreakdown
    b: StepBreakdown
    diffs: list[tuple[str, float]] = field(default_factory=list)
    deciding: list[tuple[str, float]] = field(default_factory=list)

    @property
    def step_diff_s(self) -> float:
        return self.b.step_time_s - self.a.step_time_s

    def sentences(self) -> list[str]:
        """The deciding terms in words, those that make ``b`` slower (faster) first, then those
        that pull the other way: "0.41 s more in exposed data-parallel communication"."""
        u, sign = self.a.time_unit, 1.0 if self.step_diff_s >= 0 else -1.0
        ordered = [x for x in self.deciding if x[1] * sign > 0] + [x for x in self.deciding if x[1] * sign <= 0]
        return [f"{fmt_time(abs(d), u)} {'more' if d > 0 else 'less'} in {term_words(t)}" for t, d in ordered]

    def __str__(self) -> str:
        d, u = self.step_diff_s, self.a.time_unit
        if d == 0:
            return f"{self.b.name} takes the same step time as {self.a.name}"
        rel = d / self.a.step_time_s if self.a.step_time_s else 0.0
        words = self.sentences()
        n = sum(1 for _, x in self.deciding if x * d > 0)
        out = (f"{self.b.name} is {fmt_time(abs(d), u)} {'slower' if d > 0 else 'faster'} per step than "
               f"{self.a.name} ({rel:+.{1 if abs(rel) >= 0.01 else 2}%}): it spends {_and(words[:n])}")
        if words[n:]:
            out += f", which outweighs {_and(words[n:])}"
        mem = self.b.peak_memory_gib - self.a.peak_memory_gib
        if abs(mem) >= 0.05:
            out += f"; it needs {abs(mem):.1f} GiB {'more' if mem > 0 else 'less'} memory per GPU at the peak"
        return out

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a.name, "b": self.b.name, "step_diff_s": self.step_diff_s,
                "diffs": {t: d for t, d in self.diffs}, "deciding": [
                    {"term": t, "seconds": d, "words": term_words(t)} for t, d in self.deciding]}


def _and(words: list[str]) -> str:
    return ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else (words[0] if words else "")


def coarse(terms: dict[str, float]) -> dict[str, float]:
    """The terms with backward input and weight (``BI``, ``BW``) folded into backward (``B``):
    plans with and without a split backward compare on their backward compute."""
    out: dict[str, float] = {}
    for t, s in terms.items():
        key = "B" if t in ("BI", "BW") else t
        out[key] = out.get(key, 0.0) + s
    return out


def compare(a: StepBreakdown, b: StepBreakdown, top: int = 3, floor: float = 0.1) -> Comparison:
    """``b`` against ``a``, on their `coarse` terms. The deciding terms: the largest differences
    (at most ``top``, each at least ``floor`` of the largest), extended by the largest of the
    step difference's sign until their sum has that sign, so they explain why the faster plan
    is faster."""
    ta, tb = coarse(a.terms), coarse(b.terms)
    diffs = sorted(((t, tb.get(t, 0.0) - ta.get(t, 0.0)) for t in term_order([*ta, *tb])),
                   key=lambda x: -abs(x[1]))
    diffs = [(t, d) for t, d in diffs if d != 0.0]
    total = b.step_time_s - a.step_time_s
    big = abs(diffs[0][1]) if diffs else 0.0
    deciding = [(t, d) for t, d in diffs[:top] if abs(d) >= floor * big]
    sign = 1.0 if total > 0 else -1.0
    for t, d in diffs:
        if total == 0 or sum(x for _, x in deciding) * sign > 0:
            break
        if d * sign > 0 and (t, d) not in deciding:
            deciding.append((t, d))
    return Comparison(a=a, b=b, diffs=diffs, deciding=deciding)


# ----------------------------------------------------------------------------- figure


def plot_breakdowns(breakdowns: Sequence[StepBreakdown], path: str | None = None, title: str = "", *,
                    ax: Any = None) -> Any:
    """One stacked bar per plan: its step split into terms (seconds). Returns the Figure;
    writes ``path`` when given (atomically); draws into ``ax`` when given."""
    from piper_sim.trace import new_figure, save_figure

    own = ax is None
    fig, ax = new_figure(ax, figsize=(max(5.0, 1.6 * len(breakdowns) + 3.0), 4.5))
    terms = term_order(t for b in breakdowns for t in b.terms)
    comm = [t for t in terms if t not in TERM_COLORS]
    x = list(range(len(breakdowns)))
    bottom = [0.0] * len(breakdowns)
    for t in terms:
        h = [b.get(t) for b in breakdowns]
        color = TERM_COLORS.get(t) or COMM_COLORS[comm.index(t) % len(COMM_COLORS)]
        ax.bar(x, h, bottom=bottom, color=color, edgecolor="#555555", linewidth=0.4, label=term_words(t))
        bottom = [y + v for y, v in zip(bottom, h)]
    ax.set_xticks(x)
    ax.set_xticklabels([b.name for b in breakdowns], fontsize=7, rotation=15 if len(breakdowns) > 2 else 0)
    unit = breakdowns[0].time_unit if breakdowns else "s"
    ax.set(ylabel=f"step time ({unit})", title=title or "where the step goes (mean over GPUs)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if own:
        fig.tight_layout()
    save_figure(fig, path, dpi=120)
    return fig
