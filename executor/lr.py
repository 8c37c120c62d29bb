"""The optimizer's fixed hyperparameters and the learning-rate schedule (no torch: the
launcher checks a checkpoint's schedule before any worker starts)."""

from __future__ import annotations

import math
from dataclasses import dataclass

ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate by step (0-based): a linear warm-up over ``warmup_steps`` to ``lr``,
    then ``constant``, or a ``linear`` / ``cosine`` decay to ``min_ratio`` x ``lr`` at step
    ``decay_steps`` (held there after), the shape torchtitan and nanoGPT use."""

    lr: float = ADAMW["lr"]
    warmup_steps: int = 0
    decay: str = "constant"  # "constant" | "linear" | "cosine"
    decay_steps: int = 0
    min_ratio: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay == "constant" or self.decay_steps <= self.warmup_steps:
            return self.lr
        t = min(1.0, (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        left = 1.0 - t if self.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * t))
        return self.lr * (self.min_ratio + (1.0 - self.min_ratio) * left)
