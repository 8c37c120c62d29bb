"""Strategy explorer: enumerate valid strategies, simulate each, rank them.

The search: pipeline degree, schedule, micro-batches, DP and ZeRO level, EP degree, full
recompute, tensor parallelism T over the divisors of the GPUs per node that shard the
model (with sequence parallelism when T > 1), and for long sequences (``CP_MIN_SEQ``) context
parallelism C with C × T dividing the GPUs per node. World size = PP × DP × CP × TP.

Two prunes, both exact (they never drop a strategy that would have won):
- memory: a plan whose static memory (params + grads + optimizer state) plus the
  activations its schedule keeps alive on a rank (what each F keeps for its backward,
  ``piper_sim.memory`` by recompute mode, summed along the rank's compute order, as the
  compiler allocates and frees them) exceeds the GPU's memory is out of memory (the
  simulated peak holds at least that much; `Screener`);
- time: a plan's step time is at least its busiest rank's compute time. Candidates are
  simulated in order of that lower bound, and once it reaches the best simulated step
  time the rest cannot win and are skipped.
Candidates are compiled and simulated in worker processes (all cores), or on Ray when
``use_ray`` and Ray is installed (same results).
"""

from __future__ import annotations

import csv
import functools
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable

from costmodel.dtypes import DTYPE_BYTES
from costmodel.hardware import parse_cluster
from costmodel.memory import DEFAULT_HEADROOM_BYTES, fits, memory_need
from costmodel.model import get_costmodel
from costmodel.stragglers import check_slow_ranks
from costmodel.stack import DEFAULT as DEFAULT_STACK, Stack, check_stack_on, parse_stack, stack_to_strategy
from costmodel.training_run import RANK_BY, RunOptions as TrainingRunOptions, TrainingRun
from piper_sim.bands import Band
from piper_sim.checks import MAX_EXPLORE_CANDIDATES, check_world_size, integer
from piper_sim.configs import tp_divisibility_error, tp_shard
from piper_sim.axes import cp_error, cp_memory, cp_segments, explore_options, held_after, static_memory
from piper_sim.plan import gc_paused
from piper_sim.schedules import (SCHEDULE_TABLE, SCHEDULES, ScheduleError, canonical_schedule, known_names,
                                 guess, stages_per_rank)
from piper_sim.sources import resolve_model
from piper_sim.strategy import StrategyError
from piper_sim.trace import save_figure

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    pp: int
    schedule: str
    microbatches: int
    dp: int
    zero: int
    ep: int = 1
    recompute: bool = False
    tp: int = 1
    sp: bool = False
    cp: int = 1
    # settings a registered technique adds to a directive (`piper_sim.axes.explore_options`):
    # (directive op, field, value), e.g. ("data_parallel", "shard_degree", 8) for HSDP
    options: tuple[tuple[str, str, Any], ...] = ()

    @property
    def v(self) -> int:
        return SCHEDULE_TABLE[self.schedule].stages_per_rank if self.pp > 1 else 1

    def strategy(self, model: str, cluster: str, global_batch: int, seq_len: int,
                 stack: Stack = DEFAULT_STACK) -> dict[str, Any]:
        pipe: dict[str, Any] = {"op": "pipeline", "degree": self.pp, "stages_per_rank": self.v}
        if self.pp > 1:
            pipe["layers_per_stage"] = "balanced"
        d: list[dict[str, Any]] = [pipe,
                                   {"op": "schedule", "name": self.schedule}]
        if self.dp > 1:
            d.append({"op": "data_parallel", "degree": self.dp, "zero": self.zero})
        if self.ep > 1:
            d.append({"op": "expert_parallel", "degree": self.ep})
        if self.tp > 1:
            d.append({"op": "tensor_parallel", "degree": self.tp, "sequence_parallel": self.sp})
        if self.cp > 1:
            d.append({"op": "context_parallel", "degree": self.cp})
        if self.recompute:
            d.append({"op": "recompute"})
        for op, key, value in self.options:
            next(x for x in d if x["op"] == op)[key] = value
        out = {"model": model, "cluster": cluster, "global_batch": global_batch, "seq_len": seq_len,
               "microbatches": self.microbatches, "directives": d}
        if stack != DEFAULT_STACK:
            out["stack"] = stack_to_strategy(stack)
        return out

    def short(self) -> str:
        """``pp4 1f1b m16 dp2 z1 ep2 tp2 sp rc``; no pipeline (pp1) has no schedule: ``pp1 - m8 ...``."""
        s = f"pp{self.pp} {self.schedule if self.pp > 1 else '-'} m{self.microbatches} dp{self.dp} z{self.zero}"
        if self.ep > 1:
            s += f" ep{self.ep}"
        if self.tp > 1:
            s += f" tp{self.tp}" + (" sp" if self.sp else "")
        if self.cp > 1:
            s += f" cp{self.cp}"
        s += "".join(f" {key}={value}" for _, key, value in self.options)
        return s + (" rc" if self.recompute else "")


@dataclass
class Row:
    candidate: Candidate
    status: str  # ok | tight (may run out of memory: costmodel.memory.memory_verdict) | oom | invalid | pruned | simulate-only (a back end would refuse it: explore refusal=)
    step_time_s: float = float("nan")
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    bubble_fraction: float = float("nan")
    peak_memory_bytes: float = 0.0
    lower_bound_s: float = 0.0
    reason: str = ""
    band: Band | None = None  # the 80% band of step_time_s (piper_sim.bands)
    device_memory_bytes: float = 0.0  # what the device holds at the peak: reserved + runtime (simulator)
    cluster: str = ""  # the cluster spec it ran on
    state_bytes: float = 0.0  # the most model-state bytes (params + optimizer) one rank holds
    run: TrainingRun | None = None  # time to train, goodput, $ and kWh (`add_training_runs`)
    # the share of bubble_fraction that is exposed communication (mean over ranks, `RankStats.comm_exposed_s`);
    # the rest, idle_fraction, is the pipeline bubble and other waits
    comm_fraction: float = float("nan")
    world_size: int = 0  # GPUs of the plan

    @property
    def idle_fraction(self) -> float:
        """bubble_fraction less the exposed communication: time no op runs (the pipeline bubble);
        bubble_fraction when the split is unknown."""
        if self.comm_fraction != self.comm_fraction:  # nan: not simulated here
            return self.bubble_fraction
        return max(0.0, self.bubble_fraction - self.comm_fraction)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.world_size if self.world_size else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["candidate"] = asdict(self.candidate)
        d["strategy"] = self.candidate.short()
        d["band"] = None if self.band is None else self.band.to_json()
        d["run"] = None if self.run is None else self.run.to_json()
        d["tokens_per_s_per_gpu"] = self.tokens_per_s_per_gpu
        return d


_RANKED = {"ok": 0, "tight": 1}  # simulated rows that may run, in the order they are ranked


def _rank_key(r: Row, by: str = "tokens_per_s") -> tuple:
    """Fitting plans first, then tight ones, then the rest; each by step time (``tokens_per_s``:
    every candidate trains the same tokens per step), or by its run's wall time, cost ($, else
    GPU-hours: the same order at one price) or kWh."""
    metric = r.step_time_s
    if by != "tokens_per_s" and r.run is not None:
        metric = {"time_to_train": r.run.wall_s, "energy": r.run.kwh,
                  "cost": r.run.gpu_hours if r.run.cost is None else r.run.cost}[by]
    return _RANKED.get(r.status, len(_RANKED)), metric


@dataclass
class ExploreResult:
    rows: list[Row]
    settings: dict[str, Any]
    wall_s: float
    counts: dict[str, int] = field(default_factory=dict)
    rank_by: str = "tokens_per_s"  # RANK_BY

    def key(self, r: Row) -> tuple:
        return _rank_key(r, self.rank_by)

    @property
    def ok(self) -> list[Row]:
        """The simulated plans that may run, best first (fastest, or by ``rank_by``): those that
        fit with the memory headroom, then the ``tight`` ones."""
        return sorted((r for r in self.rows if r.status in _RANKED), key=self.key)

    @property
    def best(self) -> Row | None:
        """The fastest plan that fits with the memory headroom (never a ``tight`` one), or None."""
        ok = self.ok
        return ok[0] if ok and ok[0].status == "ok" else None

    def best_strategy(self) -> dict[str, Any]:
        s = self.settings
        return self.best.candidate.strategy(s["model"], self.best.cluster or s["cluster"], s["global_batch"], s["seq_len"],
                                            s.get("stack", DEFAULT_STACK))

    @property
    def table(self) -> "pd.DataFrame":
        """Every candidate as a DataFrame row, best first (simulated ones by step time, then
        the rest): ``strategy`` (short name), ``status`` (ok | tight | oom | invalid | pruned | simulate-only), the
        simulated numbers, ``reason``, and the candidate's fields (pp, schedule, ...)."""
        import pandas as pd

        rows = sorted(self.rows, key=self.key)
        cols = ["strategy", "status", "step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "bubble_fraction",
                "comm_fraction", "peak_memory_bytes", "lower_bound_s", "reason", "cluster"] + [f.name for f in fields(Candidate)]
        return pd.DataFrame([{**{k: v for k, v in r.to_json().items() if k != "candidate"},
                              **asdict(r.candidate)} for r in rows], columns=cols)


CP_MIN_SEQ = 16384  # context parallelism is searched from this sequence length on (or when given)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_candidates(model: str, cluster: str, global_batch: int, seq_len: int,
                         schedules: Iterable[str] | None = None, zero_levels: Iterable[int] = (0, 1, 2, 3),
                         recompute: Iterable[bool] = (False, True), max_microbatches: int = 64,
                         microbatch_factors: Iterable[int] = (2, 4), microbatch_counts: Iterable[int] = (),
                         tp_degrees: Iterable[int] | None = None,
                         cp_degrees: Iterable[int] | None = None) -> list[Candidate]:
    """Every strategy the compiler accepts for this model, cluster and batch.

    Micro-batch counts: 1, 2, 4 without a pipeline, else ``microbatch_factors`` × PP, plus
    any of ``microbatch_counts``. Tensor parallel: ``tp_degrees`` (default: the divisors of
    the GPUs per node), those that divide the model's heads, KV heads and MLP widths (and
    the sequence: sequence parallelism is on whenever T > 1). Context parallel: ``cp_degrees``
    (default: from ``CP_MIN_SEQ`` tokens on, the divisors of GPUs per node / T; else 1), those
    that split the sequence into 2C chunks (`parallel.context.cp_error`)."""
    cfg = resolve_model(model)
    cl = parse_cluster(cluster)
    check_world_size(cl.world_size, f"explore cluster {cluster}", StrategyError)
    for name, degrees in (("tp_degrees", tp_degrees), ("cp_degrees", cp_degrees)):
        for d in degrees or ():
            integer(d, f"explore {name}", error=StrategyError)
    schedules = [canonical_schedule(x) for x in (schedules or SCHEDULES)]
    unknown = [x for x in schedules if x not in SCHEDULE_TABLE]
    if unknown:
        raise StrategyError(f"explore: unknown schedule(s) {', '.join(map(repr, unknown))}{guess(unknown[0])}; "
                            f"choose from {known_names()}")
    tps = _divisors(cl.gpus_per_node) if tp_degrees is None else sorted(set(tp_degrees))
    tps = [t for t in tps if t == 1 or (cl.world_size % t == 0 and not tp_divisibility_error(cfg, t)
                                        and seq_len % t == 0)]
    out = []
    for tp in tps:
        if cp_degrees is not None:
            cps = sorted(set(cp_degrees))
        else:
            cps = _divisors(cl.gpus_per_node // tp) if seq_len >= CP_MIN_SEQ and cl.gpus_per_node % tp == 0 else [1]
        cps = [c for c in cps if c == 1 or (cl.world_size % (c * tp) == 0 and not cp_error(cfg, seq_len, c, tp, tp > 1))]
        for cp in cps:
            out += _enumerate(cfg, cl.world_size // (tp * cp), tp, global_batch, schedules, zero_levels, recompute,
                              max_microbatches, microbatch_factors, microbatch_counts, cp, cl.gpus_per_node)
    return out


def _enumerate(cfg, world: int, tp: int, global_batch: int, schedules: list[str], zero_levels: Iterable[int],
               recompute: Iterable[bool], max_microbatches: int, microbatch_factors: Iterable[int],
               microbatch_counts: Iterable[int], cp: int = 1, gpus_per_node: int = 8) -> list[Candidate]:
    """Candidates with tensor-parallel degree ``tp`` and context-parallel degree ``cp`` on
    ``world`` = PP × DP ranks."""
    out = []
    for pp in _divisors(world):
        dp = world // pp
        if global_batch % dp:
            continue
        for sched in (schedules if pp > 1 else ["1f1b"]):
            entry = SCHEDULE_TABLE[sched]
            v = entry.stages_per_rank if pp > 1 else 1
            if pp * v > cfg.n_layers:
                continue
            per_replica = global_batch // dp
            options = [1, 2, 4] if pp == 1 else sorted({k * pp for k in microbatch_factors} | set(microbatch_counts))
            for m in options:
                if m > max_microbatches or per_replica % m:
                    continue
                if pp > 1 and (m < entry.explore_min_mb * pp or not _schedule_ok(sched, pp, m, v)):
                    continue
                eps = [e for e in _divisors(dp) if cfg.is_moe and cfg.n_experts % e == 0] or [1]
                copies = entry.copies
                for ep in eps:
                    if entry.needs_ep and ep == 1:  # combined_1f1b overlaps expert all-to-alls
                        continue
                    for zero in (zero_levels if dp * cp * copies > 1 else [0]):
                        for rc in (r for r in recompute if not (entry.needs_ep and r)):
                            base = Candidate(pp, sched, m, dp, zero, ep, rc, tp, tp > 1, cp)
                            out += [base] + [replace(base, options=o) for o in explore_options(base, gpus_per_node)]
    return out


def _schedule_ok(name: str, pp: int, m: int, v: int) -> bool:
    """The schedule's own checks accept (pp, m, v)."""
    try:
        stages_per_rank(name, pp, m, v)
    except ScheduleError:
        return False
    return True


@functools.lru_cache(maxsize=256)
def _schedule(name: str, pp: int, m: int, v: int):
    from piper_sim.schedules import build_schedule

    return build_schedule(name, pp, m, stages_per_rank=v)


class Screener:
    """Exact bounds of candidates without compiling them, from the compiler's own accounting.

    Memory: a rank's model states (`parallel.data.static_memory`) plus the most activation memory
    its compute stream is sure to hold (`_activation_peaks`): walking the schedule's order for the
    rank, F adds what the stage keeps for its backward (`memory.SegmentMemory.kept` under the
    recompute mode), B frees it, BI and BW free their shares (the re-run forward under full
    recompute) — each action's net bytes are `parallel.memory.held_after`, the rule
    `parallel.memory.activation_memory_pass` sets its ``alloc``/``free`` by (the screen has no
    memory formula of its own; tests/test_explore.py checks the two agree on every candidate). Compute ops run in that order and everything else a plan allocates
    (temporaries, buffers, gathered parameters, gradient buckets) only adds, so the
    simulated peak is at least this; it is judged as the simulator judges it, as the device
    would hold it (`costmodel.memory.memory_need`, with no communicators counted). Time: the busiest rank's forward+backward kernels as
    the simulator prices them (or their flops at the cost model's best efficiency). Under
    tensor parallelism both are a rank's share: the segments are profiled on its shard
    (`models.tp_shard`), as the compiler does; under context parallelism on its ``seq_len / C``
    tokens (`parallel.context.cp_segments`). Profiles, stage cuts and per-stage numbers
    are computed once per (TP, micro-batch size, stages) and shared by the candidates."""

    def __init__(self, settings: dict[str, Any], cm: Any) -> None:
        self.settings, self.cm = settings, cm
        self.cfg = resolve_model(settings["model"])
        self.dtype = settings.get("dtype", "bf16")
        self.stack = settings.get("stack", DEFAULT_STACK)
        self.gpu = parse_cluster(settings["cluster"]).gpu
        self._profiles: dict[tuple, tuple] = {}
        self._stages: dict[tuple, list] = {}
        self._per_stage: dict[tuple, tuple[float, ...]] = {}
        self._act_peaks: dict[tuple, list[float]] = {}
        self._prices: dict[int, tuple] = {}
        self._mb_counts: dict[tuple, dict[tuple[int, int], int]] = {}
        self._spec_slots: dict[tuple, list] = {}
        self._statics: dict[tuple, float] = {}

    def _profile(self, tp: int, sp: bool, mbs: int, cp: int) -> tuple:
        """A rank's share, as the compiler profiles it: its TP shard, its ``seq_len / cp`` tokens."""
        key = (tp, sp, mbs, cp)
        if key not in self._profiles:
            from piper_sim.memory import model_memory
            from piper_sim.profiling import profile_model

            shard = tp_shard(self.cfg, tp, sp)
            seq = self.settings["seq_len"] // cp
            segments = cp_segments(profile_model(shard, mbs, seq, self.dtype, self.stack, self.gpu.family), cp)
            self._profiles[key] = (segments, cp_memory(model_memory(shard, segments, mbs, seq, self.dtype, self.stack),
                                                       cp))
        return self._profiles[key]

    def _stage_costs(self, tp: int, sp: bool, mbs: int, num_stages: int, balanced: bool, cp: int) -> list:
        key = (tp, sp, mbs, num_stages, balanced, cp)
        if key not in self._stages:
            from piper_sim.compiler import stage_costs

            segments, _ = self._profile(tp, sp, mbs, cp)
            self._stages[key] = stage_costs(self.cfg, segments, num_stages, "balanced" if balanced else None,
                                            self.gpu)
        return self._stages[key]

    def _stage_numbers(self, cand: Candidate, mbs: int, num_stages: int, stage: int) -> tuple[float, ...]:
        """Of one micro-batch of a stage: (kept bytes, re-run bytes under full recompute, F+B
        seconds, transient bytes of its last segment, bytes its backward recomputes there)."""
        key = (cand.tp, cand.sp, cand.cp, mbs, num_stages, cand.pp > 1, stage, cand.recompute, cand.ep)
        if key not in self._per_stage:
            _, mems = self._profile(cand.tp, cand.sp, mbs, cand.cp)
            segs = self._stage_costs(cand.tp, cand.sp, mbs, num_stages, cand.pp > 1, cand.cp)[stage].segments
            mode = "full" if cand.recompute else "none"
            kept = sum(mems[x.name].kept(mode, cand.ep > 1) for x in segs)
            rerun = sum(mems[x.name].saved for x in segs if mems[x.name].recomputed) if cand.recompute else 0.0
            last = mems[segs[-1].name]
            self._per_stage[key] = (kept, rerun, _compute_lower_bound(self.cm, segs, cand.recompute, cand.ep,
                                                                      self._prices),
                                    last.temp, last.saved if cand.recompute and last.recomputed else 0.0)
        return self._per_stage[key]

    def _activation_peaks(self, cand: Candidate, spec: Any, mbs: int) -> list[float]:
        """Per pipeline rank, the most activation memory its compute stream is sure to hold:
        between two slots (every earlier op ended), and as a lone action's last piece starts
        (F: its stage's kept bytes all taken, plus the transient of its last segment) or its
        first backward piece starts (the last segment's transient and, under full recompute,
        its re-run activations; the backward runs the pieces last first)."""
        key = (cand.schedule, cand.pp, cand.microbatches, cand.v, cand.tp, cand.sp, cand.cp, mbs, cand.recompute,
               cand.ep)
        if key not in self._act_peaks:
            delta: dict[tuple[int, str], float] = {}
            during: dict[tuple[int, str], float] = {}
            for s in range(spec.num_stages):
                kept, rerun, _, temp, work = self._stage_numbers(cand, mbs, spec.num_stages, s)
                for k, kind in (("F", "F"), ("B", "B"), ("I", "BI"), ("W", "BW")):
                    delta[s, k] = held_after(kind, kept, rerun)
                during[s, "F"], during[s, "W"] = kept + temp, 0.0
                during[s, "B"] = during[s, "I"] = work + temp
            peaks = []
            for order in self._slots(cand, spec):
                live = peak = 0.0
                for lone, keys in order:
                    if lone:  # an overlapped pair interleaves its pieces: only its end is sure
                        if live + during[keys[0]] > peak:
                            peak = live + during[keys[0]]
                    for k in keys:
                        live += delta[k]
                    if live > peak:
                        peak = live
                peaks.append(peak)
            self._act_peaks[key] = peaks
        return self._act_peaks[key]

    def _slots(self, cand: Candidate, spec: Any) -> list[list[tuple[bool, tuple]]]:
        """Per rank, its slots as (a lone action?, its actions' (stage, kind))."""
        key = (cand.schedule, cand.pp, cand.microbatches, cand.v)
        hit = self._spec_slots.get(key)
        if hit is None:
            hit = self._spec_slots[key] = [[(len(slot) == 1, tuple((a.stage, a.kind) for a in slot))
                                                 for slot in order] for order in spec.orders]
        return hit

    def _static(self, cand: Candidate, spec: Any, mbs: int, ctx: Any, rank: int) -> float:
        """Model-state bytes of a pipeline rank (`parallel.data.static_memory`), shared by the
        candidates that differ in recompute only."""
        key = (cand.schedule, cand.pp, cand.microbatches, cand.v, cand.tp, cand.sp, cand.cp, mbs, cand.dp, cand.ep,
               cand.zero, rank)
        if key not in self._statics:
            self._statics[key] = sum(static_memory(ctx, rank, cand.zero).values())
        return self._statics[key]

    def __call__(self, cand: Candidate) -> tuple[float, float, str]:
        from piper_sim.ir import Context
        from piper_sim.plan import Layout

        mbs = self.settings["global_batch"] // (cand.dp * cand.microbatches)
        try:
            spec = _schedule(cand.schedule, cand.pp, cand.microbatches, cand.v)
            stages = self._stage_costs(cand.tp, cand.sp, mbs, spec.num_stages, cand.pp > 1, cand.cp)
            act = self._activation_peaks(cand, spec, mbs)
        except (ScheduleError, StrategyError, ValueError) as e:
            return 0.0, 0.0, str(e)
        layout = Layout(pp=cand.pp, dp=cand.dp, ep=cand.ep, stage_ranks=spec.stage_ranks, tp=cand.tp, cp=cand.cp)
        ctx = Context(setup=None, stages=stages, layout=layout,  # type: ignore[arg-type]
                      dtype_bytes=DTYPE_BYTES[self.dtype], stack=self.stack)
        spec_key = (cand.schedule, cand.pp, cand.microbatches, cand.v)
        counts = self._mb_counts.get(spec_key)
        if counts is None:  # micro-batches per (rank, stage)
            counts = {}
            for s in spec.stage_ranks:
                for mb in range(cand.microbatches):
                    counts[spec.rank_of(s, mb), s] = counts.get((spec.rank_of(s, mb), s), 0) + 1
            self._mb_counts[spec_key] = counts
        mem = time_lb = 0.0
        for r in range(cand.pp):
            held = [s for s, ranks in spec.stage_ranks.items() if r in ranks]
            # as the device would hold it (no communicators counted: a lower bound)
            need = memory_need(self._static(cand, spec, mbs, ctx, r), act[r], self.gpu.family,
                               self.stack.expandable_segments)
            mem = max(mem, need.least)  # what `memory_verdict` calls oom beyond the capacity
            busy = 0.0
            for s in held:
                busy += counts.get((r, s), 0) * self._stage_numbers(cand, mbs, spec.num_stages, s)[2]
            time_lb = max(time_lb, busy)
        return mem, time_lb, ""


def _compute_lower_bound(cm, segments, recompute: bool, ep: int, prices: dict | None = None) -> float:
    """Seconds of one micro-batch's F + B of these segments: their kernels as the simulator
    prices them (it can only add slowdowns), or a roofline of their flops. ``prices``: a
    cache of table prices by table (identical layers share their profile's tables)."""
    from piper_sim import kernels

    def price(t):
        if prices is None:
            return cm.kernels_time(t)
        hit = prices.get(id(t))
        if hit is None:  # the table is kept with its price: its id stays its own
            hit = prices[id(t)] = (t, cm.kernels_time(t))
        return hit[1]

    total = 0.0
    for x in segments:
        tables = [x.kernels_f] * (2 if recompute else 1) + [x.kernels_bi, x.kernels_bw]
        if x.is_expert and ep > 1:  # the last table is the weight gradient's
            tables = [kernels.regroup(t, ep, weight_grad=i == len(tables) - 1) for i, t in enumerate(tables)]
        priced = [price(t) for t in tables if t]
        if priced and all(p is not None for p in priced):
            total += sum(priced)
        else:
            flops = x.fwd_flops * (2 if recompute else 1) + x.bwd_input_flops + x.bwd_weight_flops
            total += cm.compute_time("F", flops)
    return total


def _compile_and_simulate(task: tuple) -> tuple:
    """Worker: compile and simulate one candidate."""
    cand, settings = task
    from piper_sim.compiler import compile_strategy
    from piper_sim.simulator import simulate

    try:
        plan = compile_strategy(cand.strategy(settings["model"], settings["cluster"], settings["global_batch"],
                                              settings["seq_len"], settings.get("stack", DEFAULT_STACK))).plan
    except (StrategyError, ValueError) as e:
        return cand, None, str(e)
    why = settings["refusal"](plan) if settings.get("refusal") else ""
    if why:
        return cand, "simulate-only", why
    r = simulate(plan, settings["costmodel"], memory_headroom_bytes=settings["memory_headroom_bytes"],
                 slow_ranks=settings.get("slow_ranks"))
    peak = max(x.peak_memory_bytes for x in r.rank_stats)
    device = max(x.device_bytes for x in r.rank_stats)
    states = max(x.params_bytes + x.optimizer_bytes for x in r.rank_stats)
    weights = sum(x.represents for x in r.rank_stats) or 1
    comm = (sum(x.comm_exposed_s * x.represents for x in r.rank_stats) / weights / r.step_time_s
            if r.step_time_s > 0 else 0.0)
    return cand, (r.step_time_s, r.tokens_per_s, r.mfu, r.bubble_fraction, peak, r.memory_verdict or "fits", r.band,
                  device, states, comm, r.world_size), ""


def _pool(workers: int, use_ray: bool):
    if use_ray:
        try:
            from ray.util.multiprocessing import Pool as RayPool  # type: ignore

            return RayPool(workers)
        except ImportError:
            log.warning("Ray is not installed; using local processes")
    import multiprocessing as mp

    # fork: workers inherit the imported modules and the profiles the screen already cached
    # (spawn would re-import and re-profile in each worker); CPU-only work, no CUDA context
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    return mp.get_context(method).Pool(workers, initializer=_die_with_parent, initargs=(os.getpid(),))


def _die_with_parent(parent: int) -> None:
    """In a pool worker: SIGKILL when the explorer dies (Linux ``PR_SET_PDEATHSIG``), so a
    killed, timed-out or SIGTERMed search leaves no worker simulating on. (The pool's own
    exit terminates its workers; this covers the deaths that never reach it.)"""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:  # the explorer died before prctl took effect
        os._exit(1)


def explore(model: str, cluster: str, global_batch: int, seq_len: int, costmodel: str = "analytic",
            workers: int | None = None, prune: bool = True, use_ray: bool = False,
            candidates: list[Candidate] | None = None,
            progress: Callable[[str, int, int], None] | None = None, stack: Stack | str | dict | None = None,
            memory_headroom_bytes: float = DEFAULT_HEADROOM_BYTES,
            refusal: Callable[[Any], str] | None = None, slow_ranks: dict[int, float] | None = None,
            **enum_kw: Any) -> ExploreResult:
    """Enumerate, screen, and simulate in order of the time bound; rows for every candidate.
    ``refusal``: a module-level function of a compiled plan giving why a back end would not run
    it ('' when it would; e.g. `executor.support.unrunnable` for ``explore --runnable``): such
    candidates are not simulated, their rows ``simulate-only`` with that reason.
    ``stack``: the training stack every candidate runs (``costmodel.stack``: a preset name, a
    mapping or a Stack; default FA2 and fused kernels). Memory as the simulator judges it
    (`costmodel.memory.memory_need`): plans within ``memory_headroom_bytes`` of the GPU's
    memory are ``tight`` and ranked after every plan that fits with the headroom.
    ``slow_ranks``: the what-if of `piper_sim.simulator.simulate` (rank -> slowdown) on every
    candidate: which plans degrade gracefully when a GPU is slow (the time bounds stay bounds)."""
    if "," in str(cluster) and candidates is None:  # several cluster sizes, ranked together
        return _explore_clusters([c.strip() for c in str(cluster).split(",")], progress, model=model,
                                 global_batch=global_batch, seq_len=seq_len, costmodel=costmodel, workers=workers,
                                 prune=prune, use_ray=use_ray, stack=stack,
                                 memory_headroom_bytes=memory_headroom_bytes, slow_ranks=slow_ranks, **enum_kw)
    t0 = time.perf_counter()
    cl = parse_cluster(cluster)
    check_world_size(cl.world_size, f"explore cluster {cluster}", StrategyError)
    check_slow_ranks(slow_ranks or {}, cl.world_size)
    stack = parse_stack(stack, "explore stack")
    check_stack_on(stack, cl.gpu, "explore stack")
    settings = {"model": model, "cluster": cluster, "global_batch": global_batch, "seq_len": seq_len,
                "costmodel": costmodel, "stack": stack, "memory_headroom_bytes": memory_headroom_bytes,
                "refusal": refusal, "slow_ranks": dict(slow_ranks or {})}
    if candidates is None:
        candidates = enumerate_candidates(model, cluster, global_batch, seq_len, **enum_kw)
    if len(candidates) > MAX_EXPLORE_CANDIDATES:
        raise StrategyError(f"explore: {len(candidates):,} strategies exceed the limit of {MAX_EXPLORE_CANDIDATES:,} "
                            "(piper_sim.checks.MAX_EXPLORE_CANDIDATES); narrow the search (schedules, ZeRO levels, "
                            "TP/CP degrees, no recompute)")
    cm = get_costmodel(costmodel, cl)
    hbm = cl.gpu.hbm_bytes
    workers = workers or os.cpu_count() or 1
    rows: list[Row] = []
    queue = []
    for cand, (mem, bound, err) in zip(candidates, _screen_all(Screener(settings, cm), candidates, progress)):
        if err:
            rows.append(Row(cand, "invalid", reason=err))
        elif prune and not fits(mem, hbm):
            rows.append(Row(cand, "oom", lower_bound_s=bound, device_memory_bytes=mem,
                            reason=f"model states + the activations its schedule holds need {mem / 2**30:.1f} GiB "
                                   f"(with the CUDA context, unfragmented) > {hbm / 2**30:.1f} GiB"))
        else:
            queue.append((bound, cand.short(), cand))
    queue.sort()
    bounds = {c: b for b, _, c in queue}
    best = float("inf")
    done = 0

    def record(cand: Candidate, res: tuple | None, err: str) -> None:
        nonlocal best, done
        done += 1
        if progress:
            progress("simulate", done, len(queue))
        if res is None or res == "simulate-only":
            rows.append(Row(cand, res or "invalid", reason=err))
            return
        step, tps, mfu, bubble, peak, verdict, band, device, states, comm, world = res  # the simulator's verdict
        if verdict == "oom":
            rows.append(Row(cand, "oom", step, tps, mfu, bubble, peak, bounds[cand], device_memory_bytes=device,
                            comm_fraction=comm, world_size=world,
                            reason=f"needs {device / 2**30:.1f} GiB (reserved + runtime; even unfragmented more "
                                   f"than {hbm / 2**30:.1f} GiB)"))
            return
        status = "ok" if verdict == "fits" else "tight"
        rows.append(Row(cand, status, step, tps, mfu, bubble, peak, bounds[cand], band=band, device_memory_bytes=device,
                        state_bytes=states, comm_fraction=comm, world_size=world,
                        reason="" if status == "ok" else f"needs {device / 2**30:.1f} GiB of {hbm / 2**30:.1f} GiB "
                        f"(with the {memory_headroom_bytes / 2**30:g} GiB headroom it may run out)"))
        if status == "ok":
            best = min(best, step)

    with (_pool(workers, use_ray) if workers > 1 else _Serial()) as pool:
        for cand, res, err in _stream(pool, workers, queue, lambda bound: prune and bound >= best, settings):
            if res == "pruned":
                bound = bounds[cand]
                rows.append(Row(cand, "pruned", lower_bound_s=bound,
                                reason=f"compute alone takes >= {bound:.4g} s, best is {best:.4g} s"))
                done += 1  # decided without simulating: the progress still reaches len(queue)
                if progress:
                    progress("simulate", done, len(queue))
                continue
            record(cand, res, err)
    counts: dict[str, int] = {}
    for r in rows:
        r.cluster = cluster
        counts[r.status] = counts.get(r.status, 0) + 1
    return ExploreResult(rows=rows, settings=settings, wall_s=time.perf_counter() - t0, counts=counts)


def _explore_clusters(specs: list[str], progress: Callable[[str, int, int], None] | None, **kw: Any) -> ExploreResult:
    """`explore` on each cluster, one result: every row names its cluster, ranked together."""
    parts = []
    for spec in specs:
        shown = None if progress is None else (lambda st, i, n, spec=spec: progress(f"{st} {spec}", i, n))
        parts.append(explore(cluster=spec, progress=shown, **kw))
    counts: dict[str, int] = {}
    for p in parts:
        for k, v in p.counts.items():
            counts[k] = counts.get(k, 0) + v
    settings = {**parts[0].settings, "cluster": ",".join(specs), "clusters": specs}
    return ExploreResult(rows=[r for p in parts for r in p.rows], settings=settings,
                         wall_s=sum(p.wall_s for p in parts), counts=counts)


def add_training_runs(result: ExploreResult, opts: TrainingRunOptions, rank_by: str = "tokens_per_s") -> ExploreResult:
    """Attach each simulated row's training run for ``opts.tokens`` (`costmodel.training_run`:
    checkpoint bytes from the model and dtype, the row's cluster's size and GPU power) and rank
    by ``rank_by`` (`RANK_BY`). The time prune stays exact per cluster: at one cluster size
    the wall time, cost and energy grow with the step time (up to an async save's host copy)."""
    from costmodel.hardware import training_power_w
    from costmodel.training_run import checkpoint_bytes, training_run

    if rank_by not in RANK_BY:
        raise ValueError(f"--rank-by {rank_by!r}: choose from {', '.join(RANK_BY)}")
    s = result.settings
    ckpt = checkpoint_bytes(resolve_model(s["model"]).param_count(), DTYPE_BYTES[s.get("dtype", "bf16")])
    for r in result.rows:
        if r.status not in _RANKED:
            continue
        cl = parse_cluster(r.cluster or s["cluster"])
        power = training_power_w(cl.gpu)
        if rank_by == "energy" and power is None:
            raise ValueError(f"--rank-by energy: no sourced board power for {cl.gpu.name} "
                             "(costmodel.hardware.TRAINING_POWER_W)")
        r.run = training_run(opts, r.step_time_s, s["global_batch"] * s["seq_len"], cl.world_size, ckpt,
                             r.state_bytes, power)
    result.rank_by = rank_by
    return result


@gc_paused
def _screen_all(screener: Screener, candidates: list[Candidate],
                progress: Callable[[str, int, int], None] | None) -> list[tuple[float, float, str]]:
    """`Screener` bounds of every candidate, in order."""
    out = []
    for i, cand in enumerate(candidates):
        out.append(screener(cand))
        if progress:
            progress("screen", i + 1, len(candidates))
    return out


def _stream(pool: Any, workers: int, queue: list, pruned: Callable[[float], bool],
            settings: dict[str, Any]) -> Iterable[tuple]:
    """Compile and simulate the queue (sorted by bound) on the pool, keeping every worker busy:
    a new candidate goes out as soon as one finishes (not batch by batch, where each batch
    waits for its slowest). A candidate is checked against ``pruned`` (the best so far) when
    it would be sent. Yields (candidate, result, error) in completion order, and
    (candidate, "pruned", "") for those skipped."""
    import queue as queue_mod

    results: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
    in_flight, i = 0, 0
    while i < len(queue) or in_flight:
        while i < len(queue) and in_flight < workers:  # one each: few sent before the best is known
            bound, _, cand = queue[i]
            i += 1
            if pruned(bound):
                yield cand, "pruned", ""
                continue
            pool.apply_async(_compile_and_simulate, ((cand, settings),), callback=results.put,
                             error_callback=lambda e: results.put((None, e, "")))
            in_flight += 1
        if in_flight:
            cand, res, err = results.get()
            in_flight -= 1
            if isinstance(res, BaseException):  # a bug, not a bad candidate: as the serial run would
                raise res
            yield cand, res, err


class _Serial:
    """A pool with one worker: this process."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def apply_async(self, fn, args, callback, error_callback=None):
        callback(fn(*args))


def _run_columns(result: ExploreResult) -> tuple[str, Callable[[Row], str]] | None:
    """The header and the cells of the training-run columns (None without runs)."""
    from costmodel.training_run import duration, human

    runs = [r.run for r in result.ok if r.run is not None]
    if not runs:
        return None
    priced = any(x.cost is not None for x in runs)
    head = f" {'train time':>10} {'goodput':>7} {'GPU-h':>7} {'energy':>9}" + (f" {'$':>7}" if priced else "")

    def cells(r: Row) -> str:
        x = r.run
        kwh = "-" if x.kwh is None else human(x.kwh * 1e3, "Wh")
        return (f" {duration(x.wall_s):>10} {x.goodput:>7.1%} {human(x.gpu_hours):>7} {kwh:>9}"
                + (f" {'-' if x.cost is None else human(x.cost):>7}" if priced else ""))
    return head, cells


def format_table(result: ExploreResult, top: int = 10) -> str:
    runs = _run_columns(result)
    many = len(result.settings.get("clusters", ())) > 1
    lines = [f"{'#':>3} {'tokens/s':>12} {'tok/s/GPU':>9} {'step s':>9} {'80% band s':>17} {'MFU':>6} {'idle':>6} "
             f"{'comm':>6} {'mem GiB':>8}{runs[0] if runs else ''}  strategy" + (" @ cluster" if many else "")]
    for i, r in enumerate(result.ok[:top], 1):
        band = f"{r.band.step_low_s:.4g}-{r.band.step_high_s:.4g}" if r.band else "-"
        tight = "  [tight: may run out of memory]" if r.status == "tight" else ""
        comm = f"{r.comm_fraction:>6.1%}" if r.comm_fraction == r.comm_fraction else f"{'-':>6}"
        lines.append(f"{i:>3} {r.tokens_per_s:>12,.0f} {r.tokens_per_s_per_gpu:>9,.0f} {r.step_time_s:>9.4g} {band:>17} "
                     f"{r.mfu:>6.1%} {r.idle_fraction:>6.1%} {comm} "
                     f"{r.device_memory_bytes / 2**30:>8.1f}{runs[1](r) if runs else ''}  "
                     f"{r.candidate.short()}{' @ ' + r.cluster if many else ''}{tight}")
    lines.append("idle: no op runs (pipeline bubble, waits); comm: exposed communication (in flight, no compute); "
                 "mem: device memory at the peak; `explore --explain K` says why #1 wins")
    if runs:
        tokens = next(r.run.tokens for r in result.ok if r.run is not None)
        lines.append(f"ranked by {result.rank_by}; runs of {tokens:.4g} tokens (costmodel.training_run)")
    best = result.best
    if best is not None and best.band is not None:
        lines.append(f"#1: {best.band.describe(best.step_time_s)}")
    stack = result.settings.get("stack")
    if stack is not None and stack != DEFAULT_STACK:
        lines.append(f"stack: {stack.describe()}")
    c = result.counts
    tight = f"{c['tight']} tight (may run out of memory), " if c.get("tight") else ""
    lines.append(f"{len(result.rows)} strategies: {c.get('ok', 0)} simulated and fit, {tight}{c.get('oom', 0)} out of memory, "
                 f"{c.get('pruned', 0)} pruned (could not win), {c.get('invalid', 0)} invalid"
                 + (f", {c['simulate-only']} the executor would not run (--runnable)" if c.get("simulate-only") else "")
                 + f"; {result.wall_s:.1f} s")
    oom = [r for r in result.rows if r.status == "oom"]
    if oom:
        lines.append(f"out of memory, e.g. {oom[0].candidate.short()}: {oom[0].reason}")
    return "\n".join(lines)


RUN_CSV = ("wall_s", "goodput", "gpu_hours", "interval_s", "interruptions", "kwh", "tokens_per_kwh", "cost",
           "cost_per_1m_tokens")


def write_csv(result: ExploreResult, path: str) -> None:
    fields = ["strategy", "status", "tokens_per_s", "tokens_per_s_per_gpu", "step_time_s", "mfu", "bubble_fraction",
              "comm_fraction", "peak_memory_bytes", "lower_bound_s", "reason", "cluster"]
    runs = any(r.run is not None for r in result.rows)
    if runs:
        fields += [f"run_{k}" for k in RUN_CSV]
    from piper_sim.files import atomic_write

    with atomic_write(path, newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields + list(asdict(result.rows[0].candidate)) if result.rows else fields)
        w.writeheader()
        for r in sorted(result.rows, key=result.key):
            d = r.to_json()
            if runs:
                d.update({f"run_{k}": "" if r.run is None or getattr(r.run, k) is None else getattr(r.run, k)
                          for k in RUN_CSV})
            w.writerow({**{k: d[k] for k in fields}, **d["candidate"]})


def pareto_front(rows: list[Row]) -> list[Row]:
    """The rows no other row beats on both throughput and peak memory, by memory."""
    front, best = [], -1.0
    for r in sorted(rows, key=lambda r: (r.peak_memory_bytes, -r.tokens_per_s)):
        if r.tokens_per_s > best:
            front.append(r)
            best = r.tokens_per_s
    return front


# label offsets (points) tried in turn around a front point until the label covers no other
_LABEL_OFFSETS = ((6, 6), (6, -12), (-6, 10), (-6, -16), (8, 18), (8, -24), (-8, 26), (-8, -32))


def plot_pareto(result: ExploreResult, path: str | None = None, *, ax: Any = None) -> Any:
    """Throughput vs peak memory (GiB); the Pareto front (more throughput for less memory)
    joined, each front point labelled with its short candidate name (offsets alternate so
    labels do not overlap), the best plan starred. Returns the Figure; writes ``path`` when
    given; draws into ``ax`` when given."""
    from piper_sim.trace import GIB, new_figure

    ok = result.ok
    own = ax is None
    fig, ax = new_figure(ax, figsize=(9, 5.5))
    s = result.settings
    hbm = parse_cluster(s.get("clusters", [s["cluster"]])[0]).gpu.hbm_bytes / GIB
    ax.axvline(hbm, color="gray", ls="--", lw=1, label=f"GPU memory {hbm:.0f} GiB")
    ax.set(xlabel="peak memory per GPU (GiB)", ylabel="tokens / s",
           title=f"{s['model']} on {s['cluster']}, batch {s['global_batch']}×{s['seq_len']}")
    if ok:
        ax.scatter([r.peak_memory_bytes / GIB for r in ok], [r.tokens_per_s for r in ok], s=14, alpha=0.6,
                   label="simulated strategies")
        front = pareto_front(ok)
        ax.plot([r.peak_memory_bytes / GIB for r in front], [r.tokens_per_s for r in front], "r.-",
                label="Pareto front")
        top = result.best
        if top is not None:
            ax.scatter([top.peak_memory_bytes / GIB], [top.tokens_per_s], marker="*", s=120, color="red",
                       zorder=3, label=f"best: {top.candidate.short()}")
        ax.margins(x=0.15, y=0.12)
    ax.legend(fontsize=8, loc="best")
    if own:
        fig.tight_layout()
    if ok:
        _label_front(ax, front)  # after the layout: the boxes are where they are drawn
    if path:
        save_figure(fig, path, dpi=120)
    return fig


def _label_front(ax: Any, front: list[Row]) -> None:
    """One label per front point: the first of `_LABEL_OFFSETS` (the first two swapped on
    every other point, so neighbours alternate above and below) whose box overlaps no label
    placed before."""
    from piper_sim.trace import GIB

    placed: list[Any] = []
    for i, r in enumerate(front):
        xy = (r.peak_memory_bytes / GIB, r.tokens_per_s)
        tries = [i % 2, 1 - i % 2] + list(range(2, len(_LABEL_OFFSETS)))
        text = None
        for k in tries:
            off = _LABEL_OFFSETS[k]
            if text is not None:
                text.remove()
            text = ax.annotate(r.candidate.short(), xy, xytext=off, textcoords="offset points", fontsize=7,
                               ha="left" if off[0] > 0 else "right",
                               arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "gray"} if abs(off[1]) > 12 else None)
            if not any(text.get_window_extent().overlaps(p) for p in placed):
                break
        placed.append(text.get_window_extent())


class _CallableModule(type(sys)):
    """``piper_sim.explore(...)`` runs `explore`: the package's top-level name and this
    module's name are the same, so the module itself is callable."""

    def __call__(self, *args: Any, **kwargs: Any) -> ExploreResult:
        return explore(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
