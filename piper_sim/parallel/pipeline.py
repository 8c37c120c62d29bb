"""Pipeline parallelism: compute ops per (stage, micro-batch) from the schedule's order, put on
their pipeline ranks with SEND/RECV between stages, and the order's temporal edges."""

from __future__ import annotations

from piper_sim.ir import Context, Node, TrainingDAG, _compute, is_inner, make_op
from piper_sim.plan import PASS_KINDS
from piper_sim.strategy import StrategyError

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
            rec = setup.plain_full(s)  # selective and the other policies: see recompute_pass
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
        elif is_inner(ins):
            todo.extend(dag.g.successors(q))
    return out


def build_pass(ctx: Context, dag: TrainingDAG) -> None:
    """The ``build`` phase: which backward kinds each (stage, mb) has, then place them."""
    ctx.kinds = split_pass(ctx)
    place_pass(ctx, dag, ctx.kinds)


def sequence_pass(ctx: Context, dag: TrainingDAG) -> None:
    """The ``order`` phase: temporal edges; each rank's compute sequence into ``ctx.sequences``."""
    ctx.sequences = order_pass(ctx, dag)
