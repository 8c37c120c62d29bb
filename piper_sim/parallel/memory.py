"""Recompute and activation memory: what each compute op allocates and frees (see
``piper_sim.memory``), and the extra forward work a selective recompute re-runs."""

from __future__ import annotations

from dataclasses import replace

from piper_sim import kernels
from piper_sim.ir import Context, TrainingDAG, op_id
from piper_sim.memory import PieceMemory, piece_memory
from piper_sim.plan import INPUT_GRAD_KINDS, PASS_KINDS, SPLIT_KINDS

BW_KEEP_FRACTION = 0.5  # share of a stage's saved activations BW still needs after BI


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
