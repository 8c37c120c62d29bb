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
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from piper_sim.plan import COLLECTIVE_KINDS, P2P_KINDS, Plan, PlanError, RankProgram


# torch 2.13 renamed the flat-tensor collectives; older versions only have the old names
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# p2p tag of the pieces `reduce_scatter_flat` sends on gloo; plan p2p ops use tags from 1 (`Comms.tags`)
PIECE_TAG = 0


def reduce_scatter_flat(inp: torch.Tensor, index: int, size: int, group=None, async_op: bool = False):
    """Reduce-scatter of a flat tensor whose ``size`` equal pieces go to the group's members:
    (work, this rank's reduced piece, valid once the work is done; work is None unless
    ``async_op``). ``inp`` is consumed. On gloo, every member sends each other member its
    copy of that member's piece and receives the group's copies of its own, summed in member
    order into its piece of ``inp`` (`PieceSum`): each rank sends (n-1)/n of the input, half
    of an all-reduce's bytes. gloo's own reduce-scatter takes 1.3-2x an all-reduce, and an
    all-to-all as many bytes (2 ranks, 25 MiB: all-reduce 27.4-35.8 ms, all-to-all and sum
    29.0-38.6 ms, sends and sum 14.6-15.1 ms; 11 MiB: 10.5-14.4, 12.3-17.3, 6.5-8.2 ms;
    medians of 21, 4 runs on the 2-core VM). Posting the sends costs the caller 0.2-2.5 ms
    there (gloo writes what the socket takes on the caller's thread), the all-to-all 0.3-1.9."""
    piece = inp.view(size, -1)[index] if inp.numel() else inp
    if dist.get_backend(group) == "gloo":
        if index != dist.get_rank(group):  # the pieces sent here are this rank's place in the group
            raise ValueError(f"reduce_scatter_flat: member index {index} of {size}, but the group's rank "
                             f"here is {dist.get_rank(group)} (torch orders a group's ranks ascending)")
        if not inp.numel() or size == 1:
            return (Done() if async_op else None), piece
        work = PieceSum.post(inp, index, size, group)
        if not async_op:
            work.wait()
            return None, piece
        return work, piece
    out = torch.empty_like(piece)
    return reduce_scatter(out, inp, group=group, async_op=async_op), out


class PieceSum:
    """gloo reduce-scatter in flight: this rank's sends of the other members' pieces and its
    receives of their copies of its own (in ``copies``, member order); once all are done,
    the sum goes into ``piece`` (once: by ``wait()``, or by the waiter thread of
    ``get_future()``, whichever runs first). Sends and receives on one group match in issue
    order, so several may be in flight."""

    def __init__(self, works: list, copies: torch.Tensor, piece: torch.Tensor, index: int, size: int) -> None:
        self.works, self.copies, self.piece, self.index, self.size = works, copies, piece, index, size
        self.lock = threading.Lock()
        self.error: BaseException | None = None

    @classmethod
    def post(cls, inp: torch.Tensor, index: int, size: int, group) -> "PieceSum":
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        pieces, copies = inp.view(size, -1), torch.empty_like(inp).view(size, -1)
        works = []
        for i, r in enumerate(ranks):
            if i != index:
                works.append(dist.isend(pieces[i], r, group=group, tag=PIECE_TAG))
                works.append(dist.irecv(copies[i], r, group=group, tag=PIECE_TAG))
        return cls(works, copies, pieces[index], index, size)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Waits for the sends and receives once (gloo's receive cannot be waited twice),
        then sums; later calls return at once, or raise the first call's error."""
        with self.lock:
            if self.error is not None:
                raise self.error
            if self.copies is None:
                return True
            try:
                for w in self.works:
                    w.wait() if timeout is None else w.wait(timeout)
            except BaseException as e:
                self.error = e
                raise
            if self.size == 2:  # a + b: the same in either order
                self.piece.add_(self.copies[1 - self.index])
            else:
                self.copies[self.index].copy_(self.piece)
                torch.sum(self.copies, 0, out=self.piece)
            self.copies = self.works = None
            return True

    def get_future(self) -> torch.futures.Future:
        """gloo's sends and receives give no future: a thread waits and completes this one."""
        fut: torch.futures.Future = torch.futures.Future()

        def wait() -> None:
            try:
                self.wait()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(e)
            else:
                fut.set_result(None)
        threading.Thread(target=wait, daemon=True).start()
        return fut


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


@dataclass
class Comms:
    """The process groups and p2p tags of one plan."""

    groups: dict[tuple[str, tuple[int, ...]], Any] = field(default_factory=dict)
    tags: dict[str, int] = field(default_factory=dict)

    @classmethod
    def create(cls, plan: Plan, timeout_s: float) -> "Comms":
        """Collective: every rank calls it with the same plan."""
        programs = plan.expand()
        check_collective_order(programs)
        comms = cls()
        for key in sorted(collective_sequences(programs)):
            stream, ranks = key
            comms.groups[key] = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s))
        matches = sorted({i.match for p in programs for lst in p.streams.values() for i in lst
                          if i.kind in P2P_KINDS})
        comms.tags = {m: k + 1 for k, m in enumerate(matches)}
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

