"""Checks on a Plan: the same checks run after compiling and on hand-edited plan files.

- every dependency names an op of the same rank;
- every SEND has its RECV on the peer (and back);
- every collective exists on all members of its group with the same kind and size;
- each (stage, micro-batch, pass) runs exactly once;
- no deadlock: with stream order, dependencies and rendezvous (send/recv pairs,
  collective members) the wait-for graph is acyclic; a cycle is reported by op id.

Folded plans are checked per rank class: DP replicas are symmetric, so a wait cycle
among real ranks shows up as a cycle among their classes.
"""

from __future__ import annotations

import networkx as nx

from piper_sim.plan import COLLECTIVE_KINDS, Plan


class PlanValidationError(ValueError):
    """The plan is inconsistent or would deadlock; one line naming the ops."""


def _members(plan: Plan, group: str, pp_rank: int, cache: dict) -> list[int]:
    """Pipeline-rank classes taking part in a (symbolic) group, seen from ``pp_rank``."""
    if (group, pp_rank) not in cache:
        rep = plan.layout.rank(pp_rank, 0)
        cache[(group, pp_rank)] = sorted({plan.layout.coords(r)[0] for r in plan.layout.group_ranks(group, rep)})
    return cache[(group, pp_rank)]


def validate_plan(plan: Plan) -> None:
    """Raise `PlanValidationError` if the plan cannot run; return quietly otherwise."""
    ops: dict[tuple[int, str], object] = {}
    for c in plan.classes:
        for stream, lst in c.streams.items():
            for ins in lst:
                if (c.pp_rank, ins.id) in ops:
                    raise PlanValidationError(f"rank class {c.pp_rank}: op {ins.id} appears twice")
                ops[(c.pp_rank, ins.id)] = ins
    g = nx.DiGraph()
    uf: dict[tuple[int, str], tuple[int, str]] = {}

    def find(x):
        root = x
        while uf.get(root, root) != root:
            root = uf[root]
        while x != root:  # path compression
            uf[x], x = root, uf[x]
        return root

    def union(a, b):
        uf[find(a)] = find(b)

    seen_compute: dict[tuple[int, int, str], int] = {}
    members_cache: dict = {}
    for c in plan.classes:
        for stream, lst in c.streams.items():
            prev = None
            for ins in lst:
                node = (c.pp_rank, ins.id)
                g.add_node(node)
                if prev is not None:
                    g.add_edge(prev, node)
                prev = node
                for dep in ins.deps:
                    if (c.pp_rank, dep) not in ops:
                        raise PlanValidationError(f"rank class {c.pp_rank}: op {ins.id} depends on {dep}, "
                                                  "which this rank does not run")
                    g.add_edge((c.pp_rank, dep), node)
                if ins.kind in ("SEND", "RECV"):
                    other = "RECV" if ins.kind == "SEND" else "SEND"
                    peer_op = ops.get((ins.peer, f"{other}.{ins.match}"))
                    if peer_op is None or peer_op.peer != c.pp_rank:
                        raise PlanValidationError(
                            f"rank class {c.pp_rank}: {ins.id} has no matching {other}.{ins.match} "
                            f"on pipeline rank {ins.peer}")
                    union(node, (ins.peer, f"{other}.{ins.match}"))
                elif ins.kind in COLLECTIVE_KINDS:
                    for m in _members(plan, ins.group, c.pp_rank, members_cache):
                        peer_op = ops.get((m, ins.id))
                        if peer_op is None or peer_op.kind != ins.kind or peer_op.bytes != ins.bytes:
                            raise PlanValidationError(
                                f"collective {ins.id} ({ins.group}) on rank class {c.pp_rank} has no "
                                f"identical counterpart on member pipeline rank {m}")
                        union(node, (m, ins.id))
                elif ins.kind in ("F", "B", "BI", "BW") and ins.part == (0 if ins.kind == "F" else ins.parts - 1):
                    key = (ins.stage, ins.mb, ins.kind)
                    if key in seen_compute:
                        raise PlanValidationError(f"{ins.id} runs on pipeline ranks {seen_compute[key]} and "
                                                  f"{c.pp_rank}; each (stage, mb, pass) must run once")
                    seen_compute[key] = c.pp_rank
    stages = {i.stage for i in ops.values() if i.kind == "F"}
    mbs = plan.meta.get("microbatches")
    if mbs is not None:
        for s in stages:
            for mb in range(mbs):
                if (s, mb, "F") not in seen_compute:
                    raise PlanValidationError(f"F.s{s}.mb{mb} is missing from the plan")
                if ((s, mb, "B") in seen_compute) == ((s, mb, "BI") in seen_compute):
                    raise PlanValidationError(f"stage {s} mb {mb} needs exactly one of B or BI+BW")
                if (s, mb, "BI") in seen_compute and (s, mb, "BW") not in seen_compute:
                    raise PlanValidationError(f"BW.s{s}.mb{mb} is missing (BI.s{s}.mb{mb} has no weight pass)")
    contracted = nx.DiGraph()
    for a, b in g.edges:
        fa, fb = find(a), find(b)
        if fa != fb:
            contracted.add_edge(fa, fb)
        elif a != b:
            raise PlanValidationError(f"deadlock: {a[1]}@{a[0]} and {b[1]}@{b[0]} wait on each other")
    if nx.is_directed_acyclic_graph(contracted):
        return
    cycle = nx.find_cycle(contracted)
    names = " -> ".join(f"{n[1]}@pp{n[0]}" for n, _ in cycle)
    raise PlanValidationError(f"deadlock: these ops wait on each other in a cycle: {names}")
