"""Real tensor (and sequence) parallelism for transformer stages of the zoo, Megatron-style.

Each tensor-parallel rank takes its shard of the stage's units (those ``shard_tensor``
selected, `sharded_units`; every one by default, the others stay whole and replicated) *after*
they are built with the single-process model's weights (`shard_stage`): q/k/v and the first MLP linears are
column-parallel (rows ``[r·n/T, (r+1)·n/T)`` of their weights and biases), the attention
output and the last MLP linear row-parallel (the same columns; a bias is added once, after
the reduction), the embedding and head vocabulary-parallel (rows of the vocabulary); norms
are replicated; MoE experts keep ``expert_ffn / T`` columns each (router replicated; the routed
tokens pass ``f`` before the experts and their outputs ``g`` after them, `Stage.expert_input` /
`expert_output`; under sequence parallelism each rank routes its shard and the experts'
tokens are all-gathered over TP after the dispatch, their outputs reduce-scattered before the
combine, `sp_experts`; without expert parallelism the layer runs whole, `tp_moe_layer`; biased
experts add their last bias once per group, `TPExpert`), shared experts are a column/row-parallel
MLP on the same ``f``-passed tokens (`TPSharedMLP`); multi-head latent attention shards its heads (`TPMLAttention`). So ``--check`` compares each rank's shard with the same slice of the
reference parameters (`TPShard.reference_view`).

The collectives run inside the modules, as autograd functions over the plan's ``tp``
process group (Shoeybi et al. 2019; Korthikanti et al. 2022):

- without sequence parallelism, ``f`` (identity forward, all-reduce backward) before the
  column-parallel linears and ``g`` (all-reduce forward, identity backward) after the
  row-parallel one;
- with sequence parallelism a layer holds its ``s / T`` shard of the sequence: the
  column-parallel linears all-gather it (and in backward gather it again for the weight
  gradients, ``.regather``, then reduce-scatter the input gradient), the row-parallel
  output is reduce-scattered (backward: all-gather); the embedding reduce-scatters;
- the vocabulary-parallel cross entropy all-reduces the max logit, the target logit and
  the sum of exponentials of every token (backward is local).

How the plan's ``TP.*`` ops are honoured: the compiler puts a unit's TP collectives right
after its compute piece (``piece -> its collectives -> next piece``), so the collectives
cannot run at their plan position without splitting the layer. Instead every collective a
module performs is logged (`TPComm.log`: name, kind, start, end) under the pass it ran in
(``F``/``B``, stage, micro-batch); when the runtime reaches a plan TP op it takes the next
logged collective of that pass, requires the same name and kind (else the op fails), and
records the logged start and end as the op's event. A collective the plan does not list is
left over at the end of the step, which fails the step. ``TP.s{S}.norms`` (the norms'
weight-gradient all-reduce under sequence parallelism) is performed at its plan position
(`TensorParallel.op`), and so is a split backward's ``.regather`` (BI keeps the input shard of
each column-parallel block, the op gathers it, BW computes the weight gradients from it:
`_GatherColumns`, `TPComm.regather`). Under ZeRO-3 ``TP.s{S}.norms`` sums the reduced shard's part
of the partial gradients, after the stage's reduce-scatters.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from executor.collectives import all_gather_flat, group_ranks, reduce_scatter_flat
from executor.parallel.axis import Axis, Handler, Logged, Posted
from executor.parallel.data import is_grad_sync
from piper_sim.header import TensorParallelHeader
from piper_sim.models import Block, Embedding, GeluMLP, GQAttention, Head, Linear, MLAttention, MTPLayer, SwiGLU, \
    apply_rope, attention_core, mtp_loss, rope_cos_sin, vocab_shard_lookup
from piper_sim.user_tp import Region, UnitTP, analyse_units, shard_unit

# the compiler's stream of tensor-parallel collectives (piper_sim.ir.TP_STREAM; the IR is not
# imported here: it pulls in the compiler's dependencies)
TP_STREAM = "tp"


def is_tp(ins) -> bool:
    return ins.stream == TP_STREAM


@dataclass
class TPComm:
    """This rank's tensor-parallel group and the log of the collectives it ran."""

    WHAT = "tensor parallel"  # names the parallelism in errors (executor.parallel.context.CPComm)
    group: Any
    size: int
    index: int
    sp: bool
    phase: tuple[str, int, int] | None = None     # (F|B, stage, micro-batch) being run
    log: dict[tuple[str, int, int], deque] = field(default_factory=dict)
    split: str = ""  # "BI" / "BW" while a split backward's half runs (`_GatherColumns`)
    # BI's saved sequence shards awaiting the plan's ``.regather`` op: (pass, label) -> {"x"} / {"total"}
    pending: dict[tuple[tuple[str, int, int], str], dict] = field(default_factory=dict)

    def _run(self, name: str, kind: str, fn, log: bool = True) -> None:
        t0 = time.perf_counter()
        fn()
        if log:
            self.record(name, kind, t0, time.perf_counter())

    def record(self, name: str, kind: str, start: float, end: float) -> None:
        """Log one collective (or a ring of p2p steps standing for one) of the running pass."""
        self.log.setdefault(self.phase or ("?", -1, -1), deque()).append(Logged(name, kind, start, end))

    def take(self, key: tuple[str, int, int], name: str, kind: str) -> Logged:
        """The next collective logged in pass ``key``; it must be ``name`` of ``kind``."""
        q = self.log.get(key)
        if not q:
            raise RuntimeError(f"{self.WHAT}: the plan expects {name} ({kind}) but the modules performed no "
                               "further collective in this pass")
        got = q.popleft()
        if (got.name, got.kind) != (name, kind):
            raise RuntimeError(f"{self.WHAT}: the plan expects {name} ({kind}) but the modules performed "
                               f"{got.name} ({got.kind}), then {[x.name for x in list(q)[:4]]}")
        return got

    def leftover(self) -> list[str]:
        out = [f"{k[0]}.s{k[1]}.mb{k[2]}:{x.name}" for k, q in self.log.items() for x in q]
        self.log.clear()
        return out

    # collectives (synchronous, logged)
    def all_reduce(self, t: torch.Tensor, name: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
        t = t.contiguous()
        self._run(name, "ALLREDUCE", lambda: dist.all_reduce(t, op=op, group=self.group))
        return t

    def gather_seq(self, x: torch.Tensor, name: str, log: bool = True) -> torch.Tensor:
        """``[B, s/T, ...]`` shards -> ``[B, s, ...]`` (rank order along the sequence)."""
        shard = x.transpose(0, 1).contiguous()
        out = shard.new_empty(shard.shape[0] * self.size, *shard.shape[1:])
        self._run(name, "ALL_GATHER", lambda: all_gather_flat(out, shard, self.index, self.size, group=self.group), log)
        return out.transpose(0, 1).contiguous()

    def regather(self, key: tuple[str, int, int], name: str) -> Logged:
        """A split backward's ``{label}.regather`` at its plan position, between BI and BW: the
        shard BI kept, gathered for BW's weight gradients."""
        box = self.pending.pop((key, name.removesuffix(".regather")))
        t0 = time.perf_counter()
        box["total"] = self.gather_seq(box.pop("x"), name, log=False)
        return Logged(name, "ALL_GATHER", t0, time.perf_counter())

    def scatter_seq(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Sum over the group of ``[B, s, ...]``, this rank's ``[B, s/T, ...]`` shard of it."""
        full = x.transpose(0, 1).contiguous()
        if full.data_ptr() == x.data_ptr() and dist.get_backend(self.group) == "gloo":  # writes its piece of the input
            full = full.clone()
        got = {}

        def scatter():
            got["piece"] = reduce_scatter_flat(full.view(-1), self.index, self.size, group=self.group)[1]
        self._run(name, "REDUCE_SCATTER", scatter)
        out = got["piece"].view(full.shape[0] // self.size, *full.shape[1:]).transpose(0, 1).contiguous()
        # on gloo the piece is a view of the whole reduced buffer: keep only the piece alive
        return out.clone() if out.untyped_storage().data_ptr() == full.untyped_storage().data_ptr() else out

    def gather_rows(self, x: torch.Tensor, name: str, counts: list[int] | None = None,
                    sizes: list[int] | None = None) -> tuple[torch.Tensor, list[list[int]]]:
        """All-gather of each member's rows ``[n_r, h]`` (``n_r`` differing: routed tokens),
        in member order; returns them and every member's ``counts``. Given ``counts`` (this
        member's rows per group, summing to ``n_r``) the members first exchange them, then the
        rows, padded to the longest (Megatron-Core's dispatcher gathers the token counts too):
        one logged collective; given every member's ``sizes``, only the rows."""
        got: dict[str, Any] = {}

        def run():
            per = [[n] for n in sizes] if sizes is not None else None
            if per is None:
                mine = torch.tensor(counts, dtype=torch.int64, device=x.device)
                every = mine.new_empty(self.size * mine.numel())
                all_gather_flat(every, mine, self.index, self.size, group=self.group)
                per = every.view(self.size, -1).tolist()
            lens = [sum(c) for c in per]
            m = max(lens)
            out = x.new_empty(self.size * m, *x.shape[1:])
            if m:
                pad = torch.cat([x, x.new_zeros(m - x.shape[0], *x.shape[1:])])
                all_gather_flat(out, pad, self.index, self.size, group=self.group)
            got["rows"] = torch.cat([out[i * m:i * m + n] for i, n in enumerate(lens)])
            got["per"] = per
        self._run(name, "ALL_GATHER", run)
        return got["rows"], got["per"]

    def scatter_rows(self, y: torch.Tensor, sizes: list[int], name: str) -> torch.Tensor:
        """Sum over the group of ``y`` (every member's rows end to end, ``sizes`` of them),
        this member's rows (`gather_rows`' reverse): a reduce-scatter of blocks padded to the
        longest."""
        m, got = max(sizes), {}

        def run():
            full = y.new_zeros(self.size * m, *y.shape[1:])
            for i, (block, n) in enumerate(zip(y.split(sizes), sizes)):
                full[i * m:i * m + n] = block
            piece = reduce_scatter_flat(full.view(-1), self.index, self.size, group=self.group)[1] if m else full
            got["rows"] = piece.view(m, *y.shape[1:])[:sizes[self.index]].clone()
        self._run(name, "REDUCE_SCATTER", run)
        return got["rows"]


# --------------------------------------------------------------------------- autograd functions


class _CopyToTP(torch.autograd.Function):
    """``f``: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, tp: TPComm, name: str):
        ctx.tp, ctx.name = tp, name
        ctx.save_for_backward(x.new_empty(0))  # under full recomputation: re-run the forward first (_ScatterSeq)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.saved_tensors
        return ctx.tp.all_reduce(g.clone(), ctx.name), None, None


class _CopyManyToTP(torch.autograd.Function):
    """``f`` over several tensors (MLA's latents): identity forward; backward all-reduces
    their input gradients together, one collective."""

    @staticmethod
    def forward(ctx, tp: TPComm, name: str, *xs):
        ctx.tp, ctx.name = tp, name
        ctx.save_for_backward(xs[0].new_empty(0))  # as _CopyToTP
        ctx.shapes = [x.shape for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.saved_tensors
        flat = torch.cat([(g if g is not None else torch.zeros(s, device=grads[0].device, dtype=grads[0].dtype))
                          .reshape(-1) for g, s in zip(grads, ctx.shapes)])
        flat = ctx.tp.all_reduce(flat, ctx.name)
        return (None, None, *(t.view(s) for t, s in zip(flat.split([s.numel() for s in ctx.shapes]), ctx.shapes)))


class _ReduceFromTP(torch.autograd.Function):
    """``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, tp: TPComm, name: str):
        return tp.all_reduce(x.clone(), name)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _ScatterSeq(torch.autograd.Function):
    """Sequence parallel: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, tp: TPComm, fwd: str, bwd: str):
        ctx.tp, ctx.bwd = tp, bwd
        # an empty saved tensor: under full recomputation, reading it makes the checkpoint
        # re-run its forward (and collectives) before this backward's all-gather, as the plan orders
        ctx.save_for_backward(x.new_empty(0))
        return tp.scatter_seq(x, fwd)

    @staticmethod
    def backward(ctx, g):
        ctx.saved_tensors
        return ctx.tp.gather_seq(g, ctx.bwd), None, None, None


class _GatherSeq(torch.autograd.Function):
    """Sequence parallel, torch's style: all-gather along the sequence forward (the gathered
    tensor is what the column-parallel linears keep), reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp: TPComm, fwd: str, bwd: str):
        ctx.tp, ctx.bwd = tp, bwd
        ctx.save_for_backward(x.new_empty(0))  # as _ScatterSeq: a full recompute re-runs the forward first
        return tp.gather_seq(x, fwd)

    @staticmethod
    def backward(ctx, g):
        ctx.saved_tensors
        return ctx.tp.scatter_seq(g, ctx.bwd), None, None, None


class _GatherRows(torch.autograd.Function):
    """MoE under sequence parallelism: all-gather over TP of the experts' routed tokens (each
    member's counts exchanged first, `TPComm.gather_rows`); backward: reduce-scatter of their
    gradients. ``per`` receives every member's counts."""

    @staticmethod
    def forward(ctx, x, tp: TPComm, counts: list[int], fwd: str, bwd: str, per: list):
        rows, every = tp.gather_rows(x, fwd, counts=counts)
        ctx.tp, ctx.bwd, ctx.sizes = tp, bwd, [sum(c) for c in every]
        per.extend(every)
        return rows

    @staticmethod
    def backward(ctx, g):
        return ctx.tp.scatter_rows(g, ctx.sizes, ctx.bwd), None, None, None, None, None


class _ScatterRows(torch.autograd.Function):
    """MoE under sequence parallelism: reduce-scatter over TP of the experts' partial outputs
    back to the members whose tokens they are; backward: all-gather of the gradients."""

    @staticmethod
    def forward(ctx, y, tp: TPComm, sizes: list[int], fwd: str, bwd: str):
        ctx.tp, ctx.sizes, ctx.bwd = tp, sizes, bwd
        ctx.save_for_backward(y.new_empty(0))  # as _ScatterSeq: a full recompute re-runs the forward first
        return tp.scatter_rows(y, sizes, fwd)

    @staticmethod
    def backward(ctx, g):
        ctx.saved_tensors
        return ctx.tp.gather_rows(g.contiguous(), ctx.bwd, sizes=ctx.sizes)[0], None, None, None, None


def sp_experts(tp: TPComm, label: str, layer: int, recv: torch.Tensor, counts: list[list[int]], run) -> torch.Tensor:
    """A MoE layer's local experts under tensor and sequence parallelism (Megatron-Core's
    all-to-all dispatcher with SP): the tokens the EP dispatch brought this rank (``counts``:
    per source rank, per local expert) are all-gathered over TP (``l{L}.moe.ag``), each expert's
    ``expert_ffn / T`` columns run on all of them (``run``: `executor.stage.Stage._local_experts`)
    and the partial outputs are reduce-scattered back to their members (``l{L}.moe.rs``)."""
    n, per = len(counts[0]), []
    rows = _GatherRows.apply(recv, tp, [c for row in counts for c in row], f"{label}.moe.ag", f"{label}.moe.rs",
                             per)
    groups = [p[i:i + n] for p in per for i in range(0, len(p), n)]  # member, then source rank
    y = run(layer, rows, groups)
    return _ScatterRows.apply(y, tp, [sum(p) for p in per], f"{label}.moe.rs", f"{label}.moe.ag")


class _GatherColumns(torch.autograd.Function):
    """Sequence parallel: all-gather the sequence shard, then column-parallel linears
    ``(weight, bias)*``; keeps only the shard, gathers it again in backward for the weight
    gradients (``.regather``) and reduce-scatters the input gradient (Megatron)."""

    @staticmethod
    def forward(ctx, x, tp: TPComm, label: str, *wb):
        ctx.tp, ctx.label = tp, label
        total = tp.gather_seq(x, f"{label}.ag")
        ctx.save_for_backward(x, *[t for t in wb if t is not None])
        ctx.has_bias = [b is not None for b in wb[1::2]]
        return tuple(F.linear(total, w, b) for w, b in zip(wb[0::2], wb[1::2]))

    @staticmethod
    def backward(ctx, *grads):
        """Split backward (zero-bubble): BI computes ``grad_x`` and leaves the shard to the plan's
        ``.regather`` op (`TPComm.regather`); BW (autograd calls this node again with the same
        gradients, `executor.stage.backward_weight`) computes the weight gradients from it."""
        x, *saved = ctx.saved_tensors
        tp, it = ctx.tp, iter(saved)
        wb = []
        for has in ctx.has_bias:
            wb += [next(it), next(it) if has else None]
        weights = wb[0::2]
        if tp.split == "BW":
            total = ctx.box.pop("total", None)
            if total is None:
                raise RuntimeError(f"tensor parallel: the weight gradients of {ctx.label} ran before the plan's "
                                   f"{ctx.label}.regather")
            grad_x = None
        else:
            grad_total = None
            for g, w in zip(grads, weights):
                if g is not None:
                    gi = g @ w
                    grad_total = gi if grad_total is None else grad_total + gi
            total = None if tp.split == "BI" else tp.gather_seq(x, f"{ctx.label}.regather")
            if grad_total is None:
                grad_total = x.new_zeros(x.shape[0], x.shape[1] * tp.size, *x.shape[2:])
            grad_x = tp.scatter_seq(grad_total, f"{ctx.label}.rs")
            if tp.split == "BI":
                ctx.box = tp.pending[(tp.phase, ctx.label)] = {"x": x}
                return (grad_x, None, None, *[None] * len(wb))
        out: list[torch.Tensor | None] = []
        flat_total = total.reshape(-1, total.shape[-1])
        for g, (w, b) in zip(grads, zip(wb[0::2], wb[1::2])):
            if g is None:
                out += [None, None]
                continue
            g2 = g.reshape(-1, g.shape[-1])
            out += [g2.t() @ flat_total, g2.sum(0) if b is not None else None]
        return (grad_x, None, None, *out)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross entropy over vocabulary-parallel logits ``[N, V/T]`` (fp32): three
    all-reduces (max, target logit, sum of exponentials); the backward is local."""

    @staticmethod
    def forward(ctx, logits, targets, tp: TPComm, lo: int, label: str):
        n = logits.shape[-1]
        m = tp.all_reduce(logits.max(-1).values, f"{label}.loss.max", op=dist.ReduceOp.MAX)
        z = logits - m[:, None]
        local = targets - lo
        inside = (local >= 0) & (local < n)
        idx = local.clamp(0, n - 1)
        pred = tp.all_reduce(z.gather(1, idx[:, None]).squeeze(1) * inside, f"{label}.loss.target")
        e = z.exp()
        sumexp = tp.all_reduce(e.sum(-1), f"{label}.loss.sumexp")
        ctx.save_for_backward(e / sumexp[:, None], idx, inside)
        return sumexp.log() - pred

    @staticmethod
    def backward(ctx, g):
        softmax, idx, inside = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, idx] -= inside.to(grad.dtype)
        return grad * g[:, None], None, None, None, None


class _GatherHidden(torch.autograd.Function):
    """Column shards ``[..., h/T]`` all-gathered into ``[..., h]`` (Megatron's
    ``gather_from_tensor_model_parallel_region``); backward: this rank's columns of the gradient."""

    @staticmethod
    def forward(ctx, x, tp: TPComm, name: str):
        ctx.tp, ctx.n = tp, x.shape[-1]
        return tp.gather_seq(x.movedim(-1, 1), name).movedim(1, -1).contiguous()

    @staticmethod
    def backward(ctx, g):
        i, n = ctx.tp.index, ctx.n
        return g[..., i * n:(i + 1) * n].contiguous(), None, None


class _SplitSeq(torch.autograd.Function):
    """Sequence parallel: this rank's ``[B, s/T, ...]`` chunk of a tensor every rank holds whole
    (Megatron's ``scatter_to_sequence_parallel_region``: no collective); backward: all-gather."""

    @staticmethod
    def forward(ctx, x, tp: TPComm, bwd: str):
        ctx.tp, ctx.bwd = tp, bwd
        ctx.save_for_backward(x.new_empty(0))  # as _ScatterSeq: a full recompute re-runs the forward first
        n = x.shape[1] // tp.size
        return x[:, tp.index * n:(tp.index + 1) * n].contiguous()

    @staticmethod
    def backward(ctx, g):
        ctx.saved_tensors
        return ctx.tp.gather_seq(g, ctx.bwd), None, None


# --------------------------------------------------------------------------- parallel linears


def column(tp: TPComm, x: torch.Tensor, linears: list[Linear], label: str) -> list[torch.Tensor]:
    """Column-parallel linears sharing input ``x`` (the sequence shard under SP)."""
    if tp.sp:
        wb = [t for lin in linears for t in (lin.weight, lin.bias)]
        return list(_GatherColumns.apply(x, tp, label, *wb))
    x = _CopyToTP.apply(x, tp, f"{label}.ar")
    return [lin(x) for lin in linears]


def row(tp: TPComm, x: torch.Tensor, lin: Linear, label: str) -> torch.Tensor:
    """Row-parallel linear: partial products summed over the group (SP: reduce-scattered to
    the sequence shard), then the bias once."""
    y = F.linear(x, lin.weight)
    y = _ScatterSeq.apply(y, tp, f"{label}.rs", f"{label}.ag") if tp.sp else _ReduceFromTP.apply(y, tp, f"{label}.ar")
    return y + lin.bias if lin.bias is not None else y


class TPAttention(nn.Module):
    """`GQAttention` on this rank's heads (same parameter names); a ``qk_norm`` model's
    query/key norms whole (over the head dim, shared by the heads: partial gradients, summed
    by ``TP.s{S}.norms``)."""

    def __init__(self, base: GQAttention, tp: TPComm, label: str):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = base.wq, base.wk, base.wv, base.wo
        if base.cfg.qk_norm:
            self.q_norm, self.k_norm = base.q_norm, base.k_norm
        self.cfg, self.window, self.tp, self.label = base.cfg, base.window, tp, label
        self.recompute_core = base.recompute_core
        self.heads, self.kv_heads = base.cfg.n_heads // tp.size, base.cfg.n_kv_heads // tp.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        q, k, v = column(self.tp, x, [self.wq, self.wk, self.wv], self.label)
        B, s = q.shape[:2]
        q = q.view(B, s, self.heads, c.head_dim)
        k = k.view(B, s, self.kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(B, s, self.kv_heads, c.head_dim).transpose(1, 2)
        if c.rope:
            cos, sin = rope_cos_sin(s, c.head_dim, c.rope_theta, q.device, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attention_core(q, k, v, self.recompute_core, self.window)
        return row(self.tp, o.transpose(1, 2).reshape(B, s, -1), self.wo, self.label)


class TPMLAttention(MLAttention):
    """`MLAttention` on this rank's heads (same parameter names; Megatron-Core's MLA): the
    down-projections and their norms replicated, computed whole from the whole input (so their
    gradients are whole), the latents and rotary key then pass ``f`` (one all-reduce of their
    gradients, ``{label}.ar``) into the column-parallel up-projections (``wq``/``wq_b``,
    ``wkv_b``); ``wo`` row-parallel. Under sequence parallelism the linears that read the input
    (the down-projections; ``wq`` without a query latent) are column linears on the gathered
    sequence (`column`: ``{label}.ag``, in backward ``.regather`` and the reduce-scatter of the
    input gradient, ``.rs``); their input gradients, partial per rank (its heads), are summed
    by that reduce-scatter, the replicated weights' by ``TP.s{S}.norms`` (as the norms')."""

    def __init__(self, base: MLAttention, tp: TPComm, label: str):
        nn.Module.__init__(self)
        for name, mod in base.named_children():
            setattr(self, name, mod)
        self.cfg, self.recompute_core, self.tp, self.label = base.cfg, base.recompute_core, tp, label
        self.local = base.cfg.n_heads // tp.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.sp:
            q_in, kv, k_pe = _CopyManyToTP.apply(self.tp, f"{self.label}.ar", *self.latents(x))
            return row(self.tp, self.heads(q_in, kv, k_pe, self.local), self.wo, self.label)
        lora = bool(self.cfg.q_lora_rank)
        q, kv_a = column(self.tp, x, [self.wq_a if lora else self.wq, self.wkv_a], self.label)
        q_in, kv, k_pe = self.normed_latents(q, kv_a)
        return row(self.tp, self.heads(q_in, kv, k_pe, self.local, q_projected=not lora), self.wo, self.label)


class TPMLP(nn.Module):
    """`SwiGLU` / `GeluMLP` on this rank's ``ffn / T`` columns (same parameter names)."""

    def __init__(self, base: nn.Module, tp: TPComm, label: str):
        super().__init__()
        self.gelu = isinstance(base, GeluMLP)
        for name, mod in base.named_children():
            setattr(self, name, mod)
        self.tp, self.label = tp, label

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu:
            (h,) = column(self.tp, x, [self.fc1], self.label)
            return row(self.tp, F.gelu(h), self.fc2, self.label)
        a, b = column(self.tp, x, [self.w1, self.w3], self.label)
        return row(self.tp, F.silu(a) * b, self.w2, self.label)


class TPSharedMLP(TPMLP):
    """A MoE block's shared experts (`SwiGLU`) on this rank's columns (Megatron-Core's
    tensor-parallel ``SharedExpertMLP``): they read the routed experts' input, which already
    passed ``f`` (`Block.forward_pre`'s ``dispatch``: one all-reduce of both input gradients);
    the row-parallel output is all-reduced (``{label}.ar``) before it joins the routed output.
    Under sequence parallelism the tokens are the rank's shard: a column/row-parallel MLP with
    SP's all-gather and reduce-scatter (`TPMLP`: ``{label}.ag``, ``.rs``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.sp:  # x [T/tp, h]: one sequence of the shard's tokens for SP's gather
            return TPMLP.forward(self, x[None])[0]
        if self.gelu:
            return row(self.tp, F.gelu(self.fc1(x)), self.fc2, self.label)
        return row(self.tp, F.silu(self.w1(x)) * self.w3(x), self.w2, self.label)


class TPEmbedding(nn.Module):
    """Vocabulary-parallel embedding: rows ``[lo, lo + V/T)``; other tokens give zeros, the
    group's sum (SP: reduce-scattered) is the full embedding."""

    def __init__(self, base: Embedding, tp: TPComm, lo: int):
        super().__init__()
        self.weight, self.tp, self.lo = base.weight, tp, lo

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(self.tp, self.weight, self.lo, tokens, "embed")


def vocab_parallel_embedding(tp: TPComm, weight: torch.Tensor, lo: int, tokens: torch.Tensor,
                             label: str) -> torch.Tensor:
    """The embedding of ``tokens`` from the vocabulary rows ``[lo, lo + V/T)`` this rank holds
    (zeros for the others), summed over the group (``{label}.ar``; SP: reduce-scattered to
    the sequence shard, ``{label}.rs``, its backward ``{label}.ag``)."""
    out = vocab_shard_lookup(tokens, weight, lo)
    if tp.sp:
        return _ScatterSeq.apply(out, tp, f"{label}.rs", f"{label}.ag")
    return _ReduceFromTP.apply(out, tp, f"{label}.ar")


class TPHead(nn.Module):
    """Replicated final norm, then the vocabulary-parallel output projection (logits of
    this rank's vocabulary rows). A tied head projects with the embedding's shard of the same
    rows (``tied``), so the one parameter gets both gradients, each whole for its rows (as
    Megatron's vocabulary-parallel tied embedding on one stage)."""

    def __init__(self, base: Head, tp: TPComm, tied: nn.Parameter | None = None):
        super().__init__()
        self.norm, self.tp = base.norm, tp
        if tied is None:
            self.out = base.out
        else:
            self.out = Linear(tied.shape[1], tied.shape[0])
            self.out.weight = tied  # shared: named once (embed.weight) in the stage's parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column(self.tp, self.norm(x), [self.out], "head")[0]

    @property
    def out_weight(self) -> torch.Tensor:
        """This rank's vocabulary rows of the output layer (`models.Head.out_weight`)."""
        return self.out.weight


def vocab_parallel_loss(tp: TPComm, lo: int, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy of vocabulary-parallel logits (as ``models.lm_loss``)."""
    return _VocabParallelCE.apply(logits.flatten(0, 1).float(), targets.flatten(), tp, lo, "head").mean()


def tp_mtp_input(mtp: MTPLayer, tp: TPComm, label: str, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """An MTP module's ``eh_proj`` as Megatron-Core runs it (`piper_sim.parallel.tensor._eh_proj_collectives`):
    column-parallel on ``[enorm(emb); hnorm(x)]`` (SP: the sequence shards, gathered), its column
    shards all-gathered over the hidden dim (``{label}.eh.gather``), under SP split back to this
    rank's sequence chunk (backward: ``{label}.eh.scatter.ag``)."""
    z = column(tp, torch.cat((mtp.enorm(emb), mtp.hnorm(x)), -1), [mtp.eh_proj], f"{label}.eh")[0]
    z = _GatherHidden.apply(z, tp, f"{label}.eh.gather")
    return _SplitSeq.apply(z, tp, f"{label}.eh.scatter.ag") if tp.sp else z


def tp_mtp_loss(tp: TPComm, lo: int, head: TPHead, cfg, y: torch.Tensor, targets: torch.Tensor,
                depth: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """MTP module ``depth``'s loss through the shared vocabulary-parallel head (its own
    collectives, ``mtp.d.head.*``: `piper_sim.parallel.tensor._block_collectives`); ``positions``:
    a context-parallel rank's (`models.mtp_loss`)."""
    label = f"mtp.{depth}.head"
    logits = column(tp, y, [head.out], label)[0]
    return mtp_loss(logits, targets, depth, cfg, ce=lambda z, t: _VocabParallelCE.apply(z, t, tp, lo, label),
                    positions=positions)


# --------------------------------------------------------------------------- sharding a stage


@dataclass
class TPShard:
    """Which slice of each reference parameter this rank holds: name -> (dim, lo, hi)."""

    slices: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    def reference_view(self, name: str, full: torch.Tensor) -> torch.Tensor:
        s = self.slices.get(name)
        return full if s is None else full.narrow(s[0], s[1], s[2] - s[1])

    def replicated(self, named: list[tuple[str, nn.Parameter]]) -> list[nn.Parameter]:
        """Parameters every member of the group holds whole (norms, row-parallel biases)."""
        return [p for n, p in named if n not in self.slices]

    # a user model's stage (`shard_user_stage`): its replicated parameters with partial gradients, by name
    user_partial: frozenset[str] | None = None

    def partial(self, named: list[tuple[str, nn.Parameter]], sp: bool, qk_norm: bool) -> list[nn.Parameter]:
        """The replicated parameters whose gradients are partial per rank, so summed over the
        group (``TP.s{S}.norms``): all of them under sequence parallelism (each rank saw its
        sequence shard), else a ``qk_norm`` model's query/key norms (each rank normalised only
        its heads); a user model's: those the compiler's trace found (`piper_sim.user_tp.analyse_units`)."""
        if self.user_partial is not None:
            return [p for n, p in named if n in self.user_partial]
        return [p for n, p in named if n not in self.slices
                and (sp or (qk_norm and (".attn.q_norm." in n or ".attn.k_norm." in n)))]


def _take(shard: TPShard, tp: TPComm, prefix: str, mod: nn.Module, attr: str, dim: int) -> None:
    p = getattr(mod, attr)
    if p is None:
        return
    n = p.shape[dim] // tp.size
    lo = tp.index * n
    setattr(mod, attr, nn.Parameter(p.data.narrow(dim, lo, n).clone()))
    shard.slices[f"{prefix}.{attr}"] = (dim, lo, lo + n)


def _columns(shard: TPShard, tp: TPComm, prefix: str, lin: Linear) -> None:
    _take(shard, tp, prefix, lin, "weight", 0)
    _take(shard, tp, prefix, lin, "bias", 0)


def sharded_units(tp: TensorParallelHeader) -> Callable[[str], bool]:
    """Which units the plan shards (``shard_tensor``'s selection, `piper_sim.directives.Setup.tp_sharded`):
    every one unless the plan's ``tensor_parallel`` header lists ``layers`` (and ``embedding``, ``head``)."""
    if tp.layers is None:
        return lambda unit: True
    layers = set(tp.layers)
    return lambda unit: tp.embedding if unit == "embed" else tp.head if unit == "head" else \
        int(unit.split(".")[1]) in layers


def shard_stage(stage, tp: TPComm, sharded: Callable[[str], bool] | None = None) -> TPShard:
    """Replace ``stage``'s units (built with the full model's weights) by this rank's
    tensor-parallel shard of them; sets the stage's loss to the vocabulary-parallel one.
    ``sharded`` (default: every unit) selects the units to shard; the others stay whole and
    replicated (every member of the group runs them on the same tokens, with identical
    gradients: no collective)."""
    shard = TPShard()
    units = stage.units
    stage.recompute_early_stop = False
    sharded = sharded or (lambda unit: True)
    for name in units.unit_names():
        unit = units[name]
        if not sharded(name):
            continue
        if name == "embed":
            _take(shard, tp, "embed", unit, "weight", 0)
            units["embed"] = TPEmbedding(unit, tp, shard.slices["embed.weight"][1])
        elif name == "head":
            if unit.tied_weight is not None:  # the embedding's vocabulary rows, sharded above
                lo = shard.slices["embed.weight"][1]
                units["head"] = TPHead(unit, tp, tied=units["embed"].weight)
            else:
                _columns(shard, tp, "head.out", unit.out)
                lo = shard.slices["head.out.weight"][1]
                units["head"] = TPHead(unit, tp)
            stage.loss_fn = lambda logits, targets, lo=lo: vocab_parallel_loss(tp, lo, logits, targets)
        elif name.startswith("mtp."):
            mtp: MTPLayer = unit
            _columns(shard, tp, f"{name}.eh_proj", mtp.eh_proj)
            mtp.project = functools.partial(tp_mtp_input, mtp, tp, name)
            _shard_block(stage, shard, tp, f"{name}.block", mtp.block, stage.cfg.n_layers + int(name.split(".")[1]))
        else:
            _shard_block(stage, shard, tp, name, unit, int(name.split(".")[1]))
    if "mtp_embed" in units and sharded("embed"):  # an untied model's copy of the embedding for its MTP modules
        _take(shard, tp, "mtp_embed", units["mtp_embed"], "weight", 0)
    if any(u.startswith("mtp.") for u in units.unit_names()):
        lo = tp.index * stage.mtp_embedding().shape[0]  # every vocabulary shard: rows [lo, lo + V/T)
        stage.mtp_embed = lambda tokens, depth: vocab_parallel_embedding(tp, stage.mtp_embedding(), lo, tokens,
                                                                         f"mtp.{depth}.embed")
        stage.mtp_loss_fn = lambda y, targets, depth: tp_mtp_loss(tp, lo, units["head"], stage.cfg, y, targets, depth,
                                                                  stage.positions)
    stage.collect_piece_params()  # the pieces' parameters are the shards now
    moe_tp = any(u.startswith(("layers.", "mtp.")) and units[u].is_moe and sharded(u)
                 for u in units.unit_names())
    unit = functools.partial(stage.unit_of, "layer")
    if moe_tp and tp.sp:  # the router and dispatch read the shard; the experts gather over TP (sp_experts)
        stage.expert_tp = lambda layer, recv, counts, run: sp_experts(tp, layer_label(unit(layer)), layer, recv,
                                                                      counts, run) \
            if sharded(unit(layer)) else run(layer, recv, counts)
    elif moe_tp:
        stage.expert_input = lambda h, layer: _CopyToTP.apply(h, tp, f"{layer_label(unit(layer))}.moe.ar") \
            if sharded(unit(layer)) else h
        stage.expert_output = lambda y, layer: _ReduceFromTP.apply(y, tp, f"{layer_label(unit(layer))}.moe.ar") \
            if sharded(unit(layer)) else y
    return shard


def layer_label(unit: str) -> str:
    """The prefix of a layer unit's TP collectives in the plan: ``layers.3`` -> ``l3``, an MTP
    module's ``mtp.0`` itself (`piper_sim.parallel.tensor.layer_label`)."""
    return "l" + unit.split(".")[1] if unit.startswith("layers.") else unit


def _shard_block(stage, shard: TPShard, tp: TPComm, prefix: str, block: Block, layer: int) -> None:
    """A transformer layer's shard (``prefix``: its parameters' names; ``layer``: its index, an
    MTP module's ``n_layers + d``): attention heads, the MLP's or the experts' columns."""
    label = layer_label(stage.unit_of("layer", layer))
    attn = block.attn
    mla = isinstance(attn, MLAttention)
    ups = (("wq_b" if attn.cfg.q_lora_rank else "wq"), "wkv_b") if mla else ("wq", "wk", "wv")
    for lin in ups:
        _columns(shard, tp, f"{prefix}.attn.{lin}", getattr(attn, lin))
    _take(shard, tp, f"{prefix}.attn.wo", attn.wo, "weight", 1)
    block.attn = (TPMLAttention if mla else TPAttention)(attn, tp, f"{label}.attn")
    if block.is_moe:
        _shard_experts(stage, shard, tp, prefix, block)
        if block.moe.shared is not None:
            _shard_mlp(shard, tp, f"{prefix}.moe.shared", block.moe.shared)
            block.moe.shared = TPSharedMLP(block.moe.shared, tp, f"{label}.shared")
        if not stage.expert_split:  # no expert parallelism: the layer runs whole, its experts here
            block.forward = functools.partial(tp_moe_layer, block, tp, label, layer, stage._local_experts)
        return
    _shard_mlp(shard, tp, f"{prefix}.mlp", block.mlp)
    block.mlp = TPMLP(block.mlp, tp, f"{label}.mlp")


@dataclass
class UserTPOps:
    """The collectives of a user model's sharded modules (`piper_sim.user_tp.TPOps`) over
    this rank's `TPComm`: a column group's ``f`` (SP: `_GatherSeq`), a row-parallel output's
    ``g`` (SP: `_ScatterSeq`), the token ids a vocabulary-parallel embedding gathers under SP."""

    tp: TPComm

    @property
    def size(self) -> int:
        return self.tp.size

    @property
    def index(self) -> int:
        return self.tp.index

    @property
    def sp(self) -> bool:
        return self.tp.sp

    def column_input(self, x: torch.Tensor, label: str) -> torch.Tensor:
        if self.tp.sp:
            return _GatherSeq.apply(x, self.tp, f"{label}.ag", f"{label}.rs")
        return _CopyToTP.apply(x, self.tp, f"{label}.ar")

    def row_output(self, y: torch.Tensor, label: str) -> torch.Tensor:
        if self.tp.sp:
            return _ScatterSeq.apply(y, self.tp, f"{label}.rs", f"{label}.ag")
        return _ReduceFromTP.apply(y, self.tp, f"{label}.ar")

    def gather_tokens(self, t: torch.Tensor, label: str) -> torch.Tensor:
        return self.tp.gather_seq(t, f"{label}.ag")


def shard_user_stage(stage, tp: TPComm, plan: dict[str, str], units: dict[str, UnitTP]) -> TPShard:
    """A user model's stage (`executor.user_stage.UserStage`, built whole with the reference's
    weights) as this rank's shard of its sharding annotations (`piper_sim.user_tp.shard_unit`:
    colwise linears keep rows ``[r·n/T, (r+1)·n/T)`` of weight and bias, rowwise ones those
    columns of the weight, a rowwise embedding those vocabulary rows; `_take` records each
    slice for ``--check``); ``units``: the compiler's analysis of each unit (its partial weights)."""
    shard = TPShard(user_partial=frozenset().union(*(units[n].partial for n in stage.units)))
    ops = UserTPOps(tp)
    stage.recompute_early_stop = False  # a recomputed unit re-runs every forward collective (TP.R ops)
    for name in list(stage.units):
        def take(path: str, mod: nn.Module, attr: str, dim: int, name=name) -> None:
            _take(shard, tp, f"{name}.{path}" if path else name, mod, attr, dim)
        stage.units[name] = shard_unit(name, stage.units[name], plan, ops, Region(), take)
    stage.collect_piece_params()
    return shard


def _shard_mlp(shard: TPShard, tp: TPComm, prefix: str, mlp: nn.Module) -> None:
    """A dense MLP's (or the shared experts') columns: first linears column-, last row-parallel."""
    first, last = (["fc1"], "fc2") if isinstance(mlp, GeluMLP) else (["w1", "w3"], "w2")
    assert isinstance(mlp, (GeluMLP, SwiGLU))
    for lin in first:
        _columns(shard, tp, f"{prefix}.{lin}", getattr(mlp, lin))
    _take(shard, tp, f"{prefix}.{last}", getattr(mlp, last), "weight", 1)


def _shard_experts(stage, shard: TPShard, tp: TPComm, name: str, block: Block) -> None:
    """Each local expert's ``expert_ffn / T`` columns (router replicated; SwiGLU or GELU, as
    `_shard_mlp`): the routed tokens pass ``f`` before the experts (`Stage.expert_input`; without
    expert parallelism `tp_moe_layer`), their outputs ``g`` after them."""
    first = stage.ep_index * stage.local_experts if stage.expert_split else 0
    for j, expert in enumerate(block.moe.experts):
        _shard_mlp(shard, tp, f"{name}.moe.experts.{first + j}", expert)  # the global expert (Stage.named_parameters)
        if (expert.fc2 if isinstance(expert, GeluMLP) else expert.w2).bias is not None:
            # TP.s{S}.norms sums the bias's gradient under SP unless it is an expert-parallel parameter
            block.moe.experts[j] = TPExpert(expert, tp, summed=tp.sp and not stage.expert_split)


class _SharedBias(torch.autograd.Function):
    """A row-parallel expert's bias, added to every TP rank's partial output before their sum:
    ``b / T`` forward (the sum adds it once); backward the whole gradient (each rank has every
    row's output gradient, even under SP, where the rows are gathered over TP), or ``1 / T`` of it
    when ``summed`` (``TP.s{S}.norms`` sums the T copies: SP without expert parallelism)."""

    @staticmethod
    def forward(ctx, b, size: int, summed: bool):
        ctx.scale = 1.0 / size if summed else 1.0
        return b / size

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None, None


class TPExpert(nn.Module):
    """A routed expert with biases (``mlp_bias``) on this rank's columns (same parameter names):
    the last linear's bias enters the partial output once per group (`_SharedBias`), as a
    row-parallel linear adds it once after the reduction."""

    def __init__(self, base: nn.Module, tp: TPComm, summed: bool):
        super().__init__()
        self.gelu = isinstance(base, GeluMLP)
        for name, mod in base.named_children():
            setattr(self, name, mod)
        self.tp, self.summed = tp, summed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, last = (F.gelu(self.fc1(x)), self.fc2) if self.gelu else (F.silu(self.w1(x)) * self.w3(x), self.w2)
        return F.linear(h, last.weight) + _SharedBias.apply(last.bias, self.tp.size, self.summed)


def tp_moe_layer(block: Block, tp: TPComm, label: str, layer: int, run, x: torch.Tensor) -> torch.Tensor:
    """A MoE layer without expert parallelism on this rank's ``expert_ffn / T`` columns of every
    expert (Megatron-Core's expert TP = TP at EP 1; the router replicated), as
    `piper_sim.parallel.tensor.tp_collectives` lowers it. Without SP the experts (routed and
    shared) read ``f(h)`` (one backward all-reduce of both input gradients, ``l{L}.moe.ar``) and the
    experts' outputs, one row per routed token copy, are all-reduced (``l{L}.moe.ar``, ``top_k·b·s·h``)
    before the routing weights multiply them (so the router's gradient sees whole outputs, as with
    expert parallelism: `Stage.expert_output`); under SP the router reads the shard, its routed token
    copies are all-gathered over TP and the experts' partial outputs reduce-scattered back
    (`sp_experts`). ``run``: `Stage._local_experts`."""
    if tp.sp:
        x, h, weights, ids, shared = block.forward_pre(x)
    else:
        x, h, weights, ids, shared = block.forward_pre(x, lambda t: _CopyToTP.apply(t, tp, f"{label}.moe.ar"))
    tokens, order, counts = block.moe.permute(h, ids)
    y = sp_experts(tp, label, layer, tokens, [counts], run) if tp.sp else \
        _ReduceFromTP.apply(run(layer, tokens, [counts]), tp, f"{label}.moe.ar")
    routed = block.moe.unpermute(y, weights, order, h.shape[0])
    block.release_mlp_norm(weights, shared)
    return block.forward_post(x, routed, shared)


# --------------------------------------------------------------------------- the runtime's axis


class ModuleCollectives(Axis):
    """An axis whose collectives the stages' modules perform (``comm`` logs them): the plan's
    ops on ``stream`` take them, pass by pass."""

    stream = ""
    comm: TPComm | None = None

    def stream_handlers(self) -> dict[str, Handler]:
        return {self.stream: self.take} if self.comm is not None else {}

    def take(self, ins) -> Logged:
        """The next collective the modules performed in the op's pass, which must be this one
        (``R``: a full recompute's, inside the B pass)."""
        pas = "B" if ins.direction == "R" else ins.direction
        return self.comm.take((pas, ins.stage, ins.mb), ins.name, ins.kind)

    def enter_pass(self, phase: tuple[str, int, int]) -> None:
        if self.comm is not None:
            self.comm.phase = phase

    def leftovers(self) -> list[str]:
        extra = self.comm.leftover() if self.comm is not None else []
        return [f"{self.comm.WHAT} collectives the plan does not list: {extra[:3]}"] if extra else []


class TensorParallel(ModuleCollectives):
    """Each stage's units that ``shard_tensor`` selected (all by default) become this rank's
    tensor-parallel shard of them, their collectives on the plan's ``tp`` group; the others run
    whole. Under sequence parallelism the stage's gradient syncs also wait for its
    ``TP.s{S}.norms`` all-reduce, which adds into the same gradient buffer; under ZeRO-3 the
    plan orders it after the syncs instead and it sums the reduced shard's part of those
    gradients (`piper_sim.parallel.tensor.norms_after_zero3_pass`)."""

    stream = TP_STREAM

    @classmethod
    def applies(cls, rt) -> bool:
        return rt.layout.tp > 1

    def __init__(self, rt):
        self.rt = rt
        self.shards: dict[int, TPShard] = {}
        self.mesh = None  # the TP group as a DeviceMesh, made when a checkpoint first needs it
        tp_ops = [i for lst in rt.prog.streams.values() for i in lst if is_tp(i)]
        if not tp_ops:  # shard_tensor selected none of this rank's units: they all run whole
            return
        sp = bool(rt.header.tp.sequence_parallel)
        group = tp_ops[0].group
        self.comm = TPComm(rt.comms.group(TP_STREAM, group), rt.layout.tp, group_ranks(group).index(rt.rank), sp)
        sharded = sharded_units(rt.header.tp)
        h = rt.header
        # a user model: what the compiler found running its shards on meta (piper_sim.user_tp)
        units = analyse_units(rt.cfg, h.micro_batch_size, h.seq_len, rt.dtype, rt.layout.tp, sp) \
            if rt.user_model else {}
        for s, stage in rt.stages.items():
            self.shards[s] = shard_user_stage(stage, self.comm, rt.cfg.tp_plan, units) if rt.user_model else \
                shard_stage(stage, self.comm, sharded)
        norms = {i.stage: i for i in tp_ops if not i.direction}
        if not norms:
            return
        # ZeRO-3: the plan orders TP.norms after the syncs (it sums the reduced shard)
        for name, lst in rt.prog.streams.items():
            rt.prog.streams[name] = [dataclasses.replace(i, deps=[*i.deps, norms[i.stage].id])
                                     if is_grad_sync(i) and i.stage in norms and i.id not in norms[i.stage].deps
                                     else i for i in lst]

    def stream_handlers(self) -> dict[str, Handler]:
        return {self.stream: self.op} if self.comm is not None else {}

    def before_issue(self, ins) -> None:
        """Tell `_GatherColumns` which half of a split backward runs; BW's collectives (the
        embedding's output-gradient all-gather under SP) are its micro-batch's B pass."""
        if self.comm is not None and ins.kind in ("F", "B", "BI", "BW"):
            self.comm.split = ins.kind if ins.kind in ("BI", "BW") else ""
            if ins.kind == "BW":
                self.comm.phase = ("B", ins.stage, ins.mb)

    def leftovers(self) -> list[str]:
        left = [f"tensor parallel: BI kept shards no .regather op gathered: {sorted(self.comm.pending)[:3]}"] \
            if self.comm is not None and self.comm.pending else []
        if left:
            self.comm.pending.clear()
        return left + super().leftovers()

    def op(self, ins):
        """A plan TP op: ``TP.s{S}.norms`` all-reduces the stage's partial replicated gradients here,
        a split backward's ``.regather`` gathers what BI kept (`TPComm.regather`); any other is the
        next collective the stage's modules performed in that pass."""
        key = ("B", ins.stage, ins.mb)
        if ins.direction == "B" and ins.name.endswith(".regather") and \
                (key, ins.name.removesuffix(".regather")) in self.comm.pending:
            return self.comm.regather(key, ins.name)
        if ins.direction:  # a full-recompute backward re-runs the forward's collectives (``TP.R.`` ops)
            return self.take(ins)
        stage = self.rt.stages[ins.stage]
        params = self.shards[ins.stage].partial(stage.named_parameters()[0], self.comm.sp,
                                                getattr(self.rt.cfg, "qk_norm", False))
        fp = self.rt.flats.get((ins.stage, ""))
        # ZeRO-3: the units' gradients went to their reduce-scatters; sum the reduced shard's part
        grads = fp.shard_grad_views(params) if fp is not None and fp.per_bucket else [p.grad for p in params]
        if not grads:  # the shard holds none of them (on every TP rank alike): a one-element sum
            grads = [torch.zeros(1, dtype=params[0].dtype, device=params[0].device)]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, group=self.rt.comms.group(ins.stream, ins.group), async_op=True)

        def then():
            torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads)])
        return Posted(work, then)

    def local_seq(self, seq: int) -> int:
        return seq // self.rt.layout.tp if self.comm is not None and self.comm.sp else seq

    def local_batch(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A user model under sequence parallelism holds its shard of the sequence (dim 1) from the
        batch on (`piper_sim.user_tp`); the zoo's embedding reads every token."""
        if not (self.rt.user_model and self.comm is not None and self.comm.sp):
            return tokens, targets
        n = tokens.shape[1] // self.comm.size
        return tuple(t.narrow(1, self.comm.index * n, n) for t in (tokens, targets))  # type: ignore[return-value]

    def reference_view(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """Its tensor-parallel slice."""
        for shard in self.shards.values():
            if name in shard.slices:
                return shard.reference_view(name, full)
        return full

    def distributed(self, name: str, local: torch.Tensor) -> torch.Tensor | None:
        """A sharded parameter's slice as a DTensor sharded on its dimension over the TP group
        (`_take` gives rank ``index`` the ``index``-th of ``size`` equal slices, as ``Shard``)."""
        dim = next((shard.slices[name][0] for shard in self.shards.values() if name in shard.slices), None)
        if dim is None:
            return None
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        if self.mesh is None:
            self.mesh = DeviceMesh.from_group(self.comm.group, self.rt.device.type)
        return DTensor.from_local(local, self.mesh, [Shard(dim)], run_check=False)

    def norm_share(self, name: str) -> float:
        """A sharded parameter's slice is this rank's alone; a replicated one (norms, biases of
        row-parallel linears) every TP rank holds whole, so each counts 1/tp of it."""
        if self.comm is None or any(name in shard.slices for shard in self.shards.values()):
            return 1.0
        return 1.0 / self.rt.layout.tp
