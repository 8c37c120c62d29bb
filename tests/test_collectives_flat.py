"""The executor's flat collectives on gloo (`all_gather_flat` as broadcasts,
`reduce_scatter_flat` as an all-to-all and a sum) give what torch's own collectives give,
on the whole world and on a subgroup whose members are not ranks 0..n-1."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import pytest

from executor.collectives import Works, all_gather_flat, reduce_scatter_flat
from calibration.microbench import free_port

WORLD = 4


def _worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                           timeout=datetime.timedelta(seconds=60))
    try:
        sub_ranks = [1, 3]
        sub = dist.new_group(sub_ranks)
        for group, members in ((None, list(range(WORLD))), (sub, sub_ranks)):
            if rank not in members:
                continue
            index, size = members.index(rank), len(members)
            piece = torch.arange(6, dtype=torch.float32) + 100 * rank
            want = torch.cat([torch.arange(6, dtype=torch.float32) + 100 * r for r in members])
            for async_op in (False, True):
                out = torch.zeros(6 * size)
                work = all_gather_flat(out, piece, index, size, group=group, async_op=async_op)
                if async_op:
                    work.get_future().wait()
                assert torch.equal(out, want), (rank, members, out)
            # the piece may already be this rank's slice of the output (in place)
            out = torch.zeros(6 * size)
            out.view(size, -1)[index].copy_(piece)
            all_gather_flat(out, out.view(size, -1)[index], index, size, group=group)
            assert torch.equal(out, want)
            # a non-contiguous 2-d piece; a piece of the wrong size or member index is refused
            grid = (torch.arange(6, dtype=torch.float32) + 100 * rank).view(2, 3).t()  # 3x2, strided
            out = torch.zeros(6 * size)
            all_gather_flat(out, grid, index, size, group=group)
            assert torch.equal(out.view(size, -1)[index], grid.reshape(-1))
            for bad in ((torch.zeros(5), index), (piece, (index + 1) % size)):
                try:
                    all_gather_flat(torch.zeros(6 * size), *bad, size, group=group)
                except ValueError as e:
                    assert "all_gather_flat" in str(e)
                else:
                    raise AssertionError(f"accepted {bad}")
            # reduce-scatter: three in flight at once on one group (matched in issue order),
            # finished through wait (twice: sums once), the future, and the blocking form
            total = sum(r + 1 for r in members)
            want = torch.arange(4 * size, dtype=torch.float32)[4 * index:4 * index + 4] * total
            posted = [reduce_scatter_flat(torch.arange(4 * size, dtype=torch.float32) * (rank + 1) * k,
                                          index, size, group=group, async_op=True) for k in (1, 2, 3)]
            posted[2][0].get_future().wait()
            posted[0][0].wait()
            posted[0][0].wait()
            posted[1][0].get_future().wait()
            for k, (_, mine) in zip((1, 2, 3), posted):
                assert torch.equal(mine, want * k), (rank, members, k, mine)
            none, mine = reduce_scatter_flat(torch.arange(4 * size, dtype=torch.float32) * (rank + 1),
                                             index, size, group=group)
            assert none is None and torch.equal(mine, want)
            # bf16 in, bf16 out (small integers: exact); an empty input; a member index that is
            # not this rank's place in the group is refused, not summed into the wrong piece
            _, mine = reduce_scatter_flat(torch.ones(4 * size, dtype=torch.bfloat16) * (rank + 1), index, size,
                                          group=group)
            assert mine.dtype == torch.bfloat16 and torch.equal(mine, torch.full((4,), float(total),
                                                                                 dtype=torch.bfloat16))
            work, mine = reduce_scatter_flat(torch.zeros(0), index, size, group=group, async_op=True)
            work.get_future().wait()
            assert mine.numel() == 0
            try:
                reduce_scatter_flat(torch.zeros(4 * size), (index + 1) % size, size, group=group)
            except ValueError as e:
                assert "reduce_scatter_flat" in str(e)
            else:
                raise AssertionError("accepted another member's index")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_flat_collectives_match_torch_on_world_and_subgroup():
    mp.start_processes(_worker, args=(free_port(),), nprocs=WORLD, join=True, start_method="spawn")


class _Handle:
    """What `Works` takes from a torch.distributed work: its future."""

    def __init__(self, fut: torch.futures.Future):
        self.fut = fut

    def get_future(self) -> torch.futures.Future:
        return self.fut


def test_works_future_fails_at_the_first_error_and_completes_after_the_last():
    a, b, c = (torch.futures.Future() for _ in range(3))
    combined = Works([_Handle(a), _Handle(b), _Handle(c)]).get_future()
    a.set_result(None)
    assert not combined.done()
    b.set_exception(RuntimeError("broadcast 1 failed: peer gone"))
    assert combined.done()  # not waiting for c
    with pytest.raises(RuntimeError, match="peer gone"):
        combined.value()
    x, y = torch.futures.Future(), torch.futures.Future()
    ok = Works([_Handle(x), _Handle(y)]).get_future()
    y.set_result(None)
    assert not ok.done()
    x.set_result(None)
    assert ok.done() and ok.value() is None
