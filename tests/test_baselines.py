"""The torch peers the executor is timed against train alike: one step of DDP +
ZeroRedundancyOptimizer (torch's ZeRO-1) leaves the same parameters as one step of DDP."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from calibration.microbench import free_port


def _worker(rank: int, port: int) -> None:
    from executor.baselines import TorchDDP, TorchZeRO1
    from piper_sim.api import compile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                           timeout=datetime.timedelta(seconds=60))
    try:
        plan = compile({"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 4, "seq_len": 16, "microbatches": 2,
                        "dtype": "fp32", "directives": [{"op": "data_parallel", "degree": 2, "zero": 1}]})
        params = []
        for cls in (TorchDDP, TorchZeRO1):
            peer = cls(plan, rank)
            before = [p.detach().clone() for p in peer.model.parameters()]
            peer.step(0)
            after = [p.detach().clone() for p in peer.model.parameters()]
            assert any(not torch.equal(a, b) for a, b in zip(before, after)), cls.__name__
            params.append(after)
        for ddp, zero1 in zip(*params):
            torch.testing.assert_close(zero1, ddp, rtol=1e-5, atol=1e-7)
    finally:
        dist.destroy_process_group()


def test_zero_redundancy_optimizer_peer_steps_like_ddp():
    mp.start_processes(_worker, args=(free_port(),), nprocs=2, join=True, start_method="spawn")
