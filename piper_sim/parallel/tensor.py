"""Tensor (and sequence) parallelism: the collectives inside each layer on the ``tp`` stream."""

from __future__ import annotations

import warnings

from piper_sim.annotate import UserModel
from piper_sim.configs import ModelConfig, tp_divisibility_error
from piper_sim.ir import Context, Node, TrainingDAG, make_op
from piper_sim.parallel.memory import stage_unit_modes
from piper_sim.plan import COMPUTE_KINDS, SPLIT_KINDS, WEIGHT_GRAD_KINDS, Instruction
from piper_sim.profiling import SegmentCost, segment_kind
from piper_sim.recompute import reruns_forward_collective
from piper_sim.strategy import StrategyError

TP_STREAM = "tp"
STREAM_WORDS = {TP_STREAM: "tensor-parallel"}  # its stream in words (`piper_sim.explain`)


def is_tp(ins: Instruction) -> bool:
    """A tensor-parallel collective (inside a layer, on the ``tp`` stream)."""
    return ins.stream == TP_STREAM


def layer_label(seg: SegmentCost) -> str:
    return "l" + seg.unit.split(".")[1] if seg.unit.startswith("layers.") else seg.unit


def attn_grad_width(cfg: ModelConfig) -> int:
    """Elements per token of a layer's attention input-gradient all-reduce (``f``) without
    sequence parallelism: ``hidden`` for GQA (q/k/v are column-parallel on the layer input);
    for multi-head latent attention the inputs of its column-parallel up-projections — the
    normalised query latent (or the layer input without ``q_lora_rank``), the normalised KV
    latent and the shared rotary key — as Megatron-Core's MLA gathers them (its
    ``linear_q_up_proj``/``linear_kv_up_proj`` column-parallel, the down-projections and their
    norms replicated on the whole input, so their weight gradients are whole: no ``TP.norms``)."""
    if cfg.attention != "mla":
        return cfg.hidden
    return (cfg.q_lora_rank or cfg.hidden) + cfg.kv_lora_rank + cfg.qk_rope_dim


def tp_collectives(seg: SegmentCost, pas: str, sp: bool, act: float, loss: float, attn_in: float | None = None,
                   shared: bool = False, routed: float | None = None) -> list[tuple[str, str, float]]:
    """The tensor-parallel collectives of one segment in one pass, in execution order, as
    (name, kind, bytes); ``act`` is the ``B·s·h`` activation in bytes, ``loss`` one fp32 value
    per token, ``attn_in`` the bytes of the attention's input-gradient all-reduce without SP
    (`attn_grad_width`; default ``act``), ``shared`` whether MoE layers have shared experts,
    ``routed`` the bytes of a MoE layer's routed token copies, ``top_k · act`` (default ``act``).
    ``pas``: ``F``; ``B`` (input gradients; ``.regather`` ops feed the weight
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
      target logit, sum of exponentials);
    - shared experts (Megatron-Core ``SharedExpertMLP``: a column/row-parallel MLP on the MoE
      block's input) all-reduce their row-parallel output in forward (``{l}.shared.ar``, in the
      ``pre`` segment that runs them); in backward the gradient of their input is summed with the
      routed experts' in the MoE block's one ``{l}.moe.ar`` (both read the same tokens);
    - MoE without SP: the experts' partial outputs are all-reduced in forward (``{l}.moe.ar``,
      after the experts) one row per routed token copy, the ``routed`` bytes, before the
      routing weights multiply them (as Megatron-Core's dispatchers reduce the copies before
      the unpermute: the router's gradient needs whole outputs; with or without expert
      parallelism, a rank's received copies averaging its own ``top_k`` per token); in
      backward the gradient of the experts' input, ``act``, in the pre segment's ``f``;
    - MoE with SP (Megatron-Core's ``MoEAlltoAllTokenDispatcher`` with SP): each TP rank routes
      and dispatches its own sequence shard (no gather before the router); after the EP
      dispatch the experts' tokens are all-gathered over TP (``{l}.moe.ag``, the ``routed``
      bytes: every TP rank's dispatched tokens, top-k copies of ``act``) and their partial
      outputs reduce-scattered back (``{l}.moe.rs``) before the combine; in backward the
      mirror pair (``{l}.moe.ag`` of the output gradient, ``{l}.moe.rs`` of the input
      gradient; the gathered tokens are kept, no re-gather); the shared experts are a
      column/row-parallel MLP with SP's gather and scatter (``{l}.shared.ag|rs``, ``.regather``).
    """
    ops = _block_collectives(seg, pas, sp, act, loss, attn_in, shared, routed)
    kind = segment_kind(None, seg.name)  # type: ignore[arg-type]
    if seg.unit.startswith("mtp.") and kind in ("dense", "moe_pre"):
        return _eh_proj_collectives(seg.unit, pas, sp, act, ops)
    return ops


def _eh_proj_collectives(unit: str, pas: str, sp: bool, act: float, layer: list) -> list[tuple[str, str, float]]:
    """An MTP module's embedding and ``eh_proj`` (2h -> h) around its layer's collectives
    ``layer``, as Megatron-Core runs them. The module embeds its shifted tokens with the GPT
    model's own vocabulary-parallel embedding (megatron-core 0.16.1
    transformer/multi_token_prediction.py:720, ``embedding(input_ids=..., position_ids=...)``):
    its output all-reduced (SP: reduce-scattered), in backward nothing (SP: the output gradient
    all-gathered), as the model's embedding (``{unit}.embed.*``). ``eh_proj``
    (multi_token_prediction.py:651-661, 737-746): column-parallel with ``gather_output=False``,
    its output all-gathered over the last dim (``gather_from_tensor_model_parallel_region``;
    backward: a local split), under SP scattered back to the sequence shard (a local split;
    backward: all-gather). The column-parallel linear's own input: without SP its gradient
    all-reduced (2h wide), with SP gathered over the sequence in forward, the gradient
    reduce-scattered and the input re-gathered for the weight gradient."""
    AR, AG, RS = "ALLREDUCE", "ALL_GATHER", "REDUCE_SCATTER"
    e, emb = f"{unit}.eh", f"{unit}.embed"
    if pas == "F":
        embed = [(f"{emb}.rs", RS, act)] if sp else [(f"{emb}.ar", AR, act)]
        return embed + ([(f"{e}.ag", AG, 2 * act)] if sp else []) + [(f"{e}.gather", AG, act)] + layer
    if sp:
        return layer + [(f"{e}.scatter.ag", AG, act), (f"{e}.regather", AG, 2 * act), (f"{e}.rs", RS, 2 * act),
                        (f"{emb}.ag", AG, act)]
    return layer + [(f"{e}.ar", AR, 2 * act)]


def _block_collectives(seg: SegmentCost, pas: str, sp: bool, act: float, loss: float, attn_in: float | None,
                       shared: bool, routed: float | None) -> list[tuple[str, str, float]]:
    """`tp_collectives` of the embedding, the head and a layer's blocks."""
    attn_in = act if attn_in is None else attn_in
    routed = act if routed is None else routed
    kind = segment_kind(None, seg.name)  # type: ignore[arg-type]
    AR, AG, RS = "ALLREDUCE", "ALL_GATHER", "REDUCE_SCATTER"
    if kind == "embed":
        return ([("embed.rs", RS, act)] if sp else [("embed.ar", AR, act)]) if pas == "F" else \
            ([("embed.ag", AG, act)] if sp else [])
    if kind == "head":  # the model's head, or an MTP module's (segment mtp.d.loss: its ops named mtp.d.head.*)
        h = "head" if seg.name == "head" else seg.name.removesuffix(".loss") + ".head"
        if pas == "F":
            head = [(f"{h}.ag", AG, act)] if sp else []
            return head + [(f"{h}.loss.{x}", AR, loss) for x in ("max", "target", "sumexp")]
        return [(f"{h}.regather", AG, act), (f"{h}.rs", RS, act)] if sp else [(f"{h}.ar", AR, act)]
    l = layer_label(seg)
    blocks = {"dense": ["attn", "mlp"], "moe_pre": ["attn", "moe"], "moe_experts": []}[kind]
    if kind == "moe_experts":  # around the experts: their tokens gathered over TP, outputs scattered (SP)
        if sp:  # forward: gather the tokens, scatter the outputs; backward: gather the output gradient, scatter
            return [(f"{l}.moe.ag", AG, routed), (f"{l}.moe.rs", RS, routed)]
        return [(f"{l}.moe.ar", AR, routed)] if pas == "F" else []  # backward: in the pre segment's f
    if sp and kind == "moe_pre":  # the router and dispatch read the shard: only attention and shared experts
        blocks = ["attn", "shared"] if shared else ["attn"]
    if pas == "F":
        if kind == "moe_pre" and not sp:  # the MoE block's output is reduced after the experts (see moe_experts)
            return [(f"{l}.attn.ar", AR, act)] + ([(f"{l}.shared.ar", AR, act)] if shared else [])
        return [x for b in blocks for x in ([(f"{l}.{b}.ag", AG, act), (f"{l}.{b}.rs", RS, act)] if sp else
                                            [(f"{l}.{b}.ar", AR, act)])]
    out = []
    for b in reversed(blocks):
        if sp:
            out += [(f"{l}.{b}.ag", AG, act), (f"{l}.{b}.regather", AG, act), (f"{l}.{b}.rs", RS, act)]
        else:
            out.append((f"{l}.{b}.ar", AR, attn_in if b == "attn" else act))
    return out


# the blocks whose column-parallel linear issues a backward collective async (`async_in_backward`)
_ASYNC_BACKWARD_BLOCKS = ("attn", "mlp", "shared", "head", "eh")


def async_in_backward(name: str, user: bool = False) -> bool:
    """Whether a backward TP collective is one a column-parallel linear issues async beside its
    GEMMs under the stack's ``tp_backward_overlap`` (costmodel.stack): the re-gather of its
    sequence-parallel input (``.regather``, beside the dgrad GEMM) and the reduction of its
    input gradient (``.rs`` with SP, ``.ar`` without: beside the wgrad GEMM), in attention, the
    MLP, shared experts, the head and MTP's ``eh_proj``. The all-gather of a row-parallel
    output gradient (``.ag``), the embedding's and the MoE dispatch's collectives block. A user
    module's (``user``, `piper_sim.user_tp`): every backward ``.rs`` / ``.ar`` is a
    column-parallel input's gradient reduction, named after the module path."""
    parts = name.split(".")
    if user:
        return parts[-1] in ("rs", "ar")
    return len(parts) >= 2 and parts[-1] in ("regather", "rs", "ar") and parts[-2] in _ASYNC_BACKWARD_BLOCKS


def _block_of(name: str) -> str:
    """The block of a TP collective's name (``l3.mlp.ar`` -> ``mlp``; the embedding's / head's: '')."""
    parts = name.split(".")
    return parts[1] if parts[0].startswith("l") and parts[0][1:].isdigit() else ""


def tensor_pass(ctx: Context, dag: TrainingDAG) -> None:
    """Tensor (and sequence) parallelism: the collectives inside each layer (`tp_collectives`)
    on the ``tp`` stream, over the ``tp`` group.

    F/B/BI are cut per unit (`Context.parts`) and a unit's collectives run, in order, between
    its compute piece and the next: ``piece(l) -> its collectives -> piece(l+1)``. Without
    async tensor parallelism the next GEMM waits for each of them, so a layer takes its
    compute plus its collectives either way; only where inside the layer they run moves
    (after its attention half, in truth). A full-recompute backward re-runs the forward's
    collectives first (``TP.R.`` ops: a unit's, all its segments' in forward order, before its
    backward's), and so do the finer policies' checkpoints that hold collectives (op-SAC, every
    N-th block, Megatron's ``mlp`` / ``shared_experts`` modules:
    `piper_sim.recompute.reruns_forward_collective`). With a BI/BW split the weight pass waits for the
    ``.regather`` all-gathers, issued after the stage's input-gradient pass, and the
    embedding's backward collective (SP: the all-gather of its output gradient) follows BW: the
    embedding has no input gradient, its whole backward is the weight gradient. The replicated
    weights whose gradients are partial per rank (the norms under sequence parallelism, the
    query/key norms of a ``qk_norm`` model) are all-reduced over the TP group before the
    optimizer step (``TP.s{S}.norms``). Segments ``shard_tensor``
    did not select (`Setup.tp_sharded`) are replicated and have no collectives."""
    if ctx.layout.tp == 1:
        return
    sp = ctx.setup.sp
    act = float(ctx.micro_batch * ctx.seq_len * ctx.hidden * ctx.dtype_bytes)
    attn_in = float(ctx.micro_batch * ctx.seq_len * (ctx.tp_attn_width or ctx.hidden) * ctx.dtype_bytes)
    shared = ctx.tp_shared_experts
    routed = act * ctx.tp_top_k if ctx.tp_top_k else None  # MoE under SP: the experts' gathered token copies
    loss = float(ctx.micro_batch * ctx.seq_len * 4)
    by_stage: dict[tuple[int, int], list[Node]] = {}
    for n in list(dag.g.nodes):
        ins = dag.ins(n)
        if ins.kind in COMPUTE_KINDS:
            by_stage.setdefault((n[0], ins.stage), []).append(n)
    user = bool(ctx.tp_unit_ops)  # a user nn.Module: its units' own collectives (piper_sim.user_tp)
    for (where, s), nodes in by_stage.items():
        group = ctx.group("tp", where)
        modes, modules = stage_unit_modes(ctx, s), ctx.setup.policy(s).module_set
        parts = ctx.parts(s)
        deferred = {} if user else _deferred_mtp_heads(parts)

        def collectives(seg: SegmentCost, pas: str) -> list[tuple[str, str, float]]:
            """The TP collectives of ``seg`` in pass ``pas``: a user unit's own (`piper_sim.user_tp`),
            else `tp_collectives`, where an MTP loss in a part before the head's runs its output
            layer in the head's part (`_deferred_mtp_heads`), before the main head's."""
            if user:
                return ctx.tp_unit_ops.get(seg.unit, {}).get(pas, [])
            if seg.name in deferred:
                return []
            own = tp_collectives(seg, pas, sp, act, loss, attn_in, shared, routed)
            if seg.name != "head" or not deferred:
                return own
            order = deferred.values() if pas == "F" else reversed(deferred.values())
            mtp = [x for d in order for x in tp_collectives(d, pas, sp, act, loss, attn_in, shared, routed)]
            return mtp + own if pas == "F" else own + mtp
        regathers: dict[int, list[Node]] = {}  # mb -> BI-split re-gathers its BW waits for
        after_bw: dict[int, list[Node]] = {}  # mb -> the embedding's backward collectives in a split: BW's
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

            recomputed: set[str] = set()
            for seg in segs:
                if not ctx.setup.tp_sharded(seg.unit):
                    continue  # replicated (shard_tensor's selection): run whole, no TP collective
                if ins.kind != "F" and seg.unit not in recomputed:
                    # a unit's checkpoint re-runs before its backward: the forward collectives it
                    # re-issues (`reruns_forward_collective`), all its segments' in forward order
                    # (a MoE layer without EP: pre, then experts)
                    recomputed.add(seg.unit)
                    mode = modes.get(seg.unit, ("none", 0))[0]
                    chain += [add("R", *x) for u in parts[ins.part] if u.unit == seg.unit and
                              ctx.memory[u.name].recomputed
                              for x in collectives(u, "F")
                              if reruns_forward_collective(mode, modules, _block_of(x[0]))]
                for x in collectives(seg, "F" if ins.kind == "F" else "B"):
                    if ins.kind == "BI" and x[0].endswith(".regather"):
                        regathers.setdefault(ins.mb, []).append(add("B", *x))
                    elif ins.kind == "BI" and (s == 0 and ins.part == 0 if user else
                                               segment_kind(None, seg.name) == "embed"  # type: ignore[arg-type]
                                               or x[0] == f"{seg.unit}.embed.ag"):
                        # the embedding's (a user model's first piece, whose input is the batch: no
                        # input gradient; an MTP module's embedding of its tokens) backward is all
                        # weight gradient, in BW
                        after_bw.setdefault(ins.mb, []).append(add("B", *x))
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
            # overlapped with the layer's GEMMs: the chain starts with the piece; with only the
            # column-parallel linears' backward ones async (tp_backward_overlap) the others hold
            # the piece's compute while they run (in the modules' order, which the executor checks)
            backward_async = ins.kind == "B" and ctx.stack.tp_backward_overlap
            if ctx.stack.tp_overlap or backward_async:
                dag.ins(chain[0]).dep_progress = 0.0
            if backward_async and not ctx.stack.tp_overlap:
                for c in chain:  # a recompute's re-run forward collectives (direction R) block
                    c_ins = dag.ins(c)
                    c_ins.holds = c_ins.direction != "B" or not async_in_backward(c_ins.name, user)
            for _, q, kind in succs:
                dag.edge(chain[-1], q, kind)
        for mb, ops in regathers.items():
            bw = (where, f"BW.s{s}.mb{mb}")
            src = last_bi[mb]
            for a, b in zip([src] + ops, ops):
                dag.edge(a, b)
            dag.edge(ops[-1], bw)
        for mb, ops in after_bw.items():  # its BI computes no input gradient: all of it is weight gradient
            for a, b in zip([(where, f"BW.s{s}.mb{mb}")] + ops, ops):
                dag.edge(a, b)
            dag.edge(ops[-1], (where, f"OPT.s{s}"))
        norms = sum(x.tp_partial_params for x in ctx.stages[s].segments) * ctx.dtype_bytes
        if norms:
            ar = dag.add(where, make_op("ALLREDUCE", TP_STREAM, stage=s, bytes=float(norms), group=group,
                                        name="norms"))
            for n in nodes:
                if dag.ins(n).kind in WEIGHT_GRAD_KINDS:
                    dag.edge(n, ar)
            dag.edge(ar, (where, f"OPT.s{s}"))


def _deferred_mtp_heads(parts: list[list[SegmentCost]]) -> dict[str, SegmentCost]:
    """The MTP loss segments (``mtp.d.loss``) of a stage in a part before the head's (always
    under TP, whose parts are units), by name in depth order: their shared output layer and
    vocabulary-parallel loss run in the head's part, before the main head's, as Megatron-Core's
    ``GPTModel._postprocess`` computes the MTP logits and losses before the main logits
    (megatron-core 0.16.1 models/gpt/gpt_model.py:620-640, then 685) and as
    the executor runs them (`executor.stage.Stage.deferred`)."""
    if not any(seg.name == "head" for part in parts for seg in part):
        return {}
    return {seg.name: seg for part in parts if not any(x.name == "head" for x in part)
            for seg in part if seg.unit.startswith("mtp.") and seg.name.endswith(".loss")}


def compute_waits_edges(ctx: Context, dag: TrainingDAG) -> None:
    """Without ``tp_overlap`` the compute stream waits for every tensor-parallel collective of
    an op before it runs the rank's next compute op, whichever op that is: torch.distributed
    issues a collective called without ``async_op`` on its NCCL stream and waits for it
    (``work.wait()``), and that wait makes the *current* CUDA stream wait for the
    collective's end event (pytorch ``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``,
    ``WorkNCCL::synchronizeStream``: "Block the current stream on the NCCL stream"), so the
    kernels enqueued after it, the next op's included, start after it. `tensor_pass` chains a
    unit's collectives to the op's next piece; this pass adds the edge to the next op on
    the rank, which the chain's data edges do not give (its output leaves through a SEND): a
    pipeline chunk of one layer otherwise ran every one of its collectives beside the next
    chunk's compute. The rank's optimizer steps wait for its last op's collectives too. The pieces
    of an overlapped pair (DualPipe's F&B) keep their overlap."""
    if ctx.layout.tp == 1 or ctx.stack.tp_overlap:
        return
    steps: dict[int, list[Node]] = {}
    for n in dag.g.nodes:
        if dag.ins(n).kind == "OPT":
            steps.setdefault(n[0], []).append(n)
    for where, seq in ctx.sequences.items():
        pairs = list(zip(seq, seq[1:])) + [(seq[-1], opt) for opt in steps.get(where, ())] if seq else []
        for prev, n in pairs:
            p_ins = dag.ins(prev)
            if dag.ins(n).kind != "OPT" and p_ins.slot == dag.ins(n).slot:
                continue
            seen: set[Node] = set()
            todo, sinks = [prev], []
            while todo:
                cur = todo.pop()
                nxt = [q for q in dag.g.successors(cur) if q not in seen and is_tp(dag.ins(q))
                       and dag.ins(q).mb == p_ins.mb and dag.ins(q).stage == p_ins.stage]
                if cur is not prev and not nxt:
                    sinks.append(cur)
                seen.update(nxt)
                todo.extend(nxt)
            for q in sinks:
                if not dag.g.has_edge(q, n):
                    dag.edge(q, n, "temporal")


def norms_after_zero3_pass(ctx: Context, dag: TrainingDAG) -> None:
    """ZeRO-3: the per-unit reduce-scatters hand each unit's gradients off during the backward,
    so ``TP.s{S}.norms`` sums the partial replicated gradients in the reduced shard instead,
    after the stage's dense gradient syncs (reduce-scatters, and HSDP's replica all-reduces):
    the sum over TP of the sum over DP is the same, and the shard lies at the same elements
    on every TP rank. Megatron-Core does it in this order too: ``finalize_model_grads`` runs
    ``finish_grad_sync`` (DP) before ``_allreduce_layernorm_grads`` (TP). Its bytes are the
    shard's: ``1 / shard_size`` of the partial weights."""
    if ctx.layout.tp == 1 or ctx.setup.zero != 3:
        return
    norms = {(n[0], dag.ins(n).stage): n for n in dag.g.nodes if is_tp(dag.ins(n)) and dag.ins(n).name == "norms"}
    syncs: dict[tuple[int, int], list[Node]] = {}
    for n in dag.g.nodes:
        ins = dag.ins(n)
        if ins.kind in ("REDUCE_SCATTER", "ALLREDUCE") and ins.bucket >= 0 and not ins.experts:
            syncs.setdefault((n[0], ins.stage), []).append(n)
    for key, ar in norms.items():
        if not syncs.get(key):
            continue  # one data-parallel rank: the gradients stay whole until the optimizer step
        for n in syncs[key]:
            dag.edge(n, ar)
        dag.ins(ar).bytes /= ctx.shard_size(key[1])


def check(cfg, setup, strategy, cluster) -> None:
    """``tensor_parallel``: the degree divides the model's heads and widths (and, with sequence
    parallelism, the sequence); a warning when it spans nodes."""
    if setup.tp == 1:
        return
    # a user nn.Module's annotations are checked against the degree by annotate.check_user_setup
    err = "" if isinstance(cfg, UserModel) else tp_divisibility_error(cfg, setup.tp)
    if err:
        raise StrategyError(f"tensor_parallel: {err}")
    if setup.sp and strategy.seq_len % setup.tp:
        raise StrategyError(f"tensor_parallel: sequence_parallel splits seq_len {strategy.seq_len} over degree "
                            f"{setup.tp}; make seq_len a multiple of {setup.tp} or set sequence_parallel false")
    if setup.tp > cluster.gpus_per_node:
        warnings.warn(f"tensor_parallel: degree {setup.tp} spans nodes (cluster {strategy.cluster} has "
                      f"{cluster.gpus_per_node} GPUs per node): its collectives leave NVLink", stacklevel=4)
