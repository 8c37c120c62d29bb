"""Recompute and activation memory: what each compute op allocates and frees (see
``piper_sim.memory``), and the extra forward work a selective recompute re-runs."""

from __future__ import annotations

from dataclasses import replace

from piper_sim import kernels
from piper_sim.ir import Context, TrainingDAG, op_id
from piper_sim.memory import PieceMemory, piece_memory
from piper_sim.plan import INPUT_GRAD_KINDS, PASS_KINDS, SPLIT_KINDS
from piper_sim.recompute import module_recompute_flops

BW_KEEP_FRACTION = 0.5  # share of a stage's saved activations BW still needs after BI


def held_after(kind: str, kept: float, rerun: float = 0.0) -> float:
    """What one action of a stage leaves held once it ends (its ``alloc - free`` in
    `activation_memory_pass`), from the stage's kept bytes of one micro-batch and, under
    full recompute, its re-run bytes: F keeps ``kept``, B frees it, BI keeps the re-run graph
    for BW and frees the rest of what BW does not need, BW frees what BI left. The
    explorer's memory screen walks a schedule with these (one rule, two users)."""
    keep = BW_KEEP_FRACTION
    if kind == "F":
        return kept
    if kind == "B":
        return -kept
    if kind == "BI":
        return keep * rerun - (1 - keep) * kept
    if kind == "BW":
        return -keep * (kept + rerun)
    raise ValueError(f"held_after: {kind!r} is not a compute kind (F, B, BI, BW)")


def recompute_pass(ctx: Context, dag: TrainingDAG) -> None:
    """Selective recompute: each backward piece (B/BI) of a selective stage runs the
    forward of its attention cores again (full recompute is priced by ``_compute``); the
    other policies (`piper_sim.recompute`) re-run their units' share (`_policy_rerun`)."""
    memo: dict[tuple[int, int], tuple[float, tuple]] = {}
    for n in dag.g.nodes:
        ins = dag.ins(n)
        if ins.kind in INPUT_GRAD_KINDS and not ctx.setup.policy(ins.stage).plain:
            key = (ins.stage, ins.part)
            if key not in memo:
                memo[key] = _policy_rerun(ctx, ins.stage, ins.part)
            flops, extra = memo[key]
            if not flops and not extra:
                continue
            ins.flops += flops
            ins.recompute = True
            rows = kernels.merge(ctx.kernels.get(ins.kernels, ()), extra)
            if rows:
                ins.kernels = kernels.table_key(rows)
                ctx.kernels[ins.kernels] = rows
            continue
        if ins.kind in INPUT_GRAD_KINDS and ctx.setup.recompute.get(ins.stage) == "selective":
            mems = [ctx.memory[x.name] for x in ctx.parts(ins.stage)[ins.part]]
            ins.flops += sum(m.core_flops for m in mems)
            ins.recompute = True
            rows = kernels.merge(ctx.kernels.get(ins.kernels, ()), *[m.core_kernels for m in mems])
            if rows:
                ins.kernels = kernels.table_key(rows)
                ctx.kernels[ins.kernels] = rows


def stage_unit_modes(ctx: Context, stage: int) -> dict[str, tuple[str, int]]:
    """unit -> (mode, chunk) of the stage's recompute policy (`Recompute.unit_modes`); a user
    model's units are each one checkpoint under full recompute, whatever their names (the
    executor's `UserStage` checkpoints every unit: a unit named ``embed`` too)."""
    segs = ctx.stages[stage].segments
    units = list(dict.fromkeys(x.unit for x in segs))
    policy = ctx.setup.policy(stage)
    if segs and all(ctx.memory[x.name].kind == "user" for x in segs):
        mode = "full" if policy.mode == "full" else "none"  # the only policy a user model takes
        return {u: (mode, -1 - i) for i, u in enumerate(units)}
    return policy.unit_modes(units)


def _gemm_rows(f_rows: tuple, shapes: list[tuple[int, int, int]]) -> tuple:
    """The kernel rows of these mm calls, one call each, from a forward's rows (per-call flops
    and bytes of the matching row)."""
    out = []
    for m, n, k in shapes:
        row = next((r for r in f_rows if r[0] == "gemm" and tuple(r[2][:3]) == (m, n, k)), None)
        if row is not None:
            out.append((*row[:4], 1, row[5] / row[4], row[6] / row[4]))
    return kernels.merge(out)


_NORMS = ("rms_norm", "layer_norm", "native_layer_norm")
_ACTS = ("silu", "gelu", "swiglu")  # the eager SwiGLU's gating mul is matched by its bytes


def _module_mem_rows(f_rows: tuple, table, mods: tuple[str, ...]) -> tuple:
    """The memory-bound kernels Megatron's selective ``mods`` re-run besides their matmuls, from
    one segment's forward rows: ``layernorm`` the two residual-stream norms (a call reads and
    writes the layer input: ``2 * input_bytes``); the activation of the segment's MLP when its
    module is named (``mlp`` a dense layer's, ``shared_experts`` or ``moe`` a MoE ``pre``'s,
    ``moe_act`` the routed experts': silu and the gating mul with 3/2 of its bytes, or gelu, or
    a fused swiglu); ``mla_up_proj`` the fused rotary kernels. Eager norms and rotary kernels
    (decomposed into small ops) are not matched, so not priced."""
    def per_call(r):
        return r[6] / r[4]

    out = []
    if "layernorm" in mods and table.kind != "moe_experts":
        out += [(*r[:4], min(r[4], 2), 0.0, per_call(r) * min(r[4], 2)) for r in f_rows
                if r[0] == "mem" and r[1] in _NORMS and per_call(r) == 2 * table.input_bytes]
    act = {"dense": ("mlp",), "moe_pre": ("shared_experts", "moe"), "moe_experts": ("moe_act",)}[table.kind]
    if any(m in mods for m in act):
        acts = [r for r in f_rows if r[0] == "mem" and r[1] in _ACTS]
        gates = {1.5 * per_call(r) for r in acts if r[1] == "silu"}
        out += acts + [r for r in f_rows if r[0] == "mem" and r[1] == "mul" and per_call(r) in gates]
    if "mla_up_proj" in mods and any(r.module == "mla_up_proj" for r in table.rows):
        out += [r for r in f_rows if r[0] == "mem" and r[1] == "rope"]
    return kernels.merge(out)


def _policy_rerun(ctx: Context, stage: int, part: int) -> tuple[float, tuple]:
    """(flops, kernel rows) a B/BI piece re-runs under its stage's `Recompute` policy: the
    forward of its full units; under op-SAC the forward minus the kept mm calls and the
    attention op (`LayerTable.op_sac_saved`); under Megatron's selective modules their
    forward (core_attn: the measured core; their matmuls and memory-bound kernels:
    `_module_mem_rows`)."""
    policy = ctx.setup.policy(stage)
    modes = stage_unit_modes(ctx, stage)
    flops, rows = 0.0, []
    for seg in ctx.parts(stage)[part]:
        m = ctx.memory[seg.name]
        mode = modes.get(seg.unit, ("none", 0))[0]
        if mode == "none" or not m.recomputed:
            continue
        f_rows = ctx.kernels.get(ctx.kernel_table("F", [seg], False), ())
        if mode == "full" or (mode == "op" and (m.kind == "moe_experts" or m.table is None)):
            flops += seg.fwd_flops
            rows.append(f_rows)
        elif mode == "op":
            kept = [shape for _, shape in m.table.op_sac_saved(m.compiled)[0]]
            drop = kernels.merge(_gemm_rows(f_rows, kept), [r for r in f_rows if r[0] == "attn_fwd"])
            left = kernels.subtract(f_rows, drop)
            flops += kernels.totals(left)[0]
            rows.append(left)
        elif mode == "selective":
            mods = policy.module_set
            if "core_attn" in mods:
                flops += m.core_flops
                rows.append(m.core_kernels)
            if m.table is None:
                continue
            flops += module_recompute_flops(m.table, mods, seg.fwd_flops)
            if "moe" in mods and m.kind == "moe_experts":
                rows.append(f_rows)
                continue
            names = {"mlp": ("mlp.",), "shared_experts": ("shared.",), "moe": ("shared.", "router"),
                     "mla_up_proj": ("wq_b", "wkv_b")}
            prefixes = tuple(p for x in mods for p in names.get(x, ()))
            shapes = [shape for name, shape in m.table.mms if prefixes and name.startswith(prefixes)]
            rows.extend([_gemm_rows(f_rows, shapes), _module_mem_rows(f_rows, m.table, mods)])
    return flops, kernels.merge(*rows)


def activation_memory_pass(ctx: Context, dag: TrainingDAG) -> None:
    """``alloc``/``free`` of compute ops and all-to-alls (see ``piper_sim.memory``).

    Per piece (`memory.piece_memory`): F takes what the piece keeps (+ temporaries while it
    runs); B frees it, holding the recompute working set and temporaries while it runs. A
    BI/BW split leaves ``BW_KEEP_FRACTION`` of the kept activations to BW; under full
    recompute BI runs the piece's forward again and keeps that graph for BW.
    All-to-all receive buffers: the forward dispatch's is the expert block's input (part of
    what its piece keeps); the forward combine's (expert outputs back home) is kept for the
    backward of the weighted sum (until the backward combine), or, with the stack's ``moe_probs``
    ``experts`` (the router's weights applied inside the experts), lives until the op that reads
    it ends; backward ones live until the piece that consumes them ends."""
    ep = ctx.layout.ep
    cache: dict[tuple[int, int], PieceMemory] = {}

    def piece(stage: int, part: int) -> PieceMemory:
        key = (stage, part)
        if key not in cache:
            mode = ctx.setup.recompute.get(stage, "none")
            segs = ctx.parts(stage)[part]
            policy = ctx.setup.policy(stage)
            cache[key] = piece_memory([(x.unit, ctx.memory[x.name]) for x in segs], mode, ep > 1, policy,
                                      None if policy.plain else stage_unit_modes(ctx, stage))
        return cache[key]

    keep = BW_KEEP_FRACTION
    for n in dag.g.nodes:
        ins = dag.ins(n)
        if ins.kind not in PASS_KINDS:
            continue
        if ins.kind == "BW":  # one op for the whole stage
            pms = [piece(ins.stage, i) for i in range(len(ctx.parts(ins.stage)))]
            ins.free = keep * sum(p.kept + p.rerun for p in pms)  # rerun: only under (some) full recompute
            continue
        p = piece(ins.stage, ins.part)
        if ins.kind == "F":
            ins.alloc, ins.free = p.kept + p.temp, p.temp
        elif ins.kind == "B":
            ins.alloc, ins.free = p.working + p.temp, p.kept + p.working + p.temp
        elif p.rerun:  # full recompute of (some of) its units: BI keeps their re-run graph for BW
            ins.alloc, ins.free = p.rerun + p.temp, p.temp + (1 - keep) * (p.kept + p.rerun)
        else:
            ins.alloc, ins.free = p.working + p.temp, p.working + p.temp + (1 - keep) * p.kept
    for n in list(dag.g.nodes):
        ins = dag.ins(n)
        if ins.kind != "ALL_TO_ALL":
            continue
        ins.alloc = ins.bytes
        forward = ins.direction == "F"
        combine = forward and ins.a2a == "combine"
        if combine and ctx.stack.moe_probs == "combine":  # kept for the backward of the weighted sum
            back = (n[0], op_id(replace(ins, direction="B", a2a="dispatch")))
            dag.ins(back).free += ins.bytes
            continue
        local = [q for q in dag.g.successors(n) if q[0] == n[0]]
        consumer = next((q for q in local if dag.ins(q).kind in SPLIT_KINDS), local[0] if combine and local else None)
        if consumer is None:  # a combine whose output leaves the stage at once: freed as it ends
            ins.free += ins.bytes
            continue
        c = dag.ins(consumer)
        if combine:  # probs applied in the experts (moe_probs experts): freed once the next op has read it
            c.free += ins.bytes
        elif forward:  # the buffer becomes what the expert piece keeps; the rest is freed when it ends
            kept = min(ins.bytes, c.alloc - c.free)  # less than the buffer: FP8-cached, moe_act recomputed
            c.alloc -= kept
            c.free += ins.bytes - kept
        else:
            c.free += ins.bytes
