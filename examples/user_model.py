"""Bring your own nn.Module: annotate a plain PyTorch model, compile, simulate and run it.

    PYTHONPATH=. python examples/user_model.py           # compile + simulate, writes user_model_plan.json
    piper-sim run user_model_plan.json --steps 5 --check  # run it on 2 CPU ranks, compare to one process

The strategy names the factory below as ``py:examples/user_model.py:tiny_convnet`` (a path
relative to where ``piper-sim`` runs; ``py:package.module:function`` works too) with its
kwargs; every rank of ``piper-sim run`` calls it again to rebuild the model. Units are the
pipeline, recompute and ZeRO-3 boundaries: the model's forward must be exactly its units in
order, each taking the previous one's output (checked on ``meta`` by `annotate`). Avoid
BatchNorm and dropout if you want ``--check`` to match: micro-batches change their results.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from piper_sim.annotate import UserModel, annotate


class Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.norm, self.conv = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv(F.silu(self.norm(x)))


class TinyConvNet(nn.Module):
    def __init__(self, channels: int, depth: int, classes: int):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[Block(channels) for _ in range(depth)])
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def batch(micro_batch: int, seq_len: int, device, dtype, seed: int):
    """(images, labels): ``seq_len`` is the image side here. Deterministic in ``seed``."""
    if torch.device(device).type == "meta":
        return (torch.empty(micro_batch, 3, seq_len, seq_len, device="meta", dtype=dtype),
                torch.empty(micro_batch, dtype=torch.long, device="meta"))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(micro_batch, 3, seq_len, seq_len, generator=g)
    return x.to(device, dtype), (x.mean((1, 2, 3)) > 0).long().to(device)


def tiny_convnet(channels: int = 16, depth: int = 6, classes: int = 2) -> UserModel:
    return annotate(TinyConvNet(channels, depth, classes), units=["stem", "blocks.*", "head"],
                    loss=lambda out, y: F.cross_entropy(out.float(), y), example_batch=batch,
                    name=f"tiny-convnet-{depth}x{channels}")


STRATEGY = {
    "model": {"source": "py:examples/user_model.py:tiny_convnet", "kwargs": {"channels": 16, "depth": 6}},
    "cluster": "cpu:2", "global_batch": 8, "seq_len": 16, "microbatches": 4, "dtype": "fp32",
    "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"},
                   {"op": "segment", "layers_per_stage": "balanced"}],
}

if __name__ == "__main__":
    import piper_sim

    plan = piper_sim.compile(STRATEGY)
    print("stages:", plan.meta["stage_units"])
    print("boundary tensors:", [b["shape"] for b in plan.meta["user_model"]["boundaries"][:-1]])
    import os

    calibration = "traces/calibration/cpu-2core.json"  # this repository's CPU calibration, when run from its root
    costmodel = calibration if os.path.exists(calibration) else "analytic"
    print(f"simulated step: {piper_sim.simulate(plan, costmodel=costmodel).step_time_s * 1e3:.2f} ms ({costmodel})")
    plan.save("user_model_plan.json")
    print("wrote user_model_plan.json; run it with: piper-sim run user_model_plan.json --steps 5 --check")
