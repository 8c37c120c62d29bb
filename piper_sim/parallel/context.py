"""Context parallelism (Megatron-LM CP; Llama 3, Dubey et al. 2024 §3.3.2): the ``cp`` ranks of a
group split every sequence, each holding ``seq_len / cp`` tokens of each micro-batch.

Load-balanced causal split: the sequence is cut into ``2 * cp`` chunks and rank i holds chunks
i and ``2cp - 1 - i``, so every rank does the same attention work. Everything but attention is
profiled on the rank's ``seq_len / cp`` tokens (so it is exactly 1/cp of the full sequence's);
attention is each local query against all ``seq_len`` keys, half masked on average: 1/cp of the
full causal attention (`cp_segments` rescales the profiled attention kernels to that).

Communication per layer with attention (the K and V of one layer: ``kv_bytes``, GQA:
``2 * b * s * n_kv_heads * head_dim * dtype_bytes`` for the whole sequence, per TP rank):

``allgather`` (Llama 3): all-gather K and V over the cp group before the attention in forward;
    in backward all-gather them again (the gathered buffers are transient, as Llama 3 keeps
    only the local chunk) and reduce-scatter dK and dV. The attention waits for the gather,
    the next layer for the reduce-scatter: both are exposed.
``ring`` (ring attention, Megatron's p2p CP): ``cp - 1`` steps, each passing one K/V chunk
    (``kv_bytes / cp``) to the next rank while attention runs on the current one; backward
    passes K,V and dK,dV. That is the traffic of a ring all-gather (and reduce-scatter) of
    ``kv_bytes``, so it is one such collective per layer and pass, priced by the collective
    model; it runs on the ``cp`` stream *alongside* the layer's compute piece (it waits for
    what the piece waits for, and what follows the piece waits for it): exposed time
    ``max(0, comm - piece compute)``. The piece is the whole layer, so this is optimistic when
    the ring outlasts the attention alone but not the layer (projections and MLP cannot hide
    real ring steps). A full-recompute backward runs the forward ring again (``R``).

Selective recompute re-runs the attention core on the K/V its backward gathers (no extra
collective). Limits: sliding-window layers gather the whole sequence's K/V, and a window between
``seq_len / cp`` and ``seq_len`` is costed as full causal attention.

Parameters are replicated over cp: gradient sync and ZeRO sharding span dp x cp (`piper_sim.ir.Context`).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

from piper_sim.configs import ModelConfig
from piper_sim.ir import Context, Node, TrainingDAG, make_op
from piper_sim.memory import SegmentMemory
from piper_sim.parallel.memory import stage_unit_modes
from piper_sim.parallel.tensor import layer_label
from piper_sim.plan import SPLIT_KINDS
from piper_sim.profiling import SegmentCost, segment_kind
from piper_sim.recompute import reruns_forward_collective
from piper_sim.strategy import StrategyError

CP_STREAM = "cp"  # its collectives' stream (inside a layer)
STREAM_WORDS = {CP_STREAM: "context-parallel"}  # that stream in words (`piper_sim.explain`)
CP_STYLES = ("allgather", "ring")
ATTENTION_KINDS = ("dense", "moe_pre")  # segments with an attention block


def cp_error(cfg: ModelConfig, seq_len: int, cp: int, tp: int = 1, sp: bool = False) -> str:
    """Why context parallel degree ``cp`` cannot split ``seq_len`` (one line naming the field), or ``""``."""
    if seq_len % (2 * cp):
        return (f"degree {cp} needs seq_len divisible by 2 x {cp} = {2 * cp} (two load-balanced chunks per "
                f"rank), got seq_len {seq_len}; use a multiple of {2 * cp} or a smaller degree")
    if sp and (seq_len // cp) % tp:
        return (f"sequence_parallel splits each rank's {seq_len // cp} tokens (seq_len / {cp}) over tensor "
                f"parallel degree {tp}; make seq_len a multiple of {cp * tp}")
    return ""


def kv_width(cfg: ModelConfig) -> int:
    """K and V elements per token on one tensor-parallel rank (GQA: its KV heads; MLA: the
    up-projected per-head keys and values of its heads, as Megatron gathers them)."""
    if cfg.attention == "mla":
        return cfg.local_heads * (cfg.qk_nope_dim + cfg.qk_rope_dim + cfg.v_head_dim)
    return 2 * cfg.local_kv_heads * cfg.head_dim


def gathered_kv_bytes(cfg: ModelConfig, micro_batch: int, seq_len: int, dtype_bytes: int) -> float:
    """One layer's K and V for a whole micro-batch (``seq_len`` tokens): what the all-gather
    gathers (GQA: ``2 * b * s * n_kv_heads * head_dim * dtype_bytes`` per TP rank)."""
    return float(micro_batch * seq_len * kv_width(cfg) * dtype_bytes)


def has_attention(seg: SegmentCost) -> bool:
    return segment_kind(None, seg.name) in ATTENTION_KINDS  # type: ignore[arg-type]


def _rescale_attention(rows: tuple, cp: int) -> tuple[tuple, float]:
    """Kernel rows of a segment profiled on ``s / cp`` tokens with each causal flash-attention
    call widened to all ``s`` keys (``(b, h, s/cp, s, d, causal)``: the load-balanced causal
    share, 1/cp of full-sequence attention) and its flops times ``cp``; also the flops added.
    Windowed calls (not causal over ``s/cp`` keys) keep their ``s/cp x window`` shape. Bytes
    are as profiled (the price reads the shape)."""
    out, extra = [], 0.0
    for r in rows:
        cls, name, shape, dtype, count, flops, nbytes = r
        if cls in ("attn_fwd", "attn_bwd") and shape[5] and shape[2] == shape[3]:
            shape = (*shape[:3], shape[3] * cp, *shape[4:])
            extra += flops * (cp - 1)
            r = (cls, name, tuple(shape), dtype, count, flops * cp, nbytes)
        out.append(r)
    return tuple(out), extra


def cp_segments(segments: list[SegmentCost], cp: int) -> list[SegmentCost]:
    """One context-parallel rank's costs from a profile on ``seq_len / cp`` tokens: attention
    widened to the rank's load-balanced share (`_rescale_attention`), everything else as is."""
    if cp == 1:
        return segments
    out = []
    for x in segments:
        f, ef = _rescale_attention(x.kernels_f, cp)
        bi, ebi = _rescale_attention(x.kernels_bi, cp)
        bw, ebw = _rescale_attention(x.kernels_bw, cp)
        out.append(replace(x, kernels_f=f, kernels_bi=bi, kernels_bw=bw, fwd_flops=round(x.fwd_flops + ef),
                           bwd_input_flops=round(x.bwd_input_flops + ebi),
                           bwd_weight_flops=round(x.bwd_weight_flops + ebw)))
    return out


def cp_memory(memory: dict[str, SegmentMemory], cp: int) -> dict[str, SegmentMemory]:
    """Memory facts of one context-parallel rank: what selective recompute re-runs (the
    attention core) widened like `cp_segments`; the bytes are the rank's ``s / cp`` tokens'."""
    if cp == 1:
        return memory
    out = {}
    for name, m in memory.items():
        rows, extra = _rescale_attention(m.core_kernels, cp)
        out[name] = replace(m, core_kernels=rows, core_flops=m.core_flops + extra)
    return out


def context_pass(ctx: Context, dag: TrainingDAG) -> None:
    """The K/V collectives of every layer with attention, on the ``cp`` stream over the ``cp``
    group (see the module docstring): ``CP.F..{l}.kv.ag`` in forward; in backward (B/BI)
    ``{l}.kv.ag`` and ``{l}.dkv.rs`` (ring: ``CP.R..{l}.kv.ag`` first when the layer's
    checkpoint re-runs its attention: full, every-N, op-SAC).
    ``allgather``: the forward gather and backward gather run before the piece, the
    reduce-scatter after it; ``ring``: all of a piece's run beside it. Runs after the
    activation memory pass: a gathered K/V buffer lives until its piece ends; a ring holds
    two chunks (double buffer) while it runs; a reduce-scatter its unreduced part."""
    cp = ctx.layout.cp
    if cp == 1:
        return
    ring = ctx.setup.cp_style == "ring"
    kv = ctx.kv_bytes
    gathered = kv * (cp - 1) / cp
    for n in list(dag.g.nodes):
        ins = dag.ins(n)
        if ins.kind not in SPLIT_KINDS:
            continue
        segs = [x for x in ctx.parts(ins.stage)[ins.part] if has_attention(x)]
        if not segs:
            continue
        where, forward = n[0], ins.kind == "F"
        modes = stage_unit_modes(ctx, ins.stage)
        group = ctx.group("cp", where)
        before: list[Node] = []
        after: list[Node] = []

        def add(pas: str, name: str, kind: str) -> Node:
            transient = 2 * kv / cp if ring else gathered
            free = transient if ring or kind == "REDUCE_SCATTER" else 0.0
            return dag.add(where, make_op(kind, CP_STREAM, stage=ins.stage, mb=ins.mb, bytes=kv, group=group,
                                          direction=pas, name=name, alloc=transient, free=free))

        for x in segs if forward else reversed(segs):
            label = layer_label(x)
            if forward:
                before.append(add("F", f"{label}.kv.ag", "ALL_GATHER"))
                continue
            # a checkpoint holding the attention (full, every-N, op-SAC) re-runs its ring
            if ring and reruns_forward_collective(modes.get(x.unit, ("none", 0))[0], (), "kv"):
                before.append(add("R", f"{label}.kv.ag", "ALL_GATHER"))
            before.append(add("B", f"{label}.kv.ag", "ALL_GATHER"))
            (before if ring else after).append(add("B", f"{label}.dkv.rs", "REDUCE_SCATTER"))
        if not ring:
            ins.free += gathered * len([b for b in before if dag.ins(b).kind == "ALL_GATHER"])
        _insert(dag, n, before, after, beside=ring)


def _insert(dag: TrainingDAG, n: Node, before: list[Node], after: list[Node], beside: bool) -> None:
    """Chain ``before`` between compute piece ``n`` and its predecessors (``beside``: also
    before its successors, so they run alongside ``n``), and ``after`` between ``n`` and its
    successors. The first op of ``before`` is issued just before ``n`` (`issue_before`)."""
    preds = list(dag.g.in_edges(n, data="kind"))
    succs = list(dag.g.out_edges(n, data="kind"))
    chain_in = before
    if chain_in:
        dag.g.nodes[chain_in[0]]["issue_before"] = n
        for p, _, kind in preds:
            dag.edge(p, chain_in[0], kind)
        for a, b in zip(chain_in, chain_in[1:]):
            dag.edge(a, b)
        if beside:
            for _, q, kind in succs:
                dag.edge(chain_in[-1], q, kind)
        else:
            dag.g.remove_edges_from([(p, n) for p, _, _ in preds])
            dag.edge(chain_in[-1], n)
    if after:
        dag.g.remove_edges_from([(n, q) for _, q, _ in succs])
        for a, b in zip([n] + after, after):
            dag.edge(a, b)
        for _, q, kind in succs:
            dag.edge(after[-1], q, kind)


def context_edges(ctx: Context, dag: TrainingDAG) -> None:
    """A piece's K/V collectives start no earlier than the compute op before the piece (the
    K/V come from the piece's own projections: no prefetch), once the order is known."""
    first: dict[Node, list[Node]] = {}
    for q, data in dag.g.nodes(data=True):
        if data.get("issue_before") is not None:
            first.setdefault(data["issue_before"], []).append(q)
    for seq in ctx.sequences.values():
        for prev, n in zip(seq, seq[1:]):
            for q in first.get(n, ()):
                if not dag.g.has_edge(prev, q):
                    dag.edge(prev, q, "temporal")


def check(cfg, setup, strategy, cluster) -> None:
    """``context_parallel``: a transformer whose sequence splits into ``2 * cp`` chunks; a
    warning when CP x TP spans nodes."""
    if setup.cp == 1:
        return
    if not isinstance(cfg, ModelConfig):
        raise StrategyError(f"context_parallel: model {cfg.name} is a user nn.Module, whose attention piper-sim "
                            "cannot split by sequence; remove the directive (zoo, model-file and hf: models "
                            "support it)")
    err = cp_error(cfg, strategy.seq_len, setup.cp, setup.tp, setup.sp)
    if err:
        raise StrategyError(f"context_parallel: {err}")
    if setup.cp * setup.tp > cluster.gpus_per_node:
        warnings.warn(f"context_parallel: degree {setup.cp} x tensor parallel {setup.tp} spans nodes (cluster "
                      f"{strategy.cluster} has {cluster.gpus_per_node} GPUs per node): K/V collectives leave "
                      "NVLink", stacklevel=4)
