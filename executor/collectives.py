"""Process groups for a plan, p2p tags, and completion notices for async work.

One process group per distinct (plan stream, member ranks) of the plan's collectives, made
on every rank in one sorted order before the first step. Keeping streams apart gives each
group a single issue order (its stream's list order), so members always agree on which
collective comes next, even when the runtime issues streams in a data-dependent order;
`check_collective_order` verifies that the plan's lists really agree. Point-to-point ops
go over the default group, told apart by a tag per ``match`` key (gloo honours tags; NCCL
matches in issue order).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from piper_sim.plan import COLLECTIVE_KINDS, P2P_KINDS, Plan, PlanError, RankProgram


# torch 2.13 renamed the flat-tensor collectives; older versions only have the old names
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_flat(inp: torch.Tensor, index: int, size: int, group=None, async_op: bool = False):
    """Reduce-scatter of a flat tensor whose ``size`` equal pieces go to the group's members:
    (work, this rank's reduced piece, valid once the work is done; work is None unless
    ``async_op``). ``inp`` is consumed. On gloo, an all-to-all hands every member the
    group's copies of its piece, summed in member order into its piece of ``inp``
    (`SumOfPieces`): each rank sends (n-1)/n of the input, half of an all-reduce's bytes;
    gloo's own reduce-scatter takes 1.3-2x an all-reduce (2 ranks, 3.8 MB: 10.6-17.0 ms vs
    7.9-9.2 ms), and issuing the all-to-all costs the issuing thread no more than an
    all-reduce (ZeRO-3 gpt-small, 2 ranks, 2-core VM: 0.27 ms median per issue; point-to-
    point sends of the pieces cost 1.1-1.8 ms there, gloo writing them on the caller's
    thread). Sends of the pieces finish in ~0.5x the all-to-all's time when timed alone
    (11-25 MiB), but in a step they were no gain: posted from the computing thread or from
    a thread of their own, ZeRO-3 gpt-small steps took 1.03-1.05x as long, ZeRO-1 0.98-1.00x
    (paired steps in one job, 2026-12-01)."""
    piece = inp.view(size, -1)[index] if inp.numel() else inp
    if dist.get_backend(group) == "gloo":
        if index != dist.get_rank(group):  # the all-to-all hands this rank the group's copies of that piece
            raise ValueError(f"reduce_scatter_flat: member index {index} of {size}, but the group's rank "
                             f"here is {dist.get_rank(group)} (torch orders a group's ranks ascending)")
        if not inp.numel() or size == 1:
            return (Done() if async_op else None), piece
        copies = torch.empty_like(inp)
        work = SumOfPieces(dist.all_to_all_single(copies, inp, group=group, async_op=True), copies, piece, size)
        if not async_op:
            work.wait()
            return None, piece
        return work, piece
    out = torch.empty_like(piece)
    return reduce_scatter(out, inp, group=group, async_op=async_op), out


class SumOfPieces:
    """gloo reduce-scatter in flight: an all-to-all filling ``copies`` with every member's
    copy of this rank's piece, in member order; once it is done, their sum goes into
    ``piece`` (once: by ``wait()`` or by the future's callback, whichever runs first)."""

    def __init__(self, work, copies: torch.Tensor, piece: torch.Tensor, size: int) -> None:
        self.work, self.copies, self.piece, self.size = work, copies, piece, size
        self.lock = threading.Lock()

    def _sum(self) -> None:
        with self.lock:
            if self.copies is not None:
                torch.sum(self.copies.view(self.size, -1), 0, out=self.piece)
                self.copies = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.work.wait() if timeout is None else self.work.wait(timeout)
        self._sum()
        return True

    def get_future(self) -> torch.futures.Future:
        def summed(fut: torch.futures.Future) -> None:
            fut.value()  # raises the collective's error
            self._sum()
        return self.work.get_future().then(summed)


class Done:
    """A work that has already completed (nothing had to move)."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut


def all_gather_flat(out: torch.Tensor, piece: torch.Tensor, index: int, size: int, group=None,
                    async_op: bool = False):
    """All-gather into a flat tensor whose ``size`` equal pieces come from the group's
    members, ``piece`` being member ``index``'s; returns the work when ``async_op``. On gloo,
    one broadcast per member, from it, of its piece into ``out``, all in flight at once:
    the same bytes as gloo's all-gather in ~0.6x its time (2 ranks, 3.8 MB: 1.6-2.3 ms vs
    2.9-3.4 ms, 15 paired rounds, 3 runs, on the 2-core VM)."""
    if dist.get_backend(group) != "gloo" or not out.numel():
        return all_gather(out, piece, group=group, async_op=async_op)
    if piece.numel() * size != out.numel() or piece.dtype != out.dtype or index != dist.get_rank(group):
        raise ValueError(f"all_gather_flat: piece of {piece.numel()} {piece.dtype} as member {index} of {size} "
                         f"into {out.numel()} {out.dtype}; the group's rank here is {dist.get_rank(group)}")
    pieces = out.view(size, -1)
    mine = pieces[index]
    if mine.data_ptr() != piece.data_ptr():
        mine.copy_(piece.reshape(-1))
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    works = [dist.broadcast(pieces[i], src=r, group=group, async_op=True) for i, r in enumerate(ranks)]
    if not async_op:
        Works(works).wait()
        return None
    return Works(works)


class Works:
    """Several async works as one: ``wait()`` for all; ``get_future()`` completes when all
    have, or fails with the first error as soon as one fails."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        lock, left = threading.Lock(), [len(self.works)]

        def done(f: torch.futures.Future) -> None:
            try:
                f.value()
                error = None
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                error = e
            with lock:
                left[0] -= 1
                if fut.done():
                    return
                if error is not None:
                    fut.set_exception(error)
                elif left[0] == 0:
                    fut.set_result(None)
        for w in self.works:
            w.get_future().add_done_callback(done)
        return fut


def group_ranks(group: str) -> tuple[int, ...]:
    """``"ranks:0,2"`` -> (0, 2)."""
    return tuple(int(x) for x in group[len("ranks:"):].split(","))


def collective_sequences(programs: list[RankProgram]) -> dict[tuple[str, tuple[int, ...]], dict[int, list[str]]]:
    """(stream, ranks) -> rank -> the collective op ids that rank issues on that group, in order."""
    out: dict[tuple[str, tuple[int, ...]], dict[int, list[str]]] = {}
    for prog in programs:
        for stream, lst in prog.streams.items():
            for ins in lst:
                if ins.kind in COLLECTIVE_KINDS:
                    key = (stream, group_ranks(ins.group))
                    out.setdefault(key, {}).setdefault(prog.rank, []).append(ins.id)
    return out


def check_collective_order(programs: list[RankProgram]) -> None:
    """Every member of a group must issue the same collectives in the same order."""
    for (stream, ranks), seqs in collective_sequences(programs).items():
        missing = [r for r in ranks if r not in seqs]
        if missing:
            raise PlanError(f"collective group {list(ranks)} on stream {stream!r}: rank(s) {missing} "
                            "never join it")
        ref = seqs[ranks[0]]
        for r in ranks[1:]:
            if seqs[r] != ref:
                k = next((i for i, (a, b) in enumerate(zip(ref, seqs[r])) if a != b), min(len(ref), len(seqs[r])))
                raise PlanError(f"collective order differs on stream {stream!r} between rank {ranks[0]} "
                                f"and rank {r} at position {k}: {ref[k:k + 3]} vs {seqs[r][k:k + 3]}; "
                                "the compiler must give every member one issue order")


_PLAN_GROUPS: dict[int, tuple[list[tuple[str, tuple[int, ...]]], dict[str, int]]] = {}


def plan_groups(plan: Plan) -> tuple[list[tuple[str, tuple[int, ...]]], dict[str, int]]:
    """The plan's collective groups, (stream, ranks) in the one order every rank creates them,
    and its p2p tags (match -> tag), after `check_collective_order`. Every rank's programs are
    expanded (O(world) work per rank): computed once per `Plan` object, so a process that sets
    up many ranks of one plan (`executor.scale_check`) pays for it once."""
    got = _PLAN_GROUPS.get(id(plan))
    if got is None:
        programs = plan.expand()
        check_collective_order(programs)
        matches = sorted({i.match for p in programs for lst in p.streams.values() for i in lst
                          if i.kind in P2P_KINDS})
        got = _PLAN_GROUPS[id(plan)] = (sorted(collective_sequences(programs)),
                                        {m: k + 1 for k, m in enumerate(matches)})
        weakref.finalize(plan, _PLAN_GROUPS.pop, id(plan), None)
    return got


@dataclass
class Comms:
    """The process groups and p2p tags of one plan."""

    groups: dict[tuple[str, tuple[int, ...]], Any] = field(default_factory=dict)
    tags: dict[str, int] = field(default_factory=dict)

    @classmethod
    def create(cls, plan: Plan, timeout_s: float) -> "Comms":
        """Collective: every rank calls it with the same plan."""
        keys, tags = plan_groups(plan)
        comms = cls(tags=dict(tags))
        for key in keys:  # (stream, ranks)
            comms.groups[key] = dist.new_group(list(key[1]), timeout=timedelta(seconds=timeout_s))
        return comms

    def group(self, stream: str, group: str):
        return self.groups[(stream, group_ranks(group))]

    def destroy(self) -> None:
        for pg in self.groups.values():
            dist.destroy_process_group(pg)
        self.groups.clear()


class Completions:
    """A queue of finished async work: ``watch(work, token)`` puts ``(token, end_time,
    error)`` when ``work`` completes (future callback, or a waiter thread where the backend
    gives no future, e.g. gloo send/recv)."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()

    def watch(self, work, token: Any) -> None:
        try:
            fut = work.get_future()
        except RuntimeError:
            threading.Thread(target=self._wait, args=(work, token), daemon=True).start()
            return
        fut.add_done_callback(lambda f: self._done(f, token))

    def _done(self, fut, token: Any) -> None:
        t = time.perf_counter()
        try:
            fut.value()
            self.q.put((token, t, None))
        except BaseException as e:  # noqa: BLE001 - handed to the issuing thread
            self.q.put((token, t, e))

    def _wait(self, work, token: Any) -> None:
        try:
            work.wait()
            self.q.put((token, time.perf_counter(), None))
        except BaseException as e:  # noqa: BLE001
            self.q.put((token, time.perf_counter(), e))

    def get(self, timeout: float | None) -> tuple[Any, float, BaseException | None]:
        return self.q.get(timeout=timeout)

    def poll(self) -> list[tuple[Any, float, BaseException | None]]:
        out = []
        while True:
            try:
                out.append(self.q.get_nowait())
            except queue.Empty:
                return out

