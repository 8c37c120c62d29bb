"""Discrete-event simulation of a Plan on a cost model (simpy).

Every rank runs one simpy process per stream; a stream executes its instructions in
order, like a CUDA stream. An instruction starts when its stream is free and its
``deps`` (op ids on the same rank) are done. A SEND and the RECV with the same ``match``
on its peer move data once both are posted; a collective moves data once every member
reached it. Comm transfers share links: each transfer asks for its solo rate on every
link it uses (`CostModel.links`), and a link asked for more than its bandwidth slows
all its transfers in proportion (finish times are recomputed whenever a transfer starts
or ends). Compute runs `comm_compute_slowdown` times slower while a transfer is active on
its rank, and a transfer `comm_overlap_slowdown` times slower while one of its ranks
computes (a CPU's gloo thread shares the cores; 1 on accelerators). Memory per rank: the
class's static model states, plus ``alloc`` when an op starts, minus ``free`` when it ends.

Host: posting an async comm op takes `CostModel.post_time` seconds of the rank's one issuing
thread (measured by a calibration; 0 otherwise). A comm op is posted as soon as its
dependencies are done, in its stream's order, even while the stream's previous op still
moves data; its transfer follows that op's. When the cost model is `host_bound` (a CPU
rank: compute runs on that same thread, as in the executor) a compute op holds the host
while it runs, so a comm op is posted between compute ops, ahead of the next one; one the
plan lets start part-way through a compute op (a gradient bucket's ``dep_progress``, a
parameter gather the op waits for, ``needed_by``) is posted from inside it, as the
executor's hooks do, and the op runs on only once the post is done. Requests made at one
instant are granted in the executor's order (comm before compute, then stream and list
order), whatever simpy's wake-up order. Ops of the tensor- and context-parallel streams
are performed inside compute: no posting. Without a host (no posting cost, not host-bound)
a stream's comm ops run one after another, posted when the previous one ends.

Folding: the data-parallel replicas and context- and tensor-parallel peers of a pipeline rank run the
same program, so when the cluster is symmetric over them (every collective and p2p
transfer of replica d, tp rank t costs what replica 0's does), one representative per
class (dp_rank 0, tp_rank 0) is simulated and a collective completes when the
representatives of all member classes reached it. The
result equals the unfolded simulation; `simulate(..., fold=False)` runs every rank.

If the run cannot finish, `SimulationDeadlock` names the op each blocked stream waits on.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from itertools import repeat
from operator import attrgetter, itemgetter, mod, sub
from typing import TYPE_CHECKING, Any

import simpy

from costmodel.collectives import a2a_algorithm, busbw_factor
from costmodel.dtypes import DTYPE_BYTES
from costmodel.hardware import Cluster, parse_cluster
from costmodel.memory import adam_state_bytes
from costmodel.memory import DEFAULT_HEADROOM_BYTES, deepep_buffer_bytes, memory_need, memory_verdict
from costmodel.model import AnalyticCostModel, CostModel, UnitCostModel, get_costmodel
from costmodel.moe import Routing
from costmodel.stack import parse_stack
from costmodel.stragglers import check_slow_ranks, slowest_factor
from piper_sim import summary, trace
from piper_sim.bands import Band, band_for, run_class
from piper_sim.header import PlanHeader
from piper_sim.ir import is_inner
from piper_sim.plan import COLLECTIVE_KINDS, COMPUTE_KINDS, P2P_KINDS, Instruction, Plan, gc_paused, p2p_partner_id
from piper_sim.validate import check_layout

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from piper_sim.explain import StepBreakdown

log = logging.getLogger(__name__)

__all__ = ["RankStats", "SimResult", "SimulationDeadlock", "SimulationError", "fold_is_exact", "simulate"]



class SimulationError(ValueError):
    """A plan the simulator cannot run (missing dependency, unmatched op...)."""


class SimulationDeadlock(SimulationError):
    """The run stopped with ops still waiting; the message names them."""


@dataclass
class RankStats:
    """Per-rank totals over one step. bubble_s = step time − compute_s (the published
    formulas' bubble); idle_s = bubble_s − comm_exposed_s."""

    rank: int
    pp_rank: int
    represents: int  # ranks this row stands for (the class's replicas when folded)
    compute_s: float
    comm_exposed_s: float
    idle_s: float
    bubble_s: float
    peak_memory_bytes: float
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float  # peak of the transient (alloc/free) memory
    fits: bool | None = None  # memory_verdict is not oom (None: no cluster known)
    # the caching allocator's bytes for peak_memory_bytes (allocated) and the process's runtime
    # memory (CUDA context, cuBLAS, NCCL), costmodel.memory.memory_need
    reserved_bytes: float = 0.0
    runtime_bytes: float = 0.0
    memory_verdict: str | None = None  # fits | tight (may run out) | oom (costmodel.memory.memory_verdict)

    @property
    def device_bytes(self) -> float:
        """What the device holds at the peak: reserved + runtime."""
        return self.reserved_bytes + self.runtime_bytes


@dataclass
class SimResult:
    """The outcome of one simulated step.

    bubble_fraction: mean over ranks of bubble_s / step_time_s (share of the step the
    compute stream does not compute). mfu: model flops / (step time × world × peak).
    memory_verdict: the worst rank's `costmodel.memory.memory_verdict` of its memory as the
    device holds it (reserved tensors + CUDA context, cuBLAS workspaces, NCCL communicators:
    `costmodel.memory.memory_need`) against ``memory_capacity_bytes`` and
    ``memory_headroom_bytes``: fits, tight (may run out) or oom; ``fits``: no rank is oom.
    Both None when the plan names no cluster.
    per_rank: one row per simulated rank (`RankStats`); events: one row per executed op
    (`piper_sim.trace.EVENT_COLUMNS` + ``posted``, ``pair``); memory: transient bytes per
    rank over time (`trace.MEMORY_COLUMNS`). All three are pandas DataFrames built on first
    access (a planner that reads only the totals skips them); `to_json` is the JSON view.
    """

    step_time_s: float
    tokens_per_s: float
    mfu: float
    bubble_fraction: float
    rank_stats: list[RankStats]  # one per simulated rank; `per_rank` is the same as a DataFrame
    num_events: int
    sim_wall_s: float
    loop_wall_s: float = 0.0  # of sim_wall_s, the event loop alone (set-up and post-processing excluded)
    rows: list[tuple] = field(repr=False, default_factory=list)
    memory_samples: list[tuple[int, float, float]] = field(repr=False, default_factory=list)
    folded: bool = True
    world_size: int = 0
    costmodel: str = ""
    fits: bool | None = None
    memory_capacity_bytes: float = 0.0
    memory_verdict: str | None = None  # the worst rank's: fits | tight | oom (None: no cluster known)
    memory_headroom_bytes: float = DEFAULT_HEADROOM_BYTES
    meta: dict[str, Any] = field(repr=False, default_factory=dict)  # the plan's meta (model, cluster, dtype...)
    pairs: dict[tuple[int, str], int] = field(repr=False, default_factory=dict)  # (pp rank, op id) -> slot
    # how far to trust step_time_s on a GPU cluster (piper_sim.bands); None off the analytic GPU model
    band: Band | None = None
    # the plan that ran: kernel-level Kineto traces read its operator profiles (`write_kineto`)
    plan: Plan | None = field(repr=False, default=None, compare=False)

    @cached_property
    def events(self) -> "pd.DataFrame":
        """One row per op; ``pair``: the plan slot of ops that run as an overlapped F&B
        pair (DualPipe, DualPipeV), -1 otherwise."""
        df = trace.events_to_dataframe(self.rows, extra_columns=("posted",))
        pp_of = {s.rank: s.pp_rank for s in self.rank_stats}
        df["pair"] = [self.pairs.get((pp_of.get(r, -1), op), -1) for r, op in zip(df["rank"], df["op_id"])]
        return df

    @cached_property
    def per_rank(self) -> "pd.DataFrame":
        """One row per simulated rank (`RankStats` columns: compute_s, comm_exposed_s,
        idle_s, bubble_s, peak_memory_bytes and its parts...); ``represents``: how many
        ranks the row stands for (a rank class when folded). `rank_stats` has the same
        rows as objects; `to_json` as dicts."""
        import pandas as pd

        return pd.DataFrame([asdict(s) for s in self.rank_stats], columns=[f.name for f in fields(RankStats)])

    @cached_property
    def memory(self) -> "pd.DataFrame":
        return trace.memory_to_dataframe(self.memory_samples)

    def to_json(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction, "num_events": self.num_events,
            "sim_wall_s": self.sim_wall_s, "loop_wall_s": self.loop_wall_s, "folded": self.folded,
            "world_size": self.world_size, "costmodel": self.costmodel, "fits": self.fits,
            "memory_capacity_bytes": self.memory_capacity_bytes, "memory_verdict": self.memory_verdict,
            "memory_headroom_bytes": self.memory_headroom_bytes,
            "band": None if self.band is None else self.band.to_json(),
            "per_rank": [asdict(s) for s in self.rank_stats],
        }

    def explain(self, name: str = "", rank: int | None = None) -> "StepBreakdown":
        """Where the step goes (`piper_sim.explain.StepBreakdown`): compute by kind, recompute,
        optimizer, exposed communication per stream and bubble/idle, in seconds that add up to
        ``step_time_s``; the mean over every GPU, or ``rank``'s. ``str()`` of it is a short table."""
        from piper_sim.explain import explain

        return explain(self, name=name, rank=rank)

    def summary(self) -> list[tuple[str, str]]:
        """The result's key facts as (name, value) pairs: what `repr` and `_repr_html_` show."""
        header = PlanHeader.from_meta(self.meta)
        units = self.time_unit == "units"
        step = f"{self.step_time_s:.4g} units" if units else f"{self.step_time_s:.4g} s"
        worst = max(self.rank_stats, key=lambda s: (s.device_bytes, s.peak_memory_bytes), default=None)
        memory = ""
        if worst is not None:
            held = worst.device_bytes or worst.peak_memory_bytes
            memory = f"rank {worst.rank} {summary.gib(held)}"
            if self.memory_capacity_bytes:
                memory += f" of {summary.gib(self.memory_capacity_bytes)}"
            if self.memory_verdict:
                memory = f"{self.memory_verdict} ({memory})"
        return [("model", str(header.model or "")), ("cluster", str(header.cluster or "")),
                ("world", str(self.world_size)), ("schedule", str(header.schedule or "")),
                ("step", step), ("tokens/s", "" if units else f"{self.tokens_per_s:,.0f}"),
                ("MFU", "" if units or not self.mfu else f"{self.mfu:.1%}"), ("bubble", f"{self.bubble_fraction:.1%}"),
                ("memory", memory), ("events", f"{self.num_events:,}"),
                ("ranks simulated", f"{len(self.rank_stats)}" + (" (folded)" if self.folded else "")),
                ("cost model", self.costmodel)]

    def __repr__(self) -> str:
        """One line (the dataclass's would print every event row): `summary`."""
        return summary.one_line("SimResult", self.summary())

    def _repr_html_(self) -> str:
        return summary.html_table("piper-sim simulated step", self.summary())

    def over_memory(self) -> list[RankStats]:
        """Ranks whose peak memory does not fit the GPU."""
        return [s for s in self.rank_stats if s.fits is False]

    def shown_ranks(self, max_ranks: int = 16) -> list[int]:
        """Ranks to draw: all when few, else one per pipeline rank."""
        ranks = [s.rank for s in self.rank_stats]
        if len(ranks) <= max_ranks:
            return ranks
        first: dict[int, int] = {}
        for s in self.rank_stats:
            first.setdefault(s.pp_rank, s.rank)
        return list(first.values())[:64]

    def static_bytes(self) -> dict[int, float]:
        """Model-state bytes (params + grads + optimizer) per rank."""
        return {s.rank: s.params_bytes + s.grads_bytes + s.optimizer_bytes for s in self.rank_stats}

    def write_trace(self, path: str) -> None:
        """One Chrome trace file (Perfetto): a process per rank, a thread per stream, p2p
        flow arrows, a memory counter per rank."""
        trace.write_chrome_trace(self.events, path, flows=True, memory=self.memory, static_bytes=self.static_bytes())

    def write_kineto(self, out_dir: str, kernels: bool = True) -> list[str]:
        """Kineto-shaped traces, one file per simulated rank (per rank class when folded),
        that HolisticTraceAnalysis and Perfetto read (`piper_sim.kineto`). ``kernels``: each
        compute op as the kernels of its operator profile, with host ``cpu_op`` launches and
        cross-stream sync events (False: one kernel per op). Returns the paths."""
        from piper_sim.kineto import write_kineto_traces

        header = PlanHeader.from_meta(self.meta)
        cluster = str(header.cluster or "")
        return write_kineto_traces(self.events, out_dir, world_size=self.world_size or None,
                                   plan=self.plan if kernels else None,
                                   dtype=header.dtype or "bf16", memory=self.memory,
                                   static_bytes=self.static_bytes(), step_end=self.step_time_s,
                                   device_name=f"simulated {cluster}".strip(), name="piper-sim simulator",
                                   backend="gloo" if cluster.startswith("cpu") else "nccl")

    @property
    def time_unit(self) -> str | None:
        """"units" for a unit cost model (times are not seconds), else None (auto s/ms/µs)."""
        return "units" if self.costmodel.startswith("unit") else None

    def plot_timeline(self, path: str | None = None, title: str = "", *, ax: Any = None, **kwargs: Any) -> Any:
        """The step as a pipeline picture (`trace.plot_timeline`); returns the Figure,
        writes ``path`` when given, draws into ``ax`` when given."""
        kwargs.setdefault("ranks", self.shown_ranks())
        kwargs.setdefault("time_unit", self.time_unit)
        return trace.plot_timeline(self.events, path, title=title, ax=ax, **kwargs)

    def plot_memory(self, path: str | None = None, title: str = "", *, ax: Any = None, states: bool = True,
                    **kwargs: Any) -> Any:
        """Memory per rank over the step in GiB (`trace.plot_memory`); returns the Figure.
        ``states=False`` draws the activations alone, so their changes fill each panel."""
        kwargs.setdefault("ranks", self.shown_ranks())
        kwargs.setdefault("time_unit", self.time_unit)
        return trace.plot_memory(self.memory, path, title=title, static_bytes=self.static_bytes() if states else None,
                                 ax=ax, t_end=self.step_time_s, **kwargs)


# ----------------------------------------------------------------------------- folding


_COMPUTE, _COLLECTIVES, _P2P = frozenset(COMPUTE_KINDS), frozenset(COLLECTIVE_KINDS), frozenset(P2P_KINDS)
_KNOWN = _COMPUTE | _COLLECTIVES | _P2P
_NORMAL = simpy.events.NORMAL  # simpy's priority of a plain event
# an instruction's or an op's fields, read by C-level passes over a stream in set-up (25K ops at scale)
_ID, _KIND, _DEPS, _HOLDS, _NEEDED_BY = map(attrgetter, ("id", "kind", "deps", "holds", "needed_by"))
_INS = attrgetter("ins")


def class_comms(cls) -> tuple[dict[str, tuple[str, bool]], list[int]]:
    """The groups a rank class's collectives name (group -> (its first op's id, whether an
    all-to-all uses it)), in order of first use, and the pipeline ranks its SENDs and RECVs
    name: what `fold_is_exact` and `communicators` read of its instructions, in one pass."""
    named: dict[str, tuple[str, bool]] = {}
    peers: dict[int, None] = {}
    for lst in cls.streams.values():
        for ins in lst:
            kind = ins.kind
            if kind in _COLLECTIVES:
                first = named.get(ins.group)
                if first is None:
                    named[ins.group] = (ins.id, kind == "ALL_TO_ALL")
                elif not first[1] and kind == "ALL_TO_ALL":
                    named[ins.group] = (first[0], True)
            elif kind in _P2P:
                peers[ins.peer] = None
    return named, list(peers)


def fold_is_exact(plan: Plan, cluster: Cluster | None, used: list | None = None) -> tuple[bool, str]:
    """Whether simulating dp_rank 0 of each class gives every replica's timeline.

    True when each collective group and p2p pair of replica d has the topology (member
    classes, ranks per node) of replica 0's, so it costs the same and shares links the
    same way. Returns (exact, reason when not). ``used``: the classes' `class_comms`, in
    order, when the caller has them.
    """
    layout = plan.layout
    if layout.class_size == 1:
        return True, ""
    groups: set[tuple[int, str]] = set()
    peers: set[tuple[int, int]] = set()
    for c, (named, class_peers) in zip(plan.classes, used or map(class_comms, plan.classes)):
        for group, (op_id, _) in named.items():
            if group.startswith("ranks:"):
                return False, f"explicit group {group} of {op_id} on a class of {layout.class_size} ranks"
            groups.add((c.pp_rank, group))
        peers.update((c.pp_rank, peer) for peer in class_peers)
    if cluster is None or cluster.nodes == 1:
        return True, ""
    g, tp = cluster.gpus_per_node, layout.tp * layout.cp
    # nodes per DP index: a CP x TP block inside a node (cp * tp | g) leaves g / (cp * tp) DP
    # ranks per node; one spanning nodes (g | cp * tp) puts every DP rank on nodes of its own
    per_node = g // tp if g % tp == 0 else (1 if tp % g == 0 else 0)
    if per_node and layout.dp % per_node == 0 and (layout.ep % per_node == 0 or per_node % layout.ep == 0):
        return True, ""  # every class fills whole nodes, TP and EP blocks align with nodes

    def signature(ranks: list[int]) -> tuple:
        return (frozenset(layout.coords(r)[0] for r in ranks),
                tuple(sorted(Counter(cluster.node_of(r) for r in ranks).values())))

    others = list(range(1, layout.class_size))  # offsets of the other members of a class
    for pp, group in sorted(groups):
        first = layout.rank(pp, 0)
        ref = signature(layout.group_ranks(group, first))
        for o in others:
            if signature(layout.group_ranks(group, first + o)) != ref:
                c = layout.coords_of(first + o)
                return False, (f"group {group} of pipeline rank {pp} differs between dp_rank 0 and {c['dp']} "
                               f"(cp_rank {c['cp']}, tp_rank {c['tp']})")
    for pp, peer in sorted(peers):
        first, peer_first = layout.rank(pp, 0), layout.rank(peer, 0)
        ref = cluster.same_node((first, peer_first))
        for o in others:
            if cluster.same_node((first + o, peer_first + o)) != ref:
                return False, f"p2p between pipeline ranks {pp} and {peer} crosses nodes only for some replicas"
    return True, ""


# ----------------------------------------------------------------------------- engine


class _Op:
    """One instruction placed on one simulated rank."""

    __slots__ = ("ins", "rank", "stream", "deps", "dur", "peer", "group", "cost", "done", "event",
                 "posted", "start", "end", "started", "begun", "job", "gates", "post", "after")

    def __init__(self, ins: Instruction, rank: int, stream: str):
        self.ins = ins
        self.rank = rank
        self.stream = stream
        self.deps: list[_Op] | tuple = ()  # made by `_Engine._link_deps`
        self.dur: float | None = None  # compute ops
        self.peer = -1
        self.group: tuple[int, ...] = ()
        self.cost: tuple = ()  # comm: (duration, links, ranks it runs on, rendezvous key, members)
        self.done = False
        self.event: simpy.Event | None = None
        self.posted: float | None = None
        self.start = 0.0
        self.end = 0.0
        self.started: simpy.Event | None = None  # for ops waiting on part of this one
        self.begun = False  # a compute op has started running
        self.job: _Job | None = None  # a compute op's rate-shared work, while it runs
        self.gates: list[tuple[float, _Op]] | tuple = ()  # compute: (share of its work, gather it then waits for)
        self.post = 0.0  # comm: host seconds to post it
        self.after = 0.0  # comm: end of its stream's previous op (it starts no earlier)


class _Link:
    """A link's bandwidth and the transfers on it (job -> demanded bytes/s, in arrival order)."""

    __slots__ = ("name", "cap", "limit", "jobs")

    def __init__(self, name: str, cap: float):
        self.name = name
        self.cap = cap
        self.limit = cap * (1 + 1e-12)  # loads above it slow the link's transfers
        self.jobs: dict[_Job, float] = {}


class _Job:
    """Work (seconds at full rate) whose rate changes with link load or comm activity."""

    __slots__ = ("left", "rate", "t", "ver", "ev", "links", "ranks", "compute", "watch")

    def __init__(self, work: float, ev: simpy.Event, links: tuple, ranks: tuple, t: float, compute: bool = False):
        self.left = work
        self.rate = 1.0
        self.t = t
        self.ver = 0
        self.ev = ev
        self.links = links  # ((_Link, demand bytes/s), ...)
        self.ranks = ranks
        self.compute = compute
        # (work left, event when it is reached); a list made by the first watcher (most jobs have none)
        self.watch: list[tuple[float, simpy.Event]] | tuple = ()


class _JobEnd:
    """The end of a job at its current rate, as a simpy event (what `simpy.Environment.step`
    reads of one: ``callbacks`` and ``_ok``) lighter than a Timeout and a closure; ignored when
    the job was re-rated since (its ``ver`` moved on)."""

    __slots__ = ("callbacks", "_ok", "job", "ver")

    def __init__(self, callbacks: tuple, job: _Job):
        self.callbacks = callbacks  # the engine's one tuple (the loop only reads it): no list per event
        self._ok = True
        self.job = job
        self.ver = job.ver


class _TransferEnd:
    """The end of a transfer that runs at full rate throughout (`_Engine._private`), as a simpy
    event (``callbacks``, ``_ok``): no job, it is never re-rated."""

    __slots__ = ("callbacks", "_ok", "ranks", "ev")

    def __init__(self, callbacks: tuple, ranks: tuple, ev: simpy.Event):
        self.callbacks = callbacks  # as `_JobEnd`'s
        self._ok = True
        self.ranks = ranks
        self.ev = ev


class _Proc:
    """A generator run as a simpy process, resumed by each event it yields once that event is
    processed (at once when it already was), as `simpy.Process` resumes one; nothing waits on
    its end, so it schedules no event of its own (a Process schedules its initialisation and
    its end). `resume` runs it now, `spawn` where a new Process would first run."""

    __slots__ = ("send", "wake")

    def __init__(self, gen):
        self.send = gen.send
        self.wake = self.resume

    def resume(self, _ev: simpy.Event | None = None) -> None:
        send, wake = self.send, self.wake
        try:
            while True:
                callbacks = send(None).callbacks
                if callbacks is not None:  # not processed yet: go on when it is
                    callbacks.append(wake)
                    return
        except StopIteration:
            pass

    @staticmethod
    def spawn(env: simpy.Environment, gen) -> None:
        """Run ``gen`` as ``env.process(gen)`` would: from an urgent event at the current time."""
        ev = simpy.Event(env)
        ev._ok, ev._value = True, None
        ev.callbacks.append(_Proc(gen).resume)
        env.schedule(ev, priority=simpy.events.URGENT)


class _Host:
    """A rank's issuing thread: one holder at a time. Requests made at one instant are
    granted after that instant's other events ran, lowest ``key`` first, so the order does
    not depend on which simpy process woke first (folded and unfolded runs agree)."""

    GRANT = 2  # simpy event priority after NORMAL (1): the end of the instant

    def __init__(self, env: simpy.Environment):
        self.env = env
        self.holder: _Op | None = None
        self.waiting: list[tuple[tuple, _Op, simpy.Event]] = []
        self.granting = False

    def request(self, key: tuple, op: _Op) -> simpy.Event:
        ev = self.env.event()
        heapq.heappush(self.waiting, (key, op, ev))
        self._arm()
        return ev

    def release(self) -> None:
        self.holder = None
        self._arm()

    def _arm(self) -> None:
        if self.holder is None and self.waiting and not self.granting:
            self.granting = True
            ev = self.env.event()
            ev._ok, ev._value = True, None  # triggered, as Event.succeed does, at our priority
            ev.callbacks.append(self._grant)
            self.env.schedule(ev, priority=self.GRANT)

    def _grant(self, _ev: simpy.Event) -> None:
        self.granting = False
        if self.holder is None and self.waiting:
            _, op, ev = heapq.heappop(self.waiting)
            self.holder = op
            ev.succeed()


class _Engine:
    def __init__(self, plan: Plan, cm: CostModel, folded: bool, slow_ranks: dict[int, float] | None = None):
        self.plan, self.cm, self.folded = plan, cm, folded
        header = plan.header
        self.dtype = header.dtype or "bf16"
        self.layout = plan.layout
        self.env = simpy.Environment()
        self._queue, self._eid = self.env._queue, self.env._eid  # the loop's heap and event ids (hot paths)
        self.slow = float(getattr(cm, "comm_compute_slowdown", 1.0) or 1.0)
        self._comm_rate = 1.0 / self.slow  # a compute job's rate while a transfer runs on its rank
        # comm runs `comm_slow` times slower while any of its ranks computes (CPU: shared cores)
        self.comm_slow = float(getattr(cm, "comm_overlap_slowdown", 1.0) or 1.0)
        self.comm_jobs: dict[int, dict[_Job, None]] = {}
        self._slowed = self.slow != 1.0 or self.comm_slow != 1.0  # rates depend on what else runs
        self._slow_compute = self.slow != 1.0  # a transfer slows its ranks' compute
        self._slow_comm = self.comm_slow != 1.0  # compute slows its ranks' transfers
        # CPU clusters: ranks' compute shares the machine's cores (processor sharing);
        # None for accelerators, where each rank has its own device.
        self.cores = getattr(cm, "compute_slots", None)
        self.cpu_jobs: dict[_Job, int] = {}
        self.unit = isinstance(cm, UnitCostModel)
        # compute runs on the thread that posts comm (CPU ranks): it holds the rank's host
        self.host_bound = bool(getattr(cm, "host_bound", False))
        self.hosts: dict[int, _Host] = {}  # rank -> its issuing thread
        self.inside_until: dict[int, float] = {}  # rank -> end of the posts made from inside compute
        replicas = self._class_size = self.layout.class_size  # DP replicas x CP and TP peers of a pipeline rank
        self.ranks = [self.layout.rank(c.pp_rank, 0) for c in plan.classes] if folded else \
            list(range(self.layout.world_size))
        self.class_of = {r: plan.classes[self.layout.coords(r)[0]] for r in self.ranks}
        self.represents = {r: (replicas if folded else 1) for r in self.ranks}
        self.streams: dict[int, list[tuple[str, list[_Op]]]] = {}
        self.rows: list[tuple] = []  # one per op, in the order they finished (made after the run)
        self.finished: list[_Op] = []
        self.mem_cur = {r: 0.0 for r in self.ranks}
        self.mem_peak = {r: 0.0 for r in self.ranks}
        self.mem_samples: list[tuple[int, float, float]] = []
        self.p2p_pending: dict[tuple[int, int, str], tuple[_Op, simpy.Event]] = {}
        self.coll_pending: dict[tuple[str, int], tuple[simpy.Event, list[_Op]]] = {}
        self.on_link: dict[str, _Link] = {}
        self.active = dict.fromkeys(self.ranks, 0)  # rank -> its transfers running
        self.compute_jobs: dict[int, dict[_Job, None]] = {r: {} for r in self.ranks}
        self._coll_cache: dict[tuple, tuple] = {}
        self._p2p_cache: dict[tuple, tuple] = {}
        self._gids: dict[tuple[int, ...], int] = {}
        # (group, rank) -> (its ranks, small id), for each group a simulated rank's collectives name
        self.resolved_groups: dict[tuple[str, int], tuple[tuple[int, ...], int]] = {}
        self._post_cache: dict[tuple[str, float], float] = {}
        self._link_reps: dict[str, str] = {}
        self._group_reps: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._group_links: dict[tuple[str, tuple[int, ...] | int], tuple[str, ...]] = {}
        self._job_end_cbs, self._alone_end_cbs = (self._job_end,), (self._alone_end,)
        moe = header.moe
        self.routing = Routing(int(moe.top_k), int(moe.n_experts)) if moe is not None else None
        self.compute_scale = self._compute_scales(slow_ranks or {})
        # collectives the compute stream waits for from inside a piece (`Instruction.holds`; set by `_ops`)
        self.holding = False
        self.held = dict.fromkeys(self.ranks, 0.0)  # rank -> seconds its compute waited for them
        self.paused = dict.fromkeys(self.ranks, 0)  # rank -> holding collectives running now
        self.paused_since: dict[int, tuple[float, bool]] = {}  # rank -> (when, a compute op was paused)
        self._build()

    # --- setup ---------------------------------------------------------------------
    def _rep(self, rank: int) -> int:
        """The rank simulated for ``rank``: its class's first (a class is a contiguous block
        of ``class_size`` ranks, pp being the outermost mesh axis: `Layout.class_ranks`)."""
        return rank - rank % self._class_size if self.folded else rank

    def _group(self, ins: Instruction, rank: int) -> tuple[tuple[int, ...], int]:
        """(ranks, small id) of collective ``ins``'s group on ``rank``, resolved and checked once
        per (group, rank)."""
        key = (ins.group, rank)
        hit = self.resolved_groups.get(key)
        if hit is None:
            try:
                ranks = tuple(self.layout.group_ranks(ins.group, rank))
            except (KeyError, ValueError) as e:
                raise SimulationError(f"rank {rank}: cannot resolve collective group {ins.group!r}: {e}") from None
            if rank not in ranks:
                raise SimulationError(f"rank {rank}: collective {ins.id} has group {ins.group} "
                                      f"= {list(ranks)}, which does not contain the rank")
            hit = self.resolved_groups[key] = (ranks, self._gids.setdefault(ranks, len(self._gids)))
        return hit

    def _compute_scales(self, slow_ranks: dict[int, float]) -> dict[int, float]:
        """Per simulated rank, how much slower its compute runs than the cost model's GPU: the
        job's expected slowest GPU (`costmodel.stragglers.slowest_factor` over the world, the
        GPU's ``speed_spread``), times the slowdown of the slowest rank it stands for (a folded
        rank stands for its class: the class's collectives wait for that member)."""
        gpu = getattr(self.cm, "gpu", None)
        base = 1.0 if self.unit or gpu is None else slowest_factor(self.layout.world_size, gpu.speed_spread)
        scales = dict.fromkeys(self.ranks, base)
        for slow, factor in slow_ranks.items():
            r = self._rep(slow)
            scales[r] = max(scales[r], base * factor)
        return scales

    def _compute_durations(self, cls) -> dict[int, float]:
        """Duration of each compute instruction of a class (keyed by id(ins))."""
        cm = self.cm
        compute = []
        for lst in cls.streams.values():  # a stream's kinds by one C-level pass (25K instructions at scale)
            kinds = set(map(_KIND, lst))
            if kinds <= _COMPUTE:
                compute += lst
            elif kinds & _COMPUTE:
                compute += [ins for ins in lst if ins.kind in _COMPUTE]
        totals: dict[tuple[str, int, int], float] = {}  # the unit model splits a pass's time by flops
        if self.unit:
            for ins in compute:
                key = (ins.kind, ins.stage, ins.mb)
                totals[key] = totals.get(key, 0.0) + ins.flops
        n_opt = sum(ins.kind == "OPT" for ins in compute)
        out: dict[int, float] = {}
        cache: dict[tuple, float] = {}
        load = float(getattr(cm, "expert_load_factor", 1.0))
        for ins in compute:
            key = (ins.kernels, ins.expert_flops) if ins.kernels else (ins.kind, ins.flops, ins.bytes, tuple(ins.gemm), ins.expert_flops)
            if not self.unit and ins.kind != "OPT" and key in cache:
                out[id(ins)] = cache[key]
                continue
            priced = None
            if not self.unit and ins.kernels and ins.kind != "OPT":
                priced = cm.kernels_time(self.plan.kernels[ins.kernels])
            if priced is not None:
                t = priced
            elif self.unit:
                t = cm.compute_time(ins.kind, ins.flops)
                if ins.parts > 1:
                    total = totals[(ins.kind, ins.stage, ins.mb)]
                    t *= ins.flops / total if total > 0 else 1.0 / ins.parts
            elif ins.kind == "OPT" and ins.flops == 0 and ins.bytes == 0 and hasattr(cm, "optimizer_time"):
                # the plan carries no optimizer cost: Adam on the class's local parameter shard
                pbytes = DTYPE_BYTES.get(self.dtype, 2)
                stack = parse_stack(self.plan.header.stack or None, "plan meta.stack")
                params = cls.static_memory.get("optimizer_bytes", 0.0) / adam_state_bytes(pbytes, stack)
                t = cm.optimizer_time(params / max(1, n_opt))
            else:
                gemm = tuple(ins.gemm) if ins.gemm else None
                t = cm.compute_time(ins.kind, ins.flops, mem_bytes=ins.bytes, gemm=gemm)
            if ins.expert_flops and load != 1.0 and ins.flops > 0:
                # the most loaded EP rank's experts get `load` × the mean tokens
                t *= 1.0 + (load - 1.0) * min(1.0, ins.expert_flops / ins.flops)
            out[id(ins)] = cache[key] = float(t)
        return out

    def _build(self) -> None:
        durs: dict[int, dict[int, float]] = {}  # pipeline rank -> id(instruction) -> seconds
        for r in self.ranks:
            cls = self.class_of[r]
            if cls.pp_rank not in durs:
                durs[cls.pp_rank] = self._compute_durations(cls)
            streams, by_id = self._ops(r, cls, durs[cls.pp_rank])
            self._link_deps(r, streams, by_id)
            self.streams[r] = streams
        # some op takes host time to post: every op's post time came through `_post_time`'s cache
        posts = any(t > 0 for t in self._post_cache.values())
        if self.host_bound or posts:
            self.hosts = {r: _Host(self.env) for r in self.ranks}
        # compute runs as a rate-shared `_Job` when its rate can change while it runs: beside comm
        # (overlap slowdowns), on shared cores, on a busy host, or paused by a holding collective
        self.compute_as_job = self._slowed or bool(self.cores) or self.host_bound or self.holding
        # a compute job's rate depends only on whether a transfer runs on its rank (`_rate`): the
        # GPU case, where a job starts without the calls `_rerate` makes for the general one
        self._plain_compute = not (self._slow_comm or self.cores or self.holding)
        self._private = set() if self._slow_comm else self._private_links()

    def _private_links(self) -> set[tuple]:
        """The links of the transfers that run at full rate throughout: every link of theirs is
        used by the transfers of one (rank, stream) alone, which run one after another, so none
        ever shares a link (and nothing else slows a transfer when ``comm_slow`` is 1)."""
        users: dict[tuple, set[tuple[int, str]]] = {}  # a transfer's links -> the (rank, stream)s using them
        for r, streams in self.streams.items():
            for name, ops in streams:
                for links in {op.cost[1] for op in ops if op.cost}:
                    if links:
                        users.setdefault(links, set()).add((r, name))
        of_link: dict[_Link, set[tuple[int, str]]] = {}
        for links, who in users.items():
            for link, _ in links:
                of_link.setdefault(link, set()).update(who)
        return {links for links in users if all(len(of_link[link]) == 1 for link, _ in links)}

    def _ops(self, r: int, cls, durs: dict[int, float]) -> tuple[list[tuple[str, list[_Op]]], dict[str, _Op]]:
        """Rank ``r``'s ops per stream, priced (compute seconds, comm costs, post times), and the
        ops by id. The ops and the id index are made by C-level passes over each stream (25K
        instructions at scale); a duplicate id or an unknown kind sends the rank to
        `_raise_first_bad_op`, which names the first bad op in plan order."""
        scale = self.compute_scale[r]
        by_id: dict[str, _Op] = {}
        streams: list[tuple[str, list[_Op]]] = []
        kinds: set[str] = set()
        for name, lst in cls.streams.items():
            ops = list(map(_Op, lst, repeat(r), repeat(name)))
            by_id.update(zip(map(_ID, lst), ops))
            kinds.update(map(_KIND, lst))
            if not self.holding and any(map(_HOLDS, lst)):
                self.holding = True
            streams.append((name, ops))
        if len(by_id) != sum(len(ops) for _, ops in streams) or not kinds <= _KNOWN:
            self._raise_first_bad_op(r, cls)
        peers: dict[int, int] = {}  # pipeline rank -> the peer rank of r there
        costs: dict[tuple, tuple] = {}  # (kind, group, bytes, a2a) -> (group ranks, cost)
        for _, ops in streams:
            self._price(r, ops, durs, scale, peers, costs)
        return streams, by_id

    def _price(self, r: int, ops: list[_Op], durs: dict[int, float], scale: float, peers: dict[int, int],
               costs: dict[tuple, tuple]) -> None:
        """A stream's ops priced: compute seconds, comm costs and post times (their kinds are
        known). ``peers`` and ``costs``: the rank's p2p peers and collective costs found so far."""
        layout = self.layout
        for op in ops:
            ins = op.ins
            kind = ins.kind
            if kind in _COMPUTE:
                op.dur = durs[id(ins)] * scale
                continue
            if kind in _P2P:
                peer = peers.get(ins.peer)
                if peer is None:
                    if not 0 <= ins.peer < layout.pp:
                        raise SimulationError(f"rank {r}: {ins.id} names peer pipeline rank {ins.peer}, "
                                              f"outside 0..{layout.pp - 1}")
                    peer = peers[ins.peer] = layout.pipeline_peer(r, ins.peer)
                op.peer = peer
                if kind == "SEND":
                    op.cost = self._p2p_cost(ins.bytes, r, peer)
            else:  # a collective
                key = (kind, ins.group, ins.bytes, ins.a2a)
                hit = costs.get(key)
                if hit is None:
                    group, gid = self._group(ins, r)
                    hit = costs[key] = (group, self._collective_cost(kind, ins.bytes, group, gid, ins.a2a))
                op.group, op.cost = hit
                if ins.name:  # inner (`is_inner`): performed inside compute, not posted
                    continue
            op.post = self._post_time(kind, ins.bytes)

    def _raise_first_bad_op(self, r: int, cls) -> None:
        """Raise the error of rank ``r``'s first op (in stream and list order) that `_ops`
        cannot place: a duplicate id, an unknown kind, or an earlier p2p peer or collective
        group that does not resolve."""
        seen: set[str] = set()
        for lst in cls.streams.values():
            for ins in lst:
                if ins.id in seen:
                    raise SimulationError(f"rank {r}: op {ins.id} appears twice")
                seen.add(ins.id)
                if ins.kind in _P2P:
                    if not 0 <= ins.peer < self.layout.pp:
                        raise SimulationError(f"rank {r}: {ins.id} names peer pipeline rank {ins.peer}, "
                                              f"outside 0..{self.layout.pp - 1}")
                elif ins.kind in _COLLECTIVES:
                    self._group(ins, r)
                elif ins.kind not in _COMPUTE:
                    raise SimulationError(f"rank {r}: op {ins.id} has unknown kind {ins.kind!r}")
        raise AssertionError("_raise_first_bad_op found no bad op")  # pragma: no cover

    @staticmethod
    def _link_deps(r: int, streams: list[tuple[str, list[_Op]]], by_id: dict[str, _Op]) -> None:
        """Each op's ``deps`` as ops; the parameter gathers a compute op waits for part-way
        (``needed_by``) as its ``gates``, by share of its work. A stream with no ``needed_by``
        op links its deps in one tight loop (25K ops at scale); one with such an op, or a
        dependency this rank does not run, goes through `_link_stream`, which raises the first
        error in list order."""
        find = by_id.__getitem__
        for _, ops in streams:
            ins_list = list(map(_INS, ops))
            if any(map(_NEEDED_BY, ins_list)):
                _Engine._link_stream(r, ops, by_id)
                continue
            try:
                for op, deps in zip(ops, map(_DEPS, ins_list)):
                    if deps:  # a map, not a comprehension: no frame per op
                        op.deps = list(map(find, deps))
            except KeyError:
                _Engine._link_stream(r, ops, by_id)

    @staticmethod
    def _link_stream(r: int, ops: list[_Op], by_id: dict[str, _Op]) -> None:
        """`_link_deps` for one stream, op by op."""
        for op in ops:
            ins = op.ins
            try:
                if ins.deps:
                    op.deps = list(map(by_id.__getitem__, ins.deps))
            except KeyError as e:
                raise SimulationError(f"rank {r}: op {ins.id} depends on {e.args[0]}, which this rank "
                                      "does not run") from None
            if ins.needed_by:
                user = by_id.get(ins.needed_by)
                if user is None or user.dur is None:
                    raise SimulationError(f"rank {r}: op {ins.id} field 'needed_by' names "
                                          f"{ins.needed_by!r}, which is no compute op of this rank")
                user.gates = sorted([*user.gates, (ins.needed_at, op)], key=lambda g: g[0])

    # --- comm costs ------------------------------------------------------------------
    def _links(self, kind: str, ranks: tuple[int, ...], dur: float, nbytes: float, gid: int | None = None) -> tuple:
        """(`_Link`, demanded bytes/s) of a transfer; the links of a (kind, group), mapped to the
        simulated ranks' ports when folded, are derived once (a group's buckets share them).
        ``gid``: a collective group's small id (`_group`), the key rather than its 4K ranks."""
        key = (kind, ranks if gid is None else gid)
        links = self._group_links.get(key)
        if links is None:
            ports = self.cm.collective_ports(kind, ranks) if self.folded and kind not in P2P_KINDS else None
            if ports is not None:  # the same ports on every member: those of the simulated ranks
                reps = self._reps(tuple(sorted(set(ranks))))
                links = tuple(f"{p}:rank{r}:{d}" for p in ports for r in reps for d in ("tx", "rx"))
            else:
                links = self.cm.links(kind, ranks)
                if self.folded:
                    links = [self._link_rep(link) for link in links]
            links = self._group_links[key] = tuple(dict.fromkeys(links))
        if not links or dur <= 0:
            return ()
        if kind in ("SEND", "RECV"):
            volume = nbytes
        else:
            volume = nbytes * busbw_factor(kind, len(ranks))
        return tuple((link, min(link.cap, volume / dur)) for link in map(self._link, links))

    def _link(self, name: str) -> _Link:
        link = self.on_link.get(name)
        if link is None:
            link = self.on_link[name] = _Link(name, float(self.cm.link_bandwidth(name)))
        return link

    def _reps(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        """The simulated ranks of ``ranks``, in order, once each (derived once per group)."""
        reps = self._group_reps.get(ranks)
        if reps is None:
            if self.folded:  # `_rep` of each rank by C-level maps (groups of 4K ranks at scale)
                cs = self._class_size
                reps = tuple(dict.fromkeys(map(sub, ranks, map(mod, ranks, repeat(cs)))))
            else:
                reps = tuple(dict.fromkeys(ranks))
            self._group_reps[ranks] = reps
        return reps

    def _link_rep(self, link: str) -> str:
        """"nvlink:rank17:tx" -> the same port of rank 17's representative."""
        rep = self._link_reps.get(link)
        if rep is None:
            port, rank, direction = link.split(":")
            rep = self._link_reps[link] = f"{port}:rank{self._rep(int(rank[4:]))}:{direction}"
        return rep

    def _post_time(self, kind: str, nbytes: float) -> float:
        key = (kind, nbytes)
        t = self._post_cache.get(key)
        if t is None:
            t = self._post_cache[key] = float(self.cm.post_time(kind, nbytes))
        return t

    def _collective_cost(self, kind: str, nbytes: float, group: tuple[int, ...], gid: int, a2a: str = "") -> tuple:
        """(duration, links, simulated ranks, rendezvous key ``gid``, members to wait for), once
        per (kind, bytes, group, all-to-all direction)."""
        key = (kind, nbytes, gid, a2a)
        if key not in self._coll_cache:
            if a2a:  # an expert block's dispatch or combine
                dur = float(self.cm.all_to_all_time(nbytes, list(group), a2a, self.routing))
            else:
                dur = float(self.cm.collective_time(kind, nbytes, list(group)))
            reps = self._reps(group)
            members = len(reps) if self.folded else len(group)
            self._coll_cache[key] = (dur, self._links(kind, group, dur, nbytes, gid), reps, gid, members)
        return self._coll_cache[key]

    def _p2p_cost(self, nbytes: float, src: int, dst: int) -> tuple:
        key = (nbytes, src, dst)
        if key not in self._p2p_cache:
            dur = float(self.cm.p2p_time(nbytes, src, dst))
            self._p2p_cache[key] = (dur, self._links("SEND", (src, dst), dur, nbytes), (src, dst))
        return self._p2p_cache[key]

    # --- rate-shared jobs ---------------------------------------------------------------
    def _transfer(self, dur: float, links: tuple, ranks: tuple, ev: simpy.Event) -> None:
        if dur <= 0:
            ev.succeed()
            return
        if not links and not self._slowed:
            self.env.timeout(dur).callbacks.append(lambda _e: ev.succeed())
            return
        if links in self._private:  # at full rate throughout: one heap entry, no job to re-rate
            self._transfer_alone(dur, ranks, ev)
            return
        job = _Job(dur, ev, links, ranks, self.env._now)
        slow_comm = self._slow_comm
        if slow_comm:
            for r in ranks:
                self.comm_jobs.setdefault(r, {})[job] = None
        # the other jobs it re-rates, in order (the values are not used); None while there are none
        affected: dict[_Job, None] | None = None
        for link, demand in links:
            on = link.jobs
            on[job] = demand
            if len(on) > 1:
                if affected is None:
                    affected = {}
                affected.update(on)
        shared = affected is not None  # another transfer uses one of its links
        affected = self._transfer_began(ranks, affected)
        if shared or slow_comm:
            self._rerate(job, True)
        else:  # alone on its links, beside no compute that slows it: `_set_rate(job, 1.0, now)`, inlined
            job.ver = 1
            heapq.heappush(self._queue, (job.t + dur, _NORMAL, next(self._eid), _JobEnd(self._job_end_cbs, job)))
        if affected is not None:
            for j in affected:
                if j is not job:
                    self._rerate(j)

    def _transfer_alone(self, dur: float, ranks: tuple, ev: simpy.Event) -> None:
        """`_transfer` of one whose links no other transfer uses (`_private`), with the same events
        in the same order: its end at ``now + dur`` (a job's at rate 1), then the compute it slows."""
        affected = self._transfer_began(ranks, None)
        heapq.heappush(self._queue, (self.env._now + dur, _NORMAL, next(self._eid),
                                     _TransferEnd(self._alone_end_cbs, ranks, ev)))
        if affected is not None:
            for j in affected:
                self._rerate(j)

    def _alone_end(self, end: _TransferEnd) -> None:
        """`_job_end` of a `_transfer_alone`: its ranks' compute runs at full rate again."""
        affected = self._transfer_left(end.ranks, None)
        if affected is not None:
            for j in affected:
                self._rerate(j)
        self._succeed_last(end.ev)

    def _transfer_began(self, ranks: tuple, affected: dict | None) -> dict | None:
        """One transfer more on each of ``ranks``: a rank that had none computes slower from now
        (``_slow_compute``), so its compute jobs join ``affected`` (as `_transfer_left`), returned."""
        active = self.active
        for r in ranks:
            c = active[r]
            active[r] = c + 1
            if c == 0 and self._slow_compute and self.compute_jobs[r]:
                if affected is None:
                    affected = {}
                affected.update(self.compute_jobs[r])
        return affected

    def _transfer_left(self, ranks: tuple, affected: dict | None) -> dict | None:
        """One transfer fewer on each of ``ranks``: a rank with none left computes at full rate
        again, so its compute jobs join ``affected`` (the jobs to re-rate, in order; None while
        there are none), which is returned."""
        active = self.active
        for r in ranks:
            c = active[r] = active[r] - 1
            if c == 0 and self._slow_compute and self.compute_jobs[r]:
                if affected is None:
                    affected = {}
                affected.update(self.compute_jobs[r])
        return affected

    def _run_compute(self, rank: int, dur: float) -> _Job:
        job = _Job(dur, self.env.event(), (), (rank,), self.env._now, compute=True)
        jobs = self.compute_jobs[rank]
        first = not jobs
        jobs[job] = None
        if self._plain_compute:  # `_rerate(job, True)`, inlined: only a transfer on its rank slows it
            now = job.t
            rate = job.rate = self._comm_rate if self.active[rank] else 1.0
            job.ver = 1
            heapq.heappush(self._queue, (now + dur / rate, _NORMAL, next(self._eid), _JobEnd(self._job_end_cbs, job)))
            return job
        if first and self._slow_comm:
            for j in list(self.comm_jobs.get(rank, ())):
                self._rerate(j)
        if self.cores:
            self.cpu_jobs[job] = self.represents[rank]
            for j in self.cpu_jobs:
                if j is not job:
                    self._rerate(j)
        self._rerate(job, True)
        return job

    def _rate(self, job: _Job) -> float:
        if job.compute:
            if self.holding and self.paused[job.ranks[0]]:
                return 0.0  # waits for a holding collective
            rate = self._comm_rate if self.active[job.ranks[0]] else 1.0
            if self.cores:
                rate *= min(1.0, self.cores / sum(self.cpu_jobs.values()))
            return rate
        rate = 1.0
        if self._slow_comm and any(self.compute_jobs[r] for r in job.ranks):
            rate = 1.0 / self.comm_slow
        for link, _ in job.links:
            jobs = link.jobs
            if len(jobs) > 1:  # one transfer asks at most the link's bandwidth
                load = sum(jobs.values())
                if load > link.limit:
                    rate = min(rate, link.cap / load)
        return rate

    def _rerate(self, job: _Job, new: bool = False) -> None:
        rate = self._rate(job)
        now = self.env._now  # `env.now`, without the property call (hot path)
        if not new:
            if rate == job.rate:
                return
            job.left -= job.rate * (now - job.t)
        self._set_rate(job, rate, now)

    def _set_rate(self, job: _Job, rate: float, now: float) -> None:
        """Run ``job`` at ``rate`` from ``now`` (its work left as of now): schedule its end, and
        the shares ops wait for (``watch``), at that rate."""
        job.t, job.rate = now, rate
        job.ver += 1
        if rate == 0.0:  # paused (`_hold`): no end until it is re-rated
            return
        # env.schedule(_JobEnd(...), delay=...), inlined
        heapq.heappush(self._queue, (now + max(job.left, 0.0) / rate, _NORMAL, next(self._eid),
                                     _JobEnd(self._job_end_cbs, job)))
        for left, ev in job.watch:
            self._watch(job, job.ver, left, ev)

    def _watch(self, job: _Job, ver: int, left: float, ev: simpy.Event) -> None:
        """Trigger `ev` when `job` has `left` work left, unless re-rated before then."""
        def fire(_e):
            if ver == job.ver and not ev.triggered:
                ev.succeed()
        if job.rate == 0.0:  # paused: armed again when it is re-rated
            return
        now_left = job.left - job.rate * (self.env.now - job.t)
        self.env.timeout(max(now_left - left, 0.0) / job.rate).callbacks.append(fire)

    def _job_end(self, end: _JobEnd) -> None:
        job = end.job
        if end.ver != job.ver:
            return  # rescheduled since
        if job.compute:
            for _, ev in job.watch:
                if not ev.triggered:
                    ev.succeed()
            rank = job.ranks[0]
            jobs = self.compute_jobs[rank]
            del jobs[job]
            if not jobs and self._slow_comm:
                for j in list(self.comm_jobs.get(rank, ())):
                    self._rerate(j)
            if self.cores:
                del self.cpu_jobs[job]
                for j in self.cpu_jobs:
                    self._rerate(j)
            self._succeed_last(job.ev)
            return
        affected: dict[_Job, None] | None = None  # the jobs it re-rates, in order; None while there are none
        for link, _ in job.links:
            on = link.jobs
            del on[job]
            if on:
                if affected is None:
                    affected = {}
                affected.update(on)
        if self._slow_comm:
            for r in job.ranks:
                self.comm_jobs[r].pop(job, None)
        affected = self._transfer_left(job.ranks, affected)
        if affected is not None:
            for j in affected:
                self._rerate(j)
        self._succeed_last(job.ev)

    def _succeed_last(self, ev: simpy.Event) -> None:
        """``ev.succeed()`` as the last thing an event's callback does: when no other event is
        due at this instant ahead of it, the loop's next step would pop ``ev`` and run its
        callbacks, so they run now instead, as that step would (same order, one event less)."""
        queue = self._queue
        ev._ok, ev._value = True, None
        now = self.env._now
        if queue and queue[0][0] <= now and queue[0][1] <= _NORMAL:
            # something due first at this instant: keep simpy's order (`ev.succeed()`, inlined)
            heapq.heappush(queue, (now, _NORMAL, next(self._eid), ev))
            return
        callbacks, ev.callbacks = ev.callbacks, None
        for callback in callbacks:
            callback(ev)

    # --- ops ----------------------------------------------------------------------------
    def _p2p(self, op: _Op) -> simpy.Event:
        ins = op.ins
        send = ins.kind == "SEND"
        key = (op.rank, op.peer, ins.match) if send else (op.peer, op.rank, ins.match)
        other = self.p2p_pending.pop(key, None)
        if other is None:
            ev = self.env.event()
            self.p2p_pending[key] = (op, ev)
            return ev
        other_op, ev = other
        if other_op.ins.kind == ins.kind:
            raise SimulationError(f"rank {op.rank}: {ins.id} and {other_op.ins.id} on rank {other_op.rank} "
                                  f"are both {ins.kind}s with match {ins.match!r}")
        posted = max(op.posted, other_op.posted)  # both sides began posting, their streams free
        op.start, other_op.start = max(posted, op.after), max(posted, other_op.after)
        dur, links, ranks = (op if send else other_op).cost
        self._transfer(dur, links, ranks, ev)
        return ev

    def _collective(self, op: _Op) -> simpy.Event:
        dur, links, reps, gid, expected = op.cost
        if expected == 1:  # a group folded into one simulated rank (or a group of one): no rendezvous
            op.start = max(op.posted, op.after)
            ev = self.env.event()
            self._transfer(dur, links, reps, ev)
            if op.ins.holds:
                self._hold(op.rank, ev)
            return ev
        key = (op.ins.id, gid)
        entry = self.coll_pending.get(key)
        if entry is None:
            entry = self.coll_pending[key] = (self.env.event(), [])
        entry[1].append(op)
        if len(entry[1]) == expected:
            del self.coll_pending[key]
            posted = max(o.posted for o in entry[1])  # the last member began posting
            for o in entry[1]:
                o.start = max(posted, o.after)  # and its stream is free
            self._transfer(dur, links, reps, entry[0])
            for o in entry[1]:
                if o.ins.holds:
                    self._hold(o.rank, entry[0])
        return entry[0]

    def _progress(self, dep: _Op, share: float):
        """Wait until `share` of compute op `dep`'s work is done (its rate changes with comm
        overlap and shared cores)."""
        env = self.env
        job = dep.job
        if job is None:  # runs at full rate
            left = dep.start + share * dep.dur - env.now
            if left > 0:
                yield env.timeout(left)
            return
        target = (1.0 - share) * dep.dur  # work left when the share is done
        if job.left - job.rate * (env.now - job.t) <= target:
            return
        ev = env.event()
        if not job.watch:
            job.watch = []
        job.watch.append((target, ev))
        self._watch(job, job.ver, target, ev)
        yield ev

    def _run_for(self, rank: int, op: _Op, dur: float):
        """Run ``dur`` seconds of compute op ``op``'s work (stretched by overlap and shared cores)."""
        if self.compute_as_job and dur > 0:
            op.job = self._run_compute(rank, dur)
            yield op.job.ev
            op.job = None
        elif dur > 0:
            yield self.env.timeout(dur)

    def _run_gated(self, rank: int, op: _Op):
        """A compute op that waits part-way for parameter gathers (``needed_by``): run up to
        each gather's share of the work, wait for it there, go on."""
        done = 0.0
        for share, gate in op.gates:
            if share > done:
                yield from self._run_for(rank, op, (share - done) * op.dur)
                done = share
            if not gate.done:
                if gate.event is None:
                    gate.event = self.env.event()
                yield gate.event
                yield from self._inside_posts_done(rank)
        yield from self._run_for(rank, op, (1.0 - done) * op.dur)

    def _inside_posts_done(self, rank: int):
        """Wait until the posts made from inside the rank's compute op are done."""
        left = self.inside_until.get(rank, 0.0) - self.env.now
        if left > 0:
            yield self.env.timeout(left)

    def _post(self, rank: int, op: _Op, key: tuple):
        """Post comm op ``op``: ``op.post`` seconds of the rank's host (module docstring). From
        inside the compute op holding the host when the plan lets it start there (after the
        posts already made from inside it), else between compute ops, ahead of the next one."""
        env = self.env
        host = self.hosts[rank]
        holder = host.holder
        if holder is not None and holder.dur is not None and \
                (op.ins.needed_by or (op.ins.dep_progress < 1.0 and holder in op.deps)):
            begin = max(env.now, self.inside_until.get(rank, 0.0))
            if begin > env.now:
                yield env.timeout(begin - env.now)
            op.posted = begin
            self.inside_until[rank] = begin + op.post
            self._stall(holder, op.post)
            if op.post > 0:
                yield env.timeout(op.post)
            return
        yield host.request(key, op)
        op.posted = env.now
        if op.post > 0:
            yield env.timeout(op.post)
        host.release()

    def _hold(self, rank: int, ends: simpy.Event) -> None:
        """A holding collective (`Instruction.holds`) has started on ``rank``: the compute the
        rank runs beside it pauses (rate 0, `_rate`) until it ends (``ends``); that time is held."""
        self.paused[rank] += 1
        if self.paused[rank] == 1:
            jobs = self.compute_jobs[rank]
            self.paused_since[rank] = (self.env.now, bool(jobs))
            for job in list(jobs):
                self._rerate(job)
        ends.callbacks.append(lambda _e: self._unhold(rank))

    def _unhold(self, rank: int) -> None:
        self.paused[rank] -= 1
        if self.paused[rank] == 0:
            since, paused_compute = self.paused_since.pop(rank)
            if paused_compute:
                self.held[rank] += self.env.now - since
            for job in list(self.compute_jobs[rank]):
                self._rerate(job)

    def _stall(self, op: _Op, seconds: float) -> None:
        """Compute op ``op`` loses ``seconds`` to a post from inside it: its remaining work,
        and so each later share a gradient bucket waits for, ends that much later. A post
        made while it waits for a parameter gather overlaps the wait."""
        job = op.job
        if seconds <= 0 or job is None or job.ev.triggered:
            return
        job.left += seconds * job.rate - job.rate * (self.env.now - job.t)
        self._rerate(job, True)

    def _transfer_after(self, rank: int, name: str, op: _Op, prev: _Op | None):
        """A posted comm op's transfer, once the previous op of its stream is done."""
        if prev is not None:
            if not prev.done:
                if prev.event is None:
                    prev.event = self.env.event()
                yield prev.event
            op.after = prev.end
        yield self._p2p(op) if op.peer >= 0 else self._collective(op)
        self._finish(rank, name, op)

    def _finish(self, rank: int, name: str, op: _Op) -> None:
        op.end = now = self.env._now
        free = op.ins.free
        if free:  # the rank's memory drops (`mem_samples`); inlined: one per op
            cur = self.mem_cur[rank] = self.mem_cur[rank] - free
            if cur > self.mem_peak[rank]:
                self.mem_peak[rank] = cur
            self.mem_samples.append((rank, now, cur))
        op.done = True
        ev = op.event
        if ev is not None:  # ev.succeed(), inlined (a hot path: an op another waits on)
            ev._ok, ev._value = True, None
            heapq.heappush(self._queue, (op.end, _NORMAL, next(self._eid), ev))
        self.finished.append(op)

    def _rows(self) -> list[tuple]:
        """The event rows (`SimResult.rows`) of the finished ops, in the order they finished."""
        return [(op.rank, op.stream, ins.id, ins.kind, ins.stage, ins.mb, op.start, op.end, ins.bytes,
                 ins.flops, op.peer, op.posted) for op in self.finished for ins in (op.ins,)]

    def _stream(self, rank: int, si: int, name: str, ops: list[_Op]):
        env = self.env
        hosted = bool(self.hosts) and not (ops and is_inner(ops[0].ins))  # inner: performed inside compute
        host_bound = self.host_bound
        as_job = self.compute_as_job
        mem_cur, mem_peak, mem_samples = self.mem_cur, self.mem_peak, self.mem_samples
        prev: _Op | None = None  # the stream's last posted comm op (its transfer may still run)
        for i, op in enumerate(ops):
            ins = op.ins
            for dep in op.deps:
                if dep.done:
                    continue
                if ins.dep_progress < 1.0 and dep.dur is not None:
                    # wait until that share of the compute op ran (e.g. a gradient bucket)
                    if not dep.begun:
                        if dep.started is None:
                            dep.started = env.event()
                        yield dep.started
                    yield from self._progress(dep, ins.dep_progress)
                    continue
                if dep.event is None:
                    dep.event = env.event()
                yield dep.event
            op.posted = now = env._now  # `env.now` (hot path)
            alloc = ins.alloc
            if alloc:  # the rank's memory grows (`mem_samples`); inlined: one per op
                cur = mem_cur[rank] = mem_cur[rank] + alloc
                if cur > mem_peak[rank]:
                    mem_peak[rank] = cur
                mem_samples.append((rank, now, cur))
            dur = op.dur
            if dur is not None:
                if host_bound:
                    yield self.hosts[rank].request((1, si, i), op)
                op.start, op.begun = env._now, True
                if op.started is not None:
                    op.started.succeed()
                if op.gates:
                    yield from self._run_gated(rank, op)
                elif dur > 0 and as_job:  # `_run_for`, inlined
                    op.job = self._run_compute(rank, dur)
                    yield op.job.ev
                    op.job = None
                elif dur > 0:
                    yield env.timeout(dur)
                if host_bound:
                    yield from self._inside_posts_done(rank)
                    self.hosts[rank].release()
            elif hosted:  # posted now; the transfer follows the stream's previous op
                yield from self._post(rank, op, (0, si, i))
                _Proc.spawn(env, self._transfer_after(rank, name, op, prev))
                prev = op
                continue
            else:
                yield self._p2p(op) if op.peer >= 0 else self._collective(op)
            self._finish(rank, name, op)

    def run(self) -> None:
        # in the order simpy would initialise processes made now: ahead of every event they schedule
        for r in self.ranks:
            for si, (name, ops) in enumerate(self.streams[r]):
                _Proc(self._stream(r, si, name, ops)).resume()
        t0 = time.perf_counter()
        self._loop()
        self.loop_wall_s = time.perf_counter() - t0
        self._check_finished()
        self.rows = self._rows()

    def _loop(self) -> None:
        """``env.run()``, inlined: pop each event in simpy's order and run its callbacks, as
        `simpy.Environment.step` does, without a method call and a ``try`` per event (no event
        of the engine fails, so step's check of a failed event has nothing to raise)."""
        env = self.env
        queue, pop = env._queue, heapq.heappop
        while queue:
            env._now, _, _, event = pop(queue)
            callbacks, event.callbacks = event.callbacks, None
            for callback in callbacks:
                callback(event)

    # --- deadlock report ----------------------------------------------------------------
    def _waits_on(self, op: _Op) -> str:
        ins = op.ins
        host = self.hosts.get(op.rank)
        if host is not None and any(w[1] is op for w in host.waiting):
            h = host.holder
            why = f", which {self._waits_on(h)}" if h is not None and h.dur is not None else ""
            return f"waits for the rank's host (its issuing thread), held by {h.ins.id if h else 'no op'}{why}"
        if op.posted is None:
            missing = [d.ins.id for d in op.deps if not d.done]
            return "waits for " + ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
        if op.dur is not None:
            missing = [g.ins.id for _, g in op.gates if not g.done]
            return "waits part-way for " + ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
        if ins.kind in ("SEND", "RECV"):
            return f"waits for {p2p_partner_id(ins)} on rank {op.peer}"
        entry = self.coll_pending.get((ins.id, op.cost[3]))
        arrived = {o.rank for o in entry[1]} if entry else set()
        members = dict.fromkeys(self._rep(r) for r in op.group) if self.folded else op.group
        missing = [r for r in members if r not in arrived]
        return f"waits for ranks {','.join(map(str, missing[:8]))}{' ...' if len(missing) > 8 else ''} to reach it"

    def _check_finished(self) -> None:
        if len(self.finished) == sum(len(ops) for streams in self.streams.values() for _, ops in streams):
            return  # every op finished: no stream to scan for a blocked op
        blocked = []
        for r in self.ranks:
            for name, ops in self.streams[r]:
                op = next((o for o in ops if not o.done), None)  # a posted op's transfer may still wait
                if op is not None:
                    blocked.append(f"rank {r} {op.ins.id} {self._waits_on(op)}")
        if blocked:
            shown = "; ".join(blocked[:10]) + (f"; (+{len(blocked) - 10} more)" if len(blocked) > 10 else "")
            raise SimulationDeadlock(f"deadlock at t={self.env.now:.6g}s, {len(blocked)} streams blocked: {shown}")


# ----------------------------------------------------------------------------- results


def _peak_flops(plan: Plan, cm: CostModel) -> float:
    """The peak MFU is measured against: the plan's dtype (one dtype knob), else the cost model's."""
    gpu = getattr(cm, "gpu", None)
    if gpu is None:
        cluster = _plan_cluster(plan)
        if cluster is None:
            return 0.0
        gpu = cluster.gpu
    for dtype in (plan.header.dtype, getattr(cm, "dtype", None), "bf16"):
        if dtype in gpu.peak_flops:
            return gpu.peak(dtype)
    return 0.0


def _cluster(plan: Plan, cm: CostModel) -> Cluster | None:
    cluster = getattr(cm, "cluster", None)
    if cluster is not None or isinstance(cm, UnitCostModel):
        return cluster
    return _plan_cluster(plan)


def _plan_cluster(plan: Plan) -> Cluster | None:
    """The cluster the plan names (None: none, or one this version does not know)."""
    name = plan.header.cluster
    try:
        return parse_cluster(name) if name is not None else None
    except ValueError:
        return None


def _memory_device(plan: Plan, cm: CostModel):
    """The GPU of the plan's cluster (the cost model's, else the plan's), or None."""
    cluster = getattr(cm, "cluster", None) or _plan_cluster(plan)
    return None if cluster is None else cluster.gpu


def communicators(plan: Plan, cls, resolved: dict[tuple[str, int], tuple] | None = None,
                  used: tuple | None = None) -> tuple[int, int, int, tuple[int, ...]]:
    """The NCCL communicators a rank of this class uses, as a trainer makes them (one per group
    of ranks, one per send/recv peer, the world's): (2-rank ones, larger ones, the peers of its
    all-to-all groups, the sizes of those groups). ``resolved``: (group, rank) -> (ranks, ...)
    the simulator already resolved (the rest are resolved here); ``used``: the class's
    `class_comms`, when the caller has it."""
    rank = cls.ranks[0]
    layout = plan.layout
    named, peers = used or class_comms(cls)  # symbolic group -> (first op, used by an all-to-all); pipeline peers
    groups: dict[tuple[int, ...], bool] = {}  # ranks -> an all-to-all group
    for peer in peers:
        groups.setdefault(tuple(sorted({rank, layout.pipeline_peer(rank, peer)})), False)
    for group, (_, a2a) in named.items():
        if not group:
            continue
        hit = (resolved or {}).get((group, rank))
        ranks = hit[0] if hit is not None else tuple(layout.group_ranks(group, rank))
        groups[ranks] = groups.get(ranks, False) or a2a
    world = layout.world_size
    # the world's communicator, unless a group above is it (the world's ranks as a tuple are
    # made only to compare with a group of that size: 65,536 of them at scale)
    world_new = world > 1 and not any(len(g) == world and g == tuple(range(world)) for g in groups)
    pairs = sum(1 for g, a2a in groups.items() if len(g) == 2 and not a2a) + (world_new and world == 2)
    larger = sum(1 for g, a2a in groups.items() if len(g) > 2 and not a2a) + (world_new and world > 2)
    a2a_peers = sum(len(g) - 1 for g, a2a in groups.items() if a2a)
    return pairs, larger, a2a_peers, tuple(sorted(len(g) for g, a2a in groups.items() if a2a))


def _overlapped_pairs(plan: Plan) -> dict[tuple[int, str], int]:
    """(pp rank, op id) -> slot for the compute ops of overlapped F&B pairs: a slot that
    holds more than one (stage, kind, micro-batch) action."""
    out: dict[tuple[int, str], int] = {}
    for c in plan.classes:
        by_slot: dict[int, list[Instruction]] = {}
        for ins in c.streams.get("compute", []):
            if ins.slot >= 0 and ins.kind in COMPUTE_KINDS:
                by_slot.setdefault(ins.slot, []).append(ins)
        for slot, lst in by_slot.items():
            if len({(i.stage, i.kind, i.mb) for i in lst}) > 1:
                out.update({(c.pp_rank, i.id): slot for i in lst})
    return out


@gc_paused
def simulate(plan: Plan | str, costmodel: str | CostModel = "analytic", fold: bool = True,
             memory_headroom_bytes: float = DEFAULT_HEADROOM_BYTES,
             slow_ranks: dict[int, float] | None = None) -> SimResult:
    """Simulate one training step of `plan` (a Plan or a plan JSON path).

    costmodel: "analytic" (on the plan's cluster), "unit:F=1,BI=1,BW=1,comm=0", a
    calibration JSON path, or a CostModel. fold: simulate one replica per rank class when
    that is exact (see `fold_is_exact`); False simulates every rank. memory_headroom_bytes:
    the margin below the GPU's memory a plan must stay within to be ``fits`` rather than
    ``tight`` (`costmodel.memory.memory_verdict`). slow_ranks: a what-if, rank -> how many
    times slower it computes (a throttled or faulty GPU), over the fleet's spread that every
    GPU cluster gets (`costmodel.stragglers`).
    """
    t0 = time.perf_counter()
    if isinstance(plan, str):
        plan = Plan.load(plan)
    check_layout(plan)
    try:
        check_slow_ranks(slow_ranks or {}, plan.layout.world_size)
    except ValueError as e:
        raise SimulationError(str(e)) from None
    cluster = None
    if not isinstance(costmodel, CostModel):
        spec = str(costmodel)
        if not spec.strip().lower().startswith("unit"):
            if plan.header.cluster is None:
                raise SimulationError(f"cost model {spec!r} needs the plan's cluster (meta.cluster); "
                                      "compile the plan with piper-sim, or use a unit cost model")
            cluster = parse_cluster(plan.header.cluster)
        costmodel = get_costmodel(spec, cluster, dtype=plan.header.dtype)
    cm = costmodel
    used = [class_comms(c) for c in plan.classes]  # read by the folding check and the communicators
    exact, why = fold_is_exact(plan, _cluster(plan, cm), used) if fold else (False, "fold=False")
    folded = fold and exact
    if fold and not exact:
        log.debug("simulating every rank: folding is not exact (%s)", why)
    eng = _Engine(plan, cm, folded, slow_ranks)
    eng.run()

    layout = plan.layout
    step = max(map(itemgetter(7), eng.rows), default=0.0)  # the last op's end
    compute_s = dict.fromkeys(eng.ranks, 0.0)
    for row in eng.rows:
        if row[3] in _COMPUTE:
            compute_s[row[0]] += row[7] - row[6]
    exposed_of = trace.exposed_comm(map(itemgetter(0, 3, 6, 7), eng.rows))  # (rank, kind, start, end)
    for r, held in eng.held.items():  # a compute op waiting for a holding collective is exposed comm
        compute_s[r] -= held
        exposed_of[r] = exposed_of.get(r, 0.0) + held
    per_rank = []
    gpu = _memory_device(plan, cm)
    capacity = None if gpu is None else float(gpu.hbm_bytes)
    expandable = bool((plan.header.stack or {}).get("expandable_segments"))
    comms = {id(c): _runtime_comms(plan, cm, communicators(plan, c, eng.resolved_groups, u))
             for c, u in zip(plan.classes, used)} if gpu is not None else {}
    for r in eng.ranks:
        cls = eng.class_of[r]
        static = cls.static_memory
        exposed = exposed_of.get(r, 0.0)
        bubble = step - compute_s[r]
        sm = sum(float(v) for k, v in static.items() if k.endswith("_bytes") and k != "total_bytes")
        per_rank.append(RankStats(
            rank=r, pp_rank=layout.coords(r)[0], represents=eng.represents[r], compute_s=compute_s[r],
            comm_exposed_s=exposed, idle_s=max(0.0, bubble - exposed), bubble_s=bubble,
            peak_memory_bytes=sm + eng.mem_peak[r],
            params_bytes=float(static.get("params_bytes", 0.0)), grads_bytes=float(static.get("grads_bytes", 0.0)),
            optimizer_bytes=float(static.get("optimizer_bytes", 0.0)), activations_bytes=eng.mem_peak[r],
            **_memory_fields(sm, eng.mem_peak[r], gpu, expandable, comms.get(id(cls)), memory_headroom_bytes)))
    weights = sum(s.represents for s in per_rank) or 1
    bubble_fraction = (sum(s.bubble_s * s.represents for s in per_rank) / weights / step) if step > 0 else 0.0
    header = plan.header
    tokens = header.tokens_per_step
    if tokens is None and header.global_batch is not None and header.seq_len is not None:
        tokens = header.global_batch * header.seq_len
    peak = _peak_flops(plan, cm)
    log.debug("simulated %d events on %d ranks in %.3f s (%s): step %.6g s", len(eng.rows), len(eng.ranks),
              time.perf_counter() - t0, "folded" if folded else "unfolded", step)
    model_flops = header.model_flops_per_step
    return SimResult(
        step_time_s=step,
        tokens_per_s=(tokens or 0) / step if step > 0 else 0.0,
        mfu=model_flops / (step * layout.world_size * peak) if step > 0 and peak > 0 else 0.0,
        bubble_fraction=bubble_fraction,
        rank_stats=per_rank, num_events=len(eng.rows), sim_wall_s=time.perf_counter() - t0,
        loop_wall_s=eng.loop_wall_s,
        rows=eng.rows, memory_samples=eng.mem_samples, folded=folded, world_size=layout.world_size,
        costmodel=getattr(cm, "name", type(cm).__name__), pairs=_overlapped_pairs(plan),
        meta={k: v for k, v in plan.meta.items() if isinstance(v, (str, int, float, bool))},
        fits=None if capacity is None else all(s.fits for s in per_rank),
        memory_verdict=None if capacity is None else _worst_verdict(s.memory_verdict for s in per_rank),
        memory_headroom_bytes=memory_headroom_bytes,
        memory_capacity_bytes=capacity or 0.0,
        band=_band(plan, cm, step),
        plan=plan,
    )


VERDICT_ORDER = ("fits", "tight", "oom")


def _worst_verdict(verdicts) -> str:
    return max(verdicts, key=VERDICT_ORDER.index, default="fits")


def _runtime_comms(plan: Plan, cm, comms: tuple) -> tuple[int, int, int, float]:
    """(pairs, larger groups, NCCL all-to-all peers, DeepEP buffer bytes) for `memory_need`: an
    all-to-all the cost model runs as DeepEP (`costmodel.collectives.a2a_algorithm`) holds DeepEP's
    buffers (`costmodel.memory.deepep_buffer_bytes`), not NCCL all-to-all connections."""
    pairs, larger, a2a_peers, sizes = comms
    moe, cluster = getattr(cm, "moe", None), getattr(cm, "cluster", None)
    if not sizes or moe is None or cluster is None or a2a_algorithm(moe, cluster) != "deepep":
        return pairs, larger, a2a_peers, 0.0
    from piper_sim.configs import config_of

    hidden_bytes = config_of(plan.header).hidden * DTYPE_BYTES[plan.header.dtype]
    return pairs, larger, 0, sum(deepep_buffer_bytes(hidden_bytes, n) for n in sizes)


def _memory_fields(static: float, transient: float, gpu, expandable: bool, comms: tuple | None,
                   headroom: float) -> dict[str, Any]:
    """A rank's memory as the device holds it (`costmodel.memory.memory_need`) and its verdict."""
    if gpu is None:
        return {}
    need = memory_need(static, transient, gpu.family, expandable, *(comms or (0, 0, 0, 0.0)))
    verdict = memory_verdict(need, float(gpu.hbm_bytes), headroom)
    return {"reserved_bytes": need.reserved, "runtime_bytes": need.runtime, "memory_verdict": verdict,
            "fits": verdict != "oom"}


def _band(plan: Plan, cm: CostModel, step: float) -> Band | None:
    """The published-runs error band of this step, for the sourced (analytic) model on a GPU."""
    gpu = getattr(cm, "gpu", None)
    if not isinstance(cm, AnalyticCostModel) or cm.name != "analytic" or gpu is None or gpu.name == "CPU":
        return None
    return band_for(step, run_class(plan.meta, plan.layout.pp, plan.layout.ep, plan.layout.dp))
