"""What torchtitan's op-SAC block and compiled loss keep for the backward, measured on CPU.

    PYTHONPATH=<dir with torchao> python benchmarks/probe_saved_tensors.py   # torchao optional

The evidence behind `piper_sim.recompute.LayerTable.op_sac_saved` (float8 linears kept like bf16
ones; under torch.compile the w2 output not saved) and `piper_sim.memory.compiled_loss`:

1. A Llama 3 TransformerBlock (torchtitan models/llama3/model.py @e7c0cae: RMSNorm, wq/wk/wv,
   complex rope, GQA repeat, SDPA, wo, SwiGLU w1/w3/w2; small distinct dims so each tensor is
   named by its shape) under torchtitan's op-SAC policy (parallelize_llama.py:218-280 @e7c0cae,
   copied; the CPU flash SDPA op stands in for the CUDA one on the save list), in bf16 and with
   torchao ``convert_to_float8_training`` (tensorwise, ``torch._scaled_mm`` on CPU), eager
   (the SAC cache) and with the checkpointed block under ``torch.compile(fullgraph=True)`` (what
   the compiled graph saves, seen by a saved-tensors hook).
2. torchtitan's ``cross_entropy_loss`` (components/loss.py:18-30 @e7c0cae), eager and compiled.

Measured with torch 2.13.0+cpu and torchao 0.18.0 (pip, no deps):

    bf16  eager   SAC cache: wq.out, wv.out, w1.out, w2.out, sdpa out + lse
    bf16  compile saved: x, wq.out, wv.out, sdpa out + lse, w1.out           (no w2.out)
    fp8   eager   SAC cache: wq.out, wv.out, w1.out, w2.out, sdpa out + lse  (as bf16)
    fp8   compile saved: x, wq.out, wv.out, sdpa out + lse, w1.out           (as bf16)
    loss  eager   saved: fp32 log-probs (tokens x vocab)
    loss  compile saved: the bf16 logits (the loss's input) + 2 fp32 per token

The policy sees ``aten.mm`` for a float8 linear: a TorchDispatchMode runs before a tensor
subclass's ``__torch_dispatch__``, and torchao's Float8 tensor implements ``aten.mm``
(torchao/float8/float8_ops.py:351 @0afa4c1).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_SAVE = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_efficient_attention.default,
         torch.ops.aten._scaled_dot_product_flash_attention.default,
         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,  # CPU stand-in
         torch.ops._c10d_functional.reduce_scatter_tensor.default, torch.ops.aten.max.default}
B, S, DIM, H, KV, HD, FFN = 2, 48, 256, 4, 2, 80, 768
NAMES = {(B * S, H * HD): "wq.out", (B, S, DIM): "x", (B * S, KV * HD): "wk/wv.out", (B * S, FFN): "w1/w3.out",
         (B * S, DIM): "wo/w2.out", (B, H, S, HD): "sdpa.out", (B, H, S): "lse"}


def _policy(meta):
    def policy(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[key] += 1
        save = func in _SAVE and not (func == torch.ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk = nn.Linear(DIM, H * HD, False), nn.Linear(DIM, KV * HD, False)
        self.wv = nn.Linear(DIM, KV * HD, False)
        self.wo, self.w1, self.w2, self.w3 = nn.Linear(H * HD, DIM, False), nn.Linear(DIM, FFN, False), \
            nn.Linear(FFN, DIM, False), nn.Linear(DIM, FFN, False)
        self.n1, self.n2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)

    def attention(self, x, fc):
        q, k, v = self.wq(x).view(B, S, -1, HD), self.wk(x).view(B, S, -1, HD), self.wv(x).view(B, S, -1, HD)
        q_ = torch.view_as_complex(q.float().reshape(B, S, -1, HD // 2, 2))
        k_ = torch.view_as_complex(k.float().reshape(B, S, -1, HD // 2, 2))
        f = fc.view(1, S, 1, -1)
        q, k = torch.view_as_real(q_ * f).flatten(3).type_as(q), torch.view_as_real(k_ * f).flatten(3).type_as(k)
        k = k.unsqueeze(3).expand(B, S, KV, H // KV, HD).reshape(B, S, H, HD)
        v = v.unsqueeze(3).expand(B, S, KV, H // KV, HD).reshape(B, S, H, HD)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).contiguous().view(B, S, -1))

    def forward(self, x, fc):
        h = x + self.attention(self.n1(x), fc)
        return h + self.w2(F.silu(self.w1(self.n2(h))) * self.w3(self.n2(h)))


def _name(t):
    return f"{NAMES.get(tuple(t.shape), tuple(t.shape))}:{str(t.dtype).removeprefix('torch.')}"


def block(fp8: bool, compiled: bool) -> str:
    torch.manual_seed(0)
    m = Block().to(torch.bfloat16)
    if fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(m, config=Float8LinearConfig())
    storages = []

    def context_fn():
        fwd, rec = create_selective_checkpoint_contexts(_policy(defaultdict(int)))
        storages.append(fwd.storage)
        return fwd, rec

    fc = torch.polar(torch.ones(S, HD // 2), torch.randn(S, HD // 2))
    def f(x):
        return checkpoint(m, x, fc, use_reentrant=False, context_fn=context_fn, preserve_rng_state=False)

    run = torch.compile(f, fullgraph=True) if compiled else f
    x = torch.randn(B, S, DIM, dtype=torch.bfloat16, requires_grad=True)
    params = {p.data_ptr() for p in m.parameters()}
    saved = []

    def pack(t):
        if t.data_ptr() not in params and t.numel() > 64 and not t.is_complex():  # not the rope table
            saved.append(_name(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = run(x)
    cached = [_name(getattr(o, "val", o)) for st in storages for outs in st.values() for v in outs.values()
              for o in torch.utils._pytree.tree_leaves(getattr(v, "val", v))
              if isinstance(getattr(o, "val", o), torch.Tensor) and getattr(o, "val", o).numel() > 1] \
        if not compiled else []  # (numel 1: the amax scalars aten.max keeps for float8)
    y.float().sum().backward()
    return f"SAC cache: {cached}" if not compiled else f"saved: {saved}"


def loss(compiled: bool) -> str:
    def cross_entropy_loss(pred, labels):
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
    fn = torch.compile(cross_entropy_loss) if compiled else cross_entropy_loss
    logits = torch.randn(B, S, 1000, dtype=torch.bfloat16, requires_grad=True) * 1.0
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), str(t.dtype))) or t,
                                                  lambda t: t):
        out = fn(logits, torch.randint(0, 1000, (B, S)))
    out.backward()
    return f"saved: {[s for s in saved if s[0] != ()]}"


if __name__ == "__main__":
    try:
        import torchao  # noqa: F401
        kinds = (False, True)
    except ImportError:
        kinds = (False,)
        print("torchao not importable: bf16 only")
    for fp8 in kinds:
        for compiled in (False, True):
            print(f"{'fp8 ' if fp8 else 'bf16'} {'compile' if compiled else 'eager  '} {block(fp8, compiled)}")
    for compiled in (False, True):
        print(f"loss {'compile' if compiled else 'eager  '} {loss(compiled)}")
