"""Tensor (+ sequence) parallelism of your own nn.Module from sharding annotations.

    PYTHONPATH=. python examples/user_transformer_tp.py      # compile + simulate TP2 + SP x PP2
    piper-sim run user_transformer_tp_plan.json --steps 5 --check  # on 4 CPU ranks, compared to one process

A small Llama-shaped language model annotated as a torchtitan ``parallelize`` plan shards one
(`TP_PLAN`: q/k/v and w1/w3 column-parallel, wo/w2 row-parallel, the embedding
vocabulary-parallel; see `piper_sim.user_tp`). The forward reshapes heads with ``-1`` and reads
the sequence length from ``q``, so a shard (and a sequence shard) runs the code as written.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from piper_sim.annotate import UserModel, annotate, reset_parameters


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        B, s = q.shape[:2]  # under sequence parallelism x is this rank's shard, q the gathered sequence
        q, k, v = (t.view(B, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        rep = q.shape[1] // k.shape[1]
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                           is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(dim), Attention(dim, heads, kv_heads)
        self.ffn_norm, self.ffn = nn.LayerNorm(dim), FeedForward(dim, hidden)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        return self.out(self.norm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, depth: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(depth))
        self.head = Head(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


TP_PLAN = {"embed": "rowwise", "blocks.*.attn.wq": "colwise", "blocks.*.attn.wk": "colwise",
           "blocks.*.attn.wv": "colwise", "blocks.*.attn.wo": "rowwise", "blocks.*.ffn.w1": "colwise",
           "blocks.*.ffn.w3": "colwise", "blocks.*.ffn.w2": "rowwise"}


def tokens(vocab: int, micro_batch: int, seq_len: int, device, dtype, seed: int):
    """(token ids, the next ids): random, deterministic in ``seed`` (empty on meta)."""
    if torch.device(device).type == "meta":
        t = torch.empty(micro_batch, seq_len, dtype=torch.long, device="meta")
        return t, t
    t = torch.randint(vocab, (micro_batch, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1].to(device), t[:, 1:].to(device)


def tiny_lm(vocab: int = 64, dim: int = 32, depth: int = 2, heads: int = 4, kv_heads: int = 2,
            hidden: int = 64) -> UserModel:
    """The annotated model: units embed, blocks.*, head; TP over `TP_PLAN`, sequence parallel."""
    return annotate(TinyLM(vocab, dim, depth, heads, kv_heads, hidden), ["embed", "blocks.*", "head"],
                    lambda out, t: F.cross_entropy(out.float().flatten(0, 1), t.flatten()),
                    functools.partial(tokens, vocab), name=f"tiny-lm-{depth}x{dim}", init_unit=reset_parameters,
                    tensor_parallel=TP_PLAN, sequence_parallel=True)


STRATEGY = {
    "model": {"source": "py:examples/user_transformer_tp.py:tiny_lm", "kwargs": {"depth": 2}},
    "cluster": "cpu:4", "global_batch": 8, "seq_len": 16, "microbatches": 4, "dtype": "fp32",
    "directives": [{"op": "tensor_parallel", "degree": 2, "sequence_parallel": True},
                   {"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"}],
}

if __name__ == "__main__":
    import piper_sim

    plan = piper_sim.compile(STRATEGY)
    print("stages:", plan.meta["stage_units"])
    print(f"simulated step: {piper_sim.simulate(plan, costmodel='analytic').step_time_s * 1e3:.2f} ms (analytic)")
    plan.save("user_transformer_tp_plan.json")
    print("wrote user_transformer_tp_plan.json; run it with: piper-sim run user_transformer_tp_plan.json --steps 5 "
          "--check")
