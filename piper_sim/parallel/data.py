"""Data parallelism: gradient sync over the replicas, ZeRO 1-3 sharding (reduce-scatter,
parameter all-gathers, FSDP-style per-unit gathers), gradient-bucket memory, the optimizer
step's cost and the model states a rank holds."""

from __future__ import annotations

from costmodel.compute import ADAM_FLOPS_PER_PARAM, adam_step_bytes, optimizer_bytes_ratio
from costmodel.fp8 import cast_of
from costmodel.memory import adam_state_bytes, bucket_sizes, model_state_bytes
from piper_sim.checks import MAX_BUCKETS_PER_STAGE
from piper_sim.fp8 import fp8_weight_tensors
from piper_sim.ir import Context, Node, TrainingDAG, is_inner, make_op
from piper_sim.plan import BACKWARD_KINDS, COMPUTE_KINDS, SPLIT_KINDS, WEIGHT_GRAD_KINDS, Instruction
from piper_sim.profiling import SegmentCost
from piper_sim.strategy import StrategyError

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
        dense_group = "stage:%d:shard" % s if layout.dp_shard else "stage:%d" % s  # HSDP: parallel.hybrid
        groups = [("", dense_group, [x for x in sc.segments if not (x.is_expert and layout.ep > 1)],
                   ctx.shard_size(s))]
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
            # a split backward's weight gradients come from one BW op for the whole stage: a bucket
            # is ready part-way through it; a pieced full backward's, from the piece that completes it
            split = any(dag.ins(n).kind == "BW" for n in last_backward)
            sources = _bucket_sources([segs] if split else ctx.parts(s), segs, buckets)
            rounds = _reduce_rounds(ctx, dag, s, nodes) if zero == 2 else [(-1, -1, last_backward)]
            for b, nbytes in enumerate(buckets):
                piece, ready = sources[b]
                for rnd, mb, producers in rounds:
                    kind = "ALLREDUCE" if zero == 0 else "REDUCE_SCATTER"
                    sync = make_op(kind, stream[kind], stage=s, mb=mb, round=rnd, bytes=nbytes * ctx.grad_reduce_scale,
                                   group=group,
                                   dep_progress=ready, bucket=b, experts=bool(tag))
                    sn = dag.add(where, sync)
                    grads = [n for n in producers if dag.ins(n).kind in WEIGHT_GRAD_KINDS]
                    last = max((dag.ins(n).mb for n in grads), default=-1)
                    for n in grads:  # the last micro-batch's backward: only the piece that completes the bucket
                        if split or dag.ins(n).mb != last or dag.ins(n).part == piece:
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
        if not producers or is_inner(ins):
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
    layout = ctx.layout
    if ins.group.endswith(":shard"):
        return ctx.shard_size(ins.stage)
    copies = len(layout.stage_ranks[ins.stage]) * layout.dp * layout.cp
    return copies // layout.ep if ins.group.endswith(":edp") else copies


def _bucket_sources(parts: list[list[SegmentCost]], segs: list, buckets: list[float]) -> list[tuple[int, float]]:
    """For each gradient bucket: the backward piece (``Instruction.part``, an index into
    ``parts``) that completes it and the share of that piece's backward done by then. The
    backward runs the pieces last to first and each piece's segments in reverse, so the bucket
    is complete once its first byte's segment is reached;
    the pieces before it in model order (run after it) need not finish, so a reduce-scatter
    overlaps the rest of the backward as DDP/FSDP/Megatron overlap them. Buckets are slices of
    the parameters in model order; the share is the backward flops of the piece's later
    segments plus the part of that segment's from the byte to its end, over the piece's (a tied
    embedding's bucket waits for the embedding's backward, the last); strictly decreasing in
    ``b`` so buckets ready together go out last first."""
    piece_of = {x.name: i for i, part in enumerate(parts) for x in part}
    out = []
    for b, (j, inside) in enumerate(_first_bytes(segs, buckets)):
        piece = piece_of[segs[j].name]
        members = parts[piece]
        k = next(i for i, x in enumerate(members) if x.name == segs[j].name)
        total = sum(x.bwd_flops for x in members)
        share = (sum(x.bwd_flops for x in members[k + 1:]) + inside * members[k].bwd_flops) / total if total > 0 else 1.0
        out.append((piece if len(parts) > 1 else 0, max(0.0, min(1.0, share) - 1e-6 * b)))
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


def optimizer_pass(ctx: Context, dag: TrainingDAG) -> None:
    """Cost of each OPT: AdamW over the parameters this rank updates (its ZeRO shard), and
    under an FP8 stack the step's weight casts (`fp8_weight_cast_bytes`)."""
    zero = ctx.setup.zero
    for n in dag.g.nodes:
        ins = dag.ins(n)
        if ins.kind != "OPT":
            continue
        local = sum(count / (n if zero else 1) for count, n in ctx.param_groups(ins.stage))
        ins.flops = ADAM_FLOPS_PER_PARAM * local
        ins.bytes = adam_step_bytes(ctx.stack, ctx.dtype_bytes) * local * optimizer_bytes_ratio(ctx.stack.optimizer)
        ins.bytes += fp8_weight_cast_bytes(ctx, ins.stage)


def fp8_weight_cast_bytes(ctx: Context, stage: int) -> float:
    """Bytes one step's FP8 weight casts move on a rank of ``stage`` (`costmodel.fp8`): each FP8
    weight quantised once per step (TE's weight cache over a step's micro-batches, Megatron-Core
    ``is_first_microbatch``; with ``fp8_param_gather`` after the optimizer step), over the
    parameters the rank updates (its ZeRO shard, its experts under expert parallelism), as
    `optimizer_pass` counts them."""
    if ctx.stack.fp8 == "none":
        return 0.0
    cast, src = cast_of(ctx.stack.fp8, ctx.gpu_family, "weight"), ctx.dtype_bytes
    total = 0.0
    for seg in ctx.stages[stage].segments:
        share = ctx.layout.ep if seg.is_expert else 1  # a rank holds 1/EP of the experts (ctx.param_groups)
        group = ctx.shard_size(stage) // share
        whole = sum(n * cast.nbytes(elements, src) for elements, n in fp8_weight_tensors(seg.kernels_f))
        total += whole / share / (group if ctx.setup.zero else 1)
    return total


def prefetch_edges(ctx: Context, dag: TrainingDAG) -> None:
    """A ZeRO-3 all-gather may start once the op two places before its consumer ended
    (one op of prefetch), so gathered parameters do not pile up in memory."""
    for seq in ctx.sequences.values():
        for i, n in enumerate(seq):
            for p in list(dag.g.predecessors(n)):
                if dag.ins(p).kind == "ALL_GATHER" and i >= 2 and not is_inner(dag.ins(p)):
                    dag.edge(seq[i - 2], p, "temporal")


def static_memory(ctx: Context, pp_rank: int, zero: int) -> dict[str, float]:
    """Parameters, gradients and optimizer state a rank holds for the whole step, in the
    dtypes the stack stores them (``grad_dtype``, ``master_dtype``, ``moment_dtype``)."""
    total = {"params_bytes": 0.0, "grads_bytes": 0.0, "optimizer_bytes": 0.0}
    pbytes = ctx.dtype_bytes
    gbytes = ctx.stack.grad_bytes(pbytes)
    optim = adam_state_bytes(pbytes, ctx.stack)
    for s, ranks in ctx.layout.stage_ranks.items():
        if pp_rank not in ranks:
            continue
        for count, n in ctx.param_groups(s):
            if count:
                m = model_state_bytes(count, n, zero, param_bytes=pbytes, grad_bytes=gbytes, optim_bytes=optim)
                for k in total:
                    total[k] += m[k]
    return total
