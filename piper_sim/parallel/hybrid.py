"""Hybrid sharded data parallelism (HSDP): ZeRO/FSDP sharding inside groups of
``shard_degree`` data-parallel ranks, plain replication across the ``degree / shard_degree``
groups (PyTorch FSDP's ``HYBRID_SHARD``; torchtitan's ``data_parallel_shard_degree`` x
``data_parallel_replicate_degree``; Megatron's ``--num-distributed-optimizer-instances``).

`parallel.data` builds the ZeRO collectives over the shard group (``stage:S:shard``: the
parameter all-gathers and gradient reduce-scatters, and the shard's optimizer state). This
pass adds what replication needs: after the last reduce-scatter of each gradient bucket in a
step, one all-reduce of the rank's reduced shard (``bytes / shard size``) over its replicas
(``stage:S:rep``), before the optimizer step. Gradient accumulation reduce-scatters every
micro-batch (or once per step, as ``reduce`` says) and all-reduces once per step, as FSDP2
does with ``set_requires_all_reduce`` on the last micro-batch only.
"""

from __future__ import annotations

from piper_sim.ir import Context, Node, TrainingDAG, is_inner, make_op
from piper_sim.strategy import StrategyError


def check(cfg, setup, strategy, cluster) -> None:
    """``data_parallel`` field ``shard_degree``: ZeRO 1-3, a real shard group, no expert parallelism."""
    if not setup.dp_shard:
        return
    if setup.dp_shard < 2:
        raise StrategyError("data_parallel: field 'shard_degree' 1 shards nothing; use zero 0 (plain data "
                            "parallelism) or a shard_degree of 2 or more")
    if setup.ep > 1:
        raise StrategyError("data_parallel: field 'shard_degree' (hybrid sharding) is not supported with "
                            "expert_parallel; drop one of them")


def replica_allreduce_pass(ctx: Context, dag: TrainingDAG) -> None:
    """One all-reduce per gradient bucket of each stage over the replicas of its shard, after
    the bucket's last reduce-scatter and before the optimizer step."""
    if not ctx.layout.dp_shard:
        return
    by_bucket: dict[tuple[int, int, int, bool], list[Node]] = {}
    for n in dag.g.nodes:
        ins = dag.ins(n)
        if ins.kind == "REDUCE_SCATTER" and not is_inner(ins):
            by_bucket.setdefault((n[0], ins.stage, ins.bucket, ins.experts), []).append(n)
    for (where, s, b, experts), scatters in sorted(by_bucket.items()):
        shard = ctx.shard_size(s)
        first = dag.ins(scatters[0])
        stream = ctx.setup.streams["ALLREDUCE"]
        ar = dag.add(where, make_op("ALLREDUCE", stream, stage=s, bytes=first.bytes / shard, bucket=b,
                                    experts=experts, group=ctx.group("stage:%d:rep" % s, where)))
        for rs in scatters:
            dag.edge(rs, ar)
        dag.edge(ar, (where, f"OPT.s{s}"))


def explore(candidate, gpus_per_node: int) -> list[tuple[tuple[str, str, object], ...]]:
    """The explorer's HSDP variant of a sharded candidate whose data-parallel ranks span nodes:
    shard within a node, replicate across nodes (FSDP's ``HYBRID_SHARD`` default; torchtitan's
    docs suggest the shard degree of one node), when the node divides the DP degree."""
    dp = candidate.dp
    if candidate.zero == 0 or candidate.ep > 1 or gpus_per_node < 2 or dp <= gpus_per_node or dp % gpus_per_node:
        return []
    return [(("data_parallel", "shard_degree", gpus_per_node),)]
