"""One pipeline stage on one rank: its units, its flat parameter buffers, and the pieces
a plan cuts it into.

* `Stage` materialises only this stage's units (``models.build_units``: the same weights
  as the single-process model), keeps only the local experts under expert parallelism, and
  runs a *piece* (``F.s1.mb0.p2``) as a small function from named tensors to named tensors.
  Piece boundaries are autograd boundaries (inputs are fresh leaves), so a backward op is
  ``autograd`` over one piece, and all-to-alls sit between pieces.
* `FlatParams` is one flat, padded buffer per stage and sync group (dense parameters, and
  local experts under EP): parameters are views into it, gradients views into a twin
  buffer. Bucket ``b`` is the ``b``-th cut of the plan's buckets (bytes in proportion; equal
  slices for equal buckets), or under ZeRO-3 one unit (or
  a few whole units: the plan's ``zero3_buckets``), each padded on its own; under ZeRO
  each member of the sync group owns slice ``index`` of every bucket (its *shard*) and the
  optimizer only steps the shard. ZeRO-3 keeps one storage per bucket and frees it
  between uses (``acquire(b)``/``release(b)``), so one gathered unit is dropped at a time.
  Under ZeRO a bucket's gradients are handed to its reduce-scatter (``take_grad_bucket``),
  which the runtime adds into the shard's gradient (``shard.grad``, the accumulator of the
  step: ZeRO-2/3 reduce every micro-batch's gradients); under ZeRO-3 each bucket's gradient
  has its own storage too, allocated by the first backward that writes it
  (``grad_acquire``) and given away with the reduce-scatter, so unsharded gradients live
  from one micro-batch's backward of a unit to its reduce-scatter.
* `backward_input` / `backward_weight` split a piece's backward in two (zero-bubble BI/BW):
  BI runs autograd to the piece inputs only and keeps, for every parameter, the gradients
  flowing into the graph nodes where its weight-gradient path leaves the input path; BW
  later runs autograd from those nodes to the parameters only.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import GradientEdge, Node
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint as _checkpoint, create_selective_checkpoint_contexts,
                                     set_checkpoint_early_stop)

from executor.lr import ADAMW
from piper_sim.models import (Block, ModelConfig, WeightGradJob, build_units, deferring_weight_grads, kept_checkpoint,
                              lm_loss, mtp_loss, mtp_shift)
from piper_sim.recompute import Recompute


def optimizer_impl(params: list[torch.Tensor]) -> str:
    """``fused`` where this torch has a fused AdamW kernel for the parameters' device and
    dtype (CUDA; CPU too since torch 2.4: one pass over the flat buffer, ~20x faster than
    the per-tensor loop on 10M fp32 elements), else ``foreach``. ``PIPER_ADAMW=foreach|
    fused|loop`` forces one."""
    forced = os.environ.get("PIPER_ADAMW", "")
    if forced:
        return forced
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        devices = _get_fused_kernels_supported_devices()
    except ImportError:  # older torch: fused on CUDA only
        devices = ["cuda"]
    ok = all(p.device.type in devices and p.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
             for p in params)
    return "fused" if ok and params else "foreach"


def set_lr(optimizers, lr: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr


def keep_first_grads(out: dict[str, torch.Tensor] | None, step: int, named) -> None:
    """Copy the gradients of step 0 into ``out`` (when given)."""
    if out is not None and step == 0:
        out.update({n: p.grad.detach().clone() for n, p in named if p.grad is not None})


def adamw_kwargs(impl: str) -> dict:
    """AdamW's keyword arguments: the fixed hyperparameters and implementation ``impl``
    (`optimizer_impl`)."""
    flags = {"fused": dict(fused=True), "foreach": dict(foreach=True), "loop": dict(foreach=False)}
    return {**flags[impl], **ADAMW}


def make_optimizer(params: list[torch.Tensor]) -> torch.optim.AdamW:
    """AdamW with the executor's fixed hyperparameters (fused or foreach, see
    `optimizer_impl`; the single-process reference and the torch baselines use the same)
    and eagerly created state (so a checkpoint can be loaded into it before the first step)."""
    impl = optimizer_impl(params)
    opt = torch.optim.AdamW(params, **adamw_kwargs(impl))
    for p in params:  # fused keeps ``step`` on the parameter's device, the others on the CPU
        opt.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32, device=p.device if impl == "fused" else "cpu"),
                        "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    return opt


# --------------------------------------------------------------------------- flat params


@dataclass
class FlatParams:
    """The parameters of one stage that share one gradient-sync group."""

    key: str                      # "s0", "s0.e" (expert parameters)
    names: list[str]              # global parameter names, in buffer order
    params: list[nn.Parameter]
    n_buckets: int
    group: tuple[int, ...]        # ranks that sync these gradients; () when nobody does
    sync: str                     # "none" | "allreduce" | "shard"
    index: int                    # position of this rank in ``group``
    zero: int
    stream: str = "dp"            # plan stream of the sync ops (names the process group)
    # elements of each bucket. ZeRO-3: whole units, parameters in bucket order, each bucket
    # padded on its own; else cuts of the parameters laid end to end (a parameter may
    # straddle two buckets; each bucket's length rounded up to a multiple of the group, so
    # a later bucket starts up to g-1 elements per bucket before the plan's cut). None:
    # equal slices
    bucket_numels: list[int] | None = None
    flat: nn.Parameter = field(init=False)
    grad: torch.Tensor = field(init=False)
    shard: nn.Parameter | None = field(init=False, default=None)
    optimizer: torch.optim.AdamW = field(init=False)

    def __post_init__(self) -> None:
        numel = sum(p.numel() for p in self.params)
        g = len(self.group) if self.sync == "shard" else 1
        if self.bucket_numels is not None and (len(self.bucket_numels) != self.n_buckets
                                               or sum(self.bucket_numels) != numel):
            raise ValueError(f"{self.key}: bucket sizes {self.bucket_numels} do not cover the {numel} "
                             f"parameters in {self.n_buckets} buckets")
        if self.bucket_numels is None:
            self.lens = [-(-numel // (self.n_buckets * g)) * g] * self.n_buckets
        else:
            self.lens = [-(-n // g) * g for n in self.bucket_numels]
        if self.zero < 3 or self.bucket_numels is None:  # slices of the parameters laid end to end
            starts = [0] * len(self.params)
            off = 0
            for i, p in enumerate(self.params):
                starts[i], off = off, off + p.numel()
        else:  # one bucket per unit group: each starts on its own boundary, padded at its end
            starts, b, used = [], 0, 0
            for p in self.params:
                while used == self.bucket_numels[b] and b + 1 < self.n_buckets:
                    b, used = b + 1, 0
                starts.append(sum(self.lens[:b]) + used)
                used += p.numel()
        self.offsets = [sum(self.lens[:b]) for b in range(self.n_buckets)]
        self.piece_lens = [n // g for n in self.lens]
        self.piece_offsets = [sum(self.piece_lens[:b]) for b in range(self.n_buckets)]
        self.param_offsets = starts
        total = sum(self.lens)
        like = self.params[0]
        # ZeRO-3 keeps one storage per bucket, so a gathered unit can be dropped on its own
        self.per_bucket = self.zero >= 3 and self.sync == "shard"
        opts = dict(dtype=like.dtype, device=like.device)
        if self.per_bucket:
            self.flat = nn.Parameter(torch.zeros(0, **opts))
            self.bufs = [torch.zeros(n, **opts) for n in self.lens]
        else:
            self.flat = nn.Parameter(torch.zeros(total, **opts))
            self.bufs = [self.flat.data[o:o + n] for o, n in zip(self.offsets, self.lens)]
        self.users = [0] * self.n_buckets
        self.shard_fresh = [True] * self.n_buckets
        # ZeRO-3: per-bucket gradient storages, None while handed off (see grad_acquire)
        self.grad = torch.zeros(0 if self.per_bucket else total, **opts)
        self.gbufs: list[torch.Tensor | None] = [None] * self.n_buckets
        self.bucket_params: list[list[int]] = [[] for _ in range(self.n_buckets)]
        self.numel = numel
        for i, (p, off) in enumerate(zip(self.params, self.param_offsets)):
            n = p.numel()
            b = max(i for i, o in enumerate(self.offsets) if o <= off) if self.per_bucket else 0
            base = self.bufs[b] if self.per_bucket else self.flat.data
            lo = off - (self.offsets[b] if self.per_bucket else 0)
            base[lo:lo + n].copy_(p.data.reshape(-1))
            p.data = base[lo:lo + n].view_as(p)
            if self.per_bucket:
                self.bucket_params[b].append(i)
                p.grad = None
            else:
                p.grad = self.grad[off:off + n].view_as(p)
        if not self.per_bucket:
            self.flat.grad = self.grad
        if self.sync == "shard":
            self.shard = nn.Parameter(torch.cat([self.bucket(b)[self.index * n:(self.index + 1) * n]
                                                 for b, n in enumerate(self.piece_lens)]).clone())
            self.shard.grad = torch.zeros_like(self.shard.data)
            self.optimizer = make_optimizer([self.shard])
            if self.per_bucket:
                for buf in self.bufs:
                    self._resize(buf, 0)
        else:
            self.optimizer = make_optimizer([self.flat])

    # buckets and shards
    def params_in_bucket(self, b: int) -> list[nn.Parameter]:
        """The parameters with elements in bucket ``b``'s slice of the flat buffer (outside
        ZeRO-3 a parameter may straddle two buckets)."""
        lo, hi = self.offsets[b], self.offsets[b] + self.lens[b]
        return [p for p, off in zip(self.params, self.param_offsets) if off < hi and off + p.numel() > lo]

    def bucket(self, b: int) -> torch.Tensor:
        return self.bufs[b]

    def grad_bucket(self, b: int) -> torch.Tensor:
        return self.grad[self.offsets[b]:self.offsets[b] + self.lens[b]]

    def shard_piece(self, b: int) -> torch.Tensor:
        assert self.shard is not None
        return self.shard.data[self.piece_offsets[b]:self.piece_offsets[b] + self.piece_lens[b]]

    def shard_grad_piece(self, b: int) -> torch.Tensor:
        assert self.shard is not None and self.shard.grad is not None
        return self.shard.grad[self.piece_offsets[b]:self.piece_offsets[b] + self.piece_lens[b]]

    @property
    def total_len(self) -> int:
        return sum(self.lens)

    # ZeRO-3: a bucket's full parameters exist only while someone uses them
    @staticmethod
    def _resize(t: torch.Tensor, numel: int) -> None:
        t.untyped_storage().resize_(numel * t.element_size())

    def materialised(self) -> bool:
        return all(buf.untyped_storage().nbytes() > 0 for buf in self.bufs)

    def acquire(self, b: int) -> None:
        if self.per_bucket:
            buf = self.bufs[b]
            if self.users[b] == 0 and buf.untyped_storage().nbytes() == 0:
                self._resize(buf, buf.numel())
            self.users[b] += 1

    def release(self, b: int) -> None:
        if self.per_bucket:
            self.users[b] -= 1
            if self.users[b] == 0:
                buf = self.bufs[b]
                if buf.is_cuda:  # kernels on other streams may still read it
                    torch.cuda.synchronize(buf.device)
                self._resize(buf, 0)

    def full_flat(self) -> torch.Tensor:
        """The parameters in the flat layout (a copy under ZeRO-3)."""
        return torch.cat(self.bufs) if self.per_bucket else self.flat.data

    # gradients and the optimizer
    def zero_grad(self) -> None:
        if self.per_bucket:
            for b in range(self.n_buckets):
                self._drop_grad(b)
        else:
            if self.grad.untyped_storage().nbytes() == 0:
                self._resize(self.grad, self.grad.numel())
            self.grad.zero_()
        # the step's accumulator of reduce-scattered gradients: the first reduce-scatter of
        # a bucket in a step assigns its piece, later ones add (no zeroing pass)
        self.shard_fresh = [True] * self.n_buckets

    def _drop_grad(self, b: int) -> None:
        self.gbufs[b] = None
        for i in self.bucket_params[b]:
            self.params[i].grad = None

    def grad_acquire(self, b: int) -> None:
        """ZeRO-3: give bucket ``b`` a zeroed gradient storage (its parameters' ``.grad``
        views) if its last one went to a reduce-scatter; call before a backward writes it."""
        if not self.per_bucket or self.gbufs[b] is not None:
            return
        like = self.bufs[b]
        buf = torch.zeros(self.lens[b], dtype=like.dtype, device=like.device)
        for i in self.bucket_params[b]:
            p = self.params[i]
            if p.grad is not None:
                raise RuntimeError(f"{self.key}: {self.names[i]} got a gradient outside its bucket's storage "
                                   f"(bucket {b} was written before grad_acquire)")
            lo = self.param_offsets[i] - self.offsets[b]
            p.grad = buf[lo:lo + p.numel()].view_as(p)
        self.gbufs[b] = buf

    def add_shard_grad(self, b: int, reduced: torch.Tensor) -> None:
        """Add a reduce-scattered piece into the shard's gradient for this step (the
        step's first one for bucket ``b`` is copied in, not added to zeros)."""
        piece = self.shard_grad_piece(b)
        if self.shard_fresh[b]:
            piece.copy_(reduced)
            self.shard_fresh[b] = False
        else:
            piece.add_(reduced)

    def shard_grad_views(self, params) -> list[torch.Tensor]:
        """ZeRO-3: the pieces of this rank's shard gradient that hold ``params``' elements
        (flat views, in buffer order; none where the shard holds none of them)."""
        ids = {id(p) for p in params}
        out = []
        for i, (p, off) in enumerate(zip(self.params, self.param_offsets)):
            if id(p) not in ids:
                continue
            b = max(k for k, o in enumerate(self.offsets) if o <= off)
            lo_shard = self.offsets[b] + self.index * self.piece_lens[b]
            lo, hi = max(off, lo_shard), min(off + p.numel(), lo_shard + self.piece_lens[b])
            if lo < hi:
                start = self.piece_offsets[b] + lo - lo_shard
                out.append(self.shard.grad[start:start + hi - lo])
        return out

    # gradient clipping by global norm: what this rank adds to the sum of squares
    def counts_in_norm(self) -> bool:
        """Shards are disjoint; an all-reduced (replicated) gradient is counted by its
        group's first member only."""
        return self.sync in ("shard", "none") or self.index == 0

    def norm_weights(self, share) -> torch.Tensor | None:
        """Per element of `stepped_grad`, the share of its square the global norm counts here
        (``share(name)`` per parameter, e.g. 1/tp for a weight every TP rank holds whole);
        None when every share is 1."""
        shares = [share(n) for n in self.names]
        if all(x == 1.0 for x in shares):
            return None
        w = torch.ones(sum(self.lens), dtype=torch.float64, device=self.grad.device)
        for p, off, x in zip(self.params, self.param_offsets, shares):
            w[off:off + p.numel()] = x
        return w if self.sync != "shard" else self.own_pieces(w)

    def own_pieces(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a buffer in the full flat layout: its piece of every bucket."""
        return torch.cat([full[o + self.index * n:o + (self.index + 1) * n] for o, n in zip(self.offsets, self.piece_lens)])

    @property
    def adam_state(self) -> dict[str, torch.Tensor]:
        """AdamW's state of the tensor the optimizer steps: the shard's under ZeRO, else the flat one's."""
        return self.optimizer.state[self.shard if self.shard is not None else self.flat]

    def stepped_grad(self) -> torch.Tensor:
        """The gradient the optimizer steps: the shard's under ZeRO, else the flat one."""
        if self.shard is not None:
            return self.shard.grad
        return self.grad

    def take_grad_bucket(self, b: int, last: bool = False) -> torch.Tensor:
        """The unsharded gradients of bucket ``b`` accumulated so far, for its reduce-scatter;
        the bucket starts again from zero. ZeRO-3 hands the storage itself over (the next
        backward writing the bucket allocates a new one); otherwise a copy goes and the
        bucket's slice of the flat gradient is zeroed."""
        if self.per_bucket:
            buf = self.gbufs[b]
            if buf is None:  # nothing wrote it since the last reduce-scatter
                like = self.bufs[b]
                buf = torch.zeros(self.lens[b], dtype=like.dtype, device=like.device)
            self._drop_grad(b)
            return buf
        g = self.grad_bucket(b)
        if last and self.zero <= 1:  # nothing writes it again this step; zero_grad zeroes it
            return g
        out = g.clone()
        g.zero_()
        return out

    def step(self) -> None:
        if self.per_bucket:
            left = [self.names[i] for b in range(self.n_buckets) for i in self.bucket_params[b]
                    if self.params[i].grad is not None]
            if left:
                raise RuntimeError(f"{self.key}: gradients of {left[:3]} were written after their bucket's "
                                   "last reduce-scatter of the step")
        if self.shard is not None:
            for b in range(self.n_buckets):
                if self.shard_fresh[b]:  # no reduce-scatter reached it this step
                    self.shard_grad_piece(b).zero_()
                    self.shard_fresh[b] = False
        self.optimizer.step()
        if self.zero >= 2 and self.sync == "shard" and not self.per_bucket:  # ZeRO-2: full gradients are not kept
            self._resize(self.grad, 0)

    def named_views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-parameter views of a full flat buffer laid out like the buckets end to end."""
        return {name: buf[off:off + p.numel()].view(p.shape)
                for name, p, off in zip(self.names, self.params, self.param_offsets)}


# --------------------------------------------------------------------------- pieces


@dataclass
class Record:
    """What a forward piece leaves for its backward: leaf inputs, outputs, parameters."""

    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    params: list[nn.Parameter]
    weight_state: Any = None  # set by backward_input, consumed by backward_weight


@dataclass
class Piece:
    # ("embed"|"layer"|"pre"|"experts"|"head"|"mtp"|"mtp_pre"|"mtp_loss", layer index; an MTP
    # module d's layer is n_layers + d, as models.MTPLayer numbers its block)
    steps: list[tuple[str, int]]
    inputs: list[str]
    params: list[nn.Parameter] = field(default_factory=list)
    step_params: list[list[nn.Parameter]] = field(default_factory=list)  # per step, in order


def _layer(segment: str) -> int:
    return int(segment.split(".")[1])


def piece_steps(segments: list[str], n_layers: int = 0) -> list[tuple[str, int]]:
    """Segment names -> steps; a MoE layer whose ``pre`` and ``experts`` segments are in the
    same piece runs whole (no expert parallelism). MTP module ``mtp.d`` (layer ``n_layers + d``):
    ``mtp`` / ``mtp_pre`` (its projection and layer, or the layer's ``pre``), ``experts``, and
    ``mtp_loss`` (segment ``mtp.d.loss``: its final norm, the shared output layer, its loss)."""
    steps: list[tuple[str, int]] = []
    i = 0
    while i < len(segments):
        seg = segments[i]
        mtp = seg.startswith("mtp.")
        layer = _layer(seg) + (n_layers if mtp else 0) if seg not in ("embed", "head") else -1
        if seg in ("embed", "head"):
            steps.append((seg, -1))
        elif mtp and seg.endswith(".loss"):
            steps.append(("mtp_loss", layer))
        elif seg.endswith(".pre"):
            whole = i + 1 < len(segments) and segments[i + 1] == seg[:-4] + ".experts"
            steps.append((("mtp" if whole else "mtp_pre") if mtp else ("layer" if whole else "pre"), layer))
            i += whole
        elif seg.endswith(".experts"):
            steps.append(("experts", layer))
        else:
            steps.append(("mtp" if mtp else "layer", layer))
        i += 1
    return steps


# torchtitan's op-level selective activation checkpointing [distributed/activation_checkpoint.py,
# ``_save_list`` and ``_get_custom_policy``]: the outputs of these ops are kept, except every
# second matmul (the count restarting per checkpointed block); everything else is recomputed.
# The attention ops are those SDPA dispatches to on CPU and GPU (piper_sim.recompute "op").
OP_SAC_SAVE = frozenset(op.default for op in (
    getattr(torch.ops.aten, name, None) for name in (
        "mm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu", "max"))
    if op is not None)
_MM = torch.ops.aten.mm.default


def op_sac_context():
    """The (forward, recompute) contexts of one checkpointed block under op-SAC."""
    counts = {False: 0, True: 0}  # matmuls seen in the forward and in the recompute

    def policy(ctx, func, *args, **kwargs):
        if func is _MM:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in OP_SAC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Stage:
    """The units of one pipeline stage on this rank, cut into pieces."""

    def __init__(self, cfg: ModelConfig, index: int, num_stages: int, units: list[str],
                 parts: list[list[str]], ep: int, ep_index: int, device: torch.device,
                 dtype: torch.dtype, seed: int):
        self.cfg, self.index = cfg, index
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.ep, self.ep_index = ep, ep_index
        self.units = build_units(cfg, units, device=device, dtype=dtype, seed=seed)
        self.loss_fn = lm_loss  # the vocabulary-parallel loss under tensor parallelism (executor.parallel.tensor)
        # an MTP module's embedding of its tokens and its loss from its final-normed states (depth d):
        # vocabulary-parallel under tensor parallelism (executor.parallel.tensor.shard_stage)
        self.mtp_embed: Callable[[torch.Tensor, int], torch.Tensor] = \
            lambda tokens, depth: F.embedding(tokens, self.mtp_embedding())
        self.mtp_loss_fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] = \
            lambda y, targets, depth: mtp_loss(self.units["head"].project(y), targets, depth, self.cfg,
                                               positions=self.positions)
        # the true positions of this rank's tokens (context parallelism: its chunks,
        # executor.parallel.context); None: the whole sequence. The targets stay the whole
        # sequence's: the losses take their positions (`local`), and the MTP modules' shifted
        # tokens and targets there need no exchange (Megatron-Core rolls them over the cp group)
        self.positions: torch.Tensor | None = None
        # full recomputation stops once backward has what it needs; tensor parallelism re-runs
        # the whole forward, so its collectives recur in the plan's order (TP.R ops)
        self.recompute_early_stop = True
        # a split backward (BI/BW) under a policy beyond plain full: checkpoints re-run once (kept_checkpoint)
        self.keep_recompute = False
        # called with a step's parameters before it runs (the runtime waits there for overlapped gathers)
        self.before_step: Callable[[list[nn.Parameter]], None] | None = None
        # tensor parallel MoE (executor.parallel.tensor): f before the experts (routed and shared), g after them;
        # with sequence parallelism instead `expert_tp(layer, recv, counts, run)` around the local experts
        # (their tokens gathered over TP, their outputs reduce-scattered back)
        self.expert_input = self.expert_output = lambda t, layer: t
        self.expert_tp: Callable[..., torch.Tensor] | None = None
        self.pieces = [Piece(piece_steps(p, cfg.n_layers), []) for p in parts]
        self.unit_names = list(units)
        # (step kind, layer) -> (how it is recomputed: none | full | op | selective, checkpoint chunk)
        self.step_modes: dict[tuple[str, int], tuple[str, int]] = {}
        self.uniform_chunks: dict[tuple[str, int], int] = {}  # the steps of Megatron uniform chunks -> chunk
        self.local_experts = cfg.n_experts // ep if cfg.is_moe else 0
        split = any(kind == "experts" for piece in self.pieces for kind, _ in piece.steps)
        self.expert_split = split
        if split:  # keep only this rank's experts
            lo = ep_index * self.local_experts
            for name in self.units.unit_names():
                block = self.units[name]
                block = getattr(block, "block", block)  # an MTP module's layer
                if isinstance(block, Block) and block.is_moe:
                    block.moe.experts = nn.ModuleList(list(block.moe.experts)[lo:lo + self.local_experts])
        # layer of the e-th expert block of this stage (``A2A.*.e{e}.*`` op ids)
        self.expert_layers = [layer for piece in self.pieces for kind, layer in piece.steps if kind == "experts"]
        main = False  # a piece before this one kept the main hidden states for the head (``xmain``)
        for piece in self.pieces:
            first = piece.steps[0][0]
            piece.inputs = {"embed": ["tokens"], "experts": [f"recv.{piece.steps[0][1]}"]}.get(first, ["x"])
            if main and first != "experts":
                piece.inputs.append("xmain")
            main = main or any(k in ("mtp", "mtp_pre") and layer == cfg.n_layers for k, layer in piece.steps)
        # MTP depths whose loss sits in a piece before the head's (MoE under EP, D > 1): their
        # final-normed output (``ymtp.d``) goes on to the head's piece, which projects it with
        # the shared output layer, so only the head's piece writes that layer's gradient, as
        # the plan's syncs of its bucket assume
        self.deferred = [layer - cfg.n_layers for piece in self.pieces for k, layer in piece.steps
                         if k == "mtp_loss" and not any(kk == "head" for kk, _ in piece.steps)]
        for piece in self.pieces:
            if any(k == "head" for k, _ in piece.steps):
                piece.inputs += [f"ymtp.{d}" for d in self.deferred]
        # the losses of the last stage's backward (the MTP modules' beside the main one)
        self.loss_names = ["loss", *(f"loss.mtp.{d}" for d in range(cfg.mtp_layers))] if self.is_last else []
        self.collect_piece_params()

    def collect_piece_params(self) -> None:
        """Each piece's parameters (again after its modules are replaced, e.g. tensor-parallel shards)."""
        for piece in self.pieces:
            piece.step_params = [self._step_params(kind, layer) for kind, layer in piece.steps]
            piece.params = list({id(p): p for params in piece.step_params for p in params}.values())

    # parameters
    def _block(self, layer: int) -> Block:
        if layer >= self.cfg.n_layers:
            return self._mtp(layer).block
        return self.units[f"layers.{layer}"]

    def _mtp(self, layer: int):
        return self.units[f"mtp.{layer - self.cfg.n_layers}"]

    def unit_of(self, kind: str, layer: int) -> str:
        """The unit a step belongs to."""
        if kind in ("embed", "head"):
            return kind
        return f"mtp.{layer - self.cfg.n_layers}" if layer >= self.cfg.n_layers else f"layers.{layer}"

    def mtp_embedding(self) -> torch.Tensor:
        """The word-embedding matrix the MTP modules read: the stage's embedding, else its copy
        (``mtp_embed``; a tied model's: the head's own copy)."""
        if "embed" in self.units:
            return self.units["embed"].weight
        if "mtp_embed" in self.units:
            return self.units["mtp_embed"].weight
        return self.units["head"].out_weight

    def _step_params(self, kind: str, layer: int) -> list[nn.Parameter]:
        if kind in ("embed", "head"):
            return list(self.units[kind].parameters())
        if kind == "mtp_loss":  # the final norm, and the shared output layer unless deferred to the head's piece
            head = self.units["head"]
            shared = head.out.parameters() if hasattr(head, "out") and layer - self.cfg.n_layers not in self.deferred \
                else ()
            return [*self._mtp(layer).final_norm.parameters(), *shared]
        if kind in ("mtp", "mtp_pre"):
            mtp = self._mtp(layer)
            own = [p for m in (mtp.enorm, mtp.hnorm, mtp.eh_proj) for p in m.parameters()]
            emb = self.mtp_embedding()
            extra = [emb] if isinstance(emb, nn.Parameter) else []
            return extra + own + self._step_params("layer" if kind == "mtp" else "pre", layer)
        block = self._block(layer)
        experts = {id(p) for p in block.moe.experts.parameters()} if block.is_moe else set()
        if kind == "experts":
            return list(block.moe.experts.parameters())
        if kind == "pre":
            return [p for p in block.parameters() if id(p) not in experts]
        return list(block.parameters())

    def named_parameters(self) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
        """(dense, expert) parameters with their names in the full model; expert parameters
        are separate only when the stage is expert-parallel."""
        dense, experts = [], []
        lo = self.ep_index * self.local_experts
        for name, p in self.units.named_parameters():
            parts = name.split(".")
            at = 3 if parts[0] == "mtp" else 2  # mtp.d.block.moe.experts.e...
            if self.expert_split and len(parts) > at + 2 and parts[at:at + 2] == ["moe", "experts"]:
                parts[at + 2] = str(lo + int(parts[at + 2]))
                experts.append((".".join(parts), p))
            else:
                dense.append((name, p))
        return dense, experts

    # forward
    def set_recompute(self, policy: Recompute) -> None:
        """The stage's recompute policy (`piper_sim.recompute.Recompute.unit_modes`, the rule the
        simulator prices): a ``full`` unit keeps only its input (``torch.utils.checkpoint``; a
        Megatron uniform chunk of layers is one checkpoint), an ``op`` unit keeps what op-SAC
        saves (`op_sac_context`), a ``selective`` one recomputes Megatron's selective modules
        (default ``core_attn``, the attention core: ``models.attention_core``; the others as
        ``models.Block.set_recompute_modules`` wraps them)."""
        modes = policy.unit_modes(self.unit_names)
        self.step_modes = {}
        for piece in self.pieces:
            for kind, layer in piece.steps:
                self.step_modes[kind, layer] = modes[self.unit_of(kind, layer)]
        self.uniform_chunks = {k: c for k, (m, c) in self.step_modes.items() if m == "full" and c >= 0}
        for name in self.units.unit_names():
            if name.startswith("layers."):
                self.units[name].set_recompute_modules(policy.module_set if modes[name][0] == "selective" else ())
                self.units[name].keep_recompute = self.keep_recompute

    def recomputes(self, i: int) -> bool:
        """Whether piece ``i`` has a step its backward re-runs (the embedding never is: its
        output is kept, as the plan's memory model says)."""
        return any(step[0] != "embed" and self.step_modes.get(step, ("none", -1))[0] in ("full", "op")
                   for step in self.pieces[i].steps)

    def forward_piece(self, i: int, vals: dict[str, torch.Tensor], routing: dict[str, Any],
                      targets: torch.Tensor | None, loss_scale: float, checkpoint: bool = True) -> Record:
        """Run piece ``i`` on ``vals`` (named tensors; outputs are added to it), each step
        recomputed as the stage's policy says (`set_recompute`); ``checkpoint=False`` keeps
        every activation (a split backward's BI re-running the forward for BW)."""
        piece = self.pieces[i]
        inputs = {n: _leaf(vals[n]) for n in piece.inputs}
        outputs: dict[str, torch.Tensor] = {}
        chunk_of = self.uniform_chunks if checkpoint else {}

        def run(step, fn, *args):
            mode = self.step_modes.get(step, ("none", -1))[0] if checkpoint else "none"
            if mode not in ("full", "op"):
                return fn(*args)
            kw = {"context_fn": op_sac_context} if mode == "op" else {}
            if self.keep_recompute:
                return kept_checkpoint(fn, *args, **kw)
            with set_checkpoint_early_stop(self.recompute_early_stop):
                return _checkpoint(fn, *args, use_reentrant=False, **kw)

        steps = list(zip(piece.steps, piece.step_params))
        with torch.enable_grad():
            x = inputs.get("x")
            xmain = inputs.get("xmain")  # the main hidden states, kept for the head past the MTP modules
            j = 0
            while j < len(steps):
                (kind, layer), params = steps[j]
                j += 1
                if self.before_step is not None:
                    self.before_step(params)
                if kind == "embed":
                    x = self.units["embed"](inputs["tokens"])
                elif kind == "layer" and (kind, layer) in chunk_of:  # a Megatron uniform chunk: one checkpoint
                    blocks = [self._block(layer)]
                    while j < len(steps) and chunk_of.get(steps[j][0]) == chunk_of[kind, layer]:
                        if self.before_step is not None:
                            self.before_step(steps[j][1])
                        blocks.append(self._block(steps[j][0][1]))
                        j += 1
                    x = run((kind, layer), nn.Sequential(*blocks), x) if len(blocks) > 1 else \
                        run((kind, layer), blocks[0], x)
                elif kind == "layer":
                    x = run((kind, layer), self._block(layer), x)
                elif kind == "head":
                    losses = run((kind, layer), self._head_losses, x if xmain is None else xmain, targets,
                                 *(inputs[f"ymtp.{d}"] for d in self.deferred))
                    for name, value in zip(["loss", *(f"loss.mtp.{d}" for d in self.deferred)], losses):
                        outputs[name] = value * loss_scale
                elif kind == "mtp_loss":
                    y = run((kind, layer), self._mtp(layer).final_norm, x)
                    d = layer - self.cfg.n_layers
                    if d in self.deferred:
                        outputs[f"ymtp.{d}"] = y
                    else:
                        outputs[f"loss.mtp.{d}"] = run((kind, layer), self.mtp_loss_fn, y, targets, d) * loss_scale
                    x = y  # the next depth's hidden states
                elif kind in ("mtp", "mtp_pre"):
                    if layer == self.cfg.n_layers:
                        xmain = x
                    d = layer - self.cfg.n_layers
                    tokens = self.local(mtp_shift(targets, d)[0])
                    if kind == "mtp":  # one checkpoint: a full recompute re-runs the module whole, as the plan
                        x = run((kind, layer), lambda h, t, d=d, block=self._block(layer):
                                block(self._mtp_input(h, t, d)), x, tokens)
                if kind in ("pre", "mtp_pre"):
                    block = self._block(layer)
                    pre = block.forward_pre if kind == "pre" else \
                        lambda h, f, t=tokens, d=d, block=block: block.forward_pre(self._mtp_input(h, t, d), f)
                    # tensor parallel: the routed and shared experts' column-parallel linears read f(h)
                    x, h, weights, ids, shared = run((kind, layer), pre, x,
                                                     functools.partial(self.expert_input, layer=layer))
                    tokens, order, counts = block.moe.permute(h, ids)
                    block.release_mlp_norm(weights, shared)  # Megatron's layernorm module: h read
                    outputs.update({f"xres.{layer}": x, f"send.{layer}": tokens, f"w.{layer}": weights})
                    if shared is not None:
                        outputs[f"shared.{layer}"] = shared
                    routing[f"order.{layer}"], routing[f"counts.{layer}"] = order, counts
                    routing[f"ntok.{layer}"] = h.shape[0]
                elif kind == "experts":
                    # tensor parallel: the sum of the experts' partial outputs (inside the recomputed
                    # step: a full recompute re-runs its all-reduce, as the plan's TP.R op says)
                    y = run((kind, layer), self._reduced_experts, layer, inputs[f"recv.{layer}"],
                            routing[f"recv_counts.{layer}"])
                    outputs[f"y.{layer}"] = y
            last = piece.steps[-1][0]
            if last in ("layer", "embed", "mtp", "mtp_loss"):
                outputs["x"] = x
            if xmain is not None and last != "head":
                outputs["xmain"] = xmain
        vals.update(outputs)
        return Record(inputs, outputs, piece.params)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a whole sequence's ``[B, s]`` tensor (`positions`)."""
        return t if self.positions is None else t[:, self.positions]

    def _head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.units["head"](x), self.local(targets))

    def _head_losses(self, x: torch.Tensor, targets: torch.Tensor, *ys: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The main loss and those of the MTP depths deferred to the head (``ys``: their
        final-normed states), one checkpoint; the MTP losses first, as Megatron-Core's
        ``GPTModel._postprocess`` computes them before the main logits."""
        mtp = [self.mtp_loss_fn(y, targets, d) for y, d in zip(ys, self.deferred)]
        return (self._head_loss(x, targets), *mtp)

    def _mtp_input(self, x: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """MTP module ``depth``'s projection of the hidden states ``x`` and of its tokens' embedding."""
        return self._mtp(self.cfg.n_layers + depth).project(x, self.mtp_embed(tokens, depth))

    def _reduced_experts(self, layer: int, recv: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        if self.expert_tp is not None:
            return self.expert_tp(layer, recv, counts, self._local_experts)
        return self.expert_output(self._local_experts(layer, recv, counts), layer)

    def _local_experts(self, layer: int, recv: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """Tokens arrive grouped by source rank, then by local expert: regroup by expert, run
        each expert once, and restore the arrival order."""
        experts = self._block(layer).moe.experts
        n = len(experts)
        flat_counts = torch.tensor([c for row in counts for c in row], device=recv.device)
        ids = torch.arange(n, device=recv.device).repeat(len(counts)).repeat_interleave(flat_counts)
        order = ids.argsort(stable=True)
        per_expert = [sum(row[e] for row in counts) for e in range(n)]
        ys = torch.cat([experts[e](t) for e, t in enumerate(recv[order].split(per_expert))])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return ys[inverse]

    def combine_post(self, layer: int, vals: dict[str, torch.Tensor], routing: dict[str, Any]) -> Record:
        """After the combine all-to-all: weight the expert outputs, sum per token, add the
        shared experts and the residual (``Block.forward_post``)."""
        names = [f"comb.{layer}", f"w.{layer}", f"xres.{layer}"]
        if f"shared.{layer}" in vals:
            names.append(f"shared.{layer}")
        inputs = {n: _leaf(vals[n]) for n in names}
        with torch.enable_grad():
            moe = self._block(layer).moe
            routed = moe.unpermute(inputs[names[0]], inputs[names[1]], routing[f"order.{layer}"],
                                   routing[f"ntok.{layer}"])
            x = Block.forward_post(inputs[names[2]], routed, inputs.get(f"shared.{layer}"))
        vals["x"] = x
        return Record(inputs, {"x": x}, [])


def _leaf(t: torch.Tensor) -> torch.Tensor:
    leaf = t.detach()
    return leaf.requires_grad_() if leaf.is_floating_point() else leaf


# --------------------------------------------------------------------------- backward


def _outputs_with_grads(rec: Record, grads: dict[str, torch.Tensor | None]):
    outs, gouts = [], []
    for name, t in rec.outputs.items():
        if t.requires_grad and name in grads:
            outs.append(t)
            gouts.append(grads[name])
    return outs, gouts


def _input_grads(rec: Record, got: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
    leaves = [(n, t) for n, t in rec.inputs.items() if t.requires_grad]
    return {n: g if g is not None else torch.zeros_like(t) for (n, t), g in zip(leaves, got)}


def backward_full(rec: Record, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """B: gradients w.r.t. the piece inputs (returned) and its parameters (accumulated)."""
    outs, gouts = _outputs_with_grads(rec, grads)
    leaves = [t for t in rec.inputs.values() if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, gouts)
    return _input_grads(rec, [t.grad for t in leaves])


def _grad_node(t: torch.Tensor) -> Node:
    """A tensor's grad_fn, or for a leaf its AccumulateGrad node."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _reverse_graph(roots: list[Node]) -> dict[Node, list[Node]]:
    reverse: dict[Node, list[Node]] = {}
    stack, seen = list(roots), set(roots)
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            reverse.setdefault(nxt, []).append(node)
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return reverse


def _climb(starts: list[Node], reverse: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from ``starts`` towards the outputs, not crossing ``stop``; returns
    (visited, the stop nodes hit)."""
    seen, hit = set(starts), set()
    stack = list(starts)
    while stack:
        for up in reverse.get(stack.pop(), []):
            if up in stop:
                hit.add(up)
            elif up not in seen:
                seen.add(up)
                stack.append(up)
    return seen, hit


@dataclass
class _WeightState:
    groups: list[dict[str, Any]]   # {"nodes": [...], "params": [...], "grads": [...]}
    orphans: list[nn.Parameter]    # parameters not behind any input path (e.g. embeddings)
    outs: list[torch.Tensor]
    gouts: list[torch.Tensor | None]
    jobs: list[WeightGradJob] = field(default_factory=list)  # DropOutputs' weights (Megatron layernorm, ...)


def backward_input(rec: Record, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """BI: gradients w.r.t. the piece inputs only; keeps what ``backward_weight`` needs."""
    outs, gouts = _outputs_with_grads(rec, grads)
    leaves = [t for t in rec.inputs.values() if t.requires_grad]
    if not outs or not leaves:
        rec.weight_state = _WeightState([], list(rec.params) if outs else [], outs, gouts)
        return _input_grads(rec, [None] * len(leaves))
    reverse = _reverse_graph([o.grad_fn for o in outs if o.grad_fn is not None])
    input_path, _ = _climb([_grad_node(x) for x in leaves], reverse, set())
    by_node: dict[Node, dict[str, Any]] = {}
    orphans = []
    for p in rec.params:
        acc = _grad_node(p)
        if acc not in reverse:
            continue  # unused in this piece
        _, hit = _climb([acc], reverse, input_path)
        if not hit:
            orphans.append(p)
            continue
        group = {"nodes": set(hit), "params": {acc: p}}
        for node in hit:  # merge groups that share a node
            other = by_node.get(node)
            if other is not None and other is not group:
                group["nodes"] |= other["nodes"]
                group["params"].update(other["params"])
        for node in group["nodes"]:
            by_node[node] = group
    groups = list({id(g): g for g in by_node.values()}.values())
    handles = []
    for g in groups:
        g["nodes"] = list(g["nodes"])
        g["grads"] = [None] * len(g["nodes"])
        for k, node in enumerate(g["nodes"]):
            def keep(grad_outputs, g=g, k=k):
                g["grads"][k] = grad_outputs
            handles.append(node.register_prehook(keep))
    try:
        with deferring_weight_grads() as jobs:
            got = torch.autograd.grad(outs, leaves, gouts, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    rec.weight_state = _WeightState(groups, orphans, outs if orphans else [], gouts if orphans else [], list(jobs))
    return _input_grads(rec, list(got))


def backward_weight(rec: Record, on_grad=None) -> None:
    """BW: the parameter gradients of a piece whose input gradients BI computed;
    ``on_grad(p)`` after each parameter's gradient is added (as a post-accumulate hook)."""
    ws: _WeightState | None = rec.weight_state
    if ws is None:
        return
    for job in ws.jobs:  # DropOutputs: their recomputed graphs, differentiated to the inputs in BI
        _accumulate(job.params, torch.autograd.grad(job.outputs, job.params, job.grads, allow_unused=True), on_grad)
    if ws.orphans:
        dws = torch.autograd.grad(ws.outs, ws.orphans, ws.gouts, retain_graph=True, allow_unused=True)
        _accumulate(ws.orphans, dws, on_grad)
    for g in ws.groups:
        edges, gs = [], []
        for node, grad_tuple in zip(g["nodes"], g["grads"]):
            for k, grad in enumerate(grad_tuple or ()):
                if grad is not None:
                    edges.append(GradientEdge(node, k))
                    gs.append(grad)
        if not edges:
            continue
        handles = []
        if len(g["nodes"]) > 1:  # feed each node exactly what it got in BI (no double counting)
            for node, grad_tuple in zip(g["nodes"], g["grads"]):
                handles.append(node.register_prehook(lambda _, saved=grad_tuple: saved))
        try:
            accs = list(g["params"])
            dws = torch.autograd.grad(edges, [GradientEdge(a, 0) for a in accs], gs, retain_graph=True,
                                      allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        _accumulate([g["params"][a] for a in accs], dws, on_grad)
    rec.weight_state = None


def _accumulate(params: list[nn.Parameter], grads, on_grad=None) -> None:
    with torch.no_grad():
        for p, g in zip(params, grads):
            if g is not None:
                p.grad.add_(g)
                if on_grad is not None:
                    on_grad(p)
