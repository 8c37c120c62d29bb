"""Tied embeddings across pipeline stages (Megatron-Core's embedding group).

A model whose head projects with the embedding's matrix (``tie_embeddings``), cut into
pipeline stages with the embedding on the first and the head on the last: the last stage
holds its own copy of the word-embedding matrix for the output layer (`compiler.stage_costs`
counts it), initialised equal to the first stage's (Megatron ``setup_embeddings_and_output_layer``).
After the backward the two copies' gradients are summed by one all-reduce over the ``embed``
group, the first and last pipeline ranks of each model replica (Megatron
``_allreduce_word_embedding_grads``, megatron-core ``distributed/finalize_model_grads.py``),
so both copies step identically. An untied model's MTP modules read the embedding on the last
stage the same way (Megatron-Core: ``mtp_num_layers`` > 0): the copy is counted in ``mtp.0``. It runs before the data-parallel sync of the buckets holding
the copy (the sum over the embedding group then over the replicas is the full gradient; after
a ZeRO reduce-scatter the two stages' shards would cover different elements; Megatron runs it
after its DP sync instead, keeping the shared embedding in a bucket of its own,
``distributed/param_and_grad_buffer.py``, so both shards cover the same elements), once per
gradient-reduce round (ZeRO-2/3 reduce every micro-batch), and before the optimizer step.

When the first and the last stage share a pipeline rank (``v`` placement, DualPipe) the rank
holds both copies: one op on that rank sums them in place, a group of one rank (no transfer;
DualPipe's two copies of each stage are then summed by the stages' own data-parallel sync).
"""

from __future__ import annotations

from piper_sim.ir import Context, Node, TrainingDAG, is_inner, make_op
from piper_sim.plan import WEIGHT_GRAD_KINDS

STREAM = "embed"
STREAM_WORDS = {STREAM: "tied-embedding gradient"}  # its stream in words (`piper_sim.explain`)


def tied_stages(ctx: Context) -> tuple[int, int] | None:
    """(first, last) stage whose copies are summed, or None when nothing is to sum."""
    last = max(ctx.layout.stage_ranks)
    if not ctx.tied_embeddings or last == 0:
        return None
    return 0, last


def tied_embedding_pass(ctx: Context, dag: TrainingDAG) -> None:
    """One all-reduce of the word-embedding gradient per rank holding the first or the last
    stage (both: one op for the two) and reduce round: after the round's backward ops of the
    stage(s), before their DP syncs of the buckets holding the embedding (first stage) or the
    head's copy (last), and before OPT."""
    stages = tied_stages(ctx)
    if stages is None:
        return
    embed = next(x for x in ctx.stages[0].segments if x.unit == "embed")
    nbytes = embed.param_bytes * ctx.grad_reduce_scale
    ranges = {s: _unit_range(ctx, s, "embed" if s == 0 else ctx.embed_copy_unit) for s in stages}
    nodes: dict[int, list[Node]] = {}
    for n in dag.g.nodes:
        s = dag.ins(n).stage
        if s in stages and (n[0], f"OPT.s{s}") in dag.g:  # a rank holding the stage
            nodes.setdefault(n[0], []).append(n)
    for where, mine in sorted(nodes.items()):
        held = sorted({dag.ins(n).stage for n in mine})
        backward = [n for n in mine if dag.ins(n).kind in WEIGHT_GRAD_KINDS]
        rounds: dict[tuple[int, int], list[Node]] = {}
        for n in mine:
            if _is_dense_sync(dag.ins(n)):
                rounds.setdefault((dag.ins(n).round, dag.ins(n).mb), []).append(n)
        if not rounds:  # no data-parallel sync: once per step, after every backward
            rounds = {(-1, -1): []}
        for (rnd, mb), members in sorted(rounds.items()):
            ar = dag.add(where, make_op("ALLREDUCE", STREAM, stage=held[0], mb=mb, round=rnd, bytes=nbytes,
                                        group=ctx.group("embed", where), tied=True))
            producers = {p for n in members for p in dag.g.predecessors(n) if p in backward} \
                if members else set(backward)
            for p in sorted(producers):
                dag.edge(p, ar)
            for s in held:
                lo, hi = ranges[s]
                for n in _holding(dag, [n for n in members if dag.ins(n).stage == s], lo, hi, ctx.grad_reduce_scale):
                    dag.edge(ar, n)
                dag.edge(ar, (where, f"OPT.s{s}"))


def _is_dense_sync(ins) -> bool:
    return ins.kind in ("ALLREDUCE", "REDUCE_SCATTER") and ins.bucket >= 0 and not ins.experts \
        and not ins.tied and not is_inner(ins)


def _unit_range(ctx: Context, s: int, unit: str) -> tuple[float, float]:
    """Byte range of a unit's parameters in the stage's dense parameters (model order)."""
    acc, lo, hi = 0.0, None, None
    for x in ctx.stages[s].dense:
        if x.unit == unit:
            lo = acc if lo is None else lo
            hi = acc + x.param_bytes
        acc += x.param_bytes
    return lo or 0.0, hi or 0.0


def _holding(dag: TrainingDAG, syncs: list[Node], lo: float, hi: float, scale: float) -> list[Node]:
    """The syncs of one round whose bucket (slices of the stage's parameters in model order,
    ``bytes / scale`` each) overlaps bytes ``[lo, hi)``."""
    out, acc = [], 0.0
    for n in sorted(syncs, key=lambda n: dag.ins(n).bucket):
        size = dag.ins(n).bytes / scale
        if acc < hi and acc + size > lo:
            out.append(n)
        acc += size
    return out
