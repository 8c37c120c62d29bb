"""The executor's rank logic at scale without GPUs: every rank of a plan in one process over
torch's fake process group, each ``torch.distributed`` call recorded, then checked.

    python -m executor.scale_check PLAN.json|STRATEGY.json [--workers N] [--clip-grad-norm X]
    python -m executor.scale_check --family zbv-zero3 --ranks 1024

For each rank in turn: the fake process group (``torch.testing._internal.distributed.fake_pg``,
which moves no data), `Comms.create`, `Runtime` and one `Runtime.run_step` -- the executor's own
code, with the NCCL branches of `executor.collectives` (the fake backend is not gloo) -- under
`recording`, which wraps the ``torch.distributed`` functions (and any ``executor`` module's alias
of one) and logs per rank, in issue order, each call's op, group, size, dtype, peer, tag and
splits. `check` then asks, and names the first mismatch in one line:

1. every rank created the same process groups in the same order (``new_group`` is collective);
2. every member of a group issued the same (op, size, dtype) sequence on it (a broadcast: from
   the same source);
3. per group and ordered pair (src, dst), the sends src issued to dst and the receives dst
   posted from src match in order, size, dtype and tag (NCCL matches them in issue order);
4. each rank issued on each of its plan's groups the collectives its `Plan.program` lists
   there, in stream order (`expected_calls`: an op that exchanges counts first is two calls,
   `issued`; a ring's K/V op is its p2p hops), the sends and receives it lists (tag and bytes per peer),
   and besides them only `EXTRA` (the step's loss all-reduce). Sizes are compared with the plan
   for sends and receives (their bytes); a collective's plan bytes are what it is priced at
   (e.g. a gradient bucket's even share of the stage), so members are compared with each other.

Values are garbage by design; `recording` fills outputs "loopback" (what the op would give if
every member held this rank's data; receives get zeros) so they stay finite. An expert
all-to-all's rows per peer come from each rank's routing, and its count exchange loops back,
so for an all-to-all with splits members must agree on the number of splits, the row shape
and the dtype, not on the rows each peer gets.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from executor.collectives import Comms, group_ranks, plan_groups
from executor.parallel.context import ring_hops
from executor.runtime import Runtime
from executor.support import MOE, TINY
from piper_sim.plan import Plan

P2P = ("send", "recv")
# torch.distributed function -> the op it records (flat and list forms alike)
OPS = {"all_reduce": "all_reduce", "reduce_scatter_single": "reduce_scatter",
       "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter": "reduce_scatter",
       "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
       "all_to_all_single": "all_to_all", "all_to_all": "all_to_all", "broadcast": "broadcast",
       "barrier": "barrier", "isend": "send", "send": "send", "irecv": "recv", "recv": "recv",
       "all_gather_object": "all_gather_object", "gather_object": "gather_object",
       "broadcast_object_list": "broadcast_object_list", "batch_isend_irecv": "batch_isend_irecv"}
WORLD = -1  # the default group's index in a `Call`
# collectives the executor issues besides the plan's ops: (op, group, numel) -> where
EXTRA = {("all_reduce", WORLD, 1): "the step's loss (Runtime.run_step)"}


@dataclass(frozen=True)
class Call:
    """One recorded ``torch.distributed`` call of one rank."""

    op: str
    group: int                      # WORLD, or k: the k-th group the rank created
    numel: int
    shape: tuple[int, ...]
    dtype: str
    peer: int = -1                  # p2p and broadcast: the global peer / source
    tag: int = 0
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # all_to_all_single: (out, in)

    def size(self) -> Any:
        """What every member must agree on besides op and dtype."""
        return (len(self.splits[0]), self.shape[1:]) if self.splits else self.numel

    def nbytes(self) -> int:
        return self.numel * getattr(torch, self.dtype).itemsize

    def __str__(self) -> str:
        size = f"{self.size()[0]} splits of rows {list(self.size()[1])}" if self.splits else f"{self.numel}"
        peer = f" peer {self.peer}" if self.peer >= 0 else ""
        return f"{self.op} {size} {self.dtype}{peer}" + (f" tag {self.tag}" if self.tag else "")


@dataclass
class RankLog:
    """What one rank did and what its plan says it does."""

    rank: int
    calls: list[Call]
    groups: list[tuple[int, ...]]                 # every new_group call, in order (its ranks)
    expected: dict[int, list[tuple[str, str]]]    # group -> (op, plan op id), stream order
    # (group, send|recv, peer) -> (tag, bytes) of each, sorted
    expected_p2p: dict[tuple[int, str, int], list[tuple[int, int]]] = field(default_factory=dict)


@dataclass
class Report:
    ranks: int
    calls: int
    seconds: float
    mismatch: str | None            # the first one, in one line; None: the check passed

    @property
    def ok(self) -> bool:
        return self.mismatch is None


# --------------------------------------------------------------------------- recording


class Recorder:
    """One rank's log: its calls and the groups it created (`recording` fills it)."""

    def __init__(self, world: int) -> None:
        self.world = tuple(range(world))
        self.calls: list[Call] = []
        self.groups: list[tuple[int, ...]] = []
        self.index: dict[int, int] = {}             # id(process group) -> its index in ``groups``

    def group(self, pg) -> tuple[int, tuple[int, ...]]:
        if pg is None or pg is dist.GroupMember.WORLD:
            return WORLD, self.world
        k = self.index[id(pg)]
        return k, self.groups[k]

    def add(self, op: str, a: dict[str, Any]) -> None:
        """Log a call of ``op`` with bound arguments ``a``."""
        g, ranks = self.group(a.get("group"))
        if op.endswith("_object"):
            lst = a.get("object_list") or a.get("object_gather_list") or []
            self.calls.append(Call(op, g, len(lst), (), "object"))
            return
        if op == "batch_isend_irecv":
            for p in a["p2p_op_list"]:
                kind = "recv" if "recv" in p.op.__name__ else "send"
                self.calls.append(Call(kind, self.group(p.group)[0], p.tensor.numel(), tuple(p.tensor.shape),
                                       str(p.tensor.dtype).removeprefix("torch."), p.peer, p.tag))
            return
        # the collective's whole size: a gather's output, a scatter's (an all-to-all's) input
        names = ("output_tensor", "tensor_list", "tensor") if op == "all_gather" else \
            ("input", "input_list", "input_tensor_list", "tensor")
        t = next((a[n] for n in names if a.get(n) is not None), None)
        if isinstance(t, (list, tuple)):  # the list forms
            t = torch.cat([x.reshape(-1) for x in t]) if t else torch.empty(0)
        if t is None:  # barrier
            self.calls.append(Call(op, g, 0, (), ""))
            return
        peer = -1
        if op in P2P or op == "broadcast":
            key = "dst" if op == "send" else "src"
            peer = a.get(key)
            if peer is None and a.get("group_" + key) is not None:
                peer = ranks[a["group_" + key]]
        splits = None
        if op == "all_to_all" and (a.get("output_split_sizes") or a.get("input_split_sizes")):
            splits = (tuple(a.get("output_split_sizes") or ()), tuple(a.get("input_split_sizes") or ()))
        self.calls.append(Call(op, g, t.numel(), tuple(t.shape), str(t.dtype).removeprefix("torch."),
                               -1 if peer is None else peer, a.get("tag", 0) or 0, splits))


def _loopback(op: str, a: dict[str, Any]) -> None:
    """Fill an output as if every member of the group held this rank's data (receives: zeros)."""
    out, inp = a.get("output", a.get("output_tensor")), a.get("input", a.get("input_tensor"))
    if op == "recv":
        a["tensor"].zero_()
    elif isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor) and out.numel():
        o, i = out.view(-1), inp.reshape(-1)
        if op == "all_gather" and i.numel():
            o.copy_(i.repeat(o.numel() // i.numel()))
        elif op in ("reduce_scatter", "all_to_all") and i.numel() >= o.numel():
            o.copy_(i[:o.numel()])
        else:
            o.zero_()


def _wrap(name: str, orig: Callable, state: dict) -> Callable:
    sig, op = inspect.signature(orig), OPS[name]

    def recorded(*args, **kwargs):
        rec: Recorder | None = state.get("rec")
        if rec is None:
            return orig(*args, **kwargs)
        a = sig.bind(*args, **kwargs).arguments
        rec.add(op, a)
        out = orig(*args, **kwargs)
        _loopback(op, a)
        return out
    recorded.__wrapped__ = orig
    return recorded


def _wrap_new_group(orig: Callable, state: dict) -> Callable:
    def new_group(ranks=None, *args, **kwargs):
        pg = orig(ranks, *args, **kwargs)
        rec: Recorder | None = state.get("rec")
        if rec is not None:
            rec.groups.append(tuple(sorted(ranks)) if ranks is not None else rec.world)
            if pg is not None and pg is not dist.GroupMember.NON_GROUP_MEMBER:
                rec.index[id(pg)] = len(rec.groups) - 1
        return pg
    new_group.__wrapped__ = orig
    return new_group


@contextmanager
def recording() -> Iterator[dict]:
    """Patch the ``torch.distributed`` functions of `OPS` and ``new_group`` (and every
    ``executor`` module attribute bound to one of them) with recording wrappers; yields the
    state whose ``"rec"`` (a `Recorder`, or None: record nothing) receives the calls."""
    state: dict[str, Recorder | None] = {"rec": None}
    originals = {n: getattr(dist, n) for n in [*OPS, "new_group"] if hasattr(dist, n)}
    wrapped = {n: (_wrap_new_group(f, state) if n == "new_group" else _wrap(n, f, state))
               for n, f in originals.items()}
    by_id = {id(f): wrapped[n] for n, f in originals.items()}
    patched: list[tuple[Any, str, Any]] = [(dist, n, f) for n, f in originals.items()]
    for mod in [m for name, m in list(sys.modules.items()) if name.split(".")[0] == "executor" and m]:
        for attr, val in list(vars(mod).items()):
            if id(val) in by_id and callable(val):
                patched.append((mod, attr, val))
    try:
        for obj, attr, val in patched:
            setattr(obj, attr, by_id[id(val)] if obj is not dist else wrapped[attr])
        yield state
    finally:
        for obj, attr, val in patched:
            setattr(obj, attr, val)


# --------------------------------------------------------------------------- running ranks


def module_order(lst: list, compute: list) -> list:
    """A tensor-/context-parallel stream in the order the executor issues it: an op with a
    direction is performed by the modules inside its compute piece (where its chain of ops
    starts); an op the runtime issues (``TP.s{S}.norms``, and a ``.regather`` after a BI piece:
    a split backward's, `TPComm.regather`) goes once the ops before it in the stream and every
    module op of the pieces it waits for are done, wherever the plan's list puts it among the
    latter."""
    kinds = {i.id: i.kind for i in compute}
    piece: dict[str, str] = {}
    mods: list = []
    runtime: list[tuple[int, Any]] = []  # (module ops before it in the list, op)
    for ins in lst:
        piece[ins.id] = next((d if d in kinds else piece.get(d, "") for d in ins.deps), "")
        if ins.direction and not (ins.name.endswith(".regather") and kinds.get(piece[ins.id]) == "BI"):
            mods.append(ins)
        else:
            runtime.append((len(mods), ins))
    out, n = [], 0
    for before, ins in runtime:
        deps = set(ins.deps)
        n = max([n, before] + [k + 1 for k, x in enumerate(mods) if piece[x.id] in deps])
        out.append((n, ins))
    merged, k = [], 0
    for n, ins in out:
        merged += mods[k:n] + [ins]
        k = max(k, n)
    return merged + mods[k:]


MODULE_STREAMS = ("tp", "cp")


def issued(ins) -> int:
    """The ``torch.distributed`` calls one plan collective is: 2 where the members exchange
    their counts first (an expert dispatch's forward all-to-all; MoE under SP, the forward or
    recomputed gather of the experts' tokens over TP, `TPComm.gather_rows`), else 1."""
    if ins.kind == "ALL_TO_ALL":
        return 2 if ins.direction == "F" and ins.a2a == "dispatch" else 1
    return 2 if ins.kind == "ALL_GATHER" and ins.direction in ("F", "R") and ins.id.endswith(".moe.ag") else 1


def expected_calls(plan: Plan, rank: int, comms: Comms, rec: Recorder) -> tuple[dict, dict]:
    """What the plan says ``rank`` issues: per group index the collectives in stream order (op,
    plan op id), and per (group, send|recv, peer) the p2p tags, from `Plan.program`."""
    prog = plan.program(rank)
    cp = plan.header.cp
    by_key = {key: rec.group(pg)[0] for key, pg in comms.groups.items() if rank in key[1]}
    out: dict[int, list[tuple[str, str]]] = {g: [] for g in by_key.values()}
    p2p: dict[tuple[int, str, int], list[int]] = {}
    for stream, lst in prog.streams.items():
        for ins in module_order(lst, prog.streams.get("compute", [])) if stream in MODULE_STREAMS else lst:
            if ins.kind in ("SEND", "RECV"):
                p2p.setdefault((WORLD, ins.kind.lower(), ins.peer), []).append((comms.tags[ins.match],
                                                                                round(ins.bytes)))
                continue
            if not ins.group:
                continue
            g = by_key[(stream, group_ranks(ins.group))]
            hops = ring_hops(ins, cp.style, cp.degree)
            if hops:  # ring attention: each hop a send and a receive
                out[g] += [("p2p", ins.id)] * (2 * hops)
                continue
            op = {"ALLREDUCE": "all_reduce", "REDUCE_SCATTER": "reduce_scatter", "ALL_GATHER": "all_gather",
                  "ALL_TO_ALL": "all_to_all"}[ins.kind]
            out[g] += [(op, ins.id)] * issued(ins)
    for key, g in by_key.items():
        if key[0] == "clip":  # DataParallel.grad_norm (--clip-grad-norm): the squared norm, once a step
            out[g].append(("all_reduce", "clip"))
    return out, {k: sorted(v) for k, v in p2p.items()}


class RankFailed(RuntimeError):
    """A rank's set-up or step raised; the message names the rank."""


def run_rank(plan: Plan, rank: int, state: dict, clip_grad_norm: float | None = None) -> RankLog:
    """One rank of ``plan``: fake process group, `Comms.create`, `Runtime`, one step, recorded."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rec = state["rec"] = Recorder(plan.world_size)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    try:
        comms = Comms.create(plan, 60.0)
        rt = Runtime(plan, rank, comms, torch.device("cpu"), clip_grad_norm=clip_grad_norm)
        rt.run_step(0)
        state["rec"] = None
        expected, p2p = expected_calls(plan, rank, comms, rec)
        comms.destroy()
    except Exception as e:  # noqa: BLE001 - one line naming the rank (InstructionError does already)
        raise RankFailed(str(e) if str(e).startswith("rank ") else f"rank {rank}: {type(e).__name__}: {e}") from e
    finally:
        state["rec"] = None
        dist.destroy_process_group()
    return RankLog(rank, rec.calls, rec.groups, expected, p2p)


def _run_ranks(plan: Plan, ranks: list[int], clip_grad_norm: float | None) -> list[RankLog]:
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only contend
    torch.set_flush_denormal(True)  # garbage values: no denormal slow paths
    try:
        with recording() as state:
            return [run_rank(plan, r, state, clip_grad_norm) for r in ranks]
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)


_POOL_PLAN: list = []


def _pool_run(args: tuple[list[int], float | None]) -> list[RankLog]:
    return _run_ranks(_POOL_PLAN[0], *args)


def record_ranks(plan: Plan, workers: int = 1, clip_grad_norm: float | None = None) -> list[RankLog]:
    """Every rank's `RankLog`, ranks run one after another (``workers`` > 1: that many forked
    processes, each a contiguous share of the ranks)."""
    ranks = list(range(plan.world_size))
    plan_groups(plan)  # once, before forking: every rank's Comms.create reuses it
    if workers <= 1:
        return _run_ranks(plan, ranks, clip_grad_norm)
    _POOL_PLAN[:] = [plan]
    chunks = [(ranks[i::workers], clip_grad_norm) for i in range(workers)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        logs = [log for part in pool.map(_pool_run, chunks) for log in part]
    return sorted(logs, key=lambda log: log.rank)


# --------------------------------------------------------------------------- the check


def _first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _at(seq: list, i: int) -> str:
    return str(seq[i]) if i < len(seq) else "nothing"


def _name(ranks: tuple[int, ...]) -> str:
    shown = ",".join(map(str, ranks[:8])) + (",..." if len(ranks) > 8 else "")
    return f"[{shown}] ({len(ranks)} ranks)"


def check(logs: list[RankLog]) -> str | None:
    """The first mismatch among the ranks' logs, in one line (None: they all agree)."""
    by_rank = {log.rank: log for log in logs}
    world = tuple(sorted(by_rank))
    ref = logs[0]
    for log in logs:  # 1. the same groups, created in the same order
        if log.groups != ref.groups:
            k = _first_difference(ref.groups, log.groups)
            return (f"group creation differs between rank {ref.rank} and rank {log.rank} at new_group #{k}: "
                    f"{_name(ref.groups[k]) if k < len(ref.groups) else 'nothing'} vs "
                    f"{_name(log.groups[k]) if k < len(log.groups) else 'nothing'}")
    groups = {WORLD: world, **dict(enumerate(ref.groups))}
    seqs: dict[int, dict[int, list[Call]]] = {}
    pairs: dict[tuple[int, int, int], dict[str, list[Call]]] = {}
    for log in logs:
        for c in log.calls:
            if c.op in P2P:
                src, dst = (log.rank, c.peer) if c.op == "send" else (c.peer, log.rank)
                pairs.setdefault((c.group, src, dst), {"send": [], "recv": []})[c.op].append(c)
            else:
                seqs.setdefault(c.group, {}).setdefault(log.rank, []).append(c)
    for g, per_rank in sorted(seqs.items()):  # 2. every member, the same sequence on a group
        members = groups[g]
        outside = [r for r in per_rank if r not in members]
        if outside:
            return f"rank {outside[0]} issued {per_rank[outside[0]][0]} on group #{g} {_name(members)}, not a member"
        sig = {r: [(c.op, c.size(), c.dtype, c.peer) for c in per_rank.get(r, [])] for r in members}
        first = sig[members[0]]
        for r in members[1:]:
            if sig[r] != first:
                k = _first_difference(first, sig[r])
                return (f"group #{g} {_name(members)}: rank {members[0]} and rank {r} differ at op {k}: "
                        f"{_at(per_rank.get(members[0], []), k)} vs {_at(per_rank.get(r, []), k)}")
    for (g, src, dst), sr in sorted(pairs.items()):  # 3. sends and receives, pair by pair
        a = [(c.numel, c.dtype, c.tag) for c in sr["send"]]
        b = [(c.numel, c.dtype, c.tag) for c in sr["recv"]]
        if a != b:
            k = _first_difference(a, b)
            return (f"p2p {src} -> {dst} on group #{g}: send {k} of rank {src} is {_at(sr['send'], k)} but "
                    f"receive {k} of rank {dst} is {_at(sr['recv'], k)}")
    for log in logs:  # 4. what the plan says
        got: dict[int, list[Call]] = {}
        for c in log.calls:
            if c.op not in P2P or c.group != WORLD:
                got.setdefault(c.group, []).append(c)
        for g in sorted(set(got) | set(log.expected)):
            calls = [c for c in got.get(g, []) if (c.op, g, c.numel) not in EXTRA]
            want = log.expected.get(g, [])
            ops = ["p2p" if c.op in P2P else c.op for c in calls]
            if ops != [op for op, _ in want]:
                k = _first_difference(ops, [op for op, _ in want])
                plan = f"{want[k][0]} ({want[k][1]})" if k < len(want) else "nothing"
                return (f"rank {log.rank} group #{g} {_name(groups[g])}: op {k} is {_at(calls, k)}, "
                        f"the plan says {plan}")
        p2p: dict[tuple[int, str, int], list[int]] = {}
        for c in log.calls:
            if c.op in P2P and c.group == WORLD:
                p2p.setdefault((c.group, c.op, c.peer), []).append((c.tag, c.nbytes()))
        for key in sorted(set(p2p) | set(log.expected_p2p)):
            mine, want = sorted(p2p.get(key, [])), log.expected_p2p.get(key, [])
            if mine != want:
                extra, missing = Counter(mine) - Counter(want), Counter(want) - Counter(mine)
                return (f"rank {log.rank}: {key[1]}s with peer {key[2]}: (tag, bytes) {sorted(extra)} issued "
                        f"beyond the plan's, {sorted(missing)} of the plan's not issued")
    return None


def scale_check(plan: Plan, workers: int = 1, clip_grad_norm: float | None = None) -> Report:
    """Run and check every rank of ``plan`` (`record_ranks`, `check`); a rank that raises is
    the report's mismatch (``failed: rank R: ...``)."""
    t0 = time.perf_counter()
    try:
        logs = record_ranks(plan, workers, clip_grad_norm)
    except RankFailed as e:
        return Report(plan.world_size, 0, time.perf_counter() - t0, f"failed: {e}")
    mismatch = check(logs)
    return Report(plan.world_size, sum(len(log.calls) for log in logs), time.perf_counter() - t0, mismatch)


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
# the families' models beyond the zoo: a model file's fields (`model_source` writes the file) or a
# user nn.Module's strategy source (a TP + SP annotated language model of examples/)
MODELS: dict[str, dict[str, Any]] = {
    "tiny-mtp": {**TINY, "name": "tiny-mtp", "mtp_layers": 1, "mtp_loss_scale": 0.3},
    "moe-tiny-mtp": {**MOE, "name": "moe-tiny-mtp", "mtp_layers": 1},
    "user-tiny-lm": {"source": f"py:{os.path.join(EXAMPLES, 'user_transformer_tp.py')}:tiny_lm",
                     "kwargs": {"depth": 4}},
}


def model_source(name: str) -> Any:
    """A strategy's ``model`` for ``name``: a zoo name as is, a `MODELS` model file written to a
    temporary folder (its path), or a user module's source."""
    spec = MODELS.get(name)
    if spec is None or "source" in spec:
        return copy.deepcopy(spec) or name
    path = os.path.join(tempfile.gettempdir(), "piper-sim-scale-check", f"{name}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(spec, f)
    os.replace(tmp, path)  # whole, whoever else writes it
    return path


@dataclass(frozen=True)
class Family:
    """A kind of plan the check samples: its model, schedule and parallelism; data parallelism
    fills the ranks left (`strategy`)."""

    sched: str = "1f1b"
    pp: int = 4
    v: int = 1                      # stages per pipeline rank
    zero: int = 0
    tp: int = 1
    sp: bool = False
    ep: int = 1
    cp: int = 1
    style: str = "allgather"
    model: str = "gpt-tiny"        # a zoo name or a `MODELS` name
    m: int = 4                      # micro-batches
    recompute: str = ""

    def strategy(self, world: int) -> dict[str, Any]:
        dp = world // (self.pp * self.tp * self.cp)
        d: list[dict[str, Any]] = [{"op": "pipeline", "degree": self.pp, **({"stages_per_rank": self.v}
                                                                             if self.v > 1 else {})},
                                   {"op": "schedule", "name": self.sched},
                                   {"op": "data_parallel", "degree": dp, "zero": self.zero}]
        if self.ep > 1:
            d.append({"op": "expert_parallel", "degree": self.ep})
        if self.tp > 1:
            d.append({"op": "tensor_parallel", "degree": self.tp, "sequence_parallel": self.sp})
        if self.cp > 1:
            d.append({"op": "context_parallel", "degree": self.cp, "style": self.style})
        if self.recompute:
            d.append({"op": "recompute", "mode": self.recompute})
        return {"model": model_source(self.model), "cluster": f"cpu:{world}", "global_batch": dp * self.m,
                "seq_len": 16 * self.cp, "microbatches": self.m, "directives": d}


# each schedule, ZeRO 0-3, TP (with and without SP), EP and CP (all-gather and ring), DeepSeek-V3's
# multi-token prediction (under TP + SP, and CP ring) and a user nn.Module's annotated TP, in plans
# the executor runs (`executor.options.refuse_unrunnable`: e.g. MTP not with its embedding copy's
# gradient reduce-scattered every micro-batch, ZeRO-2/3)
FAMILIES: dict[str, Family] = {
    "gpipe-zero0": Family("gpipe"),
    "1f1b-tp2-zero1": Family(tp=2, zero=1),
    "interleaved-tp4-sp-zero2": Family("interleaved_1f1b", v=2, tp=4, sp=True, zero=2),
    "zb1p-zero2": Family("zb1p", zero=2),
    "zbv-zero3": Family("zbv", v=2, zero=3),
    "dualpipe-tp2-zero1": Family("dualpipe", tp=2, zero=1, m=8),
    "dualpipev-moe-ep4-zero1": Family("dualpipev", pp=2, v=2, ep=4, zero=1, model="moe-tiny"),
    "1f1b-moe-ep4-tp2-zero3": Family(pp=2, ep=4, tp=2, zero=3, model="moe-tiny"),
    "1f1b-cp4-zero3": Family(pp=2, cp=4, zero=3),
    "1f1b-cp2-ring-tp2-sp-zero1": Family(pp=2, cp=2, style="ring", tp=2, sp=True, zero=1, recompute="full"),
    "zb1p-mtp-tp2-sp-zero1": Family("zb1p", tp=2, sp=True, zero=1, model="tiny-mtp", recompute="full"),
    "1f1b-moe-mtp-ep4-tp2-sp-zero1": Family(pp=2, ep=4, tp=2, sp=True, zero=1, model="moe-tiny-mtp"),
    "1f1b-mtp-cp2-ring-zero1": Family(pp=2, cp=2, style="ring", zero=1, model="tiny-mtp"),
    "1f1b-user-tp2-sp-zero3": Family(pp=2, tp=2, sp=True, zero=3, model="user-tiny-lm"),
}


def load(path: str) -> Plan:
    """A plan file, or a strategy file compiled here."""
    with open(path) as f:
        data = json.load(f)
    if "directives" in data:
        from piper_sim.compiler import compile_strategy

        return compile_strategy(data).plan
    from piper_sim.validate import load_valid_plan

    return load_valid_plan(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m executor.scale_check", description=__doc__.split("\n\n")[0])
    p.add_argument("plan", nargs="?", metavar="PLAN.json", help="a plan file, or a strategy file (compiled here)")
    p.add_argument("--family", choices=sorted(FAMILIES), help="instead of a file: a family of `FAMILIES`")
    p.add_argument("--ranks", type=int, default=64, help="with --family: the world size (default 64)")
    p.add_argument("--workers", type=int, default=1, help="processes, each running a share of the ranks")
    p.add_argument("--clip-grad-norm", type=float, default=None, help="run the step as --clip-grad-norm does")
    args = p.parse_args(argv)
    if (args.plan is None) == (args.family is None):
        p.error("give a PLAN.json or --family")
    from executor.options import refuse_unrunnable
    from piper_sim.compiler import compile_strategy

    name = args.plan or f"{args.family} on {args.ranks} ranks"
    plan = load(args.plan) if args.plan else compile_strategy(FAMILIES[args.family].strategy(args.ranks)).plan
    refuse_unrunnable(plan, name)  # what the executor would refuse to run
    r = scale_check(plan, args.workers, args.clip_grad_norm)
    print(f"{name}: {r.ranks} ranks, {r.calls} calls recorded, {r.seconds:.1f} s: "
          + ("ok" if r.ok else f"MISMATCH: {r.mismatch}"))
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
