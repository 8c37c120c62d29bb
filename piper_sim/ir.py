"""The global training DAG and the passes that rewrite it.

Nodes are keyed ``(where, op_id)``: ``where`` is the pipeline rank in a folded compile
(one representative data-parallel replica; its peers are symbolic) or the global rank
in an unfolded compile. Each node carries an `Instruction` (``g.nodes[n]["ins"]``).
Edges carry ``kind``: ``data``, ``temporal`` or ``p2p`` (a SEND to its RECV).

Passes run in a fixed order, whatever the order of the directives:
``split`` -> ``backward split`` (from ``order``) -> ``place`` (+ SEND/RECV) ->
``shard`` (expert all-to-alls) -> ``recompute`` -> ``replicate`` (DP/ZeRO collectives)
-> ``order`` (temporal edges, overlapped pairs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import networkx as nx

from piper_sim import kernels
from piper_sim.checks import MAX_BUCKETS_PER_STAGE
from piper_sim.directives import Setup
from piper_sim.plan import Instruction, Layout
from piper_sim.profiling import SegmentCost
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

    def parts(self, ep: int) -> list[list[SegmentCost]]:
        """Pieces of the stage cut around expert blocks (only when expert-parallel)."""
        if ep == 1 or not self.experts:
            return [self.segments]
        out: list[list[SegmentCost]] = [[]]
        for seg in self.segments:
            if seg.is_expert:
                out.append([seg])
                out.append([])
            else:
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
                t = {k: kernels.regroup(v, ep) for k, v in t.items()}
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

    def replicas(self) -> list[int]:
        return [0] if self.folded else list(range(self.layout.dp))

    def where(self, pp_rank: int, dp_rank: int) -> int:
        return pp_rank if self.folded else self.layout.rank(pp_rank, dp_rank)

    def group(self, symbolic: str, where: int) -> str:
        if self.folded:
            return symbolic
        ranks = self.layout.group_ranks(symbolic, where)
        return "ranks:" + ",".join(map(str, ranks))

    def param_groups(self, stage: int) -> list[tuple[float, int]]:
        """(parameters a rank holds, data-parallel group size) of a stage: the dense part
        over all its replicas; under expert parallel, the rank's expert shard over the
        replicas holding the same shard."""
        layout = self.layout
        sc = self.stages[stage]
        n_dense = len(layout.stage_ranks[stage]) * layout.dp
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


def _compute(ctx: Context, kind: str, stage: int, mb: int, segs: list[SegmentCost], recompute: bool = False,
             suffix: str = "") -> Instruction:
    fwd = sum(s.fwd_flops for s in segs)
    bi = sum(s.bwd_input_flops for s in segs)
    bw = sum(s.bwd_weight_flops for s in segs)
    flops = {"F": fwd, "B": bi + bw + (fwd if recompute else 0.0),
             "BI": bi + (fwd if recompute else 0.0), "BW": bw}[kind]
    main = max(segs, key=lambda s: s.fwd_flops)
    act = sum(s.saved_act_bytes for s in segs)
    return Instruction(id=f"{kind}.s{stage}.mb{mb}{suffix}", kind=kind, stream="compute",
                       stage=stage, mb=mb, flops=flops, tokens=main.tokens,
                       bytes=sum(s.param_bytes for s in segs) + 2 * act, recompute=recompute,
                       gemm=[main.gemm_m, main.gemm_n, main.gemm_k],
                       kernels=ctx.kernel_table(kind, segs, recompute))


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
            rec = s in setup.recompute
            for mb in range(setup.microbatches):
                w = ctx.where(setup.rank_of(s, mb), d)
                f = _compute(ctx, "F", s, mb, sc.segments)
                f.alloc = (sc.segments[0].out_bytes if rec else sum(x.saved_act_bytes for x in sc.segments))
                fn = dag.add(w, f)
                if kinds[(s, mb)] == ["F", "B"]:
                    b = _compute(ctx, "B", s, mb, sc.segments, rec)
                    b.free = f.alloc
                    bn = dag.add(w, b)
                    dag.edge(fn, bn)
                else:
                    bi = _compute(ctx, "BI", s, mb, sc.segments, rec)
                    bw = _compute(ctx, "BW", s, mb, sc.segments)
                    bi.free = f.alloc * (1 - BW_KEEP_FRACTION)
                    bw.free = f.alloc * BW_KEEP_FRACTION
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
                      f"F.s{s}.mb{mb}", s, mb, nbytes, streams)
                back = "B" if kinds[(s + 1, mb)] == ["F", "B"] else "BI"
                back_dst = "B" if kinds[(s, mb)] == ["F", "B"] else "BI"
                _link(dag, ctx, (wb, f"{back}.s{s + 1}.mb{mb}"), (wa, f"{back_dst}.s{s}.mb{mb}"), b, a, d,
                      f"B.s{s + 1}.mb{mb}", s + 1, mb, nbytes, streams)
        # one optimizer step per stage copy
        for s in range(S):
            for pp_rank in sorted({r for r, _, _ in setup.placement[s]}):
                w = ctx.where(pp_rank, d)
                opt = dag.add(w, Instruction(id=f"OPT.s{s}", kind="OPT", stream="compute", stage=s))
                for mb in range(setup.microbatches):
                    if setup.rank_of(s, mb) == pp_rank:
                        last = "B" if kinds[(s, mb)] == ["F", "B"] else "BW"
                        dag.edge((w, f"{last}.s{s}.mb{mb}"), opt, "temporal")


def _link(dag: TrainingDAG, ctx: Context, src: Node, dst: Node, src_pp: int, dst_pp: int, d: int,
          match: str, stage: int, mb: int, nbytes: float, streams: dict[str, str]) -> None:
    if src[0] == dst[0]:
        dag.edge(src, dst)
        return
    # one stream per peer and direction, like a NCCL pair: messages between two ranks
    # are received in the order they were sent
    send = dag.add(src[0], Instruction(id=f"SEND.{match}", kind="SEND", stream=f"{streams['SEND']}.pp{dst_pp}",
                                       stage=stage, mb=mb, bytes=nbytes, match=match,
                                       peer=ctx.where(dst_pp, d)))
    recv = dag.add(dst[0], Instruction(id=f"RECV.{match}", kind="RECV", stream=f"{streams['RECV']}.pp{src_pp}",
                                       stage=stage, mb=mb, bytes=nbytes, match=match,
                                       peer=ctx.where(src_pp, d)))
    dag.edge(src, send)
    dag.edge(send, recv, "p2p")
    dag.edge(recv, dst)


def shard_pass(ctx: Context, dag: TrainingDAG) -> None:
    """Expert parallel: cut F and B/BI of stages with expert blocks into pieces with
    all-to-all dispatch before and combine after each expert block (mirrored in backward)."""
    ep = ctx.layout.ep
    if ep == 1:
        return
    by_stage: dict[int, list[Node]] = {}
    for n in dag.g.nodes:
        if dag.ins(n).kind in ("F", "B", "BI", "BW"):
            by_stage.setdefault(dag.ins(n).stage, []).append(n)
    for sc in ctx.stages:
        parts = sc.parts(ep)
        if len(parts) == 1:
            continue
        for node in by_stage.get(sc.stage, []):
            if dag.ins(node).kind == "BW":  # not cut: its expert share is a field
                dag.ins(node).expert_flops = float(sum(x.bwd_weight_flops for x in sc.experts))
            else:
                _split_node(ctx, dag, node, parts)


def _split_node(ctx: Context, dag: TrainingDAG, node: Node, parts: list[list[SegmentCost]]) -> None:
    old = dag.ins(node)
    where = node[0]
    preds = list(dag.g.in_edges(node, data="kind"))
    succs = list(dag.g.out_edges(node, data="kind"))
    dag.g.remove_node(node)
    forward = old.kind == "F"
    seq = list(range(len(parts))) if forward else list(reversed(range(len(parts))))
    total_act = sum(x.saved_act_bytes for x in sum(parts, []))
    chain: list[Node] = []
    expert_idx = {p: k for k, p in enumerate(i for i, part in enumerate(parts) if part and part[0].is_expert)}
    for pos, i in enumerate(seq):
        segs = parts[i]
        if not segs:
            continue
        ins = _compute(ctx, old.kind, old.stage, old.mb, segs, old.recompute, suffix=f".p{i}")
        ins.part, ins.parts = i, len(parts)
        share = sum(x.saved_act_bytes for x in segs) / total_act if total_act else 0.0
        ins.alloc, ins.free = old.alloc * share, old.free * share
        is_expert = segs[0].is_expert
        if is_expert:
            ins.expert_flops = float(ins.flops)
        if is_expert:  # all-to-all into the expert block
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
    direction = name if pas == "F" else {"dispatch": "combine", "combine": "dispatch"}[name]
    return dag.add(where, Instruction(id=f"A2A.{pas}.s{old.stage}.mb{old.mb}.e{e}.{name}", kind="ALL_TO_ALL",
                                      stream=ctx.setup.streams["ALL_TO_ALL"], stage=old.stage, mb=old.mb,
                                      bytes=nbytes, group=ctx.group("ep", where), a2a=direction))


def replicate_pass(ctx: Context, dag: TrainingDAG) -> None:
    """Data parallel: gradient sync after a stage's backward, ZeRO sharding comms."""
    setup, layout = ctx.setup, ctx.layout
    zero = setup.zero
    stream = setup.streams
    by_where_stage: dict[tuple[int, int], list[Node]] = {}
    for n in dag.g.nodes:
        ins = dag.ins(n)
        if ins.kind in ("F", "B", "BI", "BW", "OPT"):
            by_where_stage.setdefault((n[0], ins.stage), []).append(n)
    for (where, s), nodes in sorted(by_where_stage.items()):
        sc = ctx.stages[s]
        copies = len(layout.stage_ranks[s])
        groups = [("", "stage:%d" % s, [x for x in sc.segments if not (x.is_expert and layout.ep > 1)],
                   copies * layout.dp)]
        if layout.ep > 1 and sc.experts:
            groups.append((".e", "stage:%d:edp" % s, sc.experts, copies * layout.dp // layout.ep))
        opt = (where, f"OPT.s{s}")
        last_backward = [n for n in nodes if dag.ins(n).kind in ("B", "BW")]
        for tag, symbolic, segs, size in groups:
            param_bytes = sum(x.param_bytes for x in segs) / (layout.ep if tag else 1)
            if size == 1 or param_bytes == 0:
                continue
            buckets = _buckets(param_bytes, setup.bucket_mb, len({x.unit for x in segs}))
            group = ctx.group(symbolic, where)
            n_b = len(buckets)
            for b, nbytes in enumerate(buckets):
                # bucket b (in parameter order) has its gradients once the backward reached it
                ready = (n_b - b) / n_b
                if zero == 0:
                    sync = Instruction(id=f"AR.s{s}{tag}.b{b}", kind="ALLREDUCE", stream=stream["ALLREDUCE"],
                                       stage=s, bytes=nbytes, group=group, dep_progress=ready)
                else:
                    sync = Instruction(id=f"RS.s{s}{tag}.b{b}", kind="REDUCE_SCATTER",
                                       stream=stream["REDUCE_SCATTER"], stage=s, bytes=nbytes, group=group,
                                       dep_progress=ready)
                sn = dag.add(where, sync)
                for n in last_backward:
                    dag.edge(n, sn)
                dag.edge(sn, opt)
                if zero in (1, 2):
                    ag = dag.add(where, Instruction(id=f"AG.s{s}{tag}.b{b}", kind="ALL_GATHER",
                                                    stream=stream["ALL_GATHER"], stage=s, bytes=nbytes,
                                                    group=group))
                    dag.edge(opt, ag)
                elif zero == 3:
                    _zero3_gathers(ctx, dag, where, s, nodes, tag, b, nbytes, size, group)


def _zero3_gathers(ctx: Context, dag: TrainingDAG, where: int, s: int, nodes: list[Node], tag: str,
                   b: int, nbytes: float, size: int, group: str) -> None:
    """ZeRO-3: all-gather a bucket before each forward and backward; drop it after."""
    gathered = nbytes * (size - 1) / size
    count = {"F": 0, "B": 0}
    for n in sorted(nodes, key=lambda n: (dag.ins(n).mb, dag.ins(n).part)):
        ins = dag.ins(n)
        if ins.kind not in ("F", "B", "BI"):
            continue
        first, last = (0, ins.parts - 1) if ins.kind == "F" else (ins.parts - 1, 0)
        if ins.part != first:
            continue
        pas = "F" if ins.kind == "F" else "B"
        # numbered per copy (i-th forward of this stage), so DualPipe's two copies match
        i = count[pas]
        count[pas] += 1
        ag = dag.add(where, Instruction(id=f"AG.{pas}.s{s}.i{i}{tag}.b{b}", kind="ALL_GATHER",
                                        stream=ctx.setup.streams["ALL_GATHER"], stage=s, mb=ins.mb,
                                        bytes=nbytes, group=group, alloc=gathered))
        dag.edge(ag, n)
        last_id = f"{ins.kind}.s{s}.mb{ins.mb}" + (f".p{last}" if ins.parts > 1 else "")
        if ins.kind == "BI":  # the weight pass still reads the gathered parameters
            last_id = f"BW.s{s}.mb{ins.mb}"
        dag.ins((where, last_id)).free += gathered


def _buckets(param_bytes: float, bucket_mb: float | None, n_units: int) -> list[float]:
    """Equal gradient buckets: one per layer by default, else of ``bucket_mb`` MB."""
    n = max(1, n_units) if bucket_mb is None else max(1, math.ceil(param_bytes / (bucket_mb * 2**20)))
    if n > MAX_BUCKETS_PER_STAGE:
        raise StrategyError(f"replicate: bucket_mb {bucket_mb:g} cuts a stage's {param_bytes / 2**20:.3g} MB into "
                            f"{n:,} gradient buckets; the limit is {MAX_BUCKETS_PER_STAGE:,} per stage "
                            "(piper_sim.checks.MAX_BUCKETS_PER_STAGE): use a larger bucket_mb")
    return [param_bytes / n] * n


def order_pass(ctx: Context, dag: TrainingDAG) -> dict[int, list[Node]]:
    """Temporal edges from each rank's slots; returns each rank's compute sequence.

    An overlapped pair interleaves the pieces of its two ops on the compute stream, so
    one op's all-to-all runs while the other computes (DualPipe's F&B overlap)."""
    sequences: dict[int, list[Node]] = {}
    pieces: dict[tuple[int, int, str], list[Node]] = {}
    for n in dag.g.nodes:
        ins = dag.ins(n)
        if ins.kind in ("F", "B", "BI", "BW"):
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
                        for q in list(dag.g.successors(n)):
                            if dag.ins(q).kind == "SEND":
                                dag.edge(seq[-1], q, "temporal")
            for a, b in zip(seq, seq[1:]):
                if not dag.g.has_edge(a, b):
                    dag.edge(a, b, "temporal")
            sequences[w] = seq
    return sequences


ADAM_BYTES_PER_PARAM = 28  # read+write of bf16 param and grad, fp32 master, m and v (as costmodel)
ADAM_FLOPS_PER_PARAM = 12


def optimizer_pass(ctx: Context, dag: TrainingDAG) -> None:
    """Cost of each OPT: AdamW over the parameters this rank updates (its ZeRO shard)."""
    zero = ctx.setup.zero
    for n in dag.g.nodes:
        ins = dag.ins(n)
        if ins.kind != "OPT":
            continue
        local = sum(count / (n if zero else 1) for count, n in ctx.param_groups(ins.stage))
        ins.flops = ADAM_FLOPS_PER_PARAM * local
        ins.bytes = ADAM_BYTES_PER_PARAM * local
