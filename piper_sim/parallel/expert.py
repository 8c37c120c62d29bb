"""Expert parallelism (and the cutting of F/B/BI into pieces): all-to-all dispatch and combine
around each expert block; per-unit pieces under ZeRO-3, tensor or context parallelism."""

from __future__ import annotations


from piper_sim.ir import _A2A_MIRROR, Context, Node, TrainingDAG, _compute, make_op
from piper_sim.plan import PASS_KINDS, Instruction
from piper_sim.profiling import SegmentCost
from piper_sim.strategy import StrategyError

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


def check(cfg, setup, strategy, cluster) -> None:
    """``expert_parallel``: the model has experts, the degree divides them and the DP degree."""
    if setup.ep == 1:
        return
    if not cfg.is_moe:
        raise StrategyError(f"expert_parallel: model {cfg.name} has no experts; remove the directive")
    if cfg.n_experts % setup.ep:
        raise StrategyError(f"expert_parallel: degree {setup.ep} does not divide the {cfg.n_experts} experts "
                            f"of {cfg.name}; use a divisor of {cfg.n_experts}")
    if setup.dp % setup.ep:
        raise StrategyError(f"expert_parallel: degree {setup.ep} must divide the data-parallel degree "
                            f"{setup.dp} (EP ranks are DP ranks for the dense parts)")
