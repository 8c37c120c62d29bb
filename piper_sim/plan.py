"""The Plan: the contract between compiler, simulator and executor.

A Plan holds, for each *class* of equivalent ranks, one ordered instruction list per
stream. All data-parallel replicas, expert-parallel peers and tensor-parallel peers of one
pipeline rank run the same list; only their peers and groups differ. `Plan.expand()`
resolves the symbolic peers and groups into explicit global ranks, giving one `RankProgram`
per rank.

The device mesh has named axes ``pp, dp, cp, tp`` (`Layout.axes`, outermost first; ``ep``
splits ``dp``), one rank formula (`Layout.rank_at`, mixed radix over the axes) and one group
per axis (`Layout.axis_group`); a new parallelism adds an axis there::

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

Tensor parallel is innermost, so a TP group is ``tp`` consecutive ranks and stays inside a
node when ``tp`` divides the GPUs per node; context parallel next (a CP group is ``cp`` ranks
``tp`` apart, and a TP x CP block of ``cp * tp`` consecutive ranks stays inside a node when it
divides the GPUs per node); then data parallel (an EP group is ``ep`` consecutive DP ranks
with the same pp, cp and tp rank), then pipeline (Megatron's order). A rank class (one
pipeline rank) is the ``dp * cp * tp`` consecutive ranks from ``pp_rank * dp * cp * tp``.
With ``cp == tp == 1`` this is ``rank = pp_rank * dp + dp_rank``. Groups of every axis:
`Layout.group_ranks`.

Instruction kinds
  compute: F, B, BI, BW, OPT
  p2p:     SEND, RECV              (matched by ``match``: the same string on both sides)
  coll:    ALLREDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL

Dependencies (``deps``) name op ids on the same rank (any stream). Cross-rank
dependencies are implicit: a RECV completes when its SEND (same ``match`` on ``peer``)
has been transferred; a collective completes when every member of its group reached it.
Within a stream, instructions run in list order (like a CUDA stream).

Memory: ``alloc`` bytes are taken when an instruction starts; ``free`` bytes are
released when it ends. ``Plan.static_memory`` gives per class the bytes of parameters,
gradients and optimizer state held for the whole step.

This module imports only the standard library.
"""

from __future__ import annotations

import copy
import functools
import gc
import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from typing import Any, Callable, TypeVar

from piper_sim.checks import check_world_size
from piper_sim.header import PlanHeader
from piper_sim import summary

_F = TypeVar("_F", bound=Callable[..., Any])

PLAN_FORMAT = "piper-sim-plan"
PLAN_VERSION = 2  # 2: typed fields (direction, bucket, experts, block, round, name) instead of parsing op ids
# The file form (`Plan.dumps`, `Plan.save`): version 2's content, each instruction an array
# [shape, values...] under a shared table of field names (``"fields"``), its stream left out
# (the stream it is listed under): a third of the size at 16K ranks. The hash is the content's.
FILE_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # version 1 plans are upgraded on load (`_upgrade_v1`), 3 unpacked (`_unpack`)

PASS_KINDS = ("F", "B", "BI", "BW")  # compute of a forward / backward pass (OPT is not)
COMPUTE_KINDS = PASS_KINDS + ("OPT",)
BACKWARD_KINDS = ("B", "BI", "BW")
SPLIT_KINDS = ("F", "B", "BI")  # cut into pieces (per unit, around expert blocks); BW stays one op
INPUT_GRAD_KINDS = ("B", "BI")  # produce the input gradients (and re-run the forward under recompute)
WEIGHT_GRAD_KINDS = ("B", "BW")  # produce the weight gradients
P2P_KINDS = ("SEND", "RECV")
COLLECTIVE_KINDS = ("ALLREDUCE", "REDUCE_SCATTER", "ALL_GATHER", "ALL_TO_ALL")
ALL_KINDS = COMPUTE_KINDS + P2P_KINDS + COLLECTIVE_KINDS


def gc_paused(fn: _F) -> _F:
    """``fn`` run with Python's cyclic garbage collector paused (then resumed as it was). A
    compile, a simulation or a plan's JSON makes hundreds of thousands of objects that stay
    alive, and every full collection on the way walks all of them: a third of the time at
    16K ranks. What is garbage is collected after."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()
    return run  # type: ignore[return-value]


class PlanError(ValueError):
    """A plan file that cannot be used (wrong version, hash, world size...)."""


class PlanValidationError(ValueError):
    """The plan is inconsistent or would deadlock (`piper_sim.validate`), or is not what its own
    strategy compiles to (`piper_sim.origin`); one line naming the ops."""


@dataclass(slots=True)  # 33 fields: a dict per instruction would not share its keys (~1.6 KB each)
class Instruction:
    """One op on one stream of one rank.

    id:      stable readable op id, unique per rank (``F.s3.mb5``, ``AR.s0.b2``).
    kind:    one of ALL_KINDS.
    stream:  stream name (``compute``, ``send``, ``recv``, ``dp``, ``ep``).
    stage:   pipeline stage (-1 when not tied to one).
    mb:      micro-batch index (-1 when not tied to one).
    deps:    op ids on the same rank that must finish first.
    flops:   floating point operations (compute ops).
    bytes:   payload bytes per rank (comm ops: the tensor each member contributes;
             for ALL_GATHER the full gathered size; compute: HBM traffic estimate).
    alloc/free: memory taken at start / released at end, bytes.
    peer:    p2p only. Folded plan: the peer's pipeline rank (same dp, cp and tp rank).
             Expanded: the peer's global rank.
    match:   p2p only: the key that pairs a SEND with its RECV.
    group:   collectives only. Folded: a symbolic group (see ``Layout.group_ranks``).
             Expanded: ``"ranks:0,1,2"``.
    slot:    compute only: index of the ``order`` slot; two ops with one slot are an
             overlapped pair. -1 otherwise.
    part:    piece of a stage split around expert all-to-alls, or per unit under ZeRO-3
             (0 when not split), and ``parts`` the number of pieces.
    tokens:  tokens processed (compute), for the cost model's GEMM-size efficiency.
    recompute: forward is recomputed inside this backward (B/BI): all of it under full
             recompute, the attention cores under selective (``meta["recompute"]``: stage ->
             mode).
    gemm:    [m, n, k] of the op's dominant matmul, for size-dependent efficiency.
    kernels: compute only: key of the op's operator-level table in ``Plan.kernels``.
    dep_progress: the share of its compute deps that must have run before this op may
             start (1.0: all of it). A gradient bucket is ready part-way through the last
             backward (buckets fill from the last layer), as DDP/FSDP overlap them. A back
             end that waits for the whole op is correct, only less overlapped.
    a2a:     ALL_TO_ALL of an expert block only: "dispatch" when it moves tokens (forward)
             or their output gradients (backward) to the experts, "combine" when it moves
             expert outputs or input gradients back (the backward of a dispatch is a
             combine, as in DeepEP). The cost model prices them apart (FP8 dispatch).
    expert_flops: compute only, under expert parallel: the part of ``flops`` spent in
             expert blocks (all of it for an expert piece; the experts' weight gradients
             in a stage's BW), which the most loaded EP rank has more of.

    The op id is a readable name only: a back end reads these fields, never the id
    (`piper_sim.ir.op_id` forms the id from them).

    direction: "F" (forward) or "B" (backward) for SEND/RECV (the activation or its
             gradient), ALL_TO_ALL, ZeRO-3 gathers (before a forward / a backward) and
             tensor-parallel collectives ("R": re-run inside a recomputing backward: full,
             op-SAC, every-N, Megatron's mlp);
             "" otherwise.
    bucket:  gradient / parameter collectives of data parallel (AR, RS, AG): the bucket
             index within the stage's flat parameters; -1 otherwise.
    experts: that bucket is of the expert-parallel shard (synced over ``stage:S:edp``),
             not of the dense parameters.
    block:   ALL_TO_ALL only: the expert block (MoE layer) of the stage, counted from 0.
    round:   ZeRO collectives numbered per stage copy (DualPipe's two copies pair up): the
             i-th forward / backward of the stage on this rank; -1 otherwise.
    name:    tensor-parallel collectives only: which one (``l3.attn.ag``, ``head.loss.max``,
             ``norms``).
    needed_by, needed_at: a ZeRO-1/2 parameter ALL_GATHER overlapped with the next step's
             forward (Megatron's ``overlap_param_gather``): it gathers the shards the previous
             step's optimizer updated, and compute op ``needed_by`` (the stage's first forward
             piece using the bucket) may run ``needed_at`` of its work (where its first
             parameter is used) before it waits for this gather. Not a dependency: the
             gather has none, and the compute op does not list it.
    holds:   a tensor-parallel collective run beside its compute piece (``dep_progress`` 0)
             that the compute stream waits for all the same: a blocking collective among async
             ones (the stack's ``tp_backward_overlap``); the piece's compute pauses while it runs.
    tied:    ALLREDUCE of a tied embedding's word-embedding gradient between its two copies,
             the first stage's embedding and the last stage's output layer, over the
             ``embed`` group (Megatron-Core ``_allreduce_word_embedding_grads``).
    """

    id: str
    kind: str
    stream: str
    stage: int = -1
    mb: int = -1
    deps: list[str] = field(default_factory=list)
    flops: float = 0.0
    bytes: float = 0.0
    alloc: float = 0.0
    free: float = 0.0
    peer: int = -1
    match: str = ""
    group: str = ""
    slot: int = -1
    part: int = 0
    parts: int = 1
    tokens: int = 0
    recompute: bool = False
    gemm: list[int] = field(default_factory=list)
    dep_progress: float = 1.0
    kernels: str = ""
    a2a: str = ""
    expert_flops: float = 0.0
    direction: str = ""
    bucket: int = -1
    experts: bool = False
    block: int = -1
    round: int = -1
    name: str = ""
    needed_by: str = ""
    needed_at: float = 0.0
    tied: bool = False
    holds: bool = False

    def to_json(self) -> dict[str, Any]:
        defaults = _INSTRUCTION_DEFAULTS
        return {k: (list(v) if isinstance(v, list) else v) for k, v in zip(_INSTRUCTION_FIELDS, _FIELD_VALUES(self))
                if k in ("id", "kind", "stream") or v != defaults[k]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Instruction":
        return cls(**d)


_INSTRUCTION_DEFAULTS = asdict(Instruction(id="", kind="", stream=""))
_INSTRUCTION_FIELDS = tuple(_INSTRUCTION_DEFAULTS)  # in declaration order, as a plan file lists them
_FIELD_VALUES = attrgetter(*_INSTRUCTION_FIELDS)  # an instruction's values, in that order


def p2p_id(kind: str, match: str) -> str:
    """The op id of a SEND or RECV with this ``match`` (both sides of a pair share it)."""
    return f"{kind}.{match}"


def p2p_partner_id(ins: Instruction) -> str:
    """The op id of the other side of a SEND / RECV, on its peer."""
    return p2p_id("RECV" if ins.kind == "SEND" else "SEND", ins.match)


def missing_fields(ins: Instruction) -> list[str]:
    """The typed fields a back end reads for this kind of instruction that ``ins`` lacks
    (empty when it is complete). Data-parallel collectives need a ``bucket``; tensor-parallel
    ones (on their own stream, no bucket) a ``name``."""
    k = ins.kind
    need: list[tuple[str, bool]] = [("stage", ins.stage >= 0)]
    if k in PASS_KINDS or k in P2P_KINDS or k == "ALL_TO_ALL":
        need.append(("mb", ins.mb >= 0))
    if k in P2P_KINDS:
        need += [("direction", ins.direction in ("F", "B")), ("peer", ins.peer >= 0), ("match", bool(ins.match))]
    elif k == "ALL_TO_ALL":
        need += [("direction", ins.direction in ("F", "B")), ("block", ins.block >= 0),
                 ("a2a", ins.a2a in ("dispatch", "combine")), ("group", bool(ins.group))]
    elif k in COLLECTIVE_KINDS:
        need += [("group", bool(ins.group)), ("bucket or name", ins.bucket >= 0 or bool(ins.name) or ins.tied)]
        if ins.bucket >= 0 and ins.direction:  # a ZeRO-3 gather before one forward / backward
            need += [("round", ins.round >= 0), ("mb", ins.mb >= 0)]
    return [f for f, ok in need if not ok]


@dataclass
class RankClass:
    """Ranks that run the same instruction lists (one pipeline rank, all its DP/EP/CP/TP peers)."""

    pp_rank: int
    ranks: list[int]
    streams: dict[str, list[Instruction]]
    static_memory: dict[str, float] = field(default_factory=dict)
    stages: list[int] = field(default_factory=list)

    def instructions(self) -> list[Instruction]:
        return [ins for lst in self.streams.values() for ins in lst]


@dataclass
class RankProgram:
    """The expanded program of one global rank (explicit peers and groups)."""

    rank: int
    pp_rank: int
    dp_rank: int
    streams: dict[str, list[Instruction]]
    static_memory: dict[str, float]
    stages: list[int]
    tp_rank: int = 0
    cp_rank: int = 0


MESH_AXES = ("pp", "dp", "cp", "tp")  # the grid's axes, outermost first (tp innermost); ep splits dp


@dataclass
class Layout:
    """Where every rank sits: the named-axis mesh `axes` (pp, dp, cp, tp; ep splits dp), see
    the module docstring. One rank formula (`rank_at`, mixed radix over the axes, tp innermost)
    and one group construction per axis (`axis_group`): a new parallelism adds an axis to
    `axes` and keeps both."""

    pp: int
    dp: int
    ep: int = 1
    # stage -> list of pipeline ranks holding a copy (two copies under dualpipe)
    stage_ranks: dict[int, list[int]] = field(default_factory=dict)
    tp: int = 1
    cp: int = 1
    # hybrid sharding (HSDP): ZeRO shards over groups of dp_shard consecutive DP ranks and
    # replicates across the dp / dp_shard groups (0: shard over every DP rank)
    dp_shard: int = 0

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def class_size(self) -> int:
        """Ranks per rank class (one pipeline rank): its DP replicas times its CP and TP peers."""
        return self.dp * self.cp * self.tp

    @property
    def axes(self) -> dict[str, int]:
        """The mesh's named axes and their sizes, outermost first (`MESH_AXES`)."""
        return dict(zip(MESH_AXES, self._sizes()))

    def _sizes(self) -> tuple[int, ...]:
        return self.pp, self.dp, self.cp, self.tp

    def _index(self, coords: tuple[int, ...]) -> int:
        """The rank formula: mixed radix over the axes (coordinates in `MESH_AXES` order)."""
        r = 0
        for c, n in zip(coords, self._sizes()):
            r = r * n + c
        return r

    def _coords(self, rank: int) -> tuple[int, ...]:
        out = []
        for n in reversed(self._sizes()):
            rank, c = divmod(rank, n)
            out.append(c)
        return tuple(reversed(out))

    def rank_at(self, coords: dict[str, int]) -> int:
        """The global rank at these coordinates (an axis left out: 0)."""
        return self._index(tuple(coords.get(a, 0) for a in MESH_AXES))

    def coords_of(self, rank: int) -> dict[str, int]:
        """The rank's coordinate on every axis of the grid (inverse of `rank_at`)."""
        return dict(zip(MESH_AXES, self._coords(rank)))

    def axis_group(self, axis: str, rank: int) -> list[int]:
        """The ranks that differ from ``rank`` on ``axis`` only, in axis order (its group)."""
        sizes = self._sizes()
        a = MESH_AXES.index(axis)
        stride = math.prod(sizes[a + 1:])  # the rank formula's weight of that axis
        c = list(self._coords(rank))
        c[a] = 0
        first = self._index(tuple(c))
        return list(range(first, first + sizes[a] * stride, stride))

    def class_ranks(self, pp_rank: int) -> list[int]:
        """The ranks of one rank class (every coordinate but ``pp``), in rank order."""
        first = self.rank_at({"pp": pp_rank})
        return list(range(first, first + self.class_size))

    def rank(self, pp_rank: int, dp_rank: int, tp_rank: int = 0, cp_rank: int = 0) -> int:
        return self._index((pp_rank, dp_rank, cp_rank, tp_rank))

    def coords(self, rank: int) -> tuple[int, int]:
        """(pp_rank, dp_rank) of a rank (its tp_rank: `tp_rank`, all axes: `mesh_coords`)."""
        c = self._coords(rank)
        return c[0], c[1]

    def tp_rank(self, rank: int) -> int:
        return self._coords(rank)[3]

    def cp_rank(self, rank: int) -> int:
        return self._coords(rank)[2]

    def pipeline_peer(self, rank: int, pp_rank: int) -> int:
        """The rank on pipeline rank ``pp_rank`` with ``rank``'s other coordinates (its p2p peer)."""
        return self.rank_at({**self.coords_of(rank), "pp": pp_rank})

    def mesh_coords(self, rank: int) -> dict[str, int]:
        """The rank's coordinate on every axis (``ep``: its expert shard, dp_rank mod ep)."""
        c = self.coords_of(rank)
        return {"pp": c["pp"], "dp": c["dp"], "ep": c["dp"] % self.ep, "cp": c["cp"], "tp": c["tp"]}

    def group_ranks(self, group: str, rank: int) -> list[int]:
        """Resolve a symbolic group as seen from ``rank`` to sorted global ranks.

        ``tp``          the tensor-parallel peers of ``rank`` (same pp, dp and cp rank).
        ``cp``          the context-parallel peers of ``rank`` (same pp, dp and tp rank).
        ``ep``          the expert-parallel peers of ``rank`` (same pp, cp and tp rank).
        ``dp``          all data-parallel replicas of ``rank`` (same pp, cp and tp rank).
        ``pp``          the pipeline of ``rank`` (same dp, cp and tp rank).
        ``stage:S``     all ranks holding a copy of stage S with ``rank``'s tp rank, over
                        dp x cp (data-parallel gradient sync of that tensor-parallel shard:
                        parameters are replicated over the context-parallel ranks too).
        ``stage:S:edp`` those of them that hold the same expert shard as ``rank``.
        ``stage:S:shard`` hybrid sharding: those of ``stage:S`` in ``rank``'s shard group
                        (the same ``dp_rank // dp_shard``).
        ``stage:S:rep`` hybrid sharding: ``rank``'s replicas of its shard (same pp, cp, tp
                        and ``dp_rank % dp_shard``), one per shard group.
        ``embed``       a tied embedding's two copies: ``rank``'s peers (same dp, cp and tp
                        rank) on the pipeline ranks of the first and the last stage
                        (Megatron's embedding group); ``rank`` alone when it holds both
                        stages (placement v, DualPipe).
        ``ranks:a,b``   already explicit.
        """
        if group.startswith("ranks:"):
            return [int(x) for x in group[6:].split(",")]
        if group in self.axes:
            return self.axis_group(group, rank)
        pp, dp, cp, tp = self._coords(rank)
        index = self._index
        if group == "embed":
            first, last = self.stage_ranks[0], self.stage_ranks[max(self.stage_ranks)]
            if set(first) & set(last):  # both copies on each of these ranks: summed locally
                return [rank]
            return sorted({index((p, dp, cp, tp)) for p in first + last})
        if group == "ep":  # ep consecutive data-parallel ranks
            first = dp // self.ep * self.ep
            return [index((pp, d, cp, tp)) for d in range(first, first + self.ep)]
        parts = group.split(":")
        if parts[0] == "stage":
            stage = int(parts[1])
            dps = range(self.dp)
            tag = parts[2] if len(parts) > 2 else ""
            if tag == "edp":
                dps = range(dp % self.ep, self.dp, self.ep)
            elif tag == "shard":
                dps = [d for d in dps if d // self.dp_shard == dp // self.dp_shard]
            elif tag == "rep":
                return sorted(index((pp, d, cp, tp)) for d in dps if d % self.dp_shard == dp % self.dp_shard)
            return self._stage_group(self.stage_ranks[stage], dps, tp)
        raise PlanError(f"unknown collective group {group!r} on rank {rank}")

    def _stage_group(self, pp_ranks: list[int], dps, tp: int) -> list[int]:
        """The sorted ranks with tp rank ``tp`` on pipeline ranks ``pp_ranks``, DP ranks ``dps``
        (increasing) and every CP rank. The rank formula (`_index`), inlined: groups of 4K
        ranks; each pipeline rank's block with every DP rank is one stride of ranks."""
        dp_n, cp_n, tp_n = self.dp, self.cp, self.tp
        block = dp_n * cp_n * tp_n  # ranks per pipeline rank
        pps = sorted(pp_ranks)
        if isinstance(dps, range) and dps == range(dp_n) and len(set(pps)) == len(pps):
            return [r for p in pps for r in range(p * block + tp, (p + 1) * block, tp_n)]
        return sorted(((p * dp_n + d) * cp_n + k) * tp_n + tp for p in pps for d in dps for k in range(cp_n))

    def to_json(self) -> dict[str, Any]:
        # plans without TP / CP stay as they were
        extra = {**({"tp": self.tp} if self.tp > 1 else {}), **({"cp": self.cp} if self.cp > 1 else {}),
                 **({"dp_shard": self.dp_shard} if self.dp_shard else {})}
        return {"pp": self.pp, "dp": self.dp, "ep": self.ep, **extra,
                "stage_ranks": {str(k): v for k, v in self.stage_ranks.items()}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Layout":
        return cls(pp=d["pp"], dp=d["dp"], ep=d.get("ep", 1), tp=d.get("tp", 1), cp=d.get("cp", 1),
                   dp_shard=d.get("dp_shard", 0),
                   stage_ranks={int(k): v for k, v in d["stage_ranks"].items()})


@dataclass
class Plan:
    """A compiled training step: per rank class, per stream, ordered instructions."""

    layout: Layout
    classes: list[RankClass]
    meta: dict[str, Any] = field(default_factory=dict)
    # operator-level profiles shared by compute ops: key -> rows
    # [class, name, shape, dtype, count, flops, bytes] (see piper_sim.kernels)
    kernels: dict[str, list] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def header(self) -> PlanHeader:
        """``meta`` as typed fields (`piper_sim.header`), read anew on each access: hold it."""
        return PlanHeader.from_meta(self.meta)

    def summary(self) -> list[tuple[str, str]]:
        """The plan's key facts as (name, value) pairs: what `repr` and `_repr_html_` show."""
        h, lay = self.header, self.layout
        per_class = sum(len(lst) for c in self.classes for lst in c.streams.values())
        total = sum(len(c.ranks) * sum(len(lst) for lst in c.streams.values()) for c in self.classes)
        batch = f"{h.global_batch} × {h.seq_len}" if h.global_batch else ""
        return [("model", str(h.model or "")), ("cluster", str(h.cluster or "")),
                ("world", str(self.world_size)), ("schedule", str(h.schedule or "")),
                ("degrees", summary.degrees(lay.pp, lay.dp, lay.ep, lay.tp, lay.cp, lay.dp_shard)),
                ("zero", str(h.zero)), ("micro-batches", str(h.microbatches or "")),
                ("batch", batch), ("rank classes", str(len(self.classes))),
                ("instructions", f"{per_class:,}"), ("ops over all ranks", f"{total:,}")]

    def __repr__(self) -> str:
        """One line (a 64-rank plan's fields would be ~700,000 characters): `summary`."""
        return summary.one_line("Plan", self.summary())

    def _repr_html_(self) -> str:
        return summary.html_table("piper-sim plan", self.summary())

    def class_of(self, rank: int) -> RankClass:
        pp_rank, _ = self.layout.coords(rank)
        return self.classes[pp_rank]

    def program(self, rank: int) -> RankProgram:
        """Expand one rank: resolve peers and groups to explicit global ranks."""
        if not 0 <= rank < self.world_size:
            raise PlanError(f"rank {rank} is outside the plan's world size {self.world_size}")
        pp_rank, dp_rank = self.layout.coords(rank)
        tp_rank, cp_rank = self.layout.tp_rank(rank), self.layout.cp_rank(rank)
        cls = self.classes[pp_rank]
        streams: dict[str, list[Instruction]] = {}
        groups: dict[str, str] = {}  # symbolic group -> explicit, resolved once per rank (O(members) each)
        for name, lst in cls.streams.items():
            out = []
            for ins in lst:
                new = copy.copy(ins)  # its lists its own (~20x faster than asdict's deep copy)
                new.deps, new.gemm = list(ins.deps), list(ins.gemm)
                if ins.kind in P2P_KINDS:
                    new.peer = self.layout.pipeline_peer(rank, ins.peer)
                elif ins.kind in COLLECTIVE_KINDS:
                    if ins.group not in groups:
                        groups[ins.group] = "ranks:" + ",".join(map(str, self.layout.group_ranks(ins.group, rank)))
                    new.group = groups[ins.group]
                out.append(new)
            streams[name] = out
        return RankProgram(rank=rank, pp_rank=pp_rank, dp_rank=dp_rank, streams=streams,
                           static_memory=dict(cls.static_memory), stages=list(cls.stages), tp_rank=tp_rank,
                           cp_rank=cp_rank)

    def expand(self) -> list[RankProgram]:
        return [self.program(r) for r in range(self.world_size)]

    # --- serialisation -------------------------------------------------------------
    def body_json(self) -> dict[str, Any]:
        extra = {"kernels": {k: [list(r[:2]) + [list(r[2])] + list(r[3:]) for r in rows]
                             for k, rows in sorted(self.kernels.items())}} if self.kernels else {}
        return {
            **extra,
            "layout": self.layout.to_json(),
            "meta": self.meta,
            "classes": [
                {"pp_rank": c.pp_rank, "ranks": _compress_ranks(c.ranks), "stages": c.stages,
                 "static_memory": c.static_memory,
                 "streams": {s: [i.to_json() for i in lst] for s, lst in c.streams.items()}}
                for c in self.classes
            ],
        }

    def content_hash(self) -> str:
        return _hash(self.body_json())

    def to_json(self) -> dict[str, Any]:
        """The plan as version 2 JSON: every instruction an object (what the hash covers)."""
        body = self.body_json()
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "hash": _hash(body), **body}

    def to_file_json(self) -> dict[str, Any]:
        """The plan as written to files (`FILE_VERSION`): the same content, packed."""
        body = self.body_json()
        return {"format": PLAN_FORMAT, "version": FILE_VERSION, "hash": _hash(body), **_pack(body)}

    @gc_paused
    def dumps(self) -> str:
        return json.dumps(self.to_file_json(), separators=(",", ":"))

    def save(self, path: str) -> None:
        """Write atomically: a killed save leaves the previous file, never a partial one."""
        from piper_sim.files import write_text

        write_text(path, self.dumps())

    @classmethod
    @gc_paused
    def from_json(cls, d: dict[str, Any], check_hash: bool = True) -> "Plan":
        if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
            raise PlanError("not a piper-sim plan file (missing format 'piper-sim-plan'); "
                            "compile one with `piper-sim compile STRATEGY.json -o PLAN.json`")
        if d.get("version") not in READABLE_VERSIONS:
            raise PlanError(f"plan format version {d.get('version')} is not supported (this piper-sim reads "
                            f"versions {', '.join(map(str, READABLE_VERSIONS))}); recompile the strategy")
        if d["version"] == FILE_VERSION:
            try:
                d = {**d, **_unpack(d)}
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
                raise PlanError(f"malformed plan file ({type(e).__name__}: {e}); recompile the strategy") from None
        body = {k: d[k] for k in ("kernels", "layout", "meta", "classes") if k in d}
        if check_hash and _hash(body) != d.get("hash"):
            raise PlanError("plan content hash mismatch: the file was edited after compiling; "
                            "recompile it, or pass check_hash=False / --no-hash-check to accept edits")
        _check_world(d)
        try:
            if d["version"] == 1:
                d = {**d, "classes": [{**c, "streams": {k: [_upgrade_v1(i) for i in lst]
                                                        for k, lst in c["streams"].items()}} for c in d["classes"]]}
            return cls._from_body(d)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise PlanError(f"malformed plan file ({type(e).__name__}: {e}); recompile the strategy") from None

    @classmethod
    def _from_body(cls, d: dict[str, Any]) -> "Plan":
        if not isinstance(d["meta"], dict):
            raise TypeError("meta must be an object")
        layout = Layout.from_json(d["layout"])
        classes = [
            RankClass(pp_rank=c["pp_rank"], ranks=_expand_ranks(c["ranks"]), stages=c["stages"],
                      static_memory=c["static_memory"],
                      streams={s: [Instruction.from_json(i) for i in lst]
                               for s, lst in c["streams"].items()})
            for c in d["classes"]
        ]
        kernels = {k: [tuple(r[:2]) + (tuple(r[2]),) + tuple(r[3:]) for r in rows]
                   for k, rows in d.get("kernels", {}).items()}
        return cls(layout=layout, classes=classes, meta=d["meta"], kernels=kernels)

    @classmethod
    def load(cls, path: str, check_hash: bool = True) -> "Plan":
        try:
            with open(path) as f:
                d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if isinstance(e, UnicodeDecodeError):
                raise PlanError(f"{path}: not a text (JSON) file") from None
            raise PlanError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        except RecursionError:
            raise PlanError(f"{path}: JSON nested too deeply") from None
        return cls.from_json(d, check_hash=check_hash)


def _count(value: Any) -> float:
    """A size or count as the file has it (0 when not a number: the checks after say why)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(min(max(value, 0), 2**64)) if ok else 0.0


def _check_world(d: dict[str, Any]) -> None:
    """Refuse a plan whose layout (pp x dp x cp x tp) or rank classes claim more than
    `checks.MAX_WORLD_SIZE` ranks, before any per-rank list is built."""
    lay = d.get("layout") if isinstance(d.get("layout"), dict) else {}
    world = math.prod(_count(lay.get(k, 1)) for k in MESH_AXES)
    check_world_size(world, "plan layout pp x dp x cp x tp", PlanError)
    classes = d.get("classes") if isinstance(d.get("classes"), list) else []
    runs = [run for c in classes if isinstance(c, dict) and isinstance(c.get("ranks"), list) for run in c["ranks"]]
    check_world_size(sum(_count(r[1]) for r in runs if isinstance(r, list) and len(r) == 2), "plan rank classes",
                     PlanError)


def _hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _pack(body: dict[str, Any]) -> dict[str, Any]:
    """A version 2 body in the file form: instructions as [shape, values...] rows, a shape
    being an index into ``fields`` (their field names, without ``stream`` when it is the
    stream the row is listed under)."""
    shapes: dict[tuple[str, ...], int] = {}
    classes = []
    for c in body["classes"]:
        streams = {}
        for name, lst in c["streams"].items():
            rows = []
            for ins in lst:
                keys = tuple(k for k in ins if k != "stream" or ins[k] != name)
                shape = shapes.setdefault(keys, len(shapes))
                rows.append([shape, *(ins[k] for k in keys)])
            streams[name] = rows
        classes.append({**c, "streams": streams})
    return {**body, "fields": [list(k) for k in shapes], "classes": classes}


def _unpack(d: dict[str, Any]) -> dict[str, Any]:
    """The version 2 ``classes`` of a file-form plan (`_pack` undone)."""
    fields = [tuple(f) for f in d["fields"]]
    classes = []
    for c in d["classes"]:
        streams = {}
        for name, rows in c["streams"].items():
            lst = []
            for row in rows:
                keys = fields[row[0]]
                if len(row) != len(keys) + 1:
                    raise ValueError(f"an instruction of stream {name!r} has {len(row) - 1} values for "
                                     f"{len(keys)} fields")
                ins = {"stream": name, **dict(zip(keys, row[1:]))}
                lst.append(ins)
            streams[name] = lst
        classes.append({**c, "streams": streams})
    return {"classes": classes}


def _compress_ranks(ranks: list[int]) -> list[list[int]]:
    """[0,1,2,3,8,9] -> [[0,4],[8,2]]: (start, count) runs keep plans of 10k ranks small."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][0] + runs[-1][1] == r:
            runs[-1][1] += 1
        else:
            runs.append([r, 1])
    return runs


def _expand_ranks(runs: list[list[int]]) -> list[int]:
    return [s + i for s, n in runs for i in range(n)]


# version 1 plans carried these fields in the op id only: read them back, once, on load
_V1_IDS = [(re.compile(p), f) for p, f in [
    (r"^(?:SEND|RECV)\.(F|B)\.", lambda m: {"direction": m[1]}),
    (r"^A2A\.(F|B)\.s\d+\.mb\d+\.e(\d+)\.", lambda m: {"direction": m[1], "block": int(m[2])}),
    (r"^AG\.(F|B)\.s\d+\.i(\d+)(\.e)?\.b(\d+)$",
     lambda m: {"direction": m[1], "round": int(m[2]), "experts": bool(m[3]), "bucket": int(m[4])}),
    (r"^(?:AR|RS|AG)\.s\d+(?:\.mb\d+|\.i(\d+))?(\.e)?\.b(\d+)$",
     lambda m: {"round": int(m[1] or -1), "experts": bool(m[2]), "bucket": int(m[3])}),
    (r"^TP\.(?:(F|B|R)\.s\d+\.mb\d+|s\d+)\.(.+)$", lambda m: {"direction": m[1] or "", "name": m[2]}),
]]


def _upgrade_v1(ins: dict[str, Any]) -> dict[str, Any]:
    """A version 1 instruction with the typed fields of version 2 (defaults left out)."""
    for pattern, fields in _V1_IDS:
        m = pattern.match(ins["id"])
        if m:
            return {**ins, **{k: v for k, v in fields(m).items() if v != _INSTRUCTION_DEFAULTS[k]}}
    return ins
