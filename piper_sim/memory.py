"""Activation memory per segment under each recompute mode, and the fits verdict.

What a segment keeps from its forward to its backward, per micro-batch:

``none``       every tensor autograd saves (the profile's ``saved_act_bytes``).
``selective``  Korthikanti et al. 2022: the attention core (scores, softmax, weighted sum)
               runs again in backward. It is *measured* like the profile, on ``meta``, with
               the core under ``torch.utils.checkpoint`` (what the executor runs): the core's
               inputs q, k, v stay, what only the core saves goes. With flash attention
               the core saves no ``s x s`` tensor, so this frees only the softmax
               log-sum-exp (GQA: ``4·B·heads·s`` bytes per layer; MLA also its padded v and
               output) and costs one attention-core forward per layer in backward.
``full``       every layer (and, cut by expert parallelism, every ``pre``/``experts`` piece)
               and the head is a checkpoint: it keeps its input only (``B·s·h`` in the model
               dtype, ``B·s·h/t`` under sequence parallelism; the dispatched tokens for an
               expert block), and its backward recomputes
               it, so one unit's saved activations (its *working set*) are alive during that
               unit's backward. The embedding (no flops; it keeps the token ids) is not.

Temporary buffers (alive only while an op runs): the head's logits, ``B·s·V`` in the model
dtype plus the fp32 copy the loss reads (`models.logits_bytes`), in the head's forward and
backward. All-to-all receive buffers, ZeRO gathered parameters and unsharded gradient
buckets are counted by the IR on the ops that hold them (see ``piper_sim.ir.memory_pass``).

Tensor parallelism: segments are profiled on a shard's config (`piper_sim.models.tp_shard`), so
every number here is one rank's. For the GPT-3 architecture this gives Korthikanti et al. 2022's
Table 2 per layer exactly, in its flash-attention form (no ``5as/h`` term): ``sbh(10 + 24/t)``
without and ``34·sbh/t`` with sequence parallelism, plus what that count leaves out: the norms'
fp32 statistics (``16·sb``, ``/t`` with SP) and flash attention's log-sum-exp (``4·as·b/t``,
which selective recompute frees) (tests/test_tensor_parallel.py).

The fits verdict against a GPU's memory is `costmodel.memory.fits` (simulator and explorer).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from costmodel.dtypes import dtype_bytes, dtype_name, torch_dtype
from costmodel.stack import DEFAULT as DEFAULT_STACK, ProfileKernels, Stack
from piper_sim import fp8
from piper_sim.configs import ModelConfig, layer_of_kind, logits_bytes
from piper_sim.profile_cache import on_disk
from piper_sim.profiling import (SegmentCost, measure, name_attention_rows, segment_kind, segment_windowed,
                                 with_kernels)
from piper_sim.recompute import (LayerTable, Recompute, layer_table, module_freed, op_sac_kept,
                                 with_fused_swiglu)

if TYPE_CHECKING:  # torch loads only where a layer is measured (a profile cache miss)
    import torch

RECOMPUTE_MODES = ("none", "selective", "full")
_RECOMPUTED_KINDS = ("dense", "moe_pre", "moe_experts", "head", "user")


@dataclass(frozen=True)
class SegmentMemory:
    """Memory facts of one segment for one micro-batch (bytes; flops for the core)."""

    kind: str            # embed | dense | moe_pre | moe_experts | head | user (a user model's unit)
    saved: float         # kept F -> B without recompute (the profile's saved_act_bytes)
    selective: float     # kept F -> B with the attention core recomputed
    checkpoint: float    # kept F -> B under full recompute (its input), if recomputed
    temp: float          # transient bytes during its forward and its backward (head logits)
    core_flops: float    # forward flops of its attention core (what selective recomputes)
    a2a_bytes: float = 0.0
    core_kernels: tuple = ()  # operator-level rows of that core forward (piper_sim.kernels)
    # the closed-form saved-tensor table of a layer segment (`piper_sim.recompute`): what the
    # policies beyond none/full/selective keep
    table: LayerTable | None = field(default=None, compare=False, hash=False)
    fwd_flops: float = 0.0  # the segment's forward flops (what a checkpoint re-runs)
    compiled: bool = False  # under torch.compile (op-SAC keeps only what the backward reads: op_sac_saved)

    @property
    def recomputed(self) -> bool:
        """Whether full recompute checkpoints this segment (layers and head, not the embedding)."""
        return self.kind in _RECOMPUTED_KINDS

    def kept(self, mode: str, split_experts: bool = True) -> float:
        """Bytes kept from forward to backward under ``mode``. An expert block that is not
        cut out of its layer (no expert parallelism) is inside the layer's checkpoint."""
        if mode == "selective":
            return self.selective
        if mode == "full" and self.recomputed:
            if self.kind == "moe_experts" and not split_experts:
                return 0.0
            return self.checkpoint
        return self.saved

    def kept_under(self, mode: str, modules: tuple[str, ...], split_experts: bool, first: bool = True) -> float:
        """Bytes kept under a per-unit mode of a `Recompute` policy: ``none``, ``full`` (the
        checkpoint input when ``first`` of its chunk, else nothing), ``op`` (torchtitan op-SAC;
        an expert block cut out by expert parallelism is its own checkpoint) or ``selective``
        (Megatron's ``modules``)."""
        if mode == "none" or not self.recomputed:
            return self.saved
        if mode == "full" or (mode == "op" and self.kind == "moe_experts" and split_experts):
            if self.kind == "moe_experts":
                return self.checkpoint if split_experts else 0.0
            return self.checkpoint if first else 0.0
        if self.table is None:
            return self.saved
        if mode == "op":
            return min(self.saved, op_sac_kept(self.table, self.compiled))
        return self.saved - self.freed(modules)

    def freed(self, modules: tuple[str, ...]) -> float:
        """Bytes Megatron's selective ``modules`` drop (core_attn as measured)."""
        out = self.saved - self.selective if "core_attn" in modules else 0.0
        if self.table is not None:
            out += module_freed(self.table, modules)
        return min(out, self.saved)


@functools.lru_cache(maxsize=64)
@on_disk
def _layer_measure(cfg: ModelConfig, kind: str, micro_batch: int, seq: int,
                   dtype: str | torch.dtype, windowed: bool = False,
                   kernels_run: ProfileKernels = ProfileKernels()) -> tuple[int, int, tuple]:
    """(saved bytes with the attention core recomputed, attention-core forward flops and
    kernel rows) of a ``dense`` layer or a MoE ``pre`` segment, measured on ``meta`` with
    the kernels the training stack runs (``kernels_run``, as `profiling.profile_kind`)."""
    return with_kernels(kernels_run, _measure_layer, cfg, kind, micro_batch, seq, dtype, windowed)


def _measure_layer(cfg: ModelConfig, kind: str, micro_batch: int, seq: int, dtype: str | torch.dtype,
                   windowed: bool) -> tuple[int, int, tuple]:
    import torch

    from piper_sim.models import attention, attention_core_inputs, build_units

    dtype = torch_dtype(dtype)
    layer = layer_of_kind(cfg, kind, windowed)
    block = build_units(cfg, [f"layers.{layer}"], device="meta", dtype=dtype)[f"layers.{layer}"]
    block.attn.recompute_core = True
    x = torch.empty(micro_batch, cfg.local_seq(seq), cfg.hidden, device="meta", dtype=dtype, requires_grad=True)
    if kind == "dense":
        fn, params = block, list(block.parameters())
    else:
        experts = {id(p) for p in block.moe.experts.parameters()}
        fn, params = block.forward_pre, [p for p in block.parameters() if id(p) not in experts]
    saved = measure(fn, [x], params).saved_act_bytes
    window = cfg.layer_window(layer)
    core = measure(lambda q, k, v: attention(q, k, v, window, cfg.dropout),
                   list(attention_core_inputs(cfg, micro_batch, seq, dtype=dtype)), [])
    return saved, core.fwd_flops, core.kernels_f


def segment_memory(cfg: ModelConfig, seg: SegmentCost, micro_batch: int, seq: int,
                   dtype: str | torch.dtype, stack: Stack = DEFAULT_STACK) -> SegmentMemory:
    """``dtype``: a name (``"bf16"``) or a ``torch.dtype``; ``stack``: the kernels the run
    executes (what the selectively recomputed attention core keeps and launches)."""
    kind = segment_kind(cfg, seg.name)
    dtype = dtype_name(dtype)
    nbytes = dtype_bytes(dtype)
    selective, core_flops, checkpoint, temp = float(seg.saved_act_bytes), 0.0, 0.0, 0.0
    core_kernels: tuple = ()
    table = layer_table(cfg, kind, micro_batch, seq, nbytes, seg.a2a_bytes) \
        if kind in ("dense", "moe_pre", "moe_experts") else None
    # a checkpoint keeps the unit's input: the rank's sequence shard under sequence parallelism
    unit_input = float(micro_batch * cfg.local_seq(seq) * cfg.hidden * nbytes)
    if kind in ("dense", "moe_pre"):
        sel, core_flops, core_kernels = _layer_measure(cfg, kind, micro_batch, seq, dtype,
                                                       segment_windowed(cfg, seg.name), stack.profile_key())
        core_kernels = name_attention_rows(core_kernels, stack)
        selective = float(sel)
        checkpoint = unit_input
    elif kind == "moe_experts":
        checkpoint = float(seg.a2a_bytes)
    saved = float(seg.saved_act_bytes)
    if kind == "head":
        checkpoint = unit_input
        temp = float(logits_bytes(cfg, seg.tokens, nbytes))
        if stack.compile and cfg.tp == 1:  # vocabulary-parallel (DTensor loss_parallel) under TP: not measured
            saved, temp = compiled_loss(saved, cfg, seg.tokens, nbytes)
            selective = saved
    if table is not None and stack.swiglu == "fused":
        table = with_fused_swiglu(table)
    if table is not None and stack.fp8_cached_inputs:  # the profile's saved bytes are cached already
        cached = fp8.cache_inputs(table, stack.fp8, stack.fp8_activations)
        if kind != "moe_experts":
            selective += cached.saved - table.saved
        table = cached
    return SegmentMemory(kind=kind, saved=saved, selective=selective,
                         checkpoint=checkpoint, temp=temp, core_flops=float(core_flops),
                         a2a_bytes=float(seg.a2a_bytes), core_kernels=core_kernels, table=table,
                         fwd_flops=float(seg.fwd_flops), compiled=stack.compile)


def compiled_loss(saved: float, cfg: ModelConfig, tokens: int, nbytes: int) -> tuple[float, float]:
    """(saved, transient) bytes of the head when the loss is compiled, from its eager ``saved``
    bytes (measured on meta: the loss's fp32 log-probabilities, ``tokens x vocab x 4``, among them).
    torchtitan compiles the loss with the model (components/loss.py:18-30 @e7c0cae:
    ``cross_entropy(pred.flatten(0, 1).float(), ...)``, ``torch.compile(loss_fn)`` when
    ``training.compile``); Inductor's partitioner then saves the logits in the model dtype and two
    fp32 numbers per token (max and log-sum-exp), not the fp32 log-probabilities, and no fp32 copy of
    the logits is ever materialised: the transient is the logits' gradient in the model dtype
    (measured on CPU, torch 2.13: benchmarks/probe_saved_tensors.py). Not applied under tensor
    parallelism, where torchtitan's loss runs on vocabulary-parallel DTensors (``loss_parallel``),
    which that measurement does not cover: the eager bytes stay."""
    logits = float(tokens) * cfg.local_vocab
    return saved - logits * 4 + logits * nbytes + tokens * 8.0, logits * nbytes


def model_memory(cfg: ModelConfig, segments: list[SegmentCost], micro_batch: int, seq: int,
                 dtype: str | torch.dtype, stack: Stack = DEFAULT_STACK) -> dict[str, SegmentMemory]:
    """`SegmentMemory` of every segment, by segment name."""
    return {s.name: segment_memory(cfg, s, micro_batch, seq, dtype, stack) for s in segments}


@dataclass(frozen=True)
class PieceMemory:
    """Activation memory of one compute piece (a set of segments run one after another)."""

    kept: float      # F -> backward
    temp: float      # transient during F and during the backward (largest of its segments)
    working: float   # transient during the backward: recomputed activations of one unit
    rerun: float     # what a BI that re-runs the piece's forward keeps for BW (full recompute)


def piece_memory(mems: list[tuple[str, SegmentMemory]], mode: str, split_experts: bool,
                 policy: Recompute | None = None, unit_modes: dict[str, tuple[str, int]] | None = None) -> PieceMemory:
    """``mems``: (unit, memory) of the piece's segments in order. Under full recompute the
    backward recomputes one unit at a time: its working set is the largest unit's saved
    activations; under selective one attention core at a time (what it alone saves).
    A `Recompute` ``policy`` beyond those (``unit_modes``: its `Recompute.unit_modes` over the
    stage) is priced per unit: a full unit (or chunk of units) as full recompute, an op-SAC or
    Megatron-selective one keeps its share and recomputes the rest as its working set."""
    if policy is not None and not policy.plain:
        return _policy_memory(mems, policy, unit_modes or {}, split_experts)
    kept = sum(m.kept(mode, split_experts) for _, m in mems)
    temp = max((m.temp for _, m in mems), default=0.0)
    working = rerun = 0.0
    if mode == "full":
        per_unit: dict[str, float] = {}
        for unit, m in mems:
            if m.recomputed:
                per_unit[unit] = per_unit.get(unit, 0.0) + m.saved
        working = max(per_unit.values(), default=0.0)
        rerun = sum(per_unit.values())
    elif mode == "selective":
        working = max((m.saved - m.selective for _, m in mems), default=0.0)
    return PieceMemory(kept=kept, temp=temp, working=working, rerun=rerun)


def _policy_memory(mems: list[tuple[str, SegmentMemory]], policy: Recompute,
                   unit_modes: dict[str, tuple[str, int]], split_experts: bool) -> PieceMemory:
    kept = 0.0
    temp = max((m.temp for _, m in mems), default=0.0)
    chunks: dict[int, float] = {}
    seen_chunks: set[int] = set()
    working = 0.0
    for unit, m in mems:
        mode, chunk = unit_modes.get(unit, ("none", 0))
        first = chunk not in seen_chunks
        if m.kind != "moe_experts":
            seen_chunks.add(chunk)
        kept += m.kept_under(mode, policy.module_set, split_experts, first)
        if not m.recomputed or mode == "none":
            continue
        if mode == "full" or (mode == "op" and m.kind == "moe_experts" and split_experts):
            chunks[chunk] = chunks.get(chunk, 0.0) + m.saved
        else:
            working = max(working, m.saved - m.kept_under(mode, policy.module_set, split_experts))
    working = max(working, max(chunks.values(), default=0.0))
    return PieceMemory(kept=kept, temp=temp, working=working, rerun=sum(chunks.values()))
