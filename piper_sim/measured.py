"""Read real torch.profiler (Kineto) traces and map what they recorded onto a plan's ops.

`read_rank_traces(path)` reads a folder of Chrome-trace JSON files as torch.profiler writes
them (``export_chrome_trace``, ``tensorboard_trace_handler``: ``*.pt.trace.json``, plain
``*.json``, gzipped ``*.json.gz``), one file per rank. A file's rank is its
``distributedInfo.rank``, else the number in its name (``rank3``, ``rank-3``, ``rank_3``),
else its position in name order.

`map_rank(trace, plan_ops)` finds one training step in a rank's trace and the plan ops in it.
Two mappings, tried in this order (the one used is reported per rank):

1. **annotation** (the convention): a host range named exactly by a plan op id, i.e.
   ``torch.profiler.record_function(op_id)`` around the op. In a plain loop with
   gradient accumulation over micro-batches ``k``::

       with record_function(f"F.s0.mb{k}"):  loss = loss_fn(model(x[k]), y[k])
       with record_function(f"B.s0.mb{k}"):  loss.backward()
       with record_function("OPT.s0"):       opt.step(); opt.zero_grad()

   (``piper-sim show PLAN`` lists each rank's op ids; the executor's ``run --profile`` and
   ``--kineto`` traces follow this convention for every op, comm included.) The ranges
   torch.distributed.pipelining records count too (`op_id_of`: ``PP:1F3`` is ``F.s1.mb3``,
   a single-stage schedule's ``Forward 3`` is ``F.s<stage>.mb3``), so do torchtitan's pipeline
   runs; an optimizer left unannotated is found as torch's ``Optimizer.step#...`` range.
2. **order** (the fallback, un-annotated traces): the step's top-level host ops (a range
   around backward or optimizer work, such as a ``## backward ##`` annotation or a whole
   ``train_step``, is looked into) are split into phases: ``autograd::engine::evaluate_function`` ranges are backward,
   ``Optimizer.step#...`` ranges (torch's optimizer hook) the optimizer, comm ranges their
   collective (the backend's ``nccl:all_reduce``, ``gloo:send``... when the trace has them,
   else the calling ``c10d::allreduce_``, ``record_param_comms``), everything else
   forward (data loading and the loss included); only the loop's thread (the one holding
   the step and optimizer ranges) and autograd's threads count. Consecutive ops of one phase
   form one phase instance; the i-th forward / backward / optimizer phase is the plan's i-th
   F / B / OPT op in the rank's compute order (a split backward's BI; its BW stays
   unmatched), the i-th comm range of a kind the i-th plan op of that kind.

The step: a ``ProfilerStep#N`` range (``prof.step()`` under a profiler ``schedule``, or
``record_function``); by default the one with the most mapped ops, the later one on a tie.
Without any, the trace is cut after each ``Optimizer.step`` range (no optimizer: the whole
trace is one step).

An op's measured interval is its device kernels' span when the host range launched any
(``cuda_runtime`` launches joined to ``kernel``/``gpu_memcpy``/``gpu_memset`` events by
``correlation``: the launches whose ``External id`` is the range's own, else those inside
it on its thread or on a thread without plan-op ranges, autograd's; none: an empty interval
at the range's end), else, in a trace without device work (CPU traces hold only ``cpu_op``
and ``user_annotation`` events), the host range itself. Times are seconds from the step's
start.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from piper_sim.plan import COMPUTE_KINDS

__all__ = ["RankTrace", "MeasuredOp", "RankMapping", "find_trace_files", "read_rank_traces", "map_rank",
           "phase_of", "comm_kind", "op_id_of", "plan_ops_of"]

TRACE_PATTERNS = ("*.pt.trace.json", "*.pt.trace.json.gz", "*.json", "*.json.gz")
HOST_CATS = {"cpu_op", "user_annotation", "python_function"}
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver"}
STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
RANK_RE = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
# collective names as torch's profiler records them (nccl:all_reduce, gloo:send, c10d::allreduce_,
# record_param_comms' "Collective name"), most specific first
COMM_PATTERNS = (("REDUCE_SCATTER", r"reduce_?scatter"), ("ALL_GATHER", r"all_?gather"),
                 ("ALL_TO_ALL", r"all_?to_?all"), ("ALLREDUCE", r"all_?reduce"), ("SEND", r"send"),
                 ("RECV", r"recv"))
_COMM_RE = [(k, re.compile(rf"(^|[:_. ]){p}")) for k, p in COMM_PATTERNS]
BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl")
_COMM_SCOPES = ("nccl:", "gloo:", "c10d::", "record_param_comms", "ncclDevKernel", "ncclKernel")


@dataclass
class Event:
    """One complete (``ph: X``) trace event, times in µs as in the file."""

    name: str
    cat: str
    pid: Any
    tid: Any
    ts: float
    dur: float
    args: dict[str, Any]

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass
class RankTrace:
    """One rank's trace file: its host ranges, device events and runtime launches."""

    path: str
    rank: int
    rank_from: str  # distributedInfo | file name | order
    world_size: int | None
    host: list[Event]
    device: list[Event]
    runtime: list[Event]

    @property
    def steps(self) -> list[tuple[int, Event]]:
        """(N, range) of every ``ProfilerStep#N`` host range, in time order."""
        out = [(int(m.group(1)), e) for e in self.host if (m := STEP_RE.match(e.name))]
        return sorted(out, key=lambda x: x[1].ts)


@dataclass
class MeasuredOp:
    """A plan op found in a trace: its interval (s from the step start), host and device time."""

    rank: int
    op_id: str
    kind: str
    start: float
    end: float
    host_s: float
    device_s: float  # span of its kernels; nan when it launched none
    trace_name: str  # the range it was found as
    mapping: str = "annotation"  # annotation | order
    # when the device was busy with it (s from the step start): its kernels (a compute op's
    # without the NCCL kernels it launched, a comm op's NCCL kernels), else [start, end]
    busy: list[tuple[float, float]] = field(default_factory=list)

    @property
    def measured_s(self) -> float:
        return self.end - self.start

    @property
    def busy_s(self) -> float:
        from piper_sim.trace import union_intervals

        return sum(e - s for s, e in union_intervals(self.busy))


@dataclass
class RankMapping:
    """What `map_rank` found on one rank."""

    rank: int
    mapping: str  # annotation | order | none
    step: int | None  # ProfilerStep#N used; None: a window cut at Optimizer.step, or the whole trace
    step_s: float
    ops: list[MeasuredOp]
    planned: int  # plan ops on the rank
    unmatched_phases: dict[str, int] = field(default_factory=dict)  # trace phases left over, by kind
    window: int = 0  # index of the step among the trace's steps
    windows: int = 1

    def describe_step(self) -> str:
        if self.step is not None:
            return f"ProfilerStep#{self.step}"
        if self.windows > 1:
            return f"step {self.window + 1} of {self.windows} (no ProfilerStep ranges: cut at Optimizer.step)"
        return "the whole trace (one step: no ProfilerStep or Optimizer.step ranges)"


def phase_of(name: str) -> str:
    """Phase of a top-level host range in the order fallback: B, OPT, a comm kind, skip
    (zero_grad, the step range itself) or F."""
    if name.startswith("autograd::engine::evaluate_function"):
        return "B"
    if name.startswith("Optimizer.step"):
        return "OPT"
    if name.startswith("Optimizer.zero_grad") or STEP_RE.match(name) or name.startswith("ProfilerStep"):
        return "skip"
    return comm_kind(name) or "F"


def comm_kind(name: str, args: dict[str, Any] | None = None) -> str | None:
    """The plan comm kind of a profiler range or kernel name (None when it is no comm)."""
    coll = (args or {}).get("Collective name")
    text = str(coll) if coll else name
    if not coll and not any(s in name for s in _COMM_SCOPES):
        return None
    low = text.lower()
    for kind, rx in _COMM_RE:
        if rx.search(low) or low.startswith(kind.lower()):
            return kind
    return None


# ------------------------------------------------------------------------------------- files


def find_trace_files(path: str) -> list[str]:
    """The trace files of a folder (or the one file given). A folder of per-iteration
    subfolders (torchtitan's ``iteration_N``) must be named down to one of them."""
    if not os.path.exists(path):
        raise ValueError(f"--trace {path}: no such file or folder; give the folder torch.profiler wrote "
                         "its traces into (one file per rank)")
    if os.path.isfile(path):
        return [path]
    files = sorted({f for pat in TRACE_PATTERNS for f in glob.glob(os.path.join(path, pat))})
    if files:
        return files
    nested = sorted({os.path.dirname(f) for pat in TRACE_PATTERNS
                     for f in glob.glob(os.path.join(path, "**", pat), recursive=True)})
    if nested:
        shown = ", ".join(os.path.relpath(d, path) for d in nested[:4]) + (" ..." if len(nested) > 4 else "")
        raise ValueError(f"--trace {path}: no trace files in the folder itself, only in subfolders ({shown}); "
                         "give one of them (one training run, one file per rank)")
    raise ValueError(f"--trace {path}: no trace files (*.json, *.json.gz) found; torch.profiler writes them "
                     "with export_chrome_trace or tensorboard_trace_handler")


def _load(path: str, required: bool = True) -> dict[str, Any] | None:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rt") as f:
                data = json.load(f)
        else:
            with open(path) as f:
                data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:
        raise ValueError(f"--trace {path}: not a readable JSON trace ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:80]}); pass torch.profiler's Chrome-trace files") from None
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        if not required:
            return None
        raise ValueError(f"--trace {path}: no 'traceEvents' list; not a torch.profiler (Chrome) trace")
    return data


def _events(raw: Iterable[Any]) -> tuple[list[Event], list[Event], list[Event]]:
    host, device, runtime = [], [], []
    for e in raw:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        try:
            ev = Event(str(e.get("name", "")), str(e.get("cat", "")), e.get("pid"), e.get("tid"),
                       float(e["ts"]), float(e.get("dur", 0.0) or 0.0), e.get("args") or {})
        except (KeyError, TypeError, ValueError):
            continue  # an event without a time is no interval
        cat = ev.cat.lower()
        if cat in DEVICE_CATS:
            device.append(ev)
        elif cat in RUNTIME_CATS:
            runtime.append(ev)
        elif cat in HOST_CATS:
            host.append(ev)
    return host, device, runtime


def read_rank_traces(path: str) -> list[RankTrace]:
    """Every rank's trace in ``path`` (see the module doc for how ranks are found), by rank.
    Raises ValueError (one line) on a missing folder, no trace files, unreadable JSON or two
    files of one rank. JSON files without ``traceEvents`` in a folder are passed over."""
    files = find_trace_files(path)
    # in a folder, other JSON files (a plan, a config) are passed over when some file is a trace
    loaded = [(f, d) for f in files if (d := _load(f, required=os.path.isfile(path))) is not None]
    if not loaded:
        raise ValueError(f"--trace {path}: none of its {len(files)} JSON files has a 'traceEvents' list; "
                         "not torch.profiler (Chrome) traces")
    files = [f for f, _ in loaded]
    out: list[RankTrace] = []
    named = [RANK_RE.search(os.path.basename(f)) for f in files]
    by_name = all(named) and len({int(m.group(1)) for m in named if m}) == len(files)
    for i, (f, data) in enumerate(loaded):
        info = data.get("distributedInfo") if isinstance(data.get("distributedInfo"), dict) else {}
        if isinstance(info.get("rank"), int):
            rank, source = int(info["rank"]), "distributedInfo"
        elif by_name:
            rank, source = int(named[i].group(1)), "file name"  # type: ignore[union-attr]
        else:
            rank, source = i, "order"
        ws = info.get("world_size")
        host, device, runtime = _events(data["traceEvents"])
        out.append(RankTrace(f, rank, source, int(ws) if isinstance(ws, int) else None, host, device, runtime))
    seen: dict[int, str] = {}
    for t in out:
        if t.rank in seen:
            raise ValueError(f"--trace {path}: {os.path.basename(seen[t.rank])} and {os.path.basename(t.path)} "
                             f"are both rank {t.rank}; keep one run's files in the folder")
        seen[t.rank] = t.path
    return sorted(out, key=lambda t: t.rank)


# ------------------------------------------------------------------------------------- mapping


def _top_level(events: Sequence[Event]) -> list[Event]:
    """Host ranges not inside another range of the same thread."""
    out: list[Event] = []
    by_thread: dict[tuple[Any, Any], list[Event]] = {}
    for e in events:
        by_thread.setdefault((e.pid, e.tid), []).append(e)
    for evs in by_thread.values():
        end = float("-inf")
        for e in sorted(evs, key=lambda e: (e.ts, -e.dur)):
            if e.ts >= end:  # not inside the current top-level range
                out.append(e)
                end = e.end
    return sorted(out, key=lambda e: (e.ts, -e.dur))


class _Device:
    """Device events joined to the host launches that issued them."""

    def __init__(self, trace: RankTrace):
        by_corr: dict[Any, list[Event]] = {}
        for d in trace.device:
            c = d.args.get("correlation")
            if c is not None:
                by_corr.setdefault(c, []).append(d)
        linked = [r for r in trace.runtime if r.args.get("correlation") in by_corr]
        self.launches = sorted(((r.ts, r.tid, by_corr[r.args["correlation"]]) for r in linked), key=lambda x: x[0])
        self.times = [x[0] for x in self.launches]
        self.by_ext: dict[Any, list[Event]] = {}  # launches made directly inside a range, by its External id
        for r in linked:
            if r.args.get("External id") is not None:
                self.by_ext.setdefault(r.args["External id"], []).extend(by_corr[r.args["correlation"]])

    def kernels(self, start: float, end: float, tids: set[Any] | None, ext: Any = None) -> list[Event]:
        """The device events of the launches a host range made: those linked to its External
        id ``ext`` when there are any, else those in [start, end) (µs; [start, start] for an
        empty range) from the threads ``tids`` (None: any thread)."""
        import bisect

        devs: list[Event] = list(self.by_ext.get(ext, ())) if ext is not None else []
        if not devs:
            i = bisect.bisect_left(self.times, start)
            while i < len(self.launches) and (self.launches[i][0] < end or self.launches[i][0] == start):
                _, tid, evs = self.launches[i]
                if tids is None or tid in tids:
                    devs += evs
                i += 1
        return devs


def _measured(rank: int, op_id: str, kind: str, host: tuple[float, float], dev: _Device, tids: set[Any] | None,
              t0: float, name: str, ext: Any = None, mapping: str = "annotation") -> MeasuredOp:
    devs = dev.kernels(host[0], host[1], tids, ext)
    span = (min(d.ts for d in devs), max(d.end for d in devs)) if devs else None
    # in a trace with device work, a range that launched nothing took no device time
    s, e = span if span else ((host[1], host[1]) if dev.launches else host)
    is_comm = [comm_kind(d.name, d.args) is not None for d in devs]
    busy = [d for d, c in zip(devs, is_comm) if c != (kind in COMPUTE_KINDS)] or devs
    intervals = [((d.ts - t0) / 1e6, (d.end - t0) / 1e6) for d in busy] if busy else [((s - t0) / 1e6,
                                                                                       (e - t0) / 1e6)]
    return MeasuredOp(rank, op_id, kind, (s - t0) / 1e6, (e - t0) / 1e6, (host[1] - host[0]) / 1e6,
                      (span[1] - span[0]) / 1e6 if span else float("nan"), name, mapping, intervals)


def _windows(trace: RankTrace) -> list[tuple[int | None, float, float]]:
    """(N, start, end) of each step: the ProfilerStep#N ranges; without them, the trace cut
    after each ``Optimizer.step`` range (N = None), or the whole trace."""
    steps = trace.steps
    if steps:
        return [(n, e.ts, e.end) for n, e in steps]
    times = [e.ts for e in trace.host] + [e.ts for e in trace.device]
    ends = [e.end for e in trace.host] + [e.end for e in trace.device]
    if not times:
        return [(None, 0.0, 0.0)]
    cuts = sorted(e.end for e in _top_level([e for e in trace.host if e.name.startswith("Optimizer.step")]))
    bounds = [min(times)] + cuts
    return [(None, a, b) for a, b in zip(bounds, bounds[1:])] or [(None, min(times), max(ends))]


_PP_ACTION = re.compile(r"^PP:(\d+)(F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B)(\d+)$")
_PP_SINGLE = re.compile(r"^(Forward|Backward) (\d+)$")
_PP_KIND = {"F": "F", "B": "B", "I": "BI", "W": "BW"}


def op_id_of(name: str, stages: Sequence[int] = ()) -> str | None:
    """The plan op id a torch.distributed.pipelining range stands for, or None: the
    multi-stage schedules' ``PP:<action>`` (``PP:1F3`` -> ``F.s1.mb3``, ``PP:0I2`` ->
    ``BI.s0.mb2``, ``PP:1RECV_F0`` -> ``RECV.F.s0.mb0``), and the single-stage schedules'
    ``Forward 3`` / ``Backward 3`` on a rank of one stage (``stages``)."""
    m = _PP_ACTION.match(name)
    if m:
        stage, what, mb = int(m.group(1)), m.group(2), int(m.group(3))
        if what in _PP_KIND:
            return f"{_PP_KIND[what]}.s{stage}.mb{mb}"
        direction = what[-1]  # the activation (F) or gradient (B) a stage sends or receives
        src = stage if what.startswith("SEND") else stage - 1 if direction == "F" else stage + 1
        return f"{what[:4]}.{direction}.s{src}.mb{mb}"
    m = _PP_SINGLE.match(name)
    if m and len(stages) == 1:
        return f"{m.group(1)[0]}.s{stages[0]}.mb{int(m.group(2))}"
    return None


def _plan_op_name(name: str, kinds: dict[str, str], stages: Sequence[int]) -> str | None:
    if name in kinds:
        return name
    alias = op_id_of(name, stages) if name.startswith(("PP:", "Forward ", "Backward ")) else None
    return alias if alias in kinds else None


def _by_annotation(trace: RankTrace, plan_ops: Sequence[tuple[str, str]], dev: _Device,
                   window: tuple[float, float], stages: Sequence[int] = ()) -> list[MeasuredOp]:
    kinds = dict(plan_ops)
    s0, s1 = window
    hits: dict[str, Event] = {}
    for e in trace.host:
        if s0 <= e.ts <= s1 and (op := _plan_op_name(e.name, kinds, stages)):
            if op not in hits or (e.ts, -e.dur) < (hits[op].ts, -hits[op].dur):  # the first, outermost range
                hits[op] = e
    annotated = {(e.pid, e.tid) for e in hits.values()}
    others = {e.tid for e in trace.host if (e.pid, e.tid) not in annotated}  # autograd's backward thread
    out = [_measured(trace.rank, op, kinds[op], (e.ts, e.end), dev, {e.tid} | others, s0, e.name,
                     e.args.get("External id"))
           for op, e in hits.items()]
    # an optimizer left unannotated (torch pipelining annotates only its actions): torch's own
    # Optimizer.step ranges, in order
    missing = [op for op, k in plan_ops if k == "OPT" and op not in hits]
    steps = _top_level([e for e in trace.host if s0 <= e.ts <= s1 and e.name.startswith("Optimizer.step")])
    for op, e in zip(missing, steps):
        m = _measured(trace.rank, op, "OPT", (e.ts, e.end), dev, None, s0, e.name)
        m.mapping = "order"
        out.append(m)
    return sorted(out, key=lambda m: m.start)


def _phase_ranges(events: Sequence[Event]) -> list[Event]:
    """The ranges the order fallback classifies: the top-level ones, except that a range around
    backward or optimizer work that is not itself such a range (a user's ``## backward ##``, a
    whole ``train_step``) is replaced by its children, recursively. Backward work on autograd's
    own thread counts as inside the loop thread's range it runs during."""
    import bisect

    marks = sorted(e.ts for e in events if phase_of(e.name) in ("B", "OPT"))
    children: dict[int, list[Event]] = {}
    top: list[Event] = []
    by_thread: dict[tuple[Any, Any], list[Event]] = {}
    for e in events:
        by_thread.setdefault((e.pid, e.tid), []).append(e)
    for evs in by_thread.values():
        stack: list[Event] = []
        for e in sorted(evs, key=lambda e: (e.ts, -e.dur)):
            while stack and e.ts >= stack[-1].end:
                stack.pop()
            (children.setdefault(id(stack[-1]), []) if stack else top).append(e)
            stack.append(e)

    def expand(e: Event) -> list[Event]:
        if phase_of(e.name) != "F":
            return [e]
        i = bisect.bisect_left(marks, e.ts)
        if i < len(marks) and marks[i] <= e.end:  # backward or optimizer work inside
            return [x for c in children.get(id(e), []) for x in expand(c)]
        return [e]

    return sorted((x for e in top for x in expand(e)), key=lambda e: (e.ts, -e.dur))


def _by_order(trace: RankTrace, plan_ops: Sequence[tuple[str, str]], dev: _Device,
              window: tuple[float, float]) -> tuple[list[MeasuredOp], dict[str, int]]:
    s0, s1 = window
    inside = [e for e in trace.host if s0 <= e.ts <= s1 and not STEP_RE.match(e.name)]
    # the phases run on the training loop's thread (the one holding the step / optimizer ranges)
    # and autograd's backward threads; other threads' ranges (a data loader, a pool) are left out
    loop = {(e.pid, e.tid) for e in trace.host if STEP_RE.match(e.name) or e.name.startswith("Optimizer.")}
    if loop:
        loop |= {(e.pid, e.tid) for e in inside if e.name.startswith("autograd::engine::evaluate_function")}
    comm = [e for e in inside if comm_kind(e.name, e.args)]
    # a collective is the backend's range (gloo:/nccl:, on its worker threads for gloo) when the
    # trace has them, else the range that called it (c10d::allreduce_, record_param_comms)
    backend = [e for e in comm if e.name.split(":", 1)[0] in BACKENDS]
    comms = _top_level(backend or [e for e in comm if not loop or (e.pid, e.tid) in loop])
    if loop:
        inside = [e for e in inside if (e.pid, e.tid) in loop]
    comm_ids = {id(e) for e in comms}
    phases: list[tuple[str, float, float, str]] = []  # kind, start, end, first name
    for e in _phase_ranges(inside):
        if id(e) in comm_ids:
            continue
        k = phase_of(e.name)
        if k == "skip" or k not in ("F", "B", "OPT"):
            continue
        if phases and phases[-1][0] == k:
            kind, s, end, first = phases[-1]
            phases[-1] = (kind, s, max(end, e.end), first)
        else:
            phases.append((k, e.ts, e.end, e.name))
    found: dict[str, list[tuple[float, float, str]]] = {}
    for k, s, e, name in phases:
        found.setdefault(k, []).append((s, e, name))
    for e in comms:
        found.setdefault(comm_kind(e.name, e.args) or "", []).append((e.ts, e.end, e.name))
    out: list[MeasuredOp] = []
    used: dict[str, int] = {}
    for op, kind in plan_ops:
        k = "B" if kind in ("B", "BI") else kind  # a split backward's input half stands for the backward
        i = used.get(k, 0)
        if i < len(found.get(k, [])):
            s, e, name = found[k][i]
            out.append(_measured(trace.rank, op, kind, (s, e), dev, None, s0, name, mapping="order"))
            used[k] = i + 1
    left = {k: len(v) - used.get(k, 0) for k, v in found.items() if len(v) > used.get(k, 0)}
    return sorted(out, key=lambda m: m.start), left


def map_rank(trace: RankTrace, plan_ops: Sequence[tuple[str, str]], step: int | None = None,
             stages: Sequence[int] = ()) -> RankMapping:
    """Find one step of ``trace`` and the plan ops (``(op_id, kind)`` in the rank's order:
    compute stream first) in it: by annotation where any range is named by an op id, else
    by order. ``step``: the ``ProfilerStep#N`` to use (default: the one with the most
    mapped ops, the later on a tie)."""
    dev = _Device(trace)
    windows = _windows(trace)
    if step is not None:
        windows = [w for w in windows if w[0] == step]
        if not windows:
            have = ", ".join(str(n) for n, _ in trace.steps) or "none"
            raise ValueError(f"--step {step}: rank {trace.rank}'s trace has no ProfilerStep#{step} "
                             f"(its steps: {have})")
    kinds = dict(plan_ops)
    annotated = any(_plan_op_name(e.name, kinds, stages) for e in trace.host)
    best: tuple[int, float, RankMapping] | None = None
    for w, (n, s0, s1) in enumerate(windows):
        if annotated:
            ops, left = _by_annotation(trace, plan_ops, dev, (s0, s1), stages), {}
        else:
            ops, left = _by_order(trace, plan_ops, dev, (s0, s1))
        last = max([s1] + [s0 + m.end * 1e6 for m in ops])
        m = RankMapping(trace.rank, ("annotation" if annotated else "order") if ops else "none", n,
                        (last - s0) / 1e6, ops, len(plan_ops), left, w, len(windows))
        if best is None or (len(ops), s0) >= (best[0], best[1]):
            best = (len(ops), s0, m)
    assert best is not None
    return best[2]


def plan_ops_of(plan: Any, rank: int) -> list[tuple[str, str]]:
    """``(op_id, kind)`` of a rank's plan ops: its compute stream in order, then each other
    stream in `trace.stream_order`."""
    from piper_sim.trace import stream_order

    streams = plan.program(rank).streams
    return [(i.id, i.kind) for s in stream_order(streams) for i in streams[s]]

