"""Compile a strategy: directives -> global training DAG -> per-rank, per-stream Plan."""

from __future__ import annotations

import dataclasses

import re
import time
from dataclasses import dataclass

import networkx as nx

from costmodel import operators
from costmodel.dtypes import DTYPE_BYTES, torch_dtype
from costmodel.hardware import GPU, H100, parse_cluster
from costmodel.stack import DEFAULT as DEFAULT_STACK, Stack, StackError, check_stack_on
from piper_sim.annotate import AnnotationError, UserModel, check_user_setup, resolve_user_model
from piper_sim.directives import Setup, expand, resolve
from piper_sim.axes import attn_grad_width, check_setup, cp_memory, cp_segments, gathered_kv_bytes, passes, static_memory, unit_buckets
from piper_sim.layouts import parse_layout
from piper_sim.ir import Context, Node, StageCost, TrainingDAG, is_inner, run_passes
from piper_sim.memory import SegmentMemory, model_memory
from piper_sim.configs import ModelConfig, mtp_units, plan_model_meta, tp_shard
from piper_sim.layouts import layout_mtp_layers
from piper_sim.plan import SPLIT_KINDS, Instruction, Layout, Plan, RankClass, RankProgram, gc_paused
from piper_sim.profiling import SegmentCost, profile_model
from piper_sim.checks import MAX_PLAN_INSTRUCTIONS, check_world_size
from piper_sim.schedules import SCHEDULE_TABLE, canonical_schedule, default_schedule, stages_per_rank
from piper_sim.sources import resolve_model
from piper_sim.strategy import Strategy, StrategyError, format_layers, parse_strategy



@dataclass
class Compiled:
    """What a compile produces besides the plan: the DAG and the resolved setup."""

    plan: Plan
    dag: TrainingDAG
    setup: Setup
    config: ModelConfig | UserModel
    compile_s: float


def partition_layers(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous, balanced layer ranges; the first stages take the remainder."""
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def unit_times(segments: list[SegmentCost], gpu: GPU) -> dict[str, float]:
    """Seconds of forward + backward of each unit on ``gpu`` (its kernels, priced)."""
    out: dict[str, float] = {}
    for x in segments:
        t = sum(operators.table_time(gpu, rows) for rows in (x.kernels_f, x.kernels_bi, x.kernels_bw))
        out[x.unit] = out.get(x.unit, 0.0) + t
    return out


def cost_balanced_layers(costs: list[float], first_extra: float, last_extra: float, n_stages: int) -> list[int]:
    """Layers per stage for contiguous stages of least maximum cost, where the first stage
    also carries ``first_extra`` (embedding) and the last ``last_extra`` (head and loss), each
    stage at least one layer. The bound comes from a binary search with a greedy fill; the cut
    then gives each stage the layers closest to an even share of what is left, within it."""
    n = len(costs)

    def fill(bound: float, even: bool) -> list[int] | None:
        counts, i = [], 0
        for s in range(n_stages):
            load = first_extra if s == 0 else 0.0
            start = i
            left = sum(costs[i:]) + last_extra + load
            cap = min(bound, left / (n_stages - s)) if even else bound
            # take layers while they fit (to the nearest layer of an even share), leaving one for every later stage
            while i < n - (n_stages - 1 - s) and (i == start or load + costs[i] <= cap + (costs[i] / 2 if even else 0)):
                if load + costs[i] > bound:
                    break
                load += costs[i]
                i += 1
            if s == n_stages - 1:
                load += last_extra + sum(costs[i:])
                i = n
            if load > bound * (1 + 1e-9):
                return None
            counts.append(i - start)
        return counts

    lo, hi = max(costs), sum(costs) + first_extra + last_extra
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fill(mid, False) else (mid, hi)
    return fill(hi, True) or fill(hi, False) or [len(r) for r in partition_layers(n, n_stages)]


def stage_costs(cfg: ModelConfig, segments: list[SegmentCost], n_stages: int,
                layers_per_stage: list[int] | str | None = None, gpu: GPU | None = None) -> list[StageCost]:
    """The segments of each stage: contiguous layers (equal counts, as the ``segment``
    directive says, or ``"balanced"``: equal forward+backward time with the embedding and
    the head counted, priced on ``gpu``); the embedding joins the first stage, the head the last.
    A list may give the first stage 0 layers (the embedding alone) and the last 0 (the head
    and loss alone), as Megatron's and torchtitan's layouts do."""
    if isinstance(cfg, UserModel):
        return _user_stage_costs(cfg, segments, n_stages, layers_per_stage, gpu)
    if n_stages > cfg.n_layers and not isinstance(layers_per_stage, list):
        raise StrategyError(f"pipeline: {n_stages} stages but model {cfg.name} has only {cfg.n_layers} layers; "
                            "lower the pipeline degree or stages_per_rank, or give layers_per_stage with "
                            "an embedding-only first / head-only last stage (0 layers)")
    mtp = mtp_units(cfg)  # multi-token prediction joins the head and loss (Megatron: the last stage)
    if layers_per_stage == "balanced":
        times = unit_times(segments, gpu or H100)
        layers_per_stage = cost_balanced_layers([times[f"layers.{i}"] for i in range(cfg.n_layers)],
                                                times.get("embed", 0.0),
                                                times.get("head", 0.0) + sum(times[u] for u in mtp), n_stages)
    if layers_per_stage is not None:
        if len(layers_per_stage) != n_stages or sum(layers_per_stage) != cfg.n_layers:
            raise StrategyError(f"segment: layers_per_stage {layers_per_stage} must have {n_stages} entries "
                                f"summing to the {cfg.n_layers} layers of {cfg.name}")
        empty = [s for s, n in enumerate(layers_per_stage) if n == 0 and 0 < s < n_stages - 1]
        if empty:
            raise StrategyError(f"segment: layers_per_stage {layers_per_stage} leaves stage(s) {empty} with nothing; "
                                "only the first stage (embedding) and the last (head and loss) may hold 0 layers")
        starts = [sum(layers_per_stage[:i]) for i in range(n_stages)]
        ranges = [range(a, a + n) for a, n in zip(starts, layers_per_stage)]
    else:
        ranges = partition_layers(cfg.n_layers, n_stages)
    stages = []
    for s, layers in enumerate(ranges):
        units = {f"layers.{i}" for i in layers}
        if s == 0:
            units.add("embed")
        if s == n_stages - 1:
            units.update(["head", *mtp])
        stages.append(StageCost(stage=s, segments=[x for x in segments if x.unit in units]))
    if cfg.tie_embeddings and n_stages > 1:
        _own_output_copy(stages)
    elif mtp and n_stages > 1:
        _own_output_copy(stages, mtp[0])
    return stages


def _own_output_copy(stages: list[StageCost], unit: str = "head") -> None:
    """A tied model's embedding and head on two stages: the last stage holds its own copy of
    the word-embedding matrix for the output layer (Megatron-Core ``LanguageModule``'s
    ``output_layer.weight`` off the first stage), with its gradients and optimizer state,
    kept equal by `piper_sim.parallel.tied`; the head segment owns those parameters. An
    untied model's MTP modules (``unit`` ``mtp.0``: its first segment owns them) read the
    embedding there the same way (Megatron-Core's last stage builds ``embedding`` for MTP and
    ``finalize_model_grads._allreduce_word_embedding_grads`` sums it with the first stage's)."""
    embed = next(x for x in stages[0].segments if x.unit == "embed")
    last = stages[-1].segments
    i = next(i for i, x in enumerate(last) if x.unit == unit)
    last[i] = dataclasses.replace(last[i], param_count=last[i].param_count + embed.param_count,
                                  param_bytes=last[i].param_bytes + embed.param_bytes)


def _user_stage_costs(model: UserModel, segments: list[SegmentCost], n_stages: int,
                      units_per_stage: list[int] | str | None, gpu: GPU | None) -> list[StageCost]:
    """A user model's stages: contiguous units, equal counts, the ``segment`` directive's
    counts, or ``"balanced"`` (equal profiled forward+backward time on ``gpu``)."""
    n = len(model.units)
    if n_stages > n:
        raise StrategyError(f"pipeline: {n_stages} stages but model {model.name} has only {n} units; "
                            "lower the pipeline degree or stages_per_rank, or annotate more units")
    if units_per_stage == "balanced":
        times = unit_times(segments, gpu or H100)
        units_per_stage = cost_balanced_layers([times[u] for u in model.units], 0.0, 0.0, n_stages)
    if units_per_stage is None:
        units_per_stage = [len(r) for r in partition_layers(n, n_stages)]
    if isinstance(units_per_stage, list) and 0 in units_per_stage:
        raise StrategyError(f"segment: layers_per_stage {units_per_stage} has a stage of 0 units; user model "
                            f"{model.name} has no embedding or head of its own to hold there")
    if len(units_per_stage) != n_stages or sum(units_per_stage) != n:
        raise StrategyError(f"segment: layers_per_stage {units_per_stage} must have {n_stages} entries "
                            f"summing to the {n} units of {model.name}")
    starts = [sum(units_per_stage[:i]) for i in range(n_stages)]
    return [StageCost(stage=s, segments=segments[a:a + k]) for s, (a, k) in enumerate(zip(starts, units_per_stage))]


def estimated_instructions(strategy: Strategy, cfg: ModelConfig) -> int:
    """Instructions of the folded plan, read off the high-level directives without expanding
    them: per pipeline rank, (stage, micro-batch) pairs x (F, B or BI+BW, a send, a receive,
    and under expert parallelism per MoE layer a dispatch and a combine each way and two more
    compute pieces; under context parallelism per layer two pieces and three K/V collectives)."""
    by_op = {d["op"]: d for d in strategy.directives}
    m = by_op.get("split", {}).get("microbatches", strategy.microbatches)
    pipe = by_op.get("pipeline", {})
    pp = pipe.get("degree", 1)
    requested = pipe.get("stages_per_rank")
    if "layout" in pipe:  # checked by check_directive: its stages over the degree
        requested = requested or max(1, len(parse_layout(pipe["layout"], "directive pipeline")) // pp)
    name = canonical_schedule(by_op.get("schedule", {}).get("name", default_schedule(requested)))
    try:
        v = stages_per_rank(name, pp, m, requested)
    except ValueError:
        return 0  # an impossible schedule: expanding it says why, at once
    pairs = m * v // SCHEDULE_TABLE[name].copies  # dualpipe: two copies, half the micro-batches each
    per_pair = 5
    if "expert_parallel" in by_op and cfg.is_moe:
        per_pair += 6 * -(-(cfg.n_layers - cfg.first_dense) // (pp * v))
    if by_op.get("context_parallel", {}).get("degree", 1) > 1 and isinstance(cfg, ModelConfig):
        # F and B cut per unit, and per layer a K/V gather in F, a gather and a reduce-scatter in B
        per_pair += 5 * -(-cfg.n_layers // (pp * v))
    return pp * pairs * per_pair


def _setup_and_layout(strategy: Strategy, model: object = None) -> tuple[ModelConfig | UserModel, Setup, Layout, int]:
    try:
        cfg = resolve_user_model(strategy.model, model) or resolve_model(strategy.model)
    except AnnotationError as e:
        raise StrategyError(str(e)) from None
    except ValueError as e:
        raise StrategyError(f"model: {e}") from None
    size = estimated_instructions(strategy, cfg)
    if size > MAX_PLAN_INSTRUCTIONS:
        raise StrategyError(f"plan too large: about {size:,} instructions ({strategy.microbatches:,} micro-batches) "
                            f"exceed the limit of {MAX_PLAN_INSTRUCTIONS:,} (piper_sim.checks.MAX_PLAN_INSTRUCTIONS); "
                            "use fewer micro-batches or stages per rank")
    try:
        cluster = parse_cluster(strategy.cluster)
    except ValueError as e:
        raise StrategyError(f"cluster: {e}") from None
    check_world_size(cluster.world_size, f"cluster {strategy.cluster}", StrategyError)
    setup = resolve(expand(strategy))
    held = {r for copies in setup.placement.values() for r, _, _ in copies}
    empty = sorted(set(range(setup.pp)) - held)
    if setup.tp_layers is not None or not (setup.tp_embed and setup.tp_head):  # shard_tensor selects segments
        _check_tp_selection(cfg, setup)
    if isinstance(cfg, UserModel):
        err = check_user_setup(cfg, setup.ep, setup.tp, setup.recompute, setup.sp, strategy.seq_len)
        if err:
            raise StrategyError(err)
    _check_recompute_policy(cfg, setup)
    if empty:
        raise StrategyError(f"place: pp_rank(s) {empty} hold no stage; place a stage on every pipeline rank")
    check_setup(cfg, setup, strategy, cluster)
    world = setup.pp * setup.dp * setup.cp * setup.tp
    if world != cluster.world_size:
        if setup.cp > 1:
            what = f"PP×DP×CP×TP = {setup.pp}×{setup.dp}×{setup.cp}×{setup.tp}"
        elif setup.tp > 1:
            what = f"PP×DP×TP = {setup.pp}×{setup.dp}×{setup.tp}"
        else:
            what = f"PP×DP = {setup.pp}×{setup.dp}"
        raise StrategyError(f"strategy needs {what} = {world} ranks but cluster "
                            f"{strategy.cluster} has {cluster.world_size}; change a degree or the cluster")
    per_replica = strategy.global_batch / setup.dp
    mbs = per_replica / setup.microbatches
    if mbs != int(mbs) or mbs < 1:
        raise StrategyError(f"global_batch {strategy.global_batch} does not split into DP {setup.dp} × "
                            f"{setup.microbatches} micro-batches of a whole number of sequences; "
                            "make global_batch a multiple of DP×microbatches")
    layout = Layout(pp=setup.pp, dp=setup.dp, ep=setup.ep, stage_ranks=setup.stage_ranks(), tp=setup.tp,
                    cp=setup.cp, dp_shard=setup.dp_shard)
    return cfg, setup, layout, int(mbs)


def _check_tp_selection(cfg: ModelConfig | UserModel, setup: Setup) -> None:
    """``shard_tensor`` with a selection of segments (at any degree): the layers exist; with
    tensor parallelism, something is selected and nothing needs every segment sharded
    (sequence parallelism, context parallelism, user models). A selection of every segment is
    the plain directive (``setup.tp_layers`` None)."""
    if isinstance(cfg, UserModel):
        raise StrategyError(f"shard_tensor: fields 'layers'/'embedding'/'head' need a zoo, model-file or hf: "
                            f"transformer; user model {cfg.name} shards what its annotations say; drop the fields")
    layers = setup.tp_layers
    if layers is not None:
        bad = [i for i in layers if i >= cfg.n_layers]
        if bad:
            raise StrategyError(f"shard_tensor: field 'layers' names layer(s) {format_layers(bad)}, but {cfg.name} "
                                f"has {cfg.n_layers} layers (0..{cfg.n_layers - 1})")
        if set(layers) == set(range(cfg.n_layers)):
            setup.tp_layers = layers = None
    if not setup.tp_partial:
        return
    if not layers and layers is not None and not setup.tp_embed and not setup.tp_head:
        raise StrategyError("shard_tensor: fields 'layers', 'embedding' and 'head' select no segment; select one "
                            "or drop the directive")
    if setup.sp:
        raise StrategyError("shard_tensor: field 'sequence_parallel' needs every segment sharded (a replicated "
                            "segment would need the sequence shard gathered at each of its boundaries); set it "
                            "false or drop 'layers'/'embedding'/'head'")
    if setup.cp > 1:
        raise StrategyError("shard_tensor: fields 'layers'/'embedding'/'head' (a partial selection) are not "
                            "supported with context_parallel; drop them or the context parallelism")


def _tp_segments(cfg: ModelConfig, setup: Setup, mbs: int, seq: int, dtype: str,
                 stack: Stack, family: str) -> tuple[list[SegmentCost], dict[str, SegmentMemory]]:
    """The segments one tensor-parallel rank runs and their memory: each sharded segment
    profiled on the rank's shard of the config (`tp_shard`), each unselected one on the whole
    config (replicated over the TP group: whole parameters, whole GEMMs). ``family``: the GPU
    family FP8 casts are priced for (`piper_sim.fp8`)."""
    shard = tp_shard(cfg, setup.tp, setup.sp)  # one tensor-parallel rank's share (cfg itself without TP)
    segments = profile_model(shard, mbs, seq, dtype, stack, family)
    memory = model_memory(shard, segments, mbs, seq, dtype, stack)
    if not setup.tp_partial:
        return segments, memory
    whole = profile_model(cfg, mbs, seq, dtype, stack, family)
    whole_memory = model_memory(cfg, whole, mbs, seq, dtype, stack)
    keep = [setup.tp_sharded(x.unit) for x in segments]
    return ([x if k else y for x, y, k in zip(segments, whole, keep)],
            {**memory, **{y.name: whole_memory[y.name] for y, k in zip(whole, keep) if not k}})


def build_dag(strategy: Strategy, folded: bool = True,
              model: object = None) -> tuple[TrainingDAG, Context, ModelConfig | UserModel]:
    """Run every pass; the result is the global training DAG (folded or per rank).
    ``model``: a user model (`piper_sim.annotate`) or its factory, in place of ``strategy.model``."""
    cfg, setup, layout, mbs = _setup_and_layout(strategy, model)
    dtype = strategy.dtype  # by name: a profile cache hit imports no torch
    cp = setup.cp
    seq = strategy.seq_len // cp  # the tokens of each sequence a rank holds
    kv_bytes = 0.0
    tp_model: dict = {}  # tensor parallel: what the model's layers all-reduce (Context.tp_attn_width, ...)
    gpu = parse_cluster(strategy.cluster).gpu
    try:
        check_stack_on(strategy.stack, gpu)
    except StackError as e:
        raise StrategyError(str(e)) from None
    if isinstance(cfg, UserModel):
        from piper_sim.user_profiling import profile_user_model, user_model_memory

        if strategy.stack.fp8 != "none":
            raise StrategyError(f"strategy field 'stack': fp8 {strategy.stack.fp8!r} applies to the transformer "
                                "blocks of zoo and config models, not a user nn.Module; use fp8 none")

        from piper_sim.user_profiling import UserTP

        dtype = torch_dtype(dtype)
        unit_ops: dict[str, dict[str, list]] = {}  # tensor parallel: each unit's collectives (piper_sim.user_tp)
        try:
            segments = profile_user_model(cfg, mbs, strategy.seq_len, dtype, UserTP(setup.tp, setup.sp), unit_ops)
        except AnnotationError as e:
            raise StrategyError(str(e)) from None
        memory = user_model_memory(cfg, segments, mbs, strategy.seq_len // (setup.tp if setup.sp else 1), dtype)
        if setup.tp > 1:
            tp_model = dict(tp_unit_ops=unit_ops)
    else:
        shard = tp_shard(cfg, setup.tp, setup.sp)  # one tensor-parallel rank's share (cfg itself without TP)
        # one context-parallel rank's share: seq / cp tokens, attention against the whole sequence
        tp_segs, tp_memory = _tp_segments(cfg, setup, mbs, seq, dtype, strategy.stack, gpu.family)
        segments = cp_segments(tp_segs, cp)
        memory = cp_memory(tp_memory, cp)
        if cp > 1:
            kv_bytes = gathered_kv_bytes(shard, mbs, strategy.seq_len, DTYPE_BYTES[strategy.dtype])
        tp_model = dict(tp_attn_width=attn_grad_width(cfg), tp_shared_experts=cfg.is_moe and cfg.n_shared > 0,
                        tp_top_k=cfg.top_k if cfg.is_moe else 0)
    if isinstance(cfg, ModelConfig):
        _check_layout_mtp(strategy, cfg)
    ctx = Context(setup=setup, stages=stage_costs(cfg, segments, setup.num_stages, setup.layers_per_stage, gpu),
                  layout=layout, dtype_bytes=DTYPE_BYTES[strategy.dtype], folded=folded,
                  memory=memory,
                  micro_batch=mbs, seq_len=seq, hidden=cfg.hidden, kv_bytes=kv_bytes, stack=strategy.stack,
                  gpu_family=gpu.family, tied_embeddings=isinstance(cfg, ModelConfig) and (cfg.tie_embeddings or cfg.mtp_layers > 0),
                  embed_copy_unit="mtp.0" if isinstance(cfg, ModelConfig) and cfg.mtp_layers and not cfg.tie_embeddings
                  else "head",
                  **tp_model)
    dag = TrainingDAG()
    run_passes(ctx, dag, passes())
    return dag, ctx, cfg


def _issued_before(dag: TrainingDAG, n: Node, previous: dict[Node, Node]) -> Node | None:
    """The op a node is issued just before, for ops that wait on another rank and would
    otherwise block their in-order stream too early: RECVs, all-to-alls inside a stage
    (issued before the piece that consumes them) and ZeRO-3 gathers, issued before the
    compute op that precedes their consumer (``previous``), so the gather of unit i+1 is
    on its stream ahead of unit i's reduce-scatter and runs while unit i computes."""
    ins = dag.ins(n)
    hint = dag.g._node[n].get("issue_before")  # a context-parallel chain's first op: just before its piece
    if hint is not None:
        return hint
    if is_inner(ins):
        return None  # after the compute piece (or collective) it follows (the default)
    local = [q for q in dag.g.successors(n) if q[0] == n[0]]
    if ins.kind == "ALL_GATHER" and ins.mb >= 0:
        consumer = next((q for q in local if dag.ins(q).kind in SPLIT_KINDS), None)
        return previous.get(consumer, consumer) if consumer is not None else None
    if ins.kind == "RECV":
        return local[0] if local else None
    if ins.kind == "ALL_TO_ALL":
        family = ins.direction
        for q in local:
            qi = dag.ins(q)
            if qi.stage == ins.stage and qi.mb == ins.mb and (qi.kind == "F") == (family == "F") \
                    and qi.kind in SPLIT_KINDS:
                return q
    return None


def _issue_keys(dag: TrainingDAG, sequences: dict[int, list[Node]]) -> dict[Node, float]:
    """A sort key per node: compute ops by their slot sequence; RECVs, prefetches and
    all-to-alls just before what consumes them; other comm ops right after what they
    wait on; optimizer steps at the end.

    A collective gets the same key on every member (the latest), so all members issue
    their collectives in one order (e.g. DualPipe's two copies of a stage)."""
    forced: dict[Node, float] = {}
    by_where: dict[int, list[Node]] = {}
    for n in dag.g.nodes:
        by_where.setdefault(n[0], []).append(n)
    orders: dict[int, list[Node]] = {w: [] for w in by_where}
    for n in nx.topological_sort(dag.g):  # one global order, split per rank
        orders[n[0]].append(n)
    previous = {b: a for seq in sequences.values() for a, b in zip(seq, seq[1:])}
    before = {n: _issued_before(dag, n, previous) for n in dag.g.nodes}
    for _ in range(4):
        key: dict[Node, float] = {}
        for where, topo in orders.items():
            seq = sequences.get(where, [])
            key.update({n: float(i) for i, n in enumerate(seq)})
            end = float(len(seq))

            def key_of(n: Node) -> float:
                if n not in key:
                    if before[n] is not None:
                        key[n] = key_of(before[n]) - 0.5
                        return key[n]
                    preds = [key_of(p) for p in dag.g.predecessors(n) if p[0] == where]
                    if dag.ins(n).kind == "OPT":
                        # after what it waits on, even a sync keyed past this rank's end by another
                        # rank's (a collective's latest key: e.g. AR.embed of the last stage)
                        key[n] = max(end + (max(preds) if preds else 0.0) / (end + 1), max(preds, default=0.0) + 0.1)
                    else:
                        # gradient buckets go out as the backward reaches them (last first)
                        # a layer's TP collectives (tens per compute piece) stay between it and the next
                        inside = is_inner(dag.ins(n))
                        early = 0.0 if inside else (1.0 - dag.ins(n).dep_progress) * 0.5
                        step = 0.001 if inside else 0.1
                        key[n] = max(forced.get(n, 0.0), max(preds, default=-1.0) + step - early)
                return key[n]

            for n in topo:
                key_of(n)
        latest: dict[str, float] = {}
        for n, k in key.items():
            if dag.ins(n).kind in ("ALLREDUCE", "REDUCE_SCATTER", "ALL_GATHER"):
                latest[n[1]] = max(latest.get(n[1], k), k)
        new = {n: latest[n[1]] for n in key if n[1] in latest}
        if new == forced:
            break
        forced = new
    _recv_in_send_order(dag, key)
    return key


def _recv_in_send_order(dag: TrainingDAG, key: dict[Node, float]) -> None:
    """Receive from each peer in the order the peer sends (as NCCL and gloo match
    messages between two ranks), each RECV still posted before its consumer."""
    by_stream: dict[tuple[int, str], list[Node]] = {}
    for n in key:
        ins = dag.ins(n)
        if ins.kind == "RECV":
            by_stream.setdefault((n[0], ins.stream), []).append(n)
    for recvs in by_stream.values():
        send_of = {r: next(p for p in dag.g.predecessors(r) if dag.ins(p).kind == "SEND") for r in recvs}
        recvs.sort(key=lambda r: (key[send_of[r]], send_of[r][1]))
        later = float("inf")
        for r in reversed(recvs):
            key[r] = later = min(key[r], later - 1e-6)


def lower(dag: TrainingDAG, sequences: dict[int, list[Node]]) -> dict[int, dict[str, list[Instruction]]]:
    """Per rank (or class), per stream, instructions in issue order with their deps."""
    key = _issue_keys(dag, sequences)
    by_where: dict[int, list[Node]] = {}
    for n in dag.g.nodes:
        by_where.setdefault(n[0], []).append(n)
    out: dict[int, dict[str, list[Instruction]]] = {}
    for where, nodes in by_where.items():
        streams: dict[str, list[Instruction]] = {}
        for n in sorted(nodes, key=lambda n: (key[n], _natural(n[1]))):
            ins = dag.ins(n)
            streams.setdefault(ins.stream, []).append(ins)
        for lst in streams.values():
            for ins in lst:
                ins.deps = sorted(p[1] for p in dag.g.predecessors((where, ins.id)) if p[0] == where)
        out[where] = dict(sorted(streams.items(), key=lambda kv: _STREAM_ORDER.get(kv[0], 9)))
    return out


def _natural(op_id: str) -> tuple:
    """Sort key that puts b2 before b10."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", op_id))


_STREAM_ORDER = {"compute": 0, "recv": 1, "send": 2, "ep": 3, "dp": 4, "tp": 5, "cp": 6}


@gc_paused
def compile_strategy(strategy: Strategy | dict, folded: bool = True, model: object = None) -> Compiled:
    """Compile a strategy into a Plan (one instruction list per pipeline rank class);
    ``model`` as in `build_dag`."""
    t0 = time.perf_counter()
    if isinstance(strategy, dict):
        strategy = parse_strategy(strategy)
    dag, ctx, cfg = build_dag(strategy, folded=True, model=model)
    lists = lower(dag, ctx.sequences)
    layout = ctx.layout
    classes = []
    for pp_rank in range(layout.pp):
        classes.append(RankClass(
            pp_rank=pp_rank, ranks=layout.class_ranks(pp_rank),
            streams=lists[pp_rank], static_memory=static_memory(ctx, pp_rank, ctx.setup.zero),
            stages=[s for s, rs in layout.stage_ranks.items() if pp_rank in rs]))
    meta = {
        "strategy": strategy.to_json(),
        **plan_model_meta(cfg), "cluster": strategy.cluster, "schedule": ctx.setup.schedule,
        "global_batch": strategy.global_batch, "seq_len": strategy.seq_len,
        "microbatches": ctx.setup.microbatches,
        "micro_batch_size": strategy.global_batch // (layout.dp * ctx.setup.microbatches),
        "dtype": strategy.dtype, "zero": ctx.setup.zero, "seed": strategy.seed,
        "num_stages": ctx.setup.num_stages,
        "stage_units": [list(dict.fromkeys(x.unit for x in sc.segments)) if isinstance(cfg, UserModel)
                        else sorted({x.unit for x in sc.segments}, key=_unit_order) for sc in ctx.stages],
        # the pieces F/B/BI ops are cut into (``.p{i}`` op ids): around expert blocks, per unit under ZeRO-3
        "stage_parts": [[[x.name for x in part] for part in ctx.parts(sc.stage)] for sc in ctx.stages],
        "model_flops_per_step": _model_flops(ctx, strategy, cfg),
        "tokens_per_step": strategy.global_batch * strategy.seq_len,
    }
    if strategy.stack != DEFAULT_STACK:  # absent: FA2 and fused kernels (costmodel.stack.DEFAULT)
        meta["stack"] = strategy.stack.to_json()
    if isinstance(cfg, UserModel):  # what every rank rebuilds it from, and its stages' boundary tensors
        from piper_sim.user_profiling import boundaries

        meta["user_model"] = {**cfg.to_json(), "boundaries": boundaries([sc.segments for sc in ctx.stages])}
    if layout.cp > 1:
        meta["context_parallel"] = {"degree": layout.cp, "style": ctx.setup.cp_style}
    if layout.tp > 1:
        meta["tensor_parallel"] = {"degree": layout.tp, "sequence_parallel": ctx.setup.sp}
        if ctx.setup.tp_partial:  # only these segments are sharded; the others replicated (whole)
            meta["tensor_parallel"].update(layers=list(ctx.setup.tp_layers if ctx.setup.tp_layers is not None
                                                       else range(cfg.n_layers)),
                                           embedding=ctx.setup.tp_embed, head=ctx.setup.tp_head)
    if cfg.is_moe:  # what the cost model's expert all-to-all traffic depends on (costmodel.moe)
        meta["moe"] = {"top_k": cfg.top_k, "n_experts": cfg.n_experts}
    if ctx.setup.zero == 3:  # the segments of each gathered bucket, per stage and sync group
        meta["zero3_buckets"] = [{tag: [[x.name for x in b] for b in bs] for tag, bs in unit_buckets(ctx, s).items()}
                                 for s in range(ctx.setup.num_stages)]
    if ctx.setup.recompute:  # stage -> "full" | "selective" | "op" | "every"
        meta["recompute"] = {str(s): mode for s, mode in sorted(ctx.setup.recompute.items())}
        policy = {str(s): p.options for s, p in sorted(ctx.setup.recompute_policy.items()) if p.options}
        if policy:  # only when set: plans of the plain modes keep their hashes
            meta["recompute_policy"] = policy
    plan = Plan(layout=layout, classes=classes, meta=meta, kernels=dict(ctx.kernels))
    return Compiled(plan=plan, dag=dag, setup=ctx.setup, config=cfg, compile_s=time.perf_counter() - t0)


def _check_recompute_policy(cfg, setup: Setup) -> None:
    """Refuse the recompute policies (`piper_sim.recompute`) the IR does not price yet: the
    whole MoE block under tensor or expert parallelism, Megatron uniform chunks of several
    layers under tensor or context parallelism, and any of them on a user's model (no layer
    table). The others' re-run collectives are the plan's ``R`` ops (`piper_sim.parallel.tensor`,
    `piper_sim.parallel.context`)."""
    for s, pol in sorted(setup.recompute_policy.items()):
        if pol.plain:
            continue
        what = f"directive recompute (stage {s}): mode {pol.mode!r}" + (f" field 'method' {pol.method!r}"
                                                                         if pol.method else "")
        if isinstance(cfg, UserModel):
            raise StrategyError(f"{what} needs a zoo or model-file transformer (its per-layer saved tensors); "
                                f"user model {cfg.name} takes mode full or none")
        if pol.mode == "selective":
            # mlp / shared_experts re-run their row-parallel collective (TP.R ops, tensor_pass); moe
            # re-runs the routed experts' too, which the IR does not split out of the expert block yet
            if "moe" in pol.modules and setup.tp > 1:
                raise StrategyError(f"directive recompute (stage {s}): field 'modules' ['moe'] re-runs "
                                    "tensor-parallel collectives, not priced yet; drop it or the TP degree")
            if "moe" in pol.modules and setup.ep > 1:
                raise StrategyError(f"directive recompute (stage {s}): field 'modules' 'moe' re-runs the expert "
                                    "all-to-alls under expert parallelism, not priced yet; use moe_act")
        elif pol.method == "uniform" and pol.num_layers > 1 and (setup.tp > 1 or setup.cp > 1):
            # one checkpoint of several layers re-runs all their collectives before the last one's backward
            raise StrategyError(f"{what} num_layers {pol.num_layers} with tensor or context parallelism is not "
                                "priced yet (its re-run collectives); use method block, num_layers 1, or mode op")


def compile_unfolded(strategy: Strategy | dict, model: object = None) -> list[RankProgram]:
    """Compile every rank explicitly (no folding). For tests and small worlds."""
    if isinstance(strategy, dict):
        strategy = parse_strategy(strategy)
    dag, ctx, _ = build_dag(strategy, folded=False, model=model)
    lists = lower(dag, ctx.sequences)
    layout = ctx.layout
    out = []
    for rank in range(layout.world_size):
        pp_rank, dp_rank = layout.coords(rank)
        out.append(RankProgram(rank=rank, pp_rank=pp_rank, dp_rank=dp_rank, streams=lists[rank],
                               static_memory=static_memory(ctx, pp_rank, ctx.setup.zero),
                               stages=[s for s, rs in layout.stage_ranks.items() if pp_rank in rs],
                               tp_rank=layout.tp_rank(rank), cp_rank=layout.cp_rank(rank)))
    return out


def _check_layout_mtp(strategy: Strategy, cfg: ModelConfig) -> None:
    """A pipeline layout names the model's MTP modules (``m``), as many as it has (Megatron's rule)."""
    pipe = next((d for d in strategy.directives if d["op"] == "pipeline" and "layout" in d), None)
    if pipe is None:
        return
    n = layout_mtp_layers(pipe["layout"], "directive pipeline")
    if n != cfg.mtp_layers:
        raise StrategyError(f"directive pipeline field 'layout' places {n} MTP module(s) ('m') but model {cfg.name} "
                            f"has mtp_layers = {cfg.mtp_layers}; write {cfg.mtp_layers} 'm' before the 'L'")


def _unit_order(unit: str) -> tuple[int, int]:
    if unit == "embed":
        return (0, 0)
    if unit == "head":
        return (3, 0)
    return (2 if unit.startswith("mtp.") else 1, int(unit.split(".")[1]))


def _model_flops(ctx: Context, strategy: Strategy, cfg: ModelConfig) -> float:
    """Useful training flops of one step (forward + backward, no recompute), all replicas
    (under tensor or context parallelism those of the whole model and sequence, not of a rank's shard)."""
    if isinstance(cfg, UserModel) and ctx.layout.tp > 1:  # the whole units, unsharded
        from piper_sim.user_profiling import profile_user_model

        segments = profile_user_model(cfg, ctx.micro_batch, strategy.seq_len, torch_dtype(strategy.dtype))
    elif ctx.layout.tp > 1 or ctx.layout.cp > 1:
        segments = profile_model(cfg, ctx.micro_batch, strategy.seq_len, strategy.dtype, strategy.stack,
                                 ctx.gpu_family)
    else:
        segments = [x for sc in ctx.stages for x in sc.segments]
    per_mb = sum(x.fwd_flops + x.bwd_input_flops + x.bwd_weight_flops for x in segments)
    return per_mb * ctx.setup.microbatches * ctx.layout.dp
