"""Checks on a Plan: the same checks run after compiling, before simulating a plan file
and before the executor starts any process group (`load_valid_plan`).

- the layout matches the plan's content (one class per pipeline rank, its ranks, the
  stages it holds, peers and kinds in range: `check_layout`);
- every dependency names an op of the same rank;
- every SEND has its RECV on the peer (and back);
- every collective exists on all members of its group with the same kind and size;
- each (stage, micro-batch, pass) runs exactly once;
- gathers a compute op waits for part-way (``needed_by``) head their stream;
- no deadlock: with stream order, dependencies and rendezvous (send/recv pairs,
  collective members) the wait-for graph is acyclic; a cycle is reported by op id.

A plan read from a file (`load_valid_plan`, `check_plan_file`) is also compared with what its
own strategy compiles to (`piper_sim.origin`): a plan edited and re-hashed so that it would
train wrong (an all-reduce dropped, a collective moved to another group) is consistent by the
checks above, and refused by that one.

Folded plans are checked per rank class: DP replicas are symmetric, so a wait cycle
among real ranks shows up as a cycle among their classes.
"""

from __future__ import annotations

from itertools import chain, repeat
from operator import attrgetter

import networkx as nx

from piper_sim.plan import (ALL_KINDS, COLLECTIVE_KINDS, P2P_KINDS, PASS_KINDS, Plan, PlanError,  # noqa: F401
                            PlanValidationError, gc_paused, p2p_partner_id)


def _members(plan: Plan, group: str, pp_rank: int, cache: dict) -> list[int]:
    """Pipeline-rank classes taking part in a (symbolic) group, seen from ``pp_rank``."""
    if (group, pp_rank) not in cache:
        rep = plan.layout.rank(pp_rank, 0)
        try:
            ranks = plan.layout.group_ranks(group, rep)
        except (PlanError, KeyError, ValueError, IndexError):
            raise PlanValidationError(f"rank class {pp_rank}: collective group {group!r} names no group of "
                                      "this layout") from None
        if any(not 0 <= r < plan.world_size for r in ranks):
            raise PlanValidationError(f"rank class {pp_rank}: collective group {group!r} names ranks outside "
                                      f"0..{plan.world_size - 1}")
        cache[(group, pp_rank)] = sorted({plan.layout.coords(r)[0] for r in ranks})
    return cache[(group, pp_rank)]


_ALL_KINDS = frozenset(ALL_KINDS)
_P2P_KINDS = frozenset(P2P_KINDS)
_ID, _KIND, _STAGE, _MB, _DEPS, _PEER = map(attrgetter, ("id", "kind", "stage", "mb", "deps", "peer"))


def _int(x, lo: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


def _stream_ok(lst: list, stages: set, pp: int, i: int) -> bool:
    """Whether every instruction of rank class ``i``'s stream passes `check_layout`'s checks,
    found in a few passes in C over the stream rather than a Python loop per instruction (the
    simulator checks every plan it runs: 25K instructions at scale). False: a check fails, or
    the stream mixes p2p with other kinds; `check_layout`'s loop then decides and names the op."""
    if not lst:
        return True
    kinds = set(map(_KIND, lst))
    if not kinds <= _ALL_KINDS or not all(map(isinstance, map(_ID, lst), repeat(str))):
        return False
    stage, mb, deps = list(map(_STAGE, lst)), list(map(_MB, lst)), list(map(_DEPS, lst))
    # types first: a set of values would merge True with 1
    if not (set(map(type, stage)) | set(map(type, mb)) <= {int} and set(map(type, deps)) <= {list}):
        return False
    if not all(map(isinstance, chain.from_iterable(deps), repeat(str))) or min(stage) < -1 or min(mb) < -1:
        return False
    if kinds <= _P2P_KINDS:  # a p2p stream: its peers, another pipeline rank
        peers = list(map(_PEER, lst))
        return set(map(type, peers)) <= {int} and all(0 <= p < pp and p != i for p in set(peers))
    return not kinds & _P2P_KINDS and all(s < 0 or s in stages for s in set(stage))


def check_layout(plan: Plan) -> None:
    """The layout against the plan's content: cheap (one pass over the folded plan); the
    simulator runs it on every plan, `validate_plan` starts with it."""
    lay = plan.layout
    if not (_int(lay.pp, 1) and _int(lay.dp, 1) and _int(lay.ep, 1) and _int(lay.tp, 1) and _int(lay.cp, 1)) \
            or lay.dp % lay.ep:
        raise PlanValidationError(f"layout pp={lay.pp!r} dp={lay.dp!r} ep={lay.ep!r} cp={lay.cp!r} tp={lay.tp!r}: expected "
                                  "integers >= 1 with ep dividing dp")
    if len(plan.classes) != lay.pp:
        raise PlanValidationError(f"layout.pp={lay.pp} but the plan has {len(plan.classes)} rank classes "
                                  "(one per pipeline rank)")
    for s, prs in lay.stage_ranks.items():
        if not prs or any(not _int(r) or r >= lay.pp for r in prs):
            raise PlanValidationError(f"layout.stage_ranks[{s}] = {prs!r}: pipeline ranks must be in 0..{lay.pp - 1}")
    for i, c in enumerate(plan.classes):
        if c.pp_rank != i or c.ranks != lay.class_ranks(i):
            raise PlanValidationError(f"rank class #{i} (pp_rank {c.pp_rank}, ranks {c.ranks[:4]}...) does not "
                                      f"match layout pp={lay.pp} dp={lay.dp} cp={lay.cp} tp={lay.tp}")
        for s in c.stages:
            if i not in lay.stage_ranks.get(s, []):
                raise PlanValidationError(f"rank class {i} holds stage {s}, which layout.stage_ranks does not "
                                          f"place on pipeline rank {i}")
        stages = set(c.stages)
        for stream, lst in c.streams.items():
            if _stream_ok(lst, stages, lay.pp, i):
                continue
            for ins in lst:
                stage, mb, deps = ins.stage, ins.mb, ins.deps
                plain = type(stage) is int and type(mb) is int and type(deps) is list  # `_int`'s common case
                bad = (not isinstance(ins.id, str) or ins.kind not in _ALL_KINDS
                       or not (stage >= -1 if plain else _int(stage, -1)) or not (mb >= -1 if plain else _int(mb, -1))
                       or not isinstance(deps, list) or not all(map(isinstance, deps, repeat(str))))
                if bad:
                    raise PlanValidationError(f"rank class {i} stream {stream}: malformed instruction {ins.id!r} "
                                              f"(kind {ins.kind!r}, stage {ins.stage!r}, mb {ins.mb!r}, "
                                              f"deps {ins.deps!r})")
                if ins.kind in P2P_KINDS and not (_int(ins.peer) and ins.peer < lay.pp and ins.peer != i):
                    raise PlanValidationError(f"rank class {i}: {ins.id} has peer {ins.peer!r}; expected another "
                                              f"pipeline rank in 0..{lay.pp - 1}")
                if stage >= 0 and stage not in stages and ins.kind not in P2P_KINDS:
                    raise PlanValidationError(f"rank class {i}: {ins.id} runs stage {ins.stage}, which this "
                                              f"class does not hold (stages {c.stages})")


def load_valid_plan(path: str, check_hash: bool = True) -> Plan:
    """`Plan.load` and `check_plan_file`: what every back end does with a plan file."""
    plan = Plan.load(path, check_hash=check_hash)
    try:
        check_plan_file(plan)
    except PlanValidationError as e:
        raise PlanValidationError(f"{path}: invalid plan: {e}") from None
    return plan


def check_plan_file(plan: Plan) -> None:
    """The checks on a plan read from a file: `check_layout`, `validate_plan` and
    `piper_sim.origin` (the plan is what its own strategy compiles to, up to cost estimates).
    The op counts are compared before `validate_plan` walks the plan, the ops after it (its
    messages name a dangling dependency or a deadlock more plainly)."""
    from piper_sim import origin

    check_layout(plan)
    origin.check_costs(plan)
    compiled = origin.recompile(plan)
    origin.check_op_counts(plan, compiled)
    validate_plan(plan)
    origin.check_same(plan, compiled)


@gc_paused
def validate_plan(plan: Plan) -> None:
    """Raise `PlanValidationError` if the plan cannot run; return quietly otherwise."""
    check_layout(plan)
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
            ungated = None  # the stream's first op without needed_by
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
                if not ins.needed_by:
                    ungated = ungated or ins
                else:  # a parameter gather the compute op waits for part-way through
                    if ungated is not None:  # posted from inside that op: it must head its stream
                        raise PlanValidationError(
                            f"rank class {c.pp_rank}: op {ins.id} (needed_by {ins.needed_by}) sits behind "
                            f"{ungated.id} on stream {stream!r}; a compute op waiting part-way posts only the "
                            "gathers heading their stream: put every needed_by op first on its stream")
                    user = ops.get((c.pp_rank, ins.needed_by))
                    if user is None or user.kind not in PASS_KINDS:
                        raise PlanValidationError(f"rank class {c.pp_rank}: op {ins.id} field 'needed_by' names "
                                                  f"{ins.needed_by!r}, which is no compute pass this rank runs")
                    if not 0.0 <= ins.needed_at <= 1.0:
                        raise PlanValidationError(f"rank class {c.pp_rank}: op {ins.id} field 'needed_at' "
                                                  f"{ins.needed_at} is not a share in [0, 1]")
                    g.add_edge(node, (c.pp_rank, ins.needed_by))
                if ins.kind in P2P_KINDS:
                    partner = p2p_partner_id(ins)
                    peer_op = ops.get((ins.peer, partner))
                    if peer_op is None or peer_op.peer != c.pp_rank:
                        raise PlanValidationError(
                            f"rank class {c.pp_rank}: {ins.id} has no matching {partner} "
                            f"on pipeline rank {ins.peer}")
                    union(node, (ins.peer, partner))
                elif ins.kind in COLLECTIVE_KINDS:
                    for m in _members(plan, ins.group, c.pp_rank, members_cache):
                        peer_op = ops.get((m, ins.id))
                        if peer_op is None or peer_op.kind != ins.kind or peer_op.bytes != ins.bytes:
                            raise PlanValidationError(
                                f"collective {ins.id} ({ins.group}) on rank class {c.pp_rank} has no "
                                f"identical counterpart on member pipeline rank {m}")
                        union(node, (m, ins.id))
                elif ins.kind in PASS_KINDS and ins.part == (0 if ins.kind == "F" else ins.parts - 1):
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
