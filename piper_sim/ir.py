"""The global training DAG, its ops and the pass driver.

Nodes are keyed ``(where, op_id)``: ``where`` is the pipeline rank in a folded compile
(one representative data-parallel replica; its peers are symbolic) or the global rank
in an unfolded compile. Each node carries an `Instruction` (``g.nodes[n]["ins"]``).
Edges carry ``kind``: ``data``, ``temporal`` or ``p2p`` (a SEND to its RECV).

The passes live with their technique in `piper_sim.parallel` and are listed, in the order
they run, by the registry `piper_sim.axes`; `run_passes` runs them in phase order
(`PHASES`), whatever the order of the directives:
``build`` (pipeline: compute per (stage, mb), SEND/RECV) -> ``pieces`` (F/B/BI cut around
expert blocks with all-to-alls under EP, per unit under ZeRO-3, tensor or context
parallelism) -> ``layer`` (TP/SP collectives, recompute + activation memory, CP K/V
collectives) -> ``sync`` (DP/ZeRO collectives, optimizer cost) -> ``order`` (temporal edges)
-> ``edges`` (prefetch and in-layer issue edges) -> acyclicity -> ``memory`` (gradient-bucket
memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import networkx as nx

from costmodel.stack import DEFAULT as DEFAULT_STACK, Stack
from piper_sim import kernels
from piper_sim.directives import Setup
from piper_sim.memory import SegmentMemory
from piper_sim.plan import COLLECTIVE_KINDS, COMPUTE_KINDS, P2P_KINDS, Instruction, Layout, p2p_id
from piper_sim.profiling import SegmentCost
from piper_sim.strategy import StrategyError

Node = tuple[int, str]


@dataclass
class StageCost:
    """The segments of one stage and their sums."""

    stage: int
    segments: list[SegmentCost]

    @property
    def dense(self) -> list[SegmentCost]:
        return [s for s in self.segments if not s.is_expert]

    @property
    def experts(self) -> list[SegmentCost]:
        return [s for s in self.segments if s.is_expert]

    def parts(self, ep: int, per_unit: bool = False) -> list[list[SegmentCost]]:
        """Pieces of the stage: cut around expert blocks when expert-parallel, and between
        units (FSDP-style, one gathered unit per piece) when ``per_unit``."""
        if (ep == 1 or not self.experts) and not per_unit:
            return [self.segments]
        out: list[list[SegmentCost]] = [[]]
        for seg in self.segments:
            if seg.is_expert and ep > 1:
                out.append([seg])
                out.append([])
            else:
                if per_unit and out[-1] and out[-1][-1].unit != seg.unit:
                    out.append([])
                out[-1].append(seg)
        return [p for p in out if p]

    def boundary_bytes(self) -> float:
        return self.segments[-1].out_bytes


@dataclass
class Context:
    setup: Setup
    stages: list[StageCost]
    layout: Layout
    dtype_bytes: int
    folded: bool = True
    kinds: dict[tuple[int, int], list[str]] = field(default_factory=dict)  # (stage, mb) -> F, B or F, BI, BW
    sequences: dict[int, list[tuple[int, str]]] = field(default_factory=dict)  # per rank, set by the order pass
    kernels: dict[str, tuple] = field(default_factory=dict)  # operator-level tables by key (Plan.kernels)
    _kernel_keys: dict[tuple, str] = field(default_factory=dict, repr=False)
    memory: dict[str, SegmentMemory] = field(default_factory=dict)  # per segment name (piper_sim.memory)
    micro_batch: int = 1  # sequences per micro-batch
    seq_len: int = 0  # tokens of a sequence one rank holds (seq_len / cp under context parallelism)
    hidden: int = 0
    kv_bytes: float = 0.0  # context parallel: one layer's K and V gathered over the cp group, per micro-batch
    # tensor parallel: elements per token of the attention's input-gradient all-reduce (0: hidden;
    # MLA: its latents, piper_sim.parallel.tensor.attn_grad_width), whether MoE layers have shared experts
    # and their top-k (MoE under SP: the experts' tokens gathered over TP are top-k copies of the sequence)
    tp_attn_width: int = 0
    tp_shared_experts: bool = False
    tp_top_k: int = 0
    # a user nn.Module's units: their TP collectives per pass, (name, kind, bytes) (piper_sim.user_tp)
    tp_unit_ops: dict[str, dict[str, list]] = field(default_factory=dict)
    tied_embeddings: bool = False  # the head projects with the embedding's matrix or MTP modules read it (piper_sim.parallel.tied)
    embed_copy_unit: str = "head"  # the last stage's unit holding its copy of that matrix (``mtp.0``: untied MTP)
    stack: Stack = DEFAULT_STACK  # the kernels the run executes (costmodel.stack)
    gpu_family: str = "hopper"  # the cluster GPU's family (costmodel.hardware): what FP8 casts move

    @property
    def grad_reduce_scale(self) -> float:
        """Bytes a gradient reduction moves per byte of parameters: 2 for bf16 parameters
        reduced in fp32 (the stack's ``reduce_dtype``)."""
        return self.stack.reduce_bytes(self.dtype_bytes) / self.dtype_bytes

    def kernel_table(self, kind: str, segs: list[SegmentCost], recompute: bool) -> str:
        """Key of the operator-level table of one compute op over ``segs`` (shared by
        every op with the same segments, kind and recompute)."""
        memo = (kind, recompute, tuple(id(s) for s in segs))
        key = self._kernel_keys.get(memo)
        if key is not None:
            return key
        ep = self.layout.ep

        def tables(x: SegmentCost) -> dict[str, tuple]:
            t = {"F": x.kernels_f, "BI": x.kernels_bi, "BW": x.kernels_bw}
            if x.is_expert and ep > 1:  # a rank's experts see the tokens of all its EP peers
                t = {k: kernels.regroup(v, ep, weight_grad=k == "BW") for k, v in t.items()}
            return t

        ts = [tables(x) for x in segs]
        f = [t["F"] for t in ts]
        parts = {"F": f, "BW": [t["BW"] for t in ts],
                 "BI": [t["BI"] for t in ts] + (f if recompute else []),
                 "B": [t["BI"] for t in ts] + [t["BW"] for t in ts] + (f if recompute else [])}[kind]
        rows = kernels.merge(*parts)
        key = "" if not rows else kernels.table_key(rows)
        if rows:
            self.kernels[key] = rows
        self._kernel_keys[memo] = key
        return key

    def per_unit(self, stage: int) -> bool:
        """ZeRO-3 with someone to shard with: F/B/BI run one unit at a time, each on its own
        gathered unit (FSDP)."""
        return self.setup.zero == 3 and len(self.layout.stage_ranks[stage]) * self.layout.dp * self.layout.cp > 1

    def parts(self, stage: int) -> list[list[SegmentCost]]:
        """The pieces F/B/BI of a stage are cut into (``.p{i}`` op ids when more than one):
        one per unit under ZeRO-3 and under tensor or context parallelism (their collectives go
        between)."""
        return self.stages[stage].parts(self.layout.ep, self.per_unit(stage) or self.layout.tp > 1
                                        or self.layout.cp > 1)

    def replicas(self) -> list[int]:
        """The ranks of one class compiled explicitly: every DP replica and TP peer when
        unfolded (index ``dp_rank * tp + tp_rank``), one representative when folded."""
        return [0] if self.folded else list(range(self.layout.class_size))

    def where(self, pp_rank: int, replica: int) -> int:
        return pp_rank if self.folded else self.layout.rank_at({"pp": pp_rank}) + replica  # a class is contiguous

    def group(self, symbolic: str, where: int) -> str:
        if self.folded:
            return symbolic
        ranks = self.layout.group_ranks(symbolic, where)
        return "ranks:" + ",".join(map(str, ranks))

    def shard_size(self, stage: int) -> int:
        """Ranks a stage's dense ZeRO state is sharded over: its copies x DP x CP ranks
        (parameters are replicated over cp too); under hybrid sharding its shard group, with
        ``dp_shard`` DP ranks (`piper_sim.parallel.hybrid`)."""
        layout = self.layout
        return len(layout.stage_ranks[stage]) * (layout.dp_shard or layout.dp) * layout.cp

    def param_groups(self, stage: int) -> list[tuple[float, int]]:
        """(parameters a rank holds, ZeRO sharding group size) of a stage: the dense part
        over `shard_size`; under expert parallel, the rank's expert shard over the replicas
        holding the same shard."""
        layout = self.layout
        sc = self.stages[stage]
        n_dense = self.shard_size(stage)
        if layout.ep == 1:
            return [(sum(x.param_count for x in sc.segments), n_dense)]
        dense = sum(x.param_count for x in sc.dense)
        experts = sum(x.param_count for x in sc.experts) / layout.ep
        return [(dense, n_dense), (experts, n_dense // layout.ep)]


@dataclass
class TrainingDAG:
    g: nx.DiGraph = field(default_factory=nx.DiGraph)

    def add(self, where: int, ins: Instruction) -> Node:
        node = (where, ins.id)
        if node in self.g:
            raise StrategyError(f"op {ins.id} appears twice on rank {where}")
        self.g.add_node(node, ins=ins)
        return node

    def edge(self, a: Node, b: Node, kind: str = "data") -> None:
        self.g.add_edge(a, b, kind=kind)

    def ins(self, node: Node) -> Instruction:
        return self.g._node[node]["ins"]  # the plain dict: g.nodes[...] builds a view per call


_SYNC_PREFIX = {"ALLREDUCE": "AR", "REDUCE_SCATTER": "RS", "ALL_GATHER": "AG"}


_A2A_MIRROR = {"dispatch": "combine", "combine": "dispatch"}


def op_id(ins: Instruction) -> str:
    """The readable op id of an instruction, formed from its typed fields only (the one
    place ids are made; nothing reads them back):

    ``F|B|BI|BW.s{stage}.mb{mb}[.p{part}]``, ``OPT.s{stage}``, ``SEND|RECV.{match}`` with
    ``match = {direction}.s{stage}.mb{mb}``, ``AR|AG.s{stage}[.e].b{bucket}``,
    ``RS.s{stage}[.mb{mb}|.i{round}][.e].b{bucket}``, ``AG.{direction}.s{stage}.i{round}[.e].b{bucket}``
    (ZeRO-3), ``A2A.{direction}.s{stage}.mb{mb}.e{block}.{dispatch|combine}`` (named after the
    forward op: a backward dispatch is the backward of the forward combine), and
    ``TP.{direction}.s{stage}.mb{mb}.{name}`` / ``TP.s{stage}.{name}``, ``CP.{direction}.s{stage}.mb{mb}.{name}``,
    ``AR[.mb{mb}|.i{round}].embed`` (a tied embedding's gradient, the first and last stage alike)."""
    k, s, e = ins.kind, ins.stage, ".e" if ins.experts else ""
    if k == "OPT":
        return f"OPT.s{s}"
    if k in COMPUTE_KINDS:
        return f"{k}.s{s}.mb{ins.mb}" + (f".p{ins.part}" if ins.parts > 1 else "")
    if k in P2P_KINDS:
        return p2p_id(k, p2p_match(ins.direction, s, ins.mb))
    if k == "ALL_TO_ALL":
        name = ins.a2a if ins.direction == "F" else _A2A_MIRROR[ins.a2a]
        return f"A2A.{ins.direction}.s{s}.mb{ins.mb}.e{ins.block}.{name}"
    if ins.tied:  # a tied embedding's gradient all-reduce (piper_sim.parallel.tied)
        label = f".i{ins.round}" if ins.round >= 0 else f".mb{ins.mb}" if ins.mb >= 0 else ""
        return f"AR{label}.embed"  # one id on both stages' ranks: a collective pairs by id
    if is_inner(ins):  # named after its stream: TP.… on ``tp``, CP.… on ``cp``
        axis = ins.stream.upper()
        return f"{axis}.{ins.direction}.s{s}.mb{ins.mb}.{ins.name}" if ins.direction else f"{axis}.s{s}.{ins.name}"
    if ins.direction:  # a ZeRO-3 gather before one forward / backward
        return f"AG.{ins.direction}.s{s}.i{ins.round}{e}.b{ins.bucket}"
    label = f".i{ins.round}" if ins.round >= 0 else f".mb{ins.mb}" if ins.mb >= 0 else ""
    return f"{_SYNC_PREFIX[k]}.s{s}{label}{e}.b{ins.bucket}"


def p2p_match(direction: str, stage: int, mb: int) -> str:
    """The key pairing a SEND with its RECV: the activation of ``stage`` (``F``) or the
    gradient of its input (``B``) for micro-batch ``mb``."""
    return f"{direction}.s{stage}.mb{mb}"


def make_op(kind: str, stream: str, **fields) -> Instruction:
    """An instruction with its id (`op_id`) and, for p2p, its ``match`` formed from its fields."""
    ins = Instruction(id="", kind=kind, stream=stream, **fields)
    if kind in P2P_KINDS:
        ins.match = p2p_match(ins.direction, ins.stage, ins.mb)
    ins.id = op_id(ins)
    return ins


def _compute(ctx: Context, kind: str, stage: int, mb: int, segs: list[SegmentCost], recompute: bool = False,
             part: int = 0, parts: int = 1) -> Instruction:
    fwd = sum(s.fwd_flops for s in segs)
    bi = sum(s.bwd_input_flops for s in segs)
    bw = sum(s.bwd_weight_flops for s in segs)
    flops = {"F": fwd, "B": bi + bw + (fwd if recompute else 0.0),
             "BI": bi + (fwd if recompute else 0.0), "BW": bw}[kind]
    main = max(segs, key=lambda s: s.fwd_flops)
    act = sum(s.saved_act_bytes for s in segs)
    return make_op(kind, "compute", stage=stage, mb=mb, part=part, parts=parts, flops=flops, tokens=main.tokens,
                   bytes=sum(s.param_bytes for s in segs) + 2 * act, recompute=recompute,
                   gemm=[main.gemm_m, main.gemm_n, main.gemm_k], kernels=ctx.kernel_table(kind, segs, recompute))


def is_inner(ins: Instruction) -> bool:
    """A collective inside a layer (tensor- or context-parallel: it has a ``name`` and runs
    between the layer's compute pieces), as opposed to one around a stage (DP, ZeRO, EP)."""
    return ins.kind in COLLECTIVE_KINDS and bool(ins.name)


# --- the pass driver -------------------------------------------------------------------

PHASES = ("build", "pieces", "layer", "sync", "order", "edges", "memory")
Pass = Callable[["Context", TrainingDAG], None]


def run_passes(ctx: Context, dag: TrainingDAG, passes: Iterable[tuple[str, Pass]]) -> None:
    """Run ``(phase, pass)`` pairs phase by phase (`PHASES`), in the given order within a
    phase; the DAG must be acyclic before the ``memory`` phase (a deadlocking order)."""
    todo = list(passes)
    unknown = {p for p, _ in todo} - set(PHASES)
    if unknown:
        raise ValueError(f"unknown pass phase(s) {sorted(unknown)}; phases are {PHASES}")
    for phase in PHASES:
        if phase == "memory" and not nx.is_directed_acyclic_graph(dag.g):
            cycle = nx.find_cycle(dag.g)
            ops = " -> ".join(f"{dag.ins(a).id}@{a[0]}" for a, _ in cycle)
            raise StrategyError(f"order: the schedule deadlocks; these ops wait on each other: {ops}")
        for p, fn in todo:
            if p == phase:
                fn(ctx, dag)
