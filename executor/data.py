"""Synthetic, seeded training data, split exactly as a plan says.

A step's global batch is ``global_batch`` sequences of ``seq_len + 1`` tokens drawn from a
fixed random bigram chain (so the loss can actually go down); inputs are the first
``seq_len`` tokens, targets the next tokens. Data-parallel replica ``d`` takes rows
``[d * B/dp, (d+1) * B/dp)`` of the global batch and micro-batch ``m`` the ``m``-th
contiguous slice of that, which is also what ``torch.distributed.pipelining`` does with a
replica's batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FOLLOW_PROB = 0.75  # chance that the next token follows the chain (else uniform)


@dataclass
class SyntheticData:
    vocab: int
    seq_len: int
    global_batch: int
    seed: int = 0
    _chain: torch.Tensor = field(init=False, repr=False)
    _cached: tuple = field(init=False, repr=False, default=(-1, None))

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + 17)
        self._chain = torch.randperm(self.vocab, generator=g)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets) of the whole global batch of ``step``, both ``[B, seq_len]``."""
        if self._cached[0] != step:
            self._cached = (step, self._make(step))
        return self._cached[1]

    def _make(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * (step + 1))
        B, s = self.global_batch, self.seq_len
        seq = torch.empty(B, s + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(self.vocab, (B,), generator=g)
        noise = torch.randint(self.vocab, (B, s), generator=g)
        follow = torch.rand(B, s, generator=g) < FOLLOW_PROB
        for t in range(s):
            seq[:, t + 1] = torch.where(follow[:, t], self._chain[seq[:, t]], noise[:, t])
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def microbatch(self, step: int, dp_rank: int, dp: int, microbatches: int, mb: int,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of replica ``dp_rank``'s micro-batch ``mb``."""
        tokens, targets = self.batch(step)
        per_replica = self.global_batch // dp
        mbs = per_replica // microbatches
        lo = dp_rank * per_replica + mb * mbs
        return tokens[lo:lo + mbs].to(device), targets[lo:lo + mbs].to(device)
