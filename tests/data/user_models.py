"""Example user models for tests/test_user_model.py: plain nn.Modules, annotated with
`piper_sim.annotate.annotate` (units, loss, a batch maker). Not transformers."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from piper_sim.annotate import UserModel, annotate, reset_parameters


def _randn(shape, device, dtype, g):
    if torch.device(device).type == "meta":
        return torch.empty(shape, device="meta", dtype=dtype)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def _classes(x: torch.Tensor, n_classes: int) -> torch.Tensor:
    """Learnable targets: the argmax of a fixed projection of the input's first features."""
    if x.device.type == "meta":
        return torch.empty(x.shape[:-1], dtype=torch.long, device="meta")
    proj = torch.randn(x.shape[-1], n_classes, generator=torch.Generator().manual_seed(123))
    return (x.float().cpu() @ proj).argmax(-1).to(x.device)


# --------------------------------------------------------------------------- residual MLP


class ResBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, d_in: int = 8, width: int = 16, depth: int = 4, n_classes: int = 5):
        super().__init__()
        self.stem = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(ResBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, n_classes)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def residual_mlp(d_in: int = 8, width: int = 16, depth: int = 4, n_classes: int = 5) -> UserModel:
    """Tokens of ``d_in`` features -> class per token; units stem, blocks.*, head."""
    def batch(micro_batch, seq_len, device, dtype, seed):
        x = _randn((micro_batch, seq_len, d_in), device, dtype, torch.Generator().manual_seed(seed))
        return x, _classes(x, n_classes)

    def loss(out, targets):
        return F.cross_entropy(out.float().flatten(0, 1), targets.flatten())

    # each rank allocates and initialises only its own units (torch.nn layers' reset_parameters)
    return annotate(ResidualMLP(d_in, width, depth, n_classes), ["stem", "blocks.*", "head"], loss, batch,
                    name=f"residual-mlp-{depth}x{width}", init_unit=reset_parameters)


# --------------------------------------------------------------------------- small CNN


class ConvBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.norm = nn.GroupNorm(4, c)
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv(F.relu(self.norm(x)))


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 8, depth: int = 3, n_classes: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[ConvBlock(channels) for _ in range(depth)])
        self.down = nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * channels, n_classes))
        nn.init.zeros_(self.head[2].bias)  # the model's own init (kept: no init_unit, built by the factory)
        nn.init.normal_(self.head[2].weight, std=0.02)

    def forward(self, x):
        return self.head(self.down(self.blocks(self.stem(x))))


def small_cnn(channels: int = 8, depth: int = 3, n_classes: int = 4) -> UserModel:
    """Images ``3 x seq_len x seq_len`` -> a class; units stem, blocks.*, down, head."""
    def batch(micro_batch, seq_len, device, dtype, seed):
        x = _randn((micro_batch, 3, seq_len, seq_len), device, dtype, torch.Generator().manual_seed(seed))
        return x, _classes(x.mean((2, 3)), n_classes)

    return annotate(SmallCNN(channels, depth, n_classes), ["stem", "blocks.*", "down", "head"],
                    lambda out, t: F.cross_entropy(out.float(), t), batch, name=f"small-cnn-{depth}x{channels}")


# --------------------------------------------------------------------------- custom parameters


class Scale(nn.Module):
    """A raw parameter with no reset_parameters: weights come from the factory itself."""

    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x):
        return x * self.gain


class ScaledMLP(nn.Module):
    def __init__(self, width: int = 8, depth: int = 4):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), Scale(width)) for _ in range(depth)])

    def forward(self, x):
        return self.layers(x)


def scaled_mlp(width: int = 8, depth: int = 4) -> UserModel:
    def batch(micro_batch, seq_len, device, dtype, seed):
        x = _randn((micro_batch, seq_len, width), device, dtype, torch.Generator().manual_seed(seed))
        return x, x
    return annotate(ScaledMLP(width, depth), ["layers.*"], lambda out, t: F.mse_loss(out.float(), t.float()),
                    batch)


# --------------------------------------------------------------------------- bad annotations


class Flattening(nn.Module):
    """forward does work between units (a flatten): not a chain of units."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(16, 2)

    def forward(self, x):
        return self.b(self.a(x).flatten(1))


def flattening() -> UserModel:
    def batch(micro_batch, seq_len, device, dtype, seed):
        x = _randn((micro_batch, 4, 4), device, dtype, torch.Generator().manual_seed(seed))
        return x, torch.zeros(micro_batch, dtype=torch.long, device=device)
    return annotate(Flattening(), ["a", "b"], F.cross_entropy, batch)


# --------------------------------------------------------------------------- integer inputs


class BagOfTokens(nn.Module):
    """Token ids in (no gradient reaches the inputs), a next-token guess out."""

    def __init__(self, vocab: int, width: int, depth: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.Tanh())
                                 for _ in range(depth))
        self.out = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for m in self.mix:
            x = m(x)
        return self.out(x)


def token_batch(vocab: int, micro_batch, seq_len, device, dtype, seed):
    """A micro-batch of random token ids and the same shifted by one (empty on meta)."""
    if torch.device(device).type == "meta":
        t = torch.empty(micro_batch, seq_len, dtype=torch.long, device="meta")
        return t, t
    t = torch.randint(vocab, (micro_batch, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1].to(device), t[:, 1:].to(device)


def bag_of_tokens(vocab: int = 32, width: int = 16, depth: int = 3) -> UserModel:
    return annotate(BagOfTokens(vocab, width, depth), ["embed", "mix.*", "out"],
                    lambda out, t: F.cross_entropy(out.float().flatten(0, 1), t.flatten()),
                    functools.partial(token_batch, vocab))


# --------------------------------------------------------------------------- a small transformer, tensor parallel


class Attention(nn.Module):
    """Causal grouped-query attention; heads reshaped with -1 and the sequence length read from
    q, so a column-parallel shard (and sequence parallelism) runs the code as is."""

    def __init__(self, dim: int, heads: int, kv_heads: int, qk_norm: bool):
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else None

    def forward(self, x):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        B, s = q.shape[:2]  # under sequence parallelism x is this rank's shard, q the gathered sequence
        q, k, v = (t.view(B, s, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:
            q = self.q_norm(q)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)  # biases: a column-parallel one split, a row-parallel one added once
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, qk_norm: bool):
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, kv_heads, qk_norm)
        self.ffn_norm = nn.LayerNorm(dim)
        self.ffn = FeedForward(dim, hidden)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class LMHead(nn.Module):
    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        return self.out(self.norm(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int, dim: int, depth: int, heads: int, kv_heads: int, hidden: int, qk_norm: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, kv_heads, hidden, qk_norm) for _ in range(depth))
        self.head = LMHead(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


# torchtitan's Llama plan in piper-sim's words: q/k/v and w1/w3 column-parallel, wo/w2 row-parallel,
# the embedding vocabulary-parallel (the head and norms replicated)
TP_PLAN = {"embed": "rowwise", "blocks.*.attn.wq": "colwise", "blocks.*.attn.wk": "colwise",
           "blocks.*.attn.wv": "colwise", "blocks.*.attn.wo": "rowwise", "blocks.*.ffn.w1": "colwise",
           "blocks.*.ffn.w3": "colwise", "blocks.*.ffn.w2": "rowwise"}


def tiny_transformer(vocab: int = 64, dim: int = 32, depth: int = 2, heads: int = 4, kv_heads: int = 2,
                     hidden: int = 64, qk_norm: bool = True, sequence_parallel: bool = True) -> UserModel:
    """A Llama-shaped language model with torchtitan-style sharding annotations (`TP_PLAN`)."""
    return annotate(TinyTransformer(vocab, dim, depth, heads, kv_heads, hidden, qk_norm),
                    ["embed", "blocks.*", "head"],
                    lambda out, t: F.cross_entropy(out.float().flatten(0, 1), t.flatten()),
                    functools.partial(token_batch, vocab), name=f"tiny-transformer-{depth}x{dim}", init_unit=reset_parameters,
                    tensor_parallel=TP_PLAN, sequence_parallel=sequence_parallel)
