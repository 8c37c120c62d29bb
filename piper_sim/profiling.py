"""Per-segment cost profiling on the ``meta`` device (any model size, no real memory).

For each segment (see :func:`piper_sim.models.unit_segments`) we run the real torch module
on meta tensors and measure:

- forward flops (torch's flop formulas, ``torch.utils.flop_counter``) and every aten op as
  operator-level kernel rows (``piper_sim.kernels``: GEMM shapes, flash attention, memory-bound
  bytes) for the forward, backward-input and backward-weight passes;
- backward-input flops (BI): flops of ``torch.autograd.grad(out, inputs)`` only;
- backward-weight flops (BW): full backward (inputs and parameters) minus BI;
- saved-activation bytes: every tensor autograd saves for backward, seen through
  ``torch.autograd.graph.saved_tensors_hooks``, counted once per storage, parameters excluded
  (the segment's input counts when autograd saves it);
- the shape of the dominant matmul (``gemm_m/n/k``) for a size-dependent efficiency model.

Conventions: attention is costed as flash attention (see :func:`piper_sim.models.attention`);
causal attention is counted as full ``s x s`` (FlopCounterMode's and Megatron's convention), a
sliding window shorter than the sequence as ``s x window`` (windowed layers are profiled apart:
``profile_kind(..., windowed=True)``), and flash backward includes its score recomputation
(2.5x the attention forward). Embedding
lookups count no flops. The head segment includes the loss.

Routed experts cannot run data-dependent routing on meta: we assume uniform routing, profile
one expert on ``tokens * top_k / n_experts`` tokens and multiply by ``n_experts``.

Identical layers are profiled once (cache keyed by config, kind, micro-batch, seq, dtype), in
memory and on disk across processes (`piper_sim.profile_cache`).

Tensor parallelism: profile a shard's config (`piper_sim.models.tp_shard`): every kernel has the
rank's shapes (its heads, ffn / tp, vocabulary rows; with sequence parallelism norms, dropout and
residual adds on ``s / tp`` tokens), parameters and saved bytes are the rank's (a gathered input
that a linear keeps is counted as the shard Megatron keeps, `models.sp_saved_bytes`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Sequence

from costmodel.dtypes import dtype_name, torch_dtype
from costmodel.stack import DEFAULT as DEFAULT_STACK, ProfileKernels, Stack
from piper_sim.profile_cache import on_disk
from piper_sim import fp8, kernels
from piper_sim.configs import ModelConfig, layer_of_kind, unit_names, unit_segments

if TYPE_CHECKING:  # torch loads only where a segment is measured (a profile cache miss)
    import torch


@dataclass(frozen=True)
class SegmentCost:
    """Costs of one segment for one micro-batch (frozen: cached instances are shared).

    ``out_bytes`` is the boundary tensor the segment hands on: for a layer (or the
    ``experts`` segment, after the combine) the hidden states a pipeline SEND carries, for a
    MoE ``pre`` segment the normalised tokens handed to dispatch, for the head the loss.
    ``a2a_bytes`` (expert segments only) is what a rank dispatches per micro-batch,
    ``tokens * top_k * hidden * dtype_bytes``; the combine sends the same amount back.
    Under tensor parallelism every count is one rank's share; ``out_bytes`` is what the rank
    sends (its sequence shard under sequence parallelism), ``tp_partial_params`` the replicated
    parameters whose gradients are partial per rank and so all-reduced over the tensor-parallel
    group: under sequence parallelism the norms (each sees only the rank's sequence shard), a
    MoE layer's router (it routes the shard) and MLA's down-projections and their norms
    (`_sp_partial`);
    with ``qk_norm`` (Qwen3) the query/key norms too (each rank normalises only its heads, so
    gets their share of the gradient; Megatron-Core all-reduces them over TP likewise).
    """

    name: str
    unit: str
    is_expert: bool
    fwd_flops: int
    bwd_input_flops: int
    bwd_weight_flops: int
    param_count: int
    param_bytes: int
    saved_act_bytes: int
    out_bytes: int
    tokens: int
    a2a_bytes: int = 0
    gemm_m: int = 0
    gemm_n: int = 0
    gemm_k: int = 0
    kernels_f: tuple = ()  # operator-level profile of the forward (piper_sim.kernels rows)
    kernels_bi: tuple = ()  # of the backward-input pass
    kernels_bw: tuple = ()  # of the backward-weight pass
    tp_partial_params: int = 0
    out_shape: tuple = ()  # a user model's unit: shape and dtype of the tensor it hands on
    out_dtype: str = ""

    @property
    def bwd_flops(self) -> int:
        return self.bwd_input_flops + self.bwd_weight_flops


@dataclass(frozen=True)
class Measurement:
    fwd_flops: int
    bwd_input_flops: int
    bwd_weight_flops: int
    saved_act_bytes: int
    gemm: tuple[int, int, int]  # (m, n, k) of the matmul shape with the most flops
    kernels_f: tuple = ()
    kernels_bi: tuple = ()
    kernels_bw: tuple = ()


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _differentiable(outs) -> list[torch.Tensor]:
    import torch

    outs = outs if isinstance(outs, (tuple, list)) else [outs]
    return [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]


def _recorded(fn: Callable[[], object]) -> tuple[int, tuple]:
    """(flops, kernel rows) of running ``fn``."""
    from piper_sim.kernel_recorder import KernelRecorder

    with KernelRecorder() as rec:
        fn()
    rows = rec.table()
    return round(kernels.totals(rows)[0]), rows


def _dominant_gemm(rows: tuple) -> tuple[int, int, int]:
    gemms = [r for r in rows if r[0] == "gemm"]
    if not gemms:
        return (0, 0, 0)
    m, n, k, _ = max(gemms, key=lambda r: r[5])[2]
    return (m, n, k)


def measure(fn: Callable, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> Measurement:
    """Profile ``fn(*inputs)`` (returns a tensor or a tuple; non-differentiable outputs are
    ignored). ``params`` are the weights: excluded from saved bytes, included in BW.
    Flops come from torch's flop formulas (``torch.utils.flop_counter``) per recorded op."""
    import torch

    from piper_sim import models
    from piper_sim.kernel_recorder import KernelRecorder

    param_keys = {_storage_key(p) for p in params}
    saved: dict[int, int] = {}
    models.SP_GATHERED.clear()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in param_keys:
            shard = models.sp_saved_bytes(t)
            saved[key] = t.untyped_storage().nbytes() if shard is None else shard
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with KernelRecorder() as rec:
            outs = _differentiable(fn(*inputs))
    f_rows = rec.table()
    grads = [torch.ones_like(o) for o in outs]
    xs = [x for x in inputs if x.requires_grad]
    bi, bi_rows = _recorded(lambda: torch.autograd.grad(outs, xs, grads)) if xs else (0, ())
    outs = _differentiable(fn(*inputs))  # fresh graph for the full backward
    full, full_rows = _recorded(lambda: torch.autograd.grad(outs, [*xs, *params], grads, allow_unused=True))
    return Measurement(round(kernels.totals(f_rows)[0]), bi, full - bi, sum(saved.values()),
                       _dominant_gemm(f_rows), f_rows, bi_rows, kernels.subtract(full_rows, bi_rows))


# --------------------------------------------------------------------------- per kind


@functools.lru_cache(maxsize=256)
@on_disk
def profile_kind(cfg: ModelConfig, kind: str, micro_batch: int, seq_len: int, dtype: str | torch.dtype,
                 windowed: bool = False, kernels_run: ProfileKernels = ProfileKernels()) -> SegmentCost:
    """Cost of one segment kind: ``embed``, ``dense`` (layer), ``moe_pre``, ``moe_experts``,
    ``head``, and an MTP module's ``mtp_dense`` / ``mtp_pre`` / ``mtp_loss``; ``windowed``: of a layer with sliding-window attention; ``dtype`` a name
    (``"bf16"``) or a ``torch.dtype``; ``kernels_run`` what the training stack runs (unfused
    attention, eager norms, its dropout). Cached; ``name``/``unit`` are set to the kind."""
    return with_kernels(kernels_run, _profile_kind, cfg, kind, micro_batch, seq_len, dtype, windowed)


def with_kernels(kernels_run: ProfileKernels, measure_fn: Callable, cfg: ModelConfig, *args):
    """``measure_fn(cfg, *args)`` run on meta with the kernels the stack runs (its dropout on
    ``cfg`` when it sets one)."""
    from piper_sim.models import profiling_kernels

    if kernels_run.dropout is not None:
        cfg = replace(cfg, dropout=kernels_run.dropout)
    with profiling_kernels(kernels_run):
        return measure_fn(cfg, *args)


def _profile_kind(cfg: ModelConfig, kind: str, micro_batch: int, seq_len: int, dtype: str | torch.dtype,
                  windowed: bool) -> SegmentCost:
    import torch

    from piper_sim.models import build_units, lm_loss

    dtype = torch_dtype(dtype)
    B, s, h, nbytes = micro_batch, seq_len, cfg.hidden, dtype.itemsize
    T = B * s
    meta: dict = dict(device="meta", dtype=dtype)
    hidden_in = torch.empty(B, cfg.local_seq(s), h, requires_grad=True, **meta)  # the rank's shard under SP
    tokens = torch.zeros(B, s, dtype=torch.long, device="meta")
    scale, a2a, is_expert = 1.0, 0, False
    out_bytes = B * cfg.local_seq(s) * h * nbytes
    sp_norms: list = []
    qk_norms: list = []

    def build(unit: str):
        return build_units(cfg, [unit], device="meta", dtype=dtype)[unit]

    if kind == "embed":
        mod = build("embed")
        params = list(mod.parameters())
        m = measure(mod, [tokens], params)
    elif kind == "dense":
        mod = build(f"layers.{layer_of_kind(cfg, kind, windowed)}")
        params = list(mod.parameters())
        m = measure(mod, [hidden_in], params)
        sp_norms = _sp_partial(cfg, mod)
        qk_norms = _qk_norms(cfg, mod)
    elif kind == "moe_pre":
        mod = build(f"layers.{layer_of_kind(cfg, kind, windowed)}")
        expert_ids = {id(p) for p in mod.moe.experts.parameters()}
        params = [p for p in mod.parameters() if id(p) not in expert_ids]
        m = measure(mod.forward_pre, [hidden_in], params)
        sp_norms = _sp_partial(cfg, mod)
        qk_norms = _qk_norms(cfg, mod)
    elif kind == "moe_experts":
        routed = T * cfg.top_k
        per_expert = math.ceil(routed / cfg.n_experts)  # uniform routing
        mod = build(f"layers.{cfg.first_dense}").moe.experts[0]
        params = list(mod.parameters())
        m = measure(mod, [torch.empty(per_expert, h, requires_grad=True, **meta)], params)
        scale = routed / per_expert  # = n_experts when it divides evenly
        # each TP rank dispatches the copies of its own tokens: its sequence shard under SP
        a2a, is_expert = routed * h * nbytes // (s // cfg.local_seq(s)), True
    elif kind in ("mtp_dense", "mtp_pre"):  # an MTP module: its projection and layer (configs.ModelConfig.mtp_layers)
        mod = build("mtp.0")
        embed = build("embed")  # the shared embedding of the tokens one further ahead: its gradient here
        expert_ids = {id(p) for p in mod.block.moe.experts.parameters()} if mod.is_moe else set()
        expert_ids |= {id(p) for p in mod.final_norm.parameters()}  # counted in segment mtp.d.loss
        params = [p for p in mod.parameters() if id(p) not in expert_ids]
        fn = mod.forward_pre if kind == "mtp_pre" else mod
        m = measure(lambda x: fn(x, embed(tokens)), [hidden_in], params + list(embed.parameters()))
        sp_norms = _sp_partial(cfg, mod.block)
        qk_norms = _qk_norms(cfg, mod.block)
    elif kind in ("head", "mtp_loss"):
        mod = build("head")
        params = list(mod.parameters())
        tied = [mod.tied_weight] if mod.tied_weight is not None else []  # the embedding's: its gradient here
        m = measure(lambda x: lm_loss(mod(x), tokens), [hidden_in], params + tied)
        out_bytes = 4  # the fp32 scalar loss
        sp_norms = [mod.norm]
        if kind == "mtp_loss":  # the MTP's final norm is its own; the output head is the model's (shared)
            params = list(mod.norm.parameters())
            out_bytes = B * cfg.local_seq(s) * h * nbytes  # the main hidden states go on to the head
    else:
        raise ValueError(f"unknown segment kind {kind!r}")

    n_params = sum(p.numel() for p in params) * (cfg.n_experts if is_expert else 1)
    return SegmentCost(
        name=kind,
        unit=kind,
        is_expert=is_expert,
        fwd_flops=round(m.fwd_flops * scale),
        bwd_input_flops=round(m.bwd_input_flops * scale),
        bwd_weight_flops=round(m.bwd_weight_flops * scale),
        param_count=n_params,
        param_bytes=n_params * nbytes,
        saved_act_bytes=round(m.saved_act_bytes * scale),
        out_bytes=out_bytes,
        tokens=T,
        a2a_bytes=a2a,
        gemm_m=m.gemm[0],
        gemm_n=m.gemm[1],
        gemm_k=m.gemm[2],
        kernels_f=kernels.scale(m.kernels_f, scale) if is_expert else m.kernels_f,
        kernels_bi=kernels.scale(m.kernels_bi, scale) if is_expert else m.kernels_bi,
        kernels_bw=kernels.scale(m.kernels_bw, scale) if is_expert else m.kernels_bw,
        tp_partial_params=sum(p.numel() for n in (sp_norms if cfg.sequence_parallel else []) + qk_norms
                              for p in n.parameters()),
    )


def _sp_partial(cfg: ModelConfig, layer) -> list:
    """A layer's replicated modules that see only the rank's sequence shard's share under
    sequence parallelism (`SegmentCost.tp_partial_params`): its norms, a MoE layer's router
    (it routes the shard: Megatron-Core marks it ``sequence_parallel``), and multi-head latent
    attention's down-projections and their norms (whole on every rank, on the gathered
    sequence, but fed by this rank's heads' gradients only)."""
    mods = [layer.attn_norm, layer.mlp_norm] + ([layer.moe.router] if layer.is_moe else [])
    attn = layer.attn
    if cfg.attention == "mla":
        mods += [attn.wq_a, attn.q_norm] if cfg.q_lora_rank else []
        mods += [attn.wkv_a, attn.kv_norm]
    return mods


def _qk_norms(cfg: ModelConfig, layer) -> list:
    """A layer's query/key norms when tensor-parallel (`SegmentCost.tp_partial_params`)."""
    return [layer.attn.q_norm, layer.attn.k_norm] if cfg.qk_norm and cfg.tp > 1 else []


def segment_windowed(cfg: ModelConfig, segment: str) -> bool:
    """Whether a layer segment's attention has a sliding window (False for a kind's name)."""
    parts = segment.split(".")
    if len(parts) < 2 or parts[0] != "layers" or not parts[1].isdigit():
        return False
    return cfg.layer_window(int(parts[1])) > 0


# an MTP unit's segment kind -> the kind its cost is profiled as (`profile_kind`)
MTP_PROFILE_KINDS = {"dense": "mtp_dense", "moe_pre": "mtp_pre", "moe_experts": "moe_experts", "head": "mtp_loss"}


def segment_kind(cfg: ModelConfig, segment: str) -> str:
    """``embed`` | ``dense`` | ``moe_pre`` | ``moe_experts`` | ``head`` for a segment name (an MTP
    module's segments read as the layer's kinds, its ``.loss`` as ``head``)."""
    if segment == "embed":
        return segment
    if segment == "head" or segment.endswith(".loss"):
        return "head"
    if segment.endswith(".pre"):
        return "moe_pre"
    if segment.endswith(".experts"):
        return "moe_experts"
    return "dense"


@functools.lru_cache(maxsize=64)
def _profile_model(cfg: ModelConfig, micro_batch: int, seq_len: int, dtype: str,
                   stack: Stack, family: str = "hopper") -> tuple[SegmentCost, ...]:
    out = []
    run = stack.profile_key()
    for unit in unit_names(cfg):
        for seg in unit_segments(cfg, unit):
            kind = segment_kind(cfg, seg)
            windowed = kind in ("dense", "moe_pre") and segment_windowed(cfg, seg)
            if unit.startswith("mtp."):  # priced as an MTP module's own pieces (same kinds elsewhere)
                kind = MTP_PROFILE_KINDS[kind]
            cost = _name_attention(profile_kind(cfg, kind, micro_batch, seq_len, dtype, windowed, run), stack)
            # an MTP module's layer runs in FP8 as the model's do (Megatron-Core's MTP takes the global
            # fp8 context); its eh_proj stays in the model dtype here (a small 2h x h GEMM)
            block = {"mtp_pre": "moe_pre", "mtp_dense": "dense"}.get(kind, kind)
            cost = fp8.apply(cost, cfg, block, micro_batch, seq_len, stack.fp8, family, dtype, stack.fp8_cached_inputs,
                             stack.fp8_activations)
            out.append(replace(cost, name=seg, unit=unit))
    return tuple(out)


def name_attention_rows(rows: tuple, stack: Stack) -> tuple:
    """Flash-family attention rows named for the kernel the stack runs (``costmodel.operators``
    prices each by its own throughput); profiling them is the same (one cache entry)."""
    kernel = stack.attention
    if kernel in ("flash2", "unfused"):
        return rows
    return tuple((r[0], kernel, *r[2:]) if r[0] in ("attn_fwd", "attn_bwd") else r for r in rows)


def _name_attention(cost: SegmentCost, stack: Stack) -> SegmentCost:
    return replace(cost, kernels_f=name_attention_rows(cost.kernels_f, stack),
                   kernels_bi=name_attention_rows(cost.kernels_bi, stack),
                   kernels_bw=name_attention_rows(cost.kernels_bw, stack))


def profile_model(
    cfg: ModelConfig, micro_batch: int, seq_len: int, dtype: str | torch.dtype = "bf16", stack: Stack = DEFAULT_STACK,
    family: str = "hopper",
) -> list[SegmentCost]:
    """Segment costs in model order (embed, layer segments..., head), for one micro-batch;
    ``dtype`` a name (``"bf16"``) or a ``torch.dtype``; ``stack`` the kernels the run executes
    (``costmodel.stack``; default FA2 and fused norms); ``family`` the GPU family
    (``costmodel.hardware.GPU.family``) its FP8 casts are priced for (`piper_sim.fp8`)."""
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"micro_batch and seq_len must be >= 1 (got {micro_batch}, {seq_len})")
    return list(_profile_model(cfg, micro_batch, seq_len, dtype_name(dtype), stack,
                               family if stack.fp8 != "none" else ""))
