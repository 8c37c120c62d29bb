"""The global training DAG and the passes that rewrite it.

Nodes are keyed ``(where, op_id)``: ``where`` is the pipeline rank in a folded compile
(one representative data-parallel replica; its peers are symbolic) or the global rank
in an unfolded compile. Each node carries an `Instruction` (``g.nodes[n]["ins"]``).
Edges carry ``kind``: ``data``, ``temporal`` or ``p2p`` (a SEND to its RECV).

Passes run in a fixed order, whatever the order of the directives:
``split`` -> ``backward split`` (from ``order``) -> ``place`` (+ SEND/RECV) ->
``pieces`` (F/B/BI cut around expert blocks with all-to-alls under EP, per unit under
ZeRO-3, tensor or context parallelism) -> ``tensor`` (TP/SP collectives between the pieces) ->
``recompute`` + activation memory -> ``context`` (CP K/V collectives around the pieces,
`piper_sim.context_parallel`) -> ``replicate`` (DP/ZeRO collectives over dp x cp) ->
``order`` (temporal edges, overlapped pairs) -> gradient-bucket memory.

Memory (``alloc`` at an op's start, ``free`` at its end) is set by `activation_memory_pass`
(activations per recompute mode, temporaries, all-to-all buffers; see
``piper_sim.memory``), `replicate_pass` (ZeRO-3 gathered units) and `grad_bucket_memory`
(unsharded ZeRO-2/3 gradient buckets).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import networkx as nx

from costmodel.compute import ADAM_BYTES_PER_PARAM, ADAM_FLOPS_PER_PARAM, optimizer_bytes_ratio
from costmodel.stack import DEFAULT as DEFAULT_STACK, Stack
from costmodel.memory import bucket_sizes
from piper_sim import kernels
from piper_sim.checks import MAX_BUCKETS_PER_STAGE
from piper_sim.directives import Setup
from piper_sim.memory import PieceMemory, SegmentMemory, piece_memory
from piper_sim.plan import (BACKWARD_KINDS, COMPUTE_KINDS, INPUT_GRAD_KINDS, P2P_KINDS, PASS_KINDS, SPLIT_KINDS,
                            WEIGHT_GRAD_KINDS, Instruction, Layout, p2p_id)
from piper_sim.profiling import SegmentCost, segment_kind
from piper_sim.strategy import StrategyError

Node = tuple[int, str]
BW_KEEP_FRACTION = 0.5  # share of a stage's saved activations BW still needs after BI


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
    sequences: dict[int, list[tuple[int, str]]] = field(default_factory=dict)  # per rank, set by order_pass
    kernels: dict[str, tuple] = field(default_factory=dict)  # operator-level tables by key (Plan.kernels)
    _kernel_keys: dict[tuple, str] = field(default_factory=dict, repr=False)
    memory: dict[str, SegmentMemory] = field(default_factory=dict)  # per segment name (piper_sim.memory)
    micro_batch: int = 1  # sequences per micro-batch
    seq_len: int = 0  # tokens of a sequence one rank holds (seq_len / cp under context parallelism)
    hidden: int = 0
    kv_bytes: float = 0.0  # context parallel: one layer's K and V gathered over the cp group, per micro-batch
    stack: Stack = DEFAULT_STACK  # the kernels the run executes (costmodel.stack)

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

    def param_groups(self, stage: int) -> list[tuple[float, int]]:
        """(parameters a rank holds, data-parallel group size) of a stage: the dense part
        over all its replicas (data and context parallel: parameters are replicated over cp
        too); under expert parallel, the rank's expert shard over the replicas holding the
        same shard."""
        layout = self.layout
        sc = self.stages[stage]
        n_dense = len(layout.stage_ranks[stage]) * layout.dp * layout.cp
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
    ``TP.{direction}.s{stage}.mb{mb}.{name}`` / ``TP.s{stage}.{name}``, ``CP.{direction}.s{stage}.mb{mb}.{name}``."""
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
    if is_tp(ins):
        return f"TP.{ins.direction}.s{s}.mb{ins.mb}.{ins.name}" if ins.direction else f"TP.s{s}.{ins.name}"
    if is_cp(ins):
        return f"CP.{ins.direction}.s{s}.mb{ins.mb}.{ins.name}"
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


# --- passes ---------------------------------------------------------------------------

def split_pass(ctx: Context) -> dict[tuple[int, int], list[str]]:
    """Logical compute ops per (stage, mb): which backward kinds the order asks for."""
    kinds: dict[tuple[int, int], list[str]] = {}
    seen: dict[tuple[int, str, int], int] = {}
    for r, slots in ctx.setup.orders.items():
        for slot in slots:
            for a in slot:
                key = (a.stage, a.kind, a.mb)
                if key in seen:
                    raise StrategyError(f"order: action {a} appears twice (pp_ranks {seen[key]} and {r})")
                seen[key] = r
                if a.stage >= ctx.setup.num_stages or a.mb >= ctx.setup.microbatches:
                    raise StrategyError(f"order (pp_rank {r}): action {a} names stage {a.stage} / mb {a.mb}, "
                                        f"but there are {ctx.setup.num_stages} stages and "
                                        f"{ctx.setup.microbatches} micro-batches")
                if ctx.setup.rank_of(a.stage, a.mb) != r:
                    raise StrategyError(f"order (pp_rank {r}): action {a} runs on pp_rank "
                                        f"{ctx.setup.rank_of(a.stage, a.mb)}, where stage {a.stage} is placed")
    for s in range(ctx.setup.num_stages):
        for mb in range(ctx.setup.microbatches):
            has = {k for k in "FBIW" if (s, k, mb) in seen}
            if has == {"F", "B"}:
                kinds[(s, mb)] = ["F", "B"]
            elif has == {"F", "I", "W"}:
                kinds[(s, mb)] = ["F", "BI", "BW"]
            else:
                need = "F and B (or I and W)"
                raise StrategyError(f"order: stage {s} micro-batch {mb} has actions {sorted(has) or 'none'}; "
                                    f"each (stage, mb) needs exactly {need} once")
    return kinds


def place_pass(ctx: Context, dag: TrainingDAG, kinds: dict[tuple[int, int], list[str]]) -> None:
    """Put compute on ranks; a data edge that crosses ranks becomes SEND + RECV."""
    setup = ctx.setup
    S = setup.num_stages
    streams = setup.streams
    for d in ctx.replicas():
        for s in range(S):
            sc = ctx.stages[s]
            rec = setup.recompute.get(s) == "full"  # selective: see recompute_pass
            for mb in range(setup.microbatches):
                w = ctx.where(setup.rank_of(s, mb), d)
                fn = dag.add(w, _compute(ctx, "F", s, mb, sc.segments))
                if kinds[(s, mb)] == ["F", "B"]:
                    bn = dag.add(w, _compute(ctx, "B", s, mb, sc.segments, rec))
                    dag.edge(fn, bn)
                else:
                    bi = _compute(ctx, "BI", s, mb, sc.segments, rec)
                    bw = _compute(ctx, "BW", s, mb, sc.segments)
                    bin_, bwn = dag.add(w, bi), dag.add(w, bw)
                    dag.edge(fn, bin_)
                    dag.edge(bin_, bwn)
        # stage-to-stage edges
        for s in range(S - 1):
            nbytes = ctx.stages[s].boundary_bytes()
            for mb in range(setup.microbatches):
                a, b = setup.rank_of(s, mb), setup.rank_of(s + 1, mb)
                wa, wb = ctx.where(a, d), ctx.where(b, d)
                _link(dag, ctx, (wa, f"F.s{s}.mb{mb}"), (wb, f"F.s{s + 1}.mb{mb}"), a, b, d,
                      "F", s, mb, nbytes, streams)
                back = "B" if kinds[(s + 1, mb)] == ["F", "B"] else "BI"
                back_dst = "B" if kinds[(s, mb)] == ["F", "B"] else "BI"
                _link(dag, ctx, (wb, f"{back}.s{s + 1}.mb{mb}"), (wa, f"{back_dst}.s{s}.mb{mb}"), b, a, d,
                      "B", s + 1, mb, nbytes, streams)
        # one optimizer step per stage copy
        for s in range(S):
            for pp_rank in sorted({r for r, _, _ in setup.placement[s]}):
                w = ctx.where(pp_rank, d)
                opt = dag.add(w, make_op("OPT", "compute", stage=s))
                for mb in range(setup.microbatches):
                    if setup.rank_of(s, mb) == pp_rank:
                        last = "B" if kinds[(s, mb)] == ["F", "B"] else "BW"
                        dag.edge((w, f"{last}.s{s}.mb{mb}"), opt, "temporal")


def _link(dag: TrainingDAG, ctx: Context, src: Node, dst: Node, src_pp: int, dst_pp: int, d: int,
          direction: str, stage: int, mb: int, nbytes: float, streams: dict[str, str]) -> None:
    if src[0] == dst[0]:
        dag.edge(src, dst)
        return
    # one stream per peer and direction, like a NCCL pair: messages between two ranks
    # are received in the order they were sent
    send = dag.add(src[0], make_op("SEND", f"{streams['SEND']}.pp{dst_pp}", stage=stage, mb=mb, bytes=nbytes,
                                   direction=direction, peer=ctx.where(dst_pp, d)))
    recv = dag.add(dst[0], make_op("RECV", f"{streams['RECV']}.pp{src_pp}", stage=stage, mb=mb, bytes=nbytes,
                                   direction=direction, peer=ctx.where(src_pp, d)))
    dag.edge(src, send)
    dag.edge(send, recv, "p2p")
    dag.edge(recv, dst)


def piece_pass(ctx: Context, dag: TrainingDAG) -> None:
    """Cut F and B/BI into pieces (`Context.parts`): under expert parallelism around each
    expert block, with all-to-all dispatch before and combine after it (mirrored in
    backward); under ZeRO-3 one piece per unit, each to run on its own gathered unit.
    BW is not cut (under EP its expert share is the ``expert_flops`` field)."""
    by_stage: dict[int, list[Node]] = {}
    for n in dag.g.nodes:
        if dag.ins(n).kind in PASS_KINDS:
            by_stage.setdefault(dag.ins(n).stage, []).append(n)
    for sc in ctx.stages:
        parts = ctx.parts(sc.stage)
        if len(parts) == 1:
            continue
        for node in by_stage.get(sc.stage, []):
            if dag.ins(node).kind != "BW":
                _split_node(ctx, dag, node, parts)
            elif ctx.layout.ep > 1 and sc.experts:  # not cut: its expert share is a field
                dag.ins(node).expert_flops = float(sum(x.bwd_weight_flops for x in sc.experts))


def _split_node(ctx: Context, dag: TrainingDAG, node: Node, parts: list[list[SegmentCost]]) -> None:
    old = dag.ins(node)
    where = node[0]
    preds = list(dag.g.in_edges(node, data="kind"))
    succs = list(dag.g.out_edges(node, data="kind"))
    dag.g.remove_node(node)
    forward = old.kind == "F"
    seq = list(range(len(parts))) if forward else list(reversed(range(len(parts))))
    chain: list[Node] = []
    expert_idx = {p: k for k, p in enumerate(i for i, part in enumerate(parts) if part and part[0].is_expert)}
    for pos, i in enumerate(seq):
        segs = parts[i]
        if not segs:
            continue
        ins = _compute(ctx, old.kind, old.stage, old.mb, segs, old.recompute, part=i, parts=len(parts))
        is_expert = segs[0].is_expert and ctx.layout.ep > 1
        if is_expert:
            ins.expert_flops = float(ins.flops)
            # all-to-all into the expert block
            e = expert_idx[i]
            name = "dispatch" if forward else "combine"
            chain.append(_a2a(ctx, dag, where, old, e, name, segs[0].a2a_bytes))
        chain.append(dag.add(where, ins))
        if is_expert:  # all-to-all out of the expert block
            e = expert_idx[i]
            name = "combine" if forward else "dispatch"
            chain.append(_a2a(ctx, dag, where, old, e, name, segs[0].a2a_bytes))
    for a, b in zip(chain, chain[1:]):
        dag.edge(a, b)
    for p, _, kind in preds:
        dag.edge(p, chain[0], kind)
    for _, q, kind in succs:
        dag.edge(chain[-1], q, kind)


def _a2a(ctx: Context, dag: TrainingDAG, where: int, old: Instruction, e: int, name: str,
         nbytes: float) -> Node:
    pas = "F" if old.kind == "F" else "B"
    # the backward of a dispatch moves gradients back from the experts: a combine
    direction = name if pas == "F" else _A2A_MIRROR[name]
    return dag.add(where, make_op("ALL_TO_ALL", ctx.setup.streams["ALL_TO_ALL"], stage=old.stage, mb=old.mb,
                                  bytes=nbytes, group=ctx.group("ep", where), a2a=direction, direction=pas,
                                  block=e))


TP_STREAM = "tp"


def is_tp(ins: Instruction) -> bool:
    """A tensor-parallel collective (inside a layer, on the ``tp`` stream)."""
    return ins.stream == TP_STREAM


CP_STREAM = "cp"


def is_cp(ins: Instruction) -> bool:
    """A context-parallel K/V collective (inside a layer, on the ``cp`` stream)."""
    return ins.stream == CP_STREAM


def _tp_label(seg: SegmentCost) -> str:
    return "l" + seg.unit.split(".")[1] if seg.unit.startswith("layers.") else seg.unit


def tp_collectives(seg: SegmentCost, pas: str, sp: bool, act: float, loss: float) -> list[tuple[str, str, float]]:
    """The tensor-parallel collectives of one segment in one pass, in execution order, as
    (name, kind, bytes); ``act`` is the ``B·s·h`` activation in bytes, ``loss`` one fp32 value
    per token. ``pas``: ``F``; ``B`` (input gradients; ``.regather`` ops feed the weight
    gradients). Megatron-LM's tensor parallelism (Shoeybi et al. 2019) and sequence
    parallelism (Korthikanti et al. 2022):

    - without SP, a block (attention, MLP or MoE) all-reduces its row-parallel output in
      forward (``g``) and the gradient of its column-parallel input in backward (``f``);
    - with SP, an all-gather before and a reduce-scatter after each block in forward, their
      mirror images in backward, and the all-gather of the saved input shard again for the
      weight gradients (``.regather``: Megatron keeps the shard, not the gathered input);
    - vocabulary-parallel embedding: an all-reduce (SP: reduce-scatter) of its output, in
      backward nothing (SP: all-gather of the output gradient); head: its input's backward
      all-reduce (SP: gather in forward, reduce-scatter and re-gather in backward) and the
      vocabulary-parallel cross entropy's three all-reduces of one fp32 per token (max,
      target logit, sum of exponentials).
    """
    kind = segment_kind(None, seg.name)  # type: ignore[arg-type]
    AR, AG, RS = "ALLREDUCE", "ALL_GATHER", "REDUCE_SCATTER"
    if kind == "embed":
        return ([("embed.rs", RS, act)] if sp else [("embed.ar", AR, act)]) if pas == "F" else \
            ([("embed.ag", AG, act)] if sp else [])
    if kind == "head":
        if pas == "F":
            head = [("head.ag", AG, act)] if sp else []
            return head + [(f"head.loss.{x}", AR, loss) for x in ("max", "target", "sumexp")]
        return [("head.regather", AG, act), ("head.rs", RS, act)] if sp else [("head.ar", AR, act)]
    l = _tp_label(seg)
    blocks = {"dense": ["attn", "mlp"], "moe_pre": ["attn", "moe"], "moe_experts": []}[kind]
    if pas == "F":
        if kind == "moe_pre":  # the MoE block's output is reduced after the experts (see moe_experts)
            return [(f"{l}.attn.ag", AG, act), (f"{l}.attn.rs", RS, act), (f"{l}.moe.ag", AG, act)] if sp else \
                [(f"{l}.attn.ar", AR, act)]
        if kind == "moe_experts":
            return [(f"{l}.moe.rs", RS, act)] if sp else [(f"{l}.moe.ar", AR, act)]
        return [x for b in blocks for x in ([(f"{l}.{b}.ag", AG, act), (f"{l}.{b}.rs", RS, act)] if sp else
                                            [(f"{l}.{b}.ar", AR, act)])]
    if kind == "moe_experts":  # the gradient of the MoE block's output, gathered before the experts' backward
        return [(f"{l}.moe.ag", AG, act)] if sp else []
    out = []
    for b in reversed(blocks):
        if sp:
            grad_in = [] if b == "moe" else [(f"{l}.{b}.ag", AG, act)]
            out += grad_in + [(f"{l}.{b}.regather", AG, act), (f"{l}.{b}.rs", RS, act)]
        else:
            out.append((f"{l}.{b}.ar", AR, act))
    return out


def tensor_pass(ctx: Context, dag: TrainingDAG) -> None:
    """Tensor (and sequence) parallelism: the collectives inside each layer (`tp_collectives`)
    on the ``tp`` stream, over the ``tp`` group.

    F/B/BI are cut per unit (`Context.parts`) and a unit's collectives run, in order, between
    its compute piece and the next: ``piece(l) -> its collectives -> piece(l+1)``. Without
    async tensor parallelism the next GEMM waits for each of them, so a layer takes its
    compute plus its collectives either way; only where inside the layer they run moves
    (after its attention half, in truth). A full-recompute backward re-runs the forward's
    collectives first (``TP.R.`` ops). With a BI/BW split the weight pass waits for the
    ``.regather`` all-gathers, issued after the stage's input-gradient pass. With sequence
    parallelism the norms' weight gradients (computed on a sequence shard) are all-reduced
    over the TP group before the optimizer step (``TP.s{S}.norms``). Segments ``shard_tensor``
    did not select (`Setup.tp_sharded`) are replicated and have no collectives."""
    if ctx.layout.tp == 1:
        return
    sp = ctx.setup.sp
    act = float(ctx.micro_batch * ctx.seq_len * ctx.hidden * ctx.dtype_bytes)
    loss = float(ctx.micro_batch * ctx.seq_len * 4)
    by_stage: dict[tuple[int, int], list[Node]] = {}
    for n in list(dag.g.nodes):
        ins = dag.ins(n)
        if ins.kind in COMPUTE_KINDS:
            by_stage.setdefault((n[0], ins.stage), []).append(n)
    for (where, s), nodes in by_stage.items():
        group = ctx.group("tp", where)
        full = ctx.setup.recompute.get(s) == "full"
        parts = ctx.parts(s)
        regathers: dict[int, list[Node]] = {}  # mb -> BI-split re-gathers its BW waits for
        last_bi: dict[int, Node] = {}
        for n in nodes:
            ins = dag.ins(n)
            if ins.kind not in SPLIT_KINDS:
                continue
            segs = parts[ins.part] if ins.kind == "F" else list(reversed(parts[ins.part]))
            chain: list[Node] = []

            def add(pas: str, name: str, kind: str, nbytes: float) -> Node:
                return dag.add(where, make_op(kind, TP_STREAM, stage=s, mb=ins.mb, bytes=nbytes, group=group,
                                              direction=pas, name=name))

            for seg in segs:
                if not ctx.setup.tp_sharded(seg.unit):
                    continue  # replicated (shard_tensor's selection): run whole, no TP collective
                if ins.kind != "F" and full and ctx.memory[seg.name].recomputed:
                    chain += [add("R", *x) for x in tp_collectives(seg, "F", sp, act, loss)]
                for x in tp_collectives(seg, "F" if ins.kind == "F" else "B", sp, act, loss):
                    if ins.kind == "BI" and x[0].endswith(".regather"):
                        regathers.setdefault(ins.mb, []).append(add("B", *x))
                    else:
                        chain.append(add("F" if ins.kind == "F" else "B", *x))
            if ins.kind == "BI" and ins.part == 0:
                last_bi[ins.mb] = n
            if not chain:
                continue
            succs = list(dag.g.out_edges(n, data="kind"))
            dag.g.remove_edges_from([(a, b) for a, b, _ in succs])
            for a, b in zip([n] + chain, chain):
                dag.edge(a, b)
            if ctx.stack.tp_overlap:  # overlapped with the layer's GEMMs: the chain starts with the piece
                dag.ins(chain[0]).dep_progress = 0.0
            for _, q, kind in succs:
                dag.edge(chain[-1], q, kind)
        for mb, ops in regathers.items():
            bw = (where, f"BW.s{s}.mb{mb}")
            src = last_bi[mb]
            for a, b in zip([src] + ops, ops):
                dag.edge(a, b)
            dag.edge(ops[-1], bw)
        norms = sum(x.sp_params for x in ctx.stages[s].segments) * ctx.dtype_bytes
        if sp and norms:
            ar = dag.add(where, make_op("ALLREDUCE", TP_STREAM, stage=s, bytes=float(norms), group=group,
                                        name="norms"))
            for n in nodes:
                if dag.ins(n).kind in WEIGHT_GRAD_KINDS:
                    dag.edge(n, ar)
            dag.edge(ar, (where, f"OPT.s{s}"))


def recompute_pass(ctx: Context, dag: TrainingDAG) -> None:
    """Selective recompute: each backward piece (B/BI) of a selective stage runs the
    forward of its attention cores again (full recompute is priced by ``_compute``)."""
    for n in dag.g.nodes:
        ins = dag.ins(n)
        if ins.kind in INPUT_GRAD_KINDS and ctx.setup.recompute.get(ins.stage) == "selective":
            mems = [ctx.memory[x.name] for x in ctx.parts(ins.stage)[ins.part]]
            ins.flops += sum(m.core_flops for m in mems)
            ins.recompute = True
            rows = kernels.merge(ctx.kernels.get(ins.kernels, ()), *[m.core_kernels for m in mems])
            if rows:
                ins.kernels = kernels.table_key(rows)
                ctx.kernels[ins.kernels] = rows


def activation_memory_pass(ctx: Context, dag: TrainingDAG) -> None:
    """``alloc``/``free`` of compute ops and all-to-alls (see ``piper_sim.memory``).

    Per piece (`memory.piece_memory`): F takes what the piece keeps (+ temporaries while it
    runs); B frees it, holding the recompute working set and temporaries while it runs. A
    BI/BW split leaves ``BW_KEEP_FRACTION`` of the kept activations to BW; under full
    recompute BI runs the piece's forward again and keeps that graph for BW.
    All-to-all receive buffers: the forward dispatch's is the expert block's input (part of
    what its piece keeps); the forward combine's (expert outputs back home) is kept for the
    backward of the weighted sum (until the backward combine); backward ones live until the
    piece that consumes them ends."""
    ep = ctx.layout.ep
    cache: dict[tuple[int, int], PieceMemory] = {}

    def piece(stage: int, part: int) -> PieceMemory:
        key = (stage, part)
        if key not in cache:
            mode = ctx.setup.recompute.get(stage, "none")
            segs = ctx.parts(stage)[part]
            cache[key] = piece_memory([(x.unit, ctx.memory[x.name]) for x in segs], mode, ep > 1)
        return cache[key]

    keep = BW_KEEP_FRACTION
    for n in dag.g.nodes:
        ins = dag.ins(n)
        if ins.kind not in PASS_KINDS:
            continue
        full = ctx.setup.recompute.get(ins.stage) == "full"
        if ins.kind == "BW":  # one op for the whole stage
            pms = [piece(ins.stage, i) for i in range(len(ctx.parts(ins.stage)))]
            ins.free = keep * sum(p.kept + (p.rerun if full else 0.0) for p in pms)
            continue
        p = piece(ins.stage, ins.part)
        if ins.kind == "F":
            ins.alloc, ins.free = p.kept + p.temp, p.temp
        elif ins.kind == "B":
            ins.alloc, ins.free = p.working + p.temp, p.kept + p.working + p.temp
        elif full:
            ins.alloc, ins.free = p.rerun + p.temp, p.temp + (1 - keep) * (p.kept + p.rerun)
        else:
            ins.alloc, ins.free = p.working + p.temp, p.working + p.temp + (1 - keep) * p.kept
    for n in list(dag.g.nodes):
        ins = dag.ins(n)
        if ins.kind != "ALL_TO_ALL":
            continue
        ins.alloc = ins.bytes
        forward = ins.direction == "F"
        if forward and ins.a2a == "combine":  # kept until the backward of this combine
            back = (n[0], op_id(replace(ins, direction="B", a2a="dispatch")))
            dag.ins(back).free += ins.bytes
            continue
        consumer = next(q for q in dag.g.successors(n) if q[0] == n[0] and dag.ins(q).kind in SPLIT_KINDS)
        c = dag.ins(consumer)
        if forward:  # the buffer becomes what the expert piece keeps
            c.alloc -= min(ins.bytes, c.alloc - c.free)
        else:
            c.free += ins.bytes


def unit_buckets(ctx: Context, stage: int) -> dict[str, list[list[SegmentCost]]]:
    """ZeRO-3 buckets of a stage per sync group (``""`` dense, ``".e"`` local experts under
    EP): one unit each, or consecutive whole units up to ``bucket_mb`` MB."""
    layout, sc = ctx.layout, ctx.stages[stage]
    groups = {"": [x for x in sc.segments if not (x.is_expert and layout.ep > 1)]}
    if layout.ep > 1 and sc.experts:
        groups[".e"] = sc.experts
    out: dict[str, list[list[SegmentCost]]] = {}
    limit = None if ctx.setup.bucket_mb is None else ctx.setup.bucket_mb * 2**20
    for tag, segs in groups.items():
        scale = layout.ep if tag else 1
        units: list[list[SegmentCost]] = []
        for x in segs:
            if units and units[-1][-1].unit == x.unit:
                units[-1].append(x)
            else:
                units.append([x])
        buckets: list[list[SegmentCost]] = []
        size = 0.0
        for u in units:
            nbytes = sum(x.param_bytes for x in u) / scale
            if buckets and limit is not None and size + nbytes <= limit:
                buckets[-1] += u
                size += nbytes
            else:
                buckets.append(list(u))
                size = nbytes
        out[tag] = buckets
    return out


def replicate_pass(ctx: Context, dag: TrainingDAG) -> None:
    """Data parallel: gradient sync after a stage's backward, ZeRO sharding comms."""
    setup, layout = ctx.setup, ctx.layout
    zero = setup.zero
    stream = setup.streams
    by_where_stage: dict[tuple[int, int], list[Node]] = {}
    for n in dag.g.nodes:
        ins = dag.ins(n)
        if ins.kind in COMPUTE_KINDS:
            by_where_stage.setdefault((n[0], ins.stage), []).append(n)
    for (where, s), nodes in sorted(by_where_stage.items()):
        sc = ctx.stages[s]
        copies = len(layout.stage_ranks[s])
        replicas = copies * layout.dp * layout.cp  # parameters are replicated over dp x cp
        groups = [("", "stage:%d" % s, [x for x in sc.segments if not (x.is_expert and layout.ep > 1)], replicas)]
        if layout.ep > 1 and sc.experts:
            groups.append((".e", "stage:%d:edp" % s, sc.experts, replicas // layout.ep))
        opt = (where, f"OPT.s{s}")
        last_backward = [n for n in nodes if dag.ins(n).kind in WEIGHT_GRAD_KINDS]
        for tag, symbolic, segs, size in groups:
            param_bytes = sum(x.param_bytes for x in segs) / (layout.ep if tag else 1)
            if size == 1 or param_bytes == 0:
                continue
            group = ctx.group(symbolic, where)
            if zero == 3:  # per_unit(s) holds: the dense group has peers
                _zero3_per_unit(ctx, dag, where, s, nodes, tag, unit_buckets(ctx, s)[tag], size, group, opt)
                continue
            buckets = _buckets(param_bytes, setup.bucket_mb, len({x.unit for x in segs}))
            readiness = _bucket_ready(segs, buckets)
            rounds = _reduce_rounds(ctx, dag, s, nodes) if zero == 2 else [(-1, -1, last_backward)]
            for b, nbytes in enumerate(buckets):
                ready = readiness[b]
                for rnd, mb, producers in rounds:
                    kind = "ALLREDUCE" if zero == 0 else "REDUCE_SCATTER"
                    sync = make_op(kind, stream[kind], stage=s, mb=mb, round=rnd, bytes=nbytes * ctx.grad_reduce_scale,
                                   group=group,
                                   dep_progress=ready, bucket=b, experts=bool(tag))
                    sn = dag.add(where, sync)
                    for n in producers:
                        if dag.ins(n).kind in WEIGHT_GRAD_KINDS:
                            dag.edge(n, sn)
                    dag.edge(sn, opt)
            if zero in (1, 2):
                gates = _param_gates(ctx, dag, s, nodes, segs, buckets) if setup.overlap_param_gather else None
                for b, nbytes in enumerate(buckets):
                    needed_by, needed_at = gates[b] if gates else ("", 0.0)
                    ag = dag.add(where, make_op("ALL_GATHER", stream["ALL_GATHER"], stage=s, bytes=nbytes,
                                                group=group, bucket=b, experts=bool(tag), needed_by=needed_by,
                                                needed_at=needed_at))
                    if gates:  # the shard it sends is not stepped before it went
                        dag.edge(ag, opt)
                    else:  # gathered right after the optimizer step (DeepSpeed ZeRO-1/2)
                        dag.edge(opt, ag)


def _param_gates(ctx: Context, dag: TrainingDAG, s: int, nodes: list[Node], segs: list,
                 buckets: list[float]) -> list[tuple[str, float]]:
    """ZeRO-1/2 with ``overlap_param_gather``: for each parameter bucket (slices of
    ``segs``' parameters in model order), the stage's first forward piece on this rank that
    uses the bucket's first byte, and the share of that piece's forward work done before
    the segment holding it starts (where the forward must wait for the bucket's gather)."""
    forwards = [n for n in nodes if dag.ins(n).kind == "F"]
    first = min(dag.ins(n).mb for n in forwards)
    piece_of = {dag.ins(n).part: n[1] for n in forwards if dag.ins(n).mb == first}
    before: dict[str, tuple[int, float]] = {}  # segment -> (part, share of the part's forward before it)
    for i, part in enumerate(ctx.parts(s)):
        total, acc = sum(x.fwd_flops for x in part), 0.0
        for x in part:
            before[x.name] = (i, acc / total if total > 0 else 0.0)
            acc += x.fwd_flops
    out = []
    for j, _ in _first_bytes(segs, buckets):
        part, share = before[segs[j].name]
        out.append((piece_of[part], share))
    return out


def _reduce_rounds(ctx: Context, dag: TrainingDAG, s: int, nodes: list[Node]) -> list[tuple[int, int, list[Node]]]:
    """When a ZeRO-2/3 stage copy reduce-scatters its gradients: (round, micro-batch, the
    backward ops whose gradients go). Per micro-batch (``Setup.reduce_per_microbatch``,
    FSDP's and DeepSpeed's default): one round per micro-batch this copy runs the backward
    of, numbered (``round``: the i-th here) when the stage has several copies (DualPipe), so
    the copies' collectives pair up, else -1 (named by micro-batch). Per step: one round,
    round and micro-batch -1."""
    backward = [n for n in nodes if dag.ins(n).kind in BACKWARD_KINDS]
    if not ctx.setup.reduce_per_microbatch:
        return [(-1, -1, backward)]
    copies = ctx.setup.placement[s]
    if len({hi - lo for _, lo, hi in copies}) > 1:
        raise StrategyError(f"replicate: reduce 'per_microbatch' needs the copies of stage {s} to run as many "
                            f"micro-batches each (placement {copies}); use reduce 'per_step'")
    mbs = sorted({dag.ins(n).mb for n in backward})
    many = len(ctx.layout.stage_ranks[s]) > 1
    return [(i if many else -1, mb, [n for n in backward if dag.ins(n).mb == mb])
            for i, mb in enumerate(mbs)]


def _zero3_per_unit(ctx: Context, dag: TrainingDAG, where: int, s: int, nodes: list[Node], tag: str,
                    buckets: list[list[SegmentCost]], size: int, group: str, opt: Node) -> None:
    """ZeRO-3, FSDP-style: before each forward and backward (B/BI) of the stage, all-gather
    each bucket (a unit) just for the pieces that use it, and drop it when the last of
    them ends (the compiler lets a gather start once the compute op two places before its
    consumer ended: one unit of prefetch). BW does not read the parameters (weight
    gradients need activations and output gradients only), so a BI piece drops its unit
    too. The gradients of a bucket are reduce-scattered once the backward pieces that
    produce them ran (B), or as the weight pass reaches them (BW): after every micro-batch's
    backward (into the rank's gradient shard; FSDP's default), or once per step
    (`_reduce_rounds`)."""
    stream = ctx.setup.streams
    part_names = [{x.name for x in p} for p in ctx.parts(s)]
    passes: dict[tuple[str, int], list[Node]] = {}
    for n in nodes:
        ins = dag.ins(n)
        if ins.kind in SPLIT_KINDS:
            passes.setdefault(("F" if ins.kind == "F" else "B", ins.mb), []).append(n)
    n_b = len(buckets)
    rounds = _reduce_rounds(ctx, dag, s, nodes)
    for b, bucket in enumerate(buckets):
        names = {x.name for x in bucket}
        nbytes = sum(x.param_bytes for x in bucket) / (ctx.layout.ep if tag else 1)
        gathered = nbytes * (size - 1) / size
        for pas in ("F", "B"):
            # numbered per copy (i-th forward of this stage here), so DualPipe's two copies match
            for i, mb in enumerate(sorted(mb for p, mb in passes if p == pas)):
                pieces = sorted(passes[(pas, mb)], key=lambda n: dag.ins(n).part, reverse=pas == "B")
                users = [n for n in pieces if part_names[dag.ins(n).part] & names]
                ag = dag.add(where, make_op("ALL_GATHER", stream["ALL_GATHER"], stage=s, mb=mb, bytes=nbytes,
                                            group=group, alloc=gathered, direction=pas, round=i, bucket=b,
                                            experts=bool(tag)))
                dag.edge(ag, users[0])
                dag.ins(users[-1]).free += gathered
        for rnd, mb, producers in rounds:
            bws = [n for n in producers if dag.ins(n).kind == "BW"]
            rs = dag.add(where, make_op("REDUCE_SCATTER", stream["REDUCE_SCATTER"], stage=s, mb=mb, round=rnd,
                                        bytes=nbytes * ctx.grad_reduce_scale, group=group, dep_progress=(n_b - b) / n_b if bws else 1.0,
                                        bucket=b, experts=bool(tag)))
            for n in producers:
                ins = dag.ins(n)
                if ins.kind == "B" and part_names[ins.part] & names or ins.kind == "BW":
                    dag.edge(n, rs)
            dag.edge(rs, opt)


def grad_bucket_memory(ctx: Context, dag: TrainingDAG) -> None:
    """ZeRO-2/3 keep only a gradient shard between steps: a bucket's unsharded gradients
    exist from the first backward that produces them (in the rank's compute order) until
    its reduce-scatter ends (the local shard is in the static memory). Reduced per
    micro-batch, that is one micro-batch's backward of the bucket to its reduce-scatter;
    per step, from the first micro-batch's backward to the end of the backward phase."""
    if ctx.setup.zero < 2:
        return
    position = {n: i for seq in ctx.sequences.values() for i, n in enumerate(seq)}
    for n in dag.g.nodes:
        ins = dag.ins(n)
        if ins.kind != "REDUCE_SCATTER":
            continue
        producers = [p for p in dag.g.predecessors(n) if p[0] == n[0] and dag.ins(p).kind in WEIGHT_GRAD_KINDS]
        if not producers or is_tp(ins) or is_cp(ins):
            continue
        size = _group_size(ctx, ins)
        transient = ins.bytes * (size - 1) / size
        dag.ins(min(producers, key=position.__getitem__)).alloc += transient
        ins.free += transient


def _group_size(ctx: Context, ins: Instruction) -> int:
    if ins.group.startswith("ranks:"):
        return ins.group.count(",") + 1
    if ins.group in ("tp", "cp"):
        return ctx.layout.axes[ins.group]
    copies = len(ctx.layout.stage_ranks[ins.stage]) * ctx.layout.dp * ctx.layout.cp
    return copies // ctx.layout.ep if ins.group.endswith(":edp") else copies


def _bucket_ready(segs: list, buckets: list[float]) -> list[float]:
    """The share of a stage's backward done when each gradient bucket is complete. Buckets
    are slices of the parameters in model order; the backward runs the segments in
    reverse (and, roughly, a segment's parameters too), so bucket b is complete once it
    reached b's first byte: the backward flops of the later segments plus the part of that
    segment's from the byte to the segment's end, over the total (a tied embedding's
    bucket waits for the embedding's backward, the last). Uniform shares when the profile
    has no backward flops."""
    flops = [x.bwd_flops for x in segs]
    total = sum(flops)
    if total <= 0:
        n = len(buckets)
        return [(n - b) / n for b in range(n)]
    out = []
    for j, inside in _first_bytes(segs, buckets):
        # strictly decreasing in b, so buckets ready together go out last first, and only
        # bucket 0 waits for the end of the backward
        out.append(min(1.0, (sum(flops[j + 1:]) + inside * flops[j]) / total) - 1e-6 * len(out))
    return out


def _first_bytes(segs: list, buckets: list[float]) -> list[tuple[int, float]]:
    """For each bucket (slices of ``segs``' parameters laid end to end in model order):
    the index of the segment holding its first byte, and the share of that segment's
    parameters from the byte to the segment's end."""
    ends, acc = [], 0.0
    for x in segs:
        acc += x.param_bytes
        ends.append(acc)
    scale = sum(buckets) / acc if acc else 1.0  # bucket bytes are per expert-parallel rank
    out, lo = [], 0.0
    for nbytes in buckets:
        j = next((i for i, e in enumerate(ends) if e * scale > lo and segs[i].param_bytes > 0), len(segs) - 1)
        inside = min(1.0, (ends[j] * scale - lo) / (segs[j].param_bytes * scale)) if segs[j].param_bytes else 1.0
        out.append((j, inside))
        lo += nbytes
    return out


# a remainder bucket this small (a few elements of a cut at byte precision) joins its neighbour
MIN_BUCKET_BYTES = 64


def _buckets(param_bytes: float, bucket_mb: float | None, n_units: int) -> list[float]:
    """Gradient buckets of a stage's parameters, in model order. By default equal slices,
    one per layer. With ``bucket_mb``, buckets of that size filled from the model's end,
    as DDP and Megatron-LM fill them in backward order: the first layers' bucket (the last
    one reduced and, with overlapped gathers, the first one gathered) holds the rest."""
    if bucket_mb is None:
        n = max(1, n_units)
        sizes = [param_bytes / n] * n
    else:
        sizes = bucket_sizes(param_bytes, bucket_mb)[::-1] or [param_bytes]
        if len(sizes) > 1 and sizes[0] < MIN_BUCKET_BYTES:  # a few elements left: into the next one
            sizes = [sizes[0] + sizes[1], *sizes[2:]]
    if len(sizes) > MAX_BUCKETS_PER_STAGE:
        raise StrategyError(f"replicate: bucket_mb {bucket_mb:g} cuts a stage's {param_bytes / 2**20:.3g} MB into "
                            f"{len(sizes):,} gradient buckets; the limit is {MAX_BUCKETS_PER_STAGE:,} per stage "
                            "(piper_sim.checks.MAX_BUCKETS_PER_STAGE): use a larger bucket_mb")
    return sizes


def order_pass(ctx: Context, dag: TrainingDAG) -> dict[int, list[Node]]:
    """Temporal edges from each rank's slots; returns each rank's compute sequence.

    An overlapped pair interleaves the pieces of its two ops on the compute stream, so
    one op's all-to-all runs while the other computes (DualPipe's F&B overlap)."""
    sequences: dict[int, list[Node]] = {}
    pieces: dict[tuple[int, int, str], list[Node]] = {}
    for n in dag.g.nodes:
        ins = dag.ins(n)
        if ins.kind in PASS_KINDS:
            pieces.setdefault((n[0], ins.stage, ins.mb, ins.kind), []).append(n)
    for key in pieces:
        forward = key[3] == "F"
        pieces[key].sort(key=lambda n: dag.ins(n).part, reverse=not forward)
    kind_of = {"F": "F", "B": "B", "I": "BI", "W": "BW"}
    for d in ctx.replicas():
        for pp_rank, slots in sorted(ctx.setup.orders.items()):
            w = ctx.where(pp_rank, d)
            seq: list[Node] = []
            for i, slot in enumerate(slots):
                lists = [pieces[(w, a.stage, a.mb, kind_of[a.kind])] for a in slot]
                for lst in lists:
                    for n in lst:
                        dag.ins(n).slot = i
                start = len(seq)
                for j in range(max(map(len, lists))):
                    seq.extend(lst[j] for lst in lists if j < len(lst))
                if len(slot) == 2:  # as DualPipe: a pair's outputs leave when the pair ends
                    for n in seq[start:-1]:
                        for q in _sends_after(dag, n):
                            dag.edge(seq[-1], q, "temporal")
            for a, b in zip(seq, seq[1:]):
                if not dag.g.has_edge(a, b):
                    dag.edge(a, b, "temporal")
            sequences[w] = seq
    return sequences


def _sends_after(dag: TrainingDAG, n: Node) -> list[Node]:
    """SENDs fed by compute op ``n``, directly or through its tensor- or context-parallel collectives."""
    out, todo = [], list(dag.g.successors(n))
    while todo:
        q = todo.pop()
        ins = dag.ins(q)
        if ins.kind == "SEND":
            out.append(q)
        elif is_tp(ins) or is_cp(ins):
            todo.extend(dag.g.successors(q))
    return out


def optimizer_pass(ctx: Context, dag: TrainingDAG) -> None:
    """Cost of each OPT: AdamW over the parameters this rank updates (its ZeRO shard)."""
    zero = ctx.setup.zero
    for n in dag.g.nodes:
        ins = dag.ins(n)
        if ins.kind != "OPT":
            continue
        local = sum(count / (n if zero else 1) for count, n in ctx.param_groups(ins.stage))
        ins.flops = ADAM_FLOPS_PER_PARAM * local
        ins.bytes = ADAM_BYTES_PER_PARAM * local * optimizer_bytes_ratio(ctx.stack.optimizer)
