"""Model zoo, pipeline units ("annotations") and small readable torch modules. The torch-free
half (`ModelConfig`, counts, the zoo, units) lives in `piper_sim.configs` and is re-exported here;
model files and Hugging Face configs are read by `piper_sim.sources`.

A model is an ordered list of *units*, the granularity at which pipeline stages are cut:
``embed``, ``layers.0`` ... ``layers.{L-1}``, ``head``. A MoE layer is one unit made of two
*segments* for the compiler: ``layers.i.pre`` (attention, norms, router, shared experts) and
``layers.i.experts`` (routed experts; expert parallelism puts an all-to-all dispatch before
and a combine after it). See :func:`unit_names` and :func:`unit_segments`.

Weights are initialised per unit from ``(seed, unit name)``, so any split of the model into
stages (:func:`build_units`) yields exactly the weights of :func:`build_model`.

Full-size models are only ever built on the ``meta`` device (for counting and profiling);
building more than ~2B parameters on a real device is refused.

The zoo (:data:`ZOO`): ``gpt-tiny`` and ``moe-tiny`` (CPU tests in milliseconds), Llama 3
8B/70B/405B, the Piper paper's MoE evaluation configs ``qwen3-moe-1b``/``qwen3-moe-9b``, and
``deepseek-v3`` (MLA, 1 shared + 256 routed experts, top-8; ~671B total and ~37B active
parameters; the multi-token-prediction (MTP) module is not included), and ``gpt3-175b`` (the
GPT-3 architecture of Korthikanti et al. 2022: LayerNorm, GELU MLP, dropout). ``max_seq`` is
informational: rotary tables are computed for whatever sequence length is run.

Tensor parallelism (profiling only, on ``meta``): :func:`tp_shard` gives the config of one of
``tp`` ranks' share of the model, Megatron-style: column-parallel q/k/v and first MLP linears,
row-parallel output linears (``n_heads / tp`` heads, ``n_kv_heads / tp`` KV heads, ``ffn / tp``,
``expert_ffn / tp``), vocabulary-parallel embedding and head (``ceil(vocab / tp)`` rows). With
``sequence_parallel`` a layer takes and returns its ``s / tp`` shard of the sequence: norms,
dropout and residual adds run on the shard, and the shard is gathered before the linears and
scattered after them (:class:`_SPGather`, :class:`_SPScatter`: no kernels; the IR prices the
all-gathers and reduce-scatters). Built on a real device only with ``tp == 1``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from costmodel.stack import ProfileKernels
from piper_sim.kernel_recorder import note_kernel

from piper_sim.configs import (  # noqa: F401  (re-exported: the torch-free half of this module)
    BUILTIN_ZOO, FIELDS, TP_FIELDS, ZOO, ModelConfig, _layer_index, check_config, config_from_dict, config_from_meta,
    config_to_dict, get_config, layer_of_kind, logits_bytes, mtp_index, mtp_units, plan_model_meta, tp_divisibility_error,
    tp_shard, unit_names, unit_param_count, unit_segments,
)

MAX_MATERIALISED_PARAMS = 2_000_000_000  # refuse bigger builds on a real device

# The kernels a meta profile runs (`costmodel.stack.ProfileKernels`: unfused vs flash attention,
# eager vs fused norms), set for the duration of one profile by :func:`profiling_kernels`.
_KERNELS = ProfileKernels()


@contextlib.contextmanager
def profiling_kernels(kernels: ProfileKernels):
    """Profile on meta with these kernels (the training stack's choices)."""
    global _KERNELS
    saved, _KERNELS = _KERNELS, kernels
    try:
        yield
    finally:
        _KERNELS = saved

# --------------------------------------------------------------------------- modules


# Modules are always constructed on ``meta`` in this dtype, without torch's default init
# (build_model/build_units allocate real tensors and run init_unit), which keeps a
# 671B-parameter build to a few seconds. Construct modules through those two functions.
_BUILD_DTYPE = torch.float32


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device="meta", dtype=_BUILD_DTYPE))


class Linear(nn.Module):
    """Linear layer (``weight [out, in]``, like ``nn.Linear``), bias-free unless ``bias``."""

    def __init__(self, d_in: int, d_out: int, bias: bool = False):
        super().__init__()
        self.weight = _empty(d_out, d_in)
        self.bias = _empty(d_out) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token embedding; under tensor parallelism the rank's vocabulary rows (the all-reduce,
    or with sequence parallelism the reduce-scatter to the rank's ``s / sp`` shard, is the IR's)."""

    def __init__(self, vocab: int, dim: int, sp: int = 1):
        super().__init__()
        self.weight = _empty(vocab, dim)
        self.sp = sp

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = F.embedding(tokens, self.weight)
        return _SPScatter.apply(out, self.sp) if self.sp > 1 else out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = _empty(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "meta" and _KERNELS.norms == "fused":
            return _MetaFusedRMSNorm.apply(x, self.weight)
        # eager: torch's own decomposition (fp32 upcast, pow, mean, rsqrt, muls), as torchtitan
        # without torch.compile runs it; on meta the profile records each of its kernels
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class _MetaFusedRMSNorm(torch.autograd.Function):
    """Meta stand-in for the fused GPU rms_norm kernel: saves what it saves (input, weight
    and an fp32 rstd) instead of the fp32 intermediates of torch's decomposition."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, x.new_empty(*x.shape[:-1], 1, dtype=torch.float32))
        # one kernel: read x, write y (weight and rstd are a row's worth)
        note_kernel("rms_norm", 2 * x.numel() * x.element_size(), x.dtype)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, _ = ctx.saved_tensors
        # read grad and x, write grad_x; the weight gradient is a row-wise reduction of the same reads
        note_kernel("rms_norm_backward", 3 * x.numel() * x.element_size(), x.dtype)
        return torch.empty_like(x), torch.empty_like(weight)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (GPT-3); ``F.layer_norm`` saves its input, mean and rstd."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = _empty(dim)
        self.bias = _empty(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def make_norm(cfg: "ModelConfig", dim: int) -> nn.Module:
    return LayerNorm(dim, cfg.norm_eps) if cfg.norm == "layer" else RMSNorm(dim, cfg.norm_eps)


@dataclass(frozen=True)
class DropoutStream:
    """Where real-device dropout masks come from: one stream per (step, sample, layer, site),
    so any split of the batch, the layers or the sequence draws the single-process masks.

    ``rows``: the global sample index of each row of the batch running; ``positions``: the
    true sequence positions of the tokens a dropout site sees (None: all ``seq_len``; a
    context-parallel rank's load-balanced chunks, a sequence-parallel rank's shard of them).
    Every rank draws a site's full ``[seq_len, hidden]`` mask of a sample and keeps its
    positions, so tensor, sequence and context parallel ranks hold exactly the reference's
    mask elements and ``--check`` holds bit-for-bit up to reduction order. (Megatron instead
    forks a per-TP-rank seed for the tensor-parallel region, ``tensor_parallel.random``'s
    ``CudaRNGStatesTracker``, so its masks differ from a single GPU's.)"""

    seed: int
    step: int
    rows: range
    seq_len: int
    positions: torch.Tensor | None = None


_DROPOUT_STREAM: DropoutStream | None = None


def set_dropout_stream(stream: DropoutStream | None) -> None:
    """The stream the `Dropout` sites of the batch about to run (forward, or a backward that
    recomputes) draw from; None: torch's global generator (``F.dropout``)."""
    global _DROPOUT_STREAM
    _DROPOUT_STREAM = stream


def dropout_mask(stream: DropoutStream, layer: int, site: int, p: float, shape: torch.Size,
                 device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The scaled keep-mask (``0`` or ``1 / (1 - p)``) of ``[B, s_local, hidden]`` at ``site``
    of ``layer`` for the stream's rows and positions."""
    B, s, h = shape
    if len(stream.rows) != B or s != (stream.seq_len if stream.positions is None else len(stream.positions)):
        raise RuntimeError(f"dropout: a [{B}, {s}, {h}] input does not match the stream's {len(stream.rows)} rows "
                           f"and {s if stream.positions is None else len(stream.positions)} positions")
    gen = torch.Generator(device=device)
    masks = []
    for row in stream.rows:
        gen.manual_seed(unit_seed(stream.seed, f"dropout:{stream.step}:{row}:{layer}:{site}"))
        keep = torch.rand(stream.seq_len, h, generator=gen, device=device) >= p
        masks.append(keep if stream.positions is None else keep[stream.positions.to(device)])
    return torch.stack(masks).to(dtype) * (1.0 / (1.0 - p))


class Dropout(nn.Module):
    """Dropout at a ``layer``'s residual sites; on a real device with a `DropoutStream` set,
    its masks come from the stream (`dropout_mask`), else from torch's global generator."""

    def __init__(self, p: float, layer: int = 0):
        super().__init__()
        self.p, self.layer = p, layer

    def forward(self, x: torch.Tensor, site: int = 0) -> torch.Tensor:
        if x.device.type == "meta":
            return _MetaDropout.apply(x)
        stream = _DROPOUT_STREAM
        if stream is None or not self.training or self.p == 0:
            return F.dropout(x, self.p, self.training)
        return x * dropout_mask(stream, self.layer, site, self.p, x.shape, x.device, x.dtype)


class _MetaDropout(torch.autograd.Function):
    """Meta stand-in for the fused GPU dropout kernel: keeps a one-byte mask per element for
    backward (CUDA's ``native_dropout``; torch's meta decomposition would keep a full-width one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        mask = x.new_empty(x.shape, dtype=torch.bool)
        ctx.save_for_backward(mask)
        note_kernel("dropout", 2 * x.numel() * x.element_size() + mask.numel(), x.dtype)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        note_kernel("dropout_backward", 2 * grad.numel() * grad.element_size() + mask.numel(), grad.dtype)
        return torch.empty_like(grad)


# Sequence parallelism (meta only). A gathered tensor that autograd keeps for backward is
# counted as its shard by profiling (`sp_saved_bytes`): Megatron keeps the shard and gathers it
# again in backward (the IR's re-gather). Filled by _SPGather, cleared by profiling.measure.
SP_GATHERED: dict[int, int] = {}


def sp_saved_bytes(t: torch.Tensor) -> int | None:
    """Bytes autograd really keeps for ``t`` when it is a sequence-parallel gather's output."""
    return SP_GATHERED.get(t.untyped_storage()._cdata)


class _SPGather(torch.autograd.Function):
    """All-gather of the sequence shards ``[B, s/sp, h] -> [B, s, h]`` before a block's
    column-parallel linears (backward: reduce-scatter). Launches no kernel here: the IR puts
    the collective on the ``tp`` stream."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: int) -> torch.Tensor:
        if x.device.type != "meta":
            raise RuntimeError("sequence-parallel modules run on meta only (profiling)")
        ctx.shape = x.shape
        out = x.new_empty(x.shape[0], x.shape[1] * sp, *x.shape[2:])
        SP_GATHERED[out.untyped_storage()._cdata] = x.numel() * x.element_size()
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.new_empty(ctx.shape), None


class _SPScatter(torch.autograd.Function):
    """Reduce-scatter of a row-parallel output ``[B, s, h] -> [B, s/sp, h]`` (backward:
    all-gather); no kernel here, as `_SPGather`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: int) -> torch.Tensor:
        if x.device.type != "meta":
            raise RuntimeError("sequence-parallel modules run on meta only (profiling)")
        ctx.shape = x.shape
        return x.new_empty(x.shape[0], x.shape[1] // sp, *x.shape[2:])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.new_empty(ctx.shape), None


def rope_cos_sin(seq: int, dim: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables ``[seq, dim]`` (rotate-half layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: ``[B, heads, seq, dim]``."""
    if x.device.type == "meta" and _KERNELS.rope == "fused":
        return _MetaFusedRoPE.apply(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class _MetaFusedRoPE(torch.autograd.Function):
    """Meta stand-in for a fused rotary-embedding kernel (Megatron-Core ``apply_rope_fusion``, TE's
    fused RoPE): one kernel reading ``x`` and writing the rotated ``x``; it keeps only the tables
    (the rotation is linear), its backward rotates the gradient back in one kernel."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        note_kernel("rope", 2 * x.numel() * x.element_size(), x.dtype)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        note_kernel("rope_backward", 2 * grad.numel() * grad.element_size(), grad.dtype)
        return torch.empty_like(grad), None, None


class _MetaFusedSwiGLU(torch.autograd.Function):
    """Meta stand-in for a fused SwiGLU kernel (Megatron-Core ``bias_swiglu_impl``): reads the gate
    and up projections and writes ``silu(gate) * up``, saving only its two inputs; the backward
    reads them and the output gradient and writes both input gradients, in one kernel each."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        note_kernel("swiglu", 3 * gate.numel() * gate.element_size(), gate.dtype)
        return torch.empty_like(gate)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        note_kernel("swiglu_backward", 5 * gate.numel() * gate.element_size(), gate.dtype)
        return torch.empty_like(gate), torch.empty_like(up)


class _MetaFusedSoftmax(torch.autograd.Function):
    """Meta stand-in for Megatron's fused scale-mask-softmax kernel over the ``s x s`` scores:
    one kernel reading the scores and writing the probabilities, which it saves for backward."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.empty_like(scores)
        ctx.save_for_backward(probs)
        note_kernel("scaled_masked_softmax", 2 * scores.numel() * scores.element_size(), scores.dtype)
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (probs,) = ctx.saved_tensors
        note_kernel("scaled_masked_softmax_backward", 3 * probs.numel() * probs.element_size(), probs.dtype)
        return torch.empty_like(grad)


class _MetaUnpad(torch.autograd.Function):
    """Meta stand-in for flash-attn's ``unpad_input`` of one of q, k, v (a stack's ``unpad``):
    ``IndexFirstAxis`` gathers the tokens into a new tensor (reads and writes it); its backward
    fills a zero gradient and scatters into it (flash-attn v2.4.2 flash_attn/bert_padding.py
    L8-34). The token indices it keeps (8 bytes a token) are left out."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        note_kernel("unpad_gather", 2 * x.numel() * x.element_size(), x.dtype)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        nbytes = grad.numel() * grad.element_size()
        note_kernel("unpad_zeros", nbytes, grad.dtype)
        note_kernel("unpad_scatter", 2 * nbytes, grad.dtype)
        return torch.empty_like(grad)


class _MetaPad(torch.autograd.Function):
    """Meta stand-in for flash-attn's ``pad_input`` of the attention output: ``IndexPutFirstAxis``
    writes it into a zeroed tensor (a new tensor, which the output projection keeps beside the
    one the kernel keeps); its backward gathers the gradient (bert_padding.py L37-60)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        note_kernel("pad_zeros", nbytes, x.dtype)
        note_kernel("pad_index_put", 2 * nbytes, x.dtype)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        note_kernel("pad_gather", 2 * grad.numel() * grad.element_size(), grad.dtype)
        return torch.empty_like(grad)


def unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float = 0.0) -> torch.Tensor:
    """Megatron-LM's ``CoreAttention`` on meta: ``q k^T`` (bmm), fused scale-mask-softmax,
    dropout on the probabilities, ``probs v`` (bmm); the ``s x s`` scores, probabilities and
    dropout mask are materialised and kept for backward (Korthikanti et al. 2022, §4.1:
    ``5 a s^2 b`` bytes per layer with dropout). Causal masking computes the full square."""
    heads = q.shape[1]
    if k.shape[1] != heads:  # GQA: K/V repeated per query head, as Megatron does before the bmm
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    probs = _MetaFusedSoftmax.apply(torch.matmul(q, k.transpose(-2, -1)))
    if dropout:
        probs = _MetaDropout.apply(probs)
    return torch.matmul(probs, v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
              dropout: float = 0.0) -> torch.Tensor:
    """Causal attention, ``[B, H, s, d]`` (k/v may have fewer heads: GQA; v may be narrower);
    with ``window`` each query sees itself and the ``window - 1`` tokens before it.

    On ``meta`` this calls the flash-attention op directly, so profiling sees what GPU
    training runs (no ``s x s`` matrix saved, backward recomputes scores); a window shorter
    than the sequence is costed as windowed flash attention: each query against ``window``
    keys (``s x window``, not ``s x s``); under an ``unfused`` stack (`profiling_kernels`) it
    is :func:`unfused_attention` with attention ``dropout``. Elsewhere it is
    ``F.scaled_dot_product_attention`` (with a band mask for a window; no attention dropout).
    """
    s = q.shape[-2]
    windowed = 0 < window < s
    if q.device.type != "meta":
        gqa = k.shape[1] != q.shape[1]
        if not windowed:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        i = torch.arange(s, device=q.device)
        band = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=gqa)
    if _KERNELS.attention == "unfused":
        return unfused_attention(q, k, v, dropout)
    if _KERNELS.unpad:  # the varlen path: q, k, v gathered before the kernel, its output scattered after
        q, k, v = _MetaUnpad.apply(q), _MetaUnpad.apply(k), _MetaUnpad.apply(v)
    dv = v.shape[-1]
    if dv != q.shape[-1]:  # flash kernels need equal head dims: pad v (as MLA implementations do)
        v = F.pad(v, (0, q.shape[-1] - dv))
    if windowed:  # the work of windowed flash attention: every query against `window` keys
        k, v = k[..., :window, :], v[..., :window, :]
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, not windowed)[0]
    return _MetaPad.apply(out[..., :dv]) if _KERNELS.unpad else out[..., :dv]


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recompute: bool = False,
                   window: int = 0, dropout: float = 0.0) -> torch.Tensor:
    """The attention core (scores, softmax, weighted sum). ``recompute``: selective
    activation recomputation (Korthikanti et al. 2022) — keep only q, k, v and run the core
    again in backward (``torch.utils.checkpoint``). With flash attention the core keeps no
    ``s x s`` tensor anyway, so this frees only what the core alone saves (the softmax
    log-sum-exp) and costs one more core forward."""
    if recompute and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(attention, q, k, v, window, dropout, use_reentrant=False)
    return attention(q, k, v, window, dropout)


class DropOutput:
    """Megatron-Core's ``CheckpointWithoutOutput`` (tensor_parallel/random.py), written here:
    `run` computes ``fn(*args)`` keeping only its inputs (none of ``fn``'s internals); `discard`,
    called once the consumers that save the outputs for backward have run, releases the
    outputs' storage (their metadata stays) and registers the recompute on the gradient of the
    ``hooks`` tensors, which must arrive before those consumers' backward; the recompute runs
    ``fn`` again and copies its outputs into the released storage. ``fn`` must be deterministic
    (no dropout). Megatron's ``layernorm``, ``moe_act`` and ``mla_up_proj`` selective modules.
    Gradients are plain autograd's to fp32 round-off: the nested backward sums an input's
    gradient contributions in another order."""

    def __init__(self, fn: Callable):
        self.fn, self.ctx, self.outputs = fn, None, ()

    def _call(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.fn(*args)
        out = out if isinstance(out, tuple) else (out,)
        # each output owns its storage (a view would release, and be refilled from, its base's)
        return tuple(t if t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0
                     else t.clone(memory_format=torch.contiguous_format) for t in out)

    def run(self, *args: torch.Tensor):
        out = _DropOutputFn.apply(self, *args)
        self.outputs = out if isinstance(out, tuple) else (out,)
        return out

    def discard(self, *hooks: torch.Tensor | None) -> None:
        for t in self.outputs:
            t.untyped_storage().resize_(0)
        for h in hooks:
            if h is not None and h.requires_grad:
                h.register_hook(self._recompute)

    def _recompute(self, _grad: torch.Tensor) -> None:
        ctx, self.ctx = self.ctx, None
        if ctx is None:  # an earlier hook ran it
            return
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = self._call(*inputs)
        with torch.no_grad():
            for kept, new in zip(self.outputs, out):
                kept.untyped_storage().resize_(new.untyped_storage().nbytes())
                kept.untyped_storage().copy_(new.untyped_storage())
        ctx.inputs, ctx.outputs, self.outputs = inputs, out, ()


@dataclass
class WeightGradJob:
    """A `DropOutput`'s weight gradients left for a split backward's BW: its recomputed
    outputs, the gradients they got in BI, and the parameters inside its ``fn``."""

    outputs: list[torch.Tensor]
    grads: list[torch.Tensor]
    params: list[torch.Tensor]


# set by `deferring_weight_grads` while a split backward's BI runs (a module global, not a
# context variable: the autograd engine may run backward on its own threads)
_DEFERRED: list[WeightGradJob] | None = None


@contextlib.contextmanager
def deferring_weight_grads():
    """While a split backward's BI runs (`executor.stage.backward_input`): a `DropOutput`
    differentiates its recomputed graph to its inputs only and leaves its weights' gradients
    as `WeightGradJob` s in the yielded list, which BW computes."""
    global _DEFERRED
    prev, _DEFERRED = _DEFERRED, []
    try:
        yield _DEFERRED
    finally:
        _DEFERRED = prev


def _inner_params(outputs: list[torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The leaf tensors requiring grad behind ``outputs`` other than ``inputs`` (``fn``'s weights)."""
    skip = {id(t) for t in inputs}
    seen, out, stack = set(), [], [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)  # an AccumulateGrad node
        if var is not None:
            if id(var) not in skip:
                out.append(var)
            continue
        stack.extend(nxt for nxt, _ in node.next_functions)
    return out


class _DropOutputFn(torch.autograd.Function):
    """The autograd node of a `DropOutput`: its backward differentiates the recomputed graph
    (to its inputs only under `deferring_weight_grads`)."""

    @staticmethod
    def forward(ctx, holder: DropOutput, *args: torch.Tensor):
        with torch.no_grad():
            out = holder._call(*args)
        ctx.save_for_backward(*args)
        ctx.inputs = ctx.outputs = None
        holder.ctx = ctx
        return out if len(out) > 1 else out[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        if ctx.outputs is None:
            raise RuntimeError("DropOutput: the backward reached a dropped output before its recompute hook ran")
        pairs = [(o, g) for o, g in zip(ctx.outputs, grads) if g is not None and o.requires_grad]
        outs, gs = [o for o, _ in pairs], [g for _, g in pairs]
        if pairs and _DEFERRED is not None:  # a split backward's BI: input gradients now, weights in BW
            ins = [t for t in ctx.inputs if t.requires_grad]
            params = _inner_params(outs, ctx.inputs)
            got_in = torch.autograd.grad(outs, ins, gs, retain_graph=bool(params), allow_unused=True) if ins else ()
            if params:
                _DEFERRED.append(WeightGradJob(outs, gs, params))
            by_id = {id(t): g for t, g in zip(ins, got_in)}
            got = tuple(by_id.get(id(t)) for t in ctx.inputs)
        else:
            if pairs:
                torch.autograd.backward(outs, gs)
            got = tuple(t.grad if t.requires_grad else None for t in ctx.inputs)
        ctx.inputs = ctx.outputs = None
        return (None, *got)


def _checkpoint(fn: Callable, *args: torch.Tensor, kept: bool = False) -> torch.Tensor:
    """``fn(*args)`` as a checkpoint (keeps its inputs, its backward re-runs it whole, as
    Megatron's ``tensor_parallel.checkpoint`` of the ``mlp``, ``moe`` and ``shared_experts``
    modules does and the plan prices it: no early stop before the last matmul). ``kept``: a
    split backward's (`kept_checkpoint`)."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    if kept:
        return kept_checkpoint(fn, *args)
    with set_checkpoint_early_stop(False):
        return checkpoint(fn, *args, use_reentrant=False)


class _KeptRecompute:
    """The saved tensors of one checkpointed call under a split backward: the forward keeps
    only a count of them (and the call's inputs); the first unpack, in BI, re-runs the call once
    (under op-SAC its recompute context) and keeps every tensor it saves until the graph is
    freed, so BW finds them without a second re-run (the plan prices one: BI keeps the re-run
    graph for BW). ``torch.utils.checkpoint`` re-runs the call in every backward pass (graph
    task) instead, and refuses a second backward of an op-SAC region."""

    def __init__(self, fn: Callable, args: tuple, recompute_ctx):
        self.fn, self.args, self.recompute_ctx = fn, args, recompute_ctx
        self.count = 0
        self.saved: list[torch.Tensor] | None = None

    def pack(self, t: torch.Tensor) -> tuple["_KeptRecompute", int]:
        self.count += 1
        return self, self.count - 1

    @staticmethod
    def unpack(handle: tuple["_KeptRecompute", int]) -> torch.Tensor:
        frame, i = handle
        if frame.saved is None:
            frame._recompute()
        return frame.saved[i]

    def _recompute(self) -> None:
        saved: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> None:
            saved.append(t.detach() if t.requires_grad else t)

        args = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in self.args]
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(keep, lambda _: None), self.recompute_ctx:
            self.fn(*args)
        if len(saved) != self.count:
            raise RuntimeError(f"recompute saved {len(saved)} tensors, the forward {self.count}: not deterministic")
        self.saved, self.args = saved, ()


def kept_checkpoint(fn: Callable, *args, context_fn=None):
    """``fn(*args)`` as a checkpoint that a split backward re-runs once (`_KeptRecompute`)."""
    fwd_ctx, rec_ctx = context_fn() if context_fn is not None else (contextlib.nullcontext(), contextlib.nullcontext())
    frame = _KeptRecompute(fn, args, rec_ctx)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, _KeptRecompute.unpack), fwd_ctx:
        return fn(*args)


def attention_core_inputs(cfg: "ModelConfig", batch: int, seq: int, device="meta",
                          dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tensors of the shapes one layer's attention core receives (q, k, v ``[B, heads, s, d]``)."""
    B, s, H = batch, seq, cfg.local_heads
    if cfg.attention == "mla":
        qk = cfg.qk_nope_dim + cfg.qk_rope_dim
        shapes = [(B, H, s, qk), (B, H, s, qk), (B, H, s, cfg.v_head_dim)]
    else:
        hd = cfg.head_dim
        shapes = [(B, H, s, hd), (B, cfg.local_kv_heads, s, hd), (B, cfg.local_kv_heads, s, hd)]
    q, k, v = (torch.empty(*shape, device=device, dtype=dtype, requires_grad=True) for shape in shapes)
    return q, k, v


class GQAttention(nn.Module):
    """Grouped-query attention; optional q/k/v and output biases, RMSNorm of q and k over the
    head dim before the rotary embedding (``qk_norm``, Qwen3) and a sliding ``window``."""

    def __init__(self, cfg: ModelConfig, window: int = 0):
        super().__init__()
        self.cfg, self.window = cfg, window
        h, hd = cfg.hidden, cfg.head_dim
        # under tensor parallelism the rank's heads: q/k/v column-parallel, wo row-parallel
        self.wq = Linear(h, cfg.local_heads * hd, cfg.attn_bias)
        self.wk = Linear(h, cfg.local_kv_heads * hd, cfg.attn_bias)
        self.wv = Linear(h, cfg.local_kv_heads * hd, cfg.attn_bias)
        self.wo = Linear(cfg.local_heads * hd, h, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.norm_eps), RMSNorm(hd, cfg.norm_eps)
        self.recompute_core = False  # selective recomputation (see attention_core)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, (B, s, _) = self.cfg, x.shape
        q = self.wq(x).view(B, s, c.local_heads, c.head_dim)
        k = self.wk(x).view(B, s, c.local_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(B, s, c.local_kv_heads, c.head_dim).transpose(1, 2)
        if c.rope:
            cos, sin = rope_cos_sin(s, c.head_dim, c.rope_theta, x.device, x.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attention_core(q, k, v, self.recompute_core, self.window, c.dropout)
        return self.wo(o.transpose(1, 2).reshape(B, s, -1))


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3) with the real projection shapes.

    Simplified: no KV-cache absorption tricks, plain softmax scale ``1/sqrt(qk_head_dim)``.
    ``recompute_up_proj``: Megatron's ``mla_up_proj`` selective module (`up_proj` a `DropOutput`).
    """

    recompute_up_proj = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, H = cfg.hidden, cfg.local_heads  # down-projections replicated, up-projections per head
        qk = cfg.qk_nope_dim + cfg.qk_rope_dim
        if cfg.q_lora_rank:
            self.wq_a = Linear(h, cfg.q_lora_rank)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = Linear(cfg.q_lora_rank, H * qk)
        else:
            self.wq = Linear(h, H * qk)
        self.wkv_a = Linear(h, cfg.kv_lora_rank + cfg.qk_rope_dim)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_dim + cfg.v_head_dim))
        self.wo = Linear(H * cfg.v_head_dim, h, cfg.o_bias)
        self.recompute_core = False  # selective recomputation (see attention_core)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.heads(*self.latents(x), self.cfg.local_heads))

    def latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the per-head up-projections read: the normalised query latent (``x`` itself
        without ``q_lora_rank``), the normalised KV latent and the rotary key (shared by the
        heads). Under tensor parallelism every rank computes them whole (replicated)."""
        return self.normed_latents(self.wq_a(x) if self.cfg.q_lora_rank else x, self.wkv_a(x))

    def normed_latents(self, q: torch.Tensor, kv_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`latents` from the down-projections' outputs: ``q`` (``wq_a``'s; without
        ``q_lora_rank`` passed on as it is) and ``kv_a`` (``wkv_a``'s)."""
        c = self.cfg
        kv, k_pe = kv_a.split([c.kv_lora_rank, c.qk_rope_dim], dim=-1)
        return (self.q_norm(q) if c.q_lora_rank else q), self.kv_norm(kv), k_pe

    def heads(self, q_in: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor, H: int,
              q_projected: bool = False) -> torch.Tensor:
        """The ``H`` heads' up-projections and attention from `latents`: ``[B, s, H * v_head_dim]``
        (``q_projected``: ``q_in`` is already the heads' queries, ``wq`` applied)."""
        c, (B, s, _) = self.cfg, kv.shape
        up = functools.partial(self.up_proj, H=H, q_projected=q_projected)
        keep = DropOutput(up) if self.recompute_up_proj and torch.is_grad_enabled() else None
        q, k, v = keep.run(q_in, kv, k_pe) if keep is not None else up(q_in, kv, k_pe)
        o = attention_core(q, k, v, self.recompute_core, dropout=c.dropout)
        if keep is not None:  # q, k, v dropped; re-made when the core's output gradient arrives
            keep.discard(o)
        return o.transpose(1, 2).reshape(B, s, -1)

    def up_proj(self, q_in: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor, H: int, q_projected: bool = False,
                rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The up-projections and rotary embedding (Megatron-Core ``qkv_up_proj_and_rope_apply``):
        the attention core's ``q, k, v [B, H, s, d]`` from the normalised latents and rotary key
        (``rope_tables``: the rotary ``cos, sin [s, qk_rope_dim]`` of the tokens' true positions,
        default those of ``0..s-1``; context parallelism)."""
        c, (B, s, _) = self.cfg, kv.shape
        nope, rope = c.qk_nope_dim, c.qk_rope_dim
        q = q_in if q_projected else self.wq_b(q_in) if c.q_lora_rank else self.wq(q_in)
        q_nope, q_pe = q.view(B, s, H, nope + rope).transpose(1, 2).split([nope, rope], dim=-1)
        kv = self.wkv_b(kv).view(B, s, H, nope + c.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([nope, c.v_head_dim], dim=-1)
        cos, sin = rope_tables or rope_cos_sin(s, rope, c.rope_theta, kv.device, kv.dtype)
        q_pe = apply_rope(q_pe, cos, sin)
        k_pe = apply_rope(k_pe.view(B, 1, s, rope), cos, sin).expand(B, H, s, rope)
        return torch.cat([q_nope, q_pe], -1), torch.cat([k_nope, k_pe], -1), v


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _dropped_act(act: Callable, out: nn.Module, *args: torch.Tensor) -> torch.Tensor:
    """``out(act(*args))`` with the activation's output and internals dropped until the
    gradient of ``out``'s output arrives (Megatron's ``moe_act``: `DropOutput`)."""
    keep = DropOutput(act)
    y = out(keep.run(*args))
    keep.discard(y)
    return y


class SwiGLU(nn.Module):
    recompute_act = False  # Megatron's moe_act selective module (routed experts; `_dropped_act`)

    def __init__(self, hidden: int, ffn: int, bias: bool = False):
        super().__init__()
        self.w1 = Linear(hidden, ffn, bias)  # gate
        self.w3 = Linear(hidden, ffn, bias)  # up
        self.w2 = Linear(ffn, hidden, bias)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "meta" and _KERNELS.swiglu == "fused":
            return self.w2(_MetaFusedSwiGLU.apply(self.w1(x), self.w3(x)))
        if self.recompute_act and torch.is_grad_enabled():
            return _dropped_act(_swiglu, self.w2, self.w1(x), self.w3(x))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GeluMLP(nn.Module):
    """``h -> ffn -> h`` with GELU (GPT-3)."""

    recompute_act = False  # as `SwiGLU`'s

    def __init__(self, hidden: int, ffn: int, bias: bool = False):
        super().__init__()
        self.fc1 = Linear(hidden, ffn, bias)
        self.fc2 = Linear(ffn, hidden, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_act and torch.is_grad_enabled():
            return _dropped_act(F.gelu, self.fc2, self.fc1(x))
        return self.fc2(F.gelu(self.fc1(x)))


def make_mlp(cfg: "ModelConfig", ffn: int) -> nn.Module:
    return (GeluMLP if cfg.mlp == "gelu" else SwiGLU)(cfg.hidden, ffn, cfg.mlp_bias)


class MoE(nn.Module):
    """Router + routed experts + optional shared experts.

    The pieces are exposed so an executor can put an all-to-all around the expert block:
    ``route(x)`` -> ``(topk_weights, topk_ids)``; ``permute`` sorts token copies by expert
    (giving per-expert counts, the all-to-all split sizes); ``experts[e](tokens)``;
    ``unpermute`` weights and sums the expert outputs back per token. ``forward`` does
    all of it in-process and is the reference.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk = cfg.n_experts, cfg.top_k, cfg.norm_topk
        self.router = Linear(cfg.hidden, cfg.n_experts, cfg.router_bias)
        self.experts = nn.ModuleList(make_mlp(cfg, cfg.local_expert_ffn) for _ in range(cfg.n_experts))
        self.shared = make_mlp(cfg, cfg.n_shared * cfg.local_expert_ffn) if cfg.n_shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, h]`` -> top-k weights ``[T, k]`` (x's dtype; renormalised to sum 1 if
        ``norm_topk``) and expert ids ``[T, k]``."""
        probs = F.softmax(self.router(x).float(), dim=-1)
        w, ids = probs.topk(self.top_k, dim=-1)
        return (w / w.sum(-1, keepdim=True) if self.norm_topk else w).to(x.dtype), ids

    def permute(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Token copies sorted by expert: ``(tokens [T*k, h], order [T*k], counts per expert)``."""
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=self.n_experts).tolist()
        return x[order // self.top_k], order, counts

    def unpermute(self, y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """Inverse of :meth:`permute`: weight each expert output and sum per token -> ``[T, h]``."""
        y = y * weights.flatten()[order, None]
        return torch.zeros(n_tokens, y.shape[-1], dtype=y.dtype, device=y.device).index_add(0, order // self.top_k, y)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Local dispatch -> experts -> combine for ``x [T, h]``."""
        tokens, order, counts = self.permute(x, ids)
        y = torch.cat([self.experts[e](t) for e, t in enumerate(tokens.split(counts))])
        return self.unpermute(y, weights, order, x.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.route(flat)
        out = self.routed(flat, weights, ids).view_as(x)
        return out + self.shared(x) if self.shared is not None else out


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp_or_moe(norm(x))``
    (with dropout before each residual add when ``cfg.dropout``). Under sequence parallelism
    ``x`` is the rank's sequence shard: gathered after each norm, scattered before each add.
    ``recompute_modules``: the Megatron selective modules it recomputes (`set_recompute_modules`)."""

    recompute_modules: frozenset[str] = frozenset()
    keep_recompute = False  # a split backward (BI/BW): its module checkpoints re-run once (`kept_checkpoint`)
    _mlp_norm_keep: "DropOutput | None" = None

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = make_norm(cfg, cfg.hidden)
        self.attn = MLAttention(cfg) if cfg.attention == "mla" else GQAttention(cfg, cfg.layer_window(layer))
        self.mlp_norm = make_norm(cfg, cfg.hidden)
        self.is_moe = cfg.is_moe_layer(layer)
        if self.is_moe:
            self.moe = MoE(cfg)
        else:
            self.mlp = make_mlp(cfg, cfg.local_ffn)
        self.drop = Dropout(cfg.dropout, layer) if cfg.dropout else None
        self.sp = cfg.tp if cfg.sequence_parallel else 1

    def set_recompute_modules(self, modules) -> None:
        """Recompute Megatron's selective ``modules`` (`piper_sim.recompute.MODULES`) as
        Megatron-Core does [megatron/core/transformer/transformer_layer.py, moe/moe_layer.py,
        moe/experts.py, multi_latent_attention.py]: ``core_attn`` (`attention_core`);
        ``layernorm`` both norms' outputs dropped (`DropOutput`) until the attention's or the
        MLP/MoE block's output gradient arrives; ``mlp`` a dense layer's MLP a checkpoint;
        ``moe`` the whole MoE block (router, experts, shared experts) one checkpoint;
        ``shared_experts`` the shared experts a checkpoint; ``moe_act`` the routed experts'
        activations dropped; ``mla_up_proj`` MLA's up-projections and rope (`MLAttention.up_proj`).
        ``moe`` covers ``shared_experts`` and ``moe_act`` (what they drop it never keeps)."""
        m = frozenset(modules)
        self.recompute_modules = m
        self.attn.recompute_core = "core_attn" in m
        if hasattr(self.attn, "recompute_up_proj"):
            self.attn.recompute_up_proj = "mla_up_proj" in m
        if self.is_moe:
            for e in self.moe.experts:
                e.recompute_act = "moe_act" in m and "moe" not in m

    def _recomputes(self, module: str) -> bool:
        return module in self.recompute_modules and torch.is_grad_enabled()

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, "DropOutput | None"]:
        """``norm(x)``; under ``layernorm`` with the `DropOutput` that will drop its output."""
        if not self._recomputes("layernorm"):
            return norm(x), None
        keep = DropOutput(norm)
        return keep.run(x), keep

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        n, keep = self._norm(self.attn_norm, x)
        a = self.attn(self._in(n))
        if keep is not None:
            keep.discard(a)
        return x + self._out(a, 0)

    def release_mlp_norm(self, *hooks: torch.Tensor | None) -> None:
        """Under ``layernorm`` on a MoE layer: drop the MLP norm's output now that the router,
        the shared experts and the dispatch have read it; the first gradient of ``hooks`` (the
        routing weights, the shared experts' output) recomputes it. A no-op otherwise."""
        keep, self._mlp_norm_keep = self._mlp_norm_keep, None
        if keep is not None:
            keep.discard(*hooks)

    def _in(self, x: torch.Tensor) -> torch.Tensor:
        return _SPGather.apply(x, self.sp) if self.sp > 1 else x

    def _out(self, x: torch.Tensor, site: int) -> torch.Tensor:
        """The sublayer output (``site`` 0: attention, 1: MLP) scattered (SP) and dropped out."""
        if self.sp > 1:
            x = _SPScatter.apply(x, self.sp)
        return self.drop(x, site) if self.drop is not None else x

    def forward_pre(self, x: torch.Tensor, dispatch: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """MoE segment ``pre``: returns ``(x, h, weights, ids, shared)`` with ``x`` after the
        attention residual, ``h = norm(x)`` flattened to ``[T, hidden]`` (what gets
        dispatched), routing ``weights/ids [T, k]`` and the shared-expert output (or None).
        ``dispatch`` maps the router's input to the experts' (routed and shared; tensor
        parallel: ``f``, whose backward sums both gradients in one all-reduce). Under sequence
        parallelism the router and the dispatch read the rank's shard (Megatron-Core's
        all-to-all dispatcher), the shared experts gather it (`_shared`)."""
        x = self._attention(x)
        n, self._mlp_norm_keep = self._norm(self.mlp_norm, x)  # dropped by `release_mlp_norm`
        h = n.reshape(-1, x.shape[-1])
        weights, ids = self.moe.route(h)
        if dispatch is not None:
            h = dispatch(h)
        shared = None
        if self.moe.shared is not None:
            shared = _checkpoint(self._shared, h, n, kept=self.keep_recompute) \
                if self._recomputes("shared_experts") else self._shared(h, n)
        return x, h, weights, ids, shared

    def _shared(self, h: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """The shared experts on the tokens ``h [T, hidden]`` (``n``: their ``[B, s, hidden]``
        shape); under sequence parallelism a column/row-parallel MLP with SP's gather and
        scatter around it (Megatron-Core ``SharedExpertMLP``)."""
        if self.sp == 1:
            return self.moe.shared(h)
        y = self.moe.shared(_SPGather.apply(h.view(n.shape), self.sp))
        return _SPScatter.apply(y, self.sp).reshape(-1, h.shape[-1])

    @staticmethod
    def forward_post(x: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        """Residual after the combine: ``routed`` and ``shared`` are ``[T, hidden]``."""
        out = routed if shared is None else routed + shared
        return x + out.view_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_moe:
            x = self._attention(x)
            n, keep = self._norm(self.mlp_norm, x)
            m = _checkpoint(self.mlp, self._in(n), kept=self.keep_recompute) if self._recomputes("mlp") \
                else self.mlp(self._in(n))
            if keep is not None:
                keep.discard(m)
            return x + self._out(m, 1)
        if self._recomputes("moe"):  # Megatron's MoELayer forward under one checkpoint
            x = self._attention(x)
            n, keep = self._norm(self.mlp_norm, x)
            y = _checkpoint(self._moe_block, n, kept=self.keep_recompute)
            if keep is not None:
                keep.discard(y)
            return x + y
        x, h, weights, ids, shared = self.forward_pre(x)
        routed = self.moe.routed(h, weights, ids)
        self.release_mlp_norm(weights, shared)
        return self.forward_post(x, routed, shared)

    def _moe_block(self, n: torch.Tensor) -> torch.Tensor:
        """The MoE block on the MLP norm's output ``n`` (as `forward_pre` and `forward_post` compute it)."""
        h = n.reshape(-1, n.shape[-1])
        weights, ids = self.moe.route(h)
        shared = self._shared(h, n) if self.moe.shared is not None else None
        routed = self.moe.routed(h, weights, ids)
        return (routed if shared is None else routed + shared).view_as(n)


class Head(nn.Module):
    """Final norm + output projection -> logits (the rank's vocabulary shard under tensor
    parallelism: a vocabulary-parallel loss, whose small all-reduces are the IR's)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = make_norm(cfg, cfg.hidden)
        if cfg.tie_embeddings:
            # tied: the embedding's matrix, not a parameter of this module (see tie_head); on
            # meta a stand-in that profiling differentiates as a weight
            self._tied = [torch.empty(cfg.local_vocab, cfg.hidden, device="meta", dtype=_BUILD_DTYPE,
                                      requires_grad=True)]
        else:
            self.out = Linear(cfg.hidden, cfg.local_vocab)
        self.sp = cfg.tp if cfg.sequence_parallel else 1

    @property
    def tied_weight(self) -> torch.Tensor | None:
        """The embedding matrix a tied head projects with (None when untied)."""
        return self._tied[0] if hasattr(self, "_tied") else None

    def tie(self, weight: torch.Tensor) -> None:
        self._tied = [weight]

    def own_copy(self, weight: torch.Tensor) -> None:
        """A tied head on a stage without the embedding: its output layer is a parameter of
        its own (``head.out.weight``), equal to ``weight`` (the embedding's, built from the
        same seed, as Megatron-Core's last stage holds ``output_layer.weight``); the executor
        sums the two copies' gradients (`executor.parallel.tied`)."""
        del self._tied
        self.out = Linear(weight.shape[1], weight.shape[0])
        self.out.weight = nn.Parameter(weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        x = _SPGather.apply(x, self.sp) if self.sp > 1 else x
        return self.project(x)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The output layer alone (no norm): what the MTP modules share."""
        return self.out(x) if self.tied_weight is None else F.linear(x, self.tied_weight)

    @property
    def out_weight(self) -> torch.Tensor:
        """The matrix the output layer projects with (its own, or the tied embedding's)."""
        return self.out.weight if self.tied_weight is None else self.tied_weight


class MTPLayer(nn.Module):
    """One multi-token-prediction module (DeepSeek-V3, arXiv 2412.19437 §2.2; Megatron-Core
    ``MultiTokenPredictionLayer``): ``block(eh_proj([enorm(emb); hnorm(x)]))`` then
    ``final_norm``, where ``x`` is the previous depth's hidden states and ``emb`` the shared
    embedding of the tokens one further ahead; the shared output head and the loss follow
    (segment ``mtp.d.loss``). Under tensor parallelism ``eh_proj`` is the rank's column shard
    (Megatron: column-parallel, output gathered: `piper_sim.parallel.tensor._eh_proj_collectives`)."""

    def __init__(self, cfg: ModelConfig, depth: int):
        super().__init__()
        self.enorm = make_norm(cfg, cfg.hidden)
        self.hnorm = make_norm(cfg, cfg.hidden)
        self.eh_proj = Linear(2 * cfg.hidden, cfg.hidden // cfg.tp)
        self.block = Block(cfg, cfg.n_layers + depth)
        self.final_norm = make_norm(cfg, cfg.hidden)
        self.tp = cfg.tp

    @property
    def is_moe(self) -> bool:
        return self.block.is_moe

    def project(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        z = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(x)), -1))
        return z.repeat(1, 1, self.tp) if self.tp > 1 else z  # the gathered columns (shapes only)

    def forward_pre(self, x: torch.Tensor, emb: torch.Tensor):
        """MoE segment ``pre``: as `Block.forward_pre` on the projected input."""
        return self.block.forward_pre(self.project(x, emb))

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return self.final_norm(self.block(self.project(x, emb)))


def mtp_shift(targets: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What MTP module ``depth`` (0-based) sees of a micro-batch whose ``targets`` are the
    inputs shifted by one: (the tokens it embeds, ``depth + 1`` further ahead of the inputs;
    the tokens it predicts, ``depth + 2`` ahead; the mask of positions that have one). As
    Megatron-Core's ``roll_tensor`` (``models/gpt/gpt_model.py``): shifted left, zero-filled,
    the tail masked out of the loss."""
    s = targets.shape[-1]
    emb, tgt = torch.zeros_like(targets), torch.zeros_like(targets)
    emb[..., :s - depth] = targets[..., depth:]
    tgt[..., :max(s - depth - 1, 0)] = targets[..., depth + 1:]
    mask = torch.zeros(targets.shape, dtype=torch.bool, device=targets.device)
    mask[..., :max(s - depth - 1, 0)] = True
    return emb, tgt, mask


def vocab_shard_lookup(ids: torch.Tensor, weight: torch.Tensor, lo: int) -> torch.Tensor:
    """The embedding of ``ids`` from the vocabulary rows ``[lo, lo + len(weight))`` a
    tensor-parallel rank holds, zeros for the others: summed over the group, the embedding."""
    local = ids - lo
    inside = (local >= 0) & (local < weight.shape[0])
    return F.embedding(local.clamp(0, weight.shape[0] - 1), weight) * inside[..., None]


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of each token, ``logits`` ``[N, V]`` in fp32."""
    return F.cross_entropy(logits, targets, reduction="none")


def mtp_loss(logits: torch.Tensor, targets: torch.Tensor, depth: int, cfg: ModelConfig,
             ce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_cross_entropy,
             positions: torch.Tensor | None = None) -> torch.Tensor:
    """Module ``depth``'s share of the training loss: its mean token cross entropy over the
    positions with a target (fp32), times ``mtp_loss_scale / mtp_layers`` (DeepSeek-V3 §2.2's
    lambda / D; Megatron-Core ``mtp_loss_scaling_factor / mtp_num_layers``). ``ce``: each
    token's cross entropy (a vocabulary-parallel one under tensor parallelism).

    ``positions``: the true sequence positions of ``logits``' tokens, ``targets`` being the
    whole sequence's (a context-parallel rank's chunks): their cross entropies summed over the
    whole sequence's count of positions with a target, times ``s / len(positions)``, so that
    the mean over the ranks of the group is the whole sequence's loss (as their main losses)."""
    _, tgt, mask = mtp_shift(targets, depth)
    count = mask.sum().clamp(min=1)
    if positions is not None:
        tgt, mask = tgt[..., positions], mask[..., positions]
        count = count * (positions.numel() / targets.shape[-1])
    ce = ce(logits.flatten(0, 1).float(), tgt.flatten())
    m = mask.flatten()
    return (ce * m).sum() / count * (cfg.mtp_loss_scale / cfg.mtp_layers)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy (computed in fp32)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.local_vocab, cfg.hidden, cfg.tp if cfg.sequence_parallel else 1)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        if cfg.mtp_layers:  # forward() runs the main path; training_loss adds the MTP modules' losses
            self.mtp = nn.ModuleList(MTPLayer(cfg, d) for d in range(cfg.mtp_layers))
        self.head = Head(cfg)

    @property
    def norm(self) -> RMSNorm:
        return self.head.norm

    def unit(self, name: str) -> nn.Module:
        if name in ("embed", "head"):
            return getattr(self, name)
        if name.startswith("mtp."):
            return self.mtp[mtp_index(self.cfg, name)]
        return self.layers[_layer_index(self.cfg, name)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets)

    def training_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The main loss plus the MTP modules' (`mtp_loss`): module d takes the previous
        depth's hidden states (the main model's before its final norm, then module d-1's
        after its own) and the shared embedding of the tokens d+1 ahead (`mtp_shift`); the
        shared output layer projects its final-normed output."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        loss = lm_loss(self.head(x), targets)
        for d, module in enumerate(getattr(self, "mtp", [])):
            x = module(x, self.embed(mtp_shift(targets, d)[0]))
            loss = loss + mtp_loss(self.head.project(x), targets, d, self.cfg)
        return loss


def _make_unit(cfg: ModelConfig, name: str) -> nn.Module:
    if name == "embed":
        return Embedding(cfg.local_vocab, cfg.hidden, cfg.tp if cfg.sequence_parallel else 1)
    if name == "head":
        return Head(cfg)
    if name.startswith("mtp."):
        return MTPLayer(cfg, mtp_index(cfg, name))
    return Block(cfg, _layer_index(cfg, name))


# --------------------------------------------------------------------------- building


def unit_seed(seed: int, name: str) -> int:
    """Stable 63-bit seed for one unit (independent of Python's hash randomisation)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def init_unit(module: nn.Module, seed: int, name: str) -> None:
    """Normal(0, 0.02) for matrices (linears, embeddings), ones for norm weights, zeros for
    norm biases.

    Values are drawn in fp32 on the CPU in parameter order, then copied, so they are the
    same on every device and dtype."""
    g = torch.Generator().manual_seed(unit_seed(seed, name))
    for name, p in module.named_parameters():
        if p.device.type == "meta":
            continue
        if p.ndim >= 2:
            v = torch.empty(p.shape).normal_(0.0, 0.02, generator=g)
        else:
            v = torch.zeros(p.shape) if name.endswith("bias") else torch.ones(p.shape)
        p.copy_(v)


def _check_size(cfg: ModelConfig, n_params: int, device) -> None:
    if torch.device(device).type != "meta" and cfg.tp > 1:
        raise ValueError(f"refusing to build a tensor-parallel shard of {cfg.name} on {device!r}: "
                         "tensor parallelism is simulate-only (build it on device='meta')")
    if torch.device(device).type != "meta" and n_params > MAX_MATERIALISED_PARAMS:
        raise ValueError(
            f"refusing to materialise {n_params / 1e9:.1f}B parameters of {cfg.name} on {device!r} "
            f"(limit {MAX_MATERIALISED_PARAMS / 1e9:.0f}B); build it on device='meta'"
        )


def _construct(make, device, dtype: torch.dtype, seed: int, names: list[str]):
    """Construct on meta; on a real device allocate, then init each unit in fp32 and cast."""
    global _BUILD_DTYPE
    meta = torch.device(device).type == "meta"
    _BUILD_DTYPE, saved = (dtype if meta else torch.float32), _BUILD_DTYPE
    try:
        module = make()
    finally:
        _BUILD_DTYPE = saved
    if meta:
        return module
    # allocate in place of the meta tensors (Module.to_empty would import sympy: ~1.5 s per process)
    module = module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    for name in names:
        init_unit(module.unit(name) if isinstance(module, Transformer) else module, seed, name)
    return module.to(dtype)


def build_model(cfg: ModelConfig, device="meta", dtype: torch.dtype = torch.float32, seed: int = 0) -> Transformer:
    """The whole model. Non-meta builds are limited to ~2B parameters."""
    _check_size(cfg, cfg.param_count(), device)
    model = _construct(lambda: Transformer(cfg), device, dtype, seed, unit_names(cfg))
    if cfg.tie_embeddings and torch.device(device).type != "meta":
        model.head.tie(model.embed.weight)
    return model


class UnitDict(nn.ModuleDict):
    """Units of one stage, laid out like :class:`Transformer` (``embed``, ``layers`` as a
    ModuleDict keyed by layer index, ``head``) so state-dict keys match the full model.
    Index it with unit names: ``units["layers.3"]``."""

    def __getitem__(self, name: str) -> nn.Module:
        if name.startswith(("layers.", "mtp.")):
            group, index = name.split(".", 1)
            return self._modules[group][index]
        return self._modules[name]

    def __contains__(self, name: str) -> bool:
        try:
            self[name]
            return True
        except KeyError:
            return False

    def unit_names(self) -> list[str]:
        names = ["embed"] if "embed" in self._modules else []
        names += [f"layers.{i}" for i in sorted(map(int, self._modules.get("layers", {}).keys()))]
        names += [f"mtp.{d}" for d in sorted(map(int, self._modules.get("mtp", {}).keys()))]
        return names + (["head"] if "head" in self._modules else [])


def build_units(
    cfg: ModelConfig, names: list[str], device="cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> UnitDict:
    """Build only the requested units, with the same weights as ``build_model(cfg, seed=seed)``.
    A tied head built with the embedding projects with its matrix; without it (the embedding on
    another pipeline stage), with its own copy of that matrix (`Head.own_copy`)."""
    _check_size(cfg, sum(unit_param_count(cfg, n) for n in names), device)
    real = torch.device(device).type != "meta"
    built = {n: _construct(lambda: _make_unit(cfg, n), device, dtype, seed, [n]) for n in names}
    units = UnitDict()
    if "embed" in built:
        units["embed"] = built["embed"]
    for group in ("layers", "mtp"):
        members = {n.split(".")[1]: m for n, m in built.items() if n.startswith(group + ".")}
        if group == "mtp" and members and real and "embed" not in built and not cfg.tie_embeddings:
            # the MTP modules' embedding on a stage without it: a copy (``mtp_embed``, Megatron-Core's
            # last stage holds ``embedding`` when it runs MTP), ahead of the modules as the plan counts it
            units["mtp_embed"] = _construct(lambda: _make_unit(cfg, "embed"), device, dtype, seed, ["embed"])
        if members:
            units[group] = nn.ModuleDict(dict(sorted(members.items(), key=lambda kv: int(kv[0]))))
    if "head" in built:
        units["head"] = built["head"]
        if cfg.tie_embeddings and real and "embed" in built:
            units["head"].tie(units["embed"].weight)
        elif cfg.tie_embeddings and real:  # the embedding on another stage: the head's own copy of it
            embed = _construct(lambda: _make_unit(cfg, "embed"), device, dtype, seed, ["embed"])
            units["head"].own_copy(embed.weight)
    return units


def run_units(units, names: list[str], x: torch.Tensor) -> torch.Tensor:
    """Apply units in order: embed takes tokens, layers hidden states, head returns logits."""
    for name in names:
        x = units[name](x)
    return x
