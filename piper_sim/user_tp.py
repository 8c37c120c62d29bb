"""Tensor (and sequence) parallelism of a user nn.Module from its sharding annotations.

A model opts in with ``annotate(..., tensor_parallel={path: style}, sequence_parallel=True)``,
the way a torchtitan ``parallelize`` plan names torch's styles: ``"colwise"`` (an ``nn.Linear``
whose weight rows, dim 0, and bias are split over the TP group: ColwiseParallel) and
``"rowwise"`` (an ``nn.Linear`` whose weight columns, dim 1, are split and whose partial outputs
are summed over the group, the bias added once after; or an ``nn.Embedding`` whose vocabulary
rows are split: RowwiseParallel). Paths are module paths inside the units (``*`` is one path
component). The module's own forward must not hard-code the split widths (reshape heads with
``-1``, as torchtitan's models do).

The collectives are Megatron-LM's (Shoeybi et al. 2019), named after the module path:

- the column-parallel linears that read one tensor (q, k and v of the same input) share one
  ``f``: identity forward, all-reduce of the input gradient backward (``{first}.ar``); a
  row-parallel output is all-reduced forward (``{path}.ar``), nothing backward;
- with sequence parallelism (Korthikanti et al. 2022; torch's SequenceParallel) everything
  outside the column-to-row regions holds the rank's ``s / T`` shard of the sequence (dim 1),
  from the batch on (inputs and targets are split along dim 1; the loss is the shard's mean):
  a column group all-gathers the sequence (``{first}.ag``; backward reduce-scatters the input
  gradient, ``{first}.rs``; the gathered input is kept for the weight gradients, as torch's
  DTensor styles keep it: no re-gather), a row-parallel output is reduce-scattered
  (``{path}.rs``; backward all-gathers, ``{path}.ag``); a row-parallel embedding gathers the
  token ids first (``{path}.tokens.ag``).

Replicated parameters whose gradients are partial per rank are all-reduced over the group
before the optimizer step (the plan's ``TP.s{S}.norms``): under sequence parallelism all of
them, without it those of modules that run inside a column-to-row region (a per-head query
norm, say). The same wrappers (`shard_unit`) run in the compiler, on ``meta`` with
`MetaOps` (which logs each collective's name, kind and bytes: the plan's ``TP.*`` ops), and in
the executor with real collectives (`executor.parallel.tensor.UserTPOps`), so the two issue one
sequence of collectives.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from piper_sim.module_paths import AnnotationError, path_pattern

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

STYLES = ("colwise", "rowwise")


class ShardingError(AnnotationError):
    """A sharding annotation or a TP degree that does not fit the model; one line."""


def expand_tp_plan(module: nn.Module, units: list[str], plan: dict[str, str]) -> dict[str, str]:
    """``plan`` (module path patterns -> style) as the matched module paths, in module order,
    each checked: an ``nn.Linear`` (colwise, rowwise) or a plain ``nn.Embedding`` (rowwise) inside
    a unit."""
    import torch.nn as nn


    if not isinstance(plan, dict) or not plan:
        raise ShardingError("tensor_parallel must be a non-empty dict of module paths -> \"colwise\" | \"rowwise\"")
    names = [n for n, _ in module.named_modules() if n]
    out: dict[str, str] = {}
    for pat, style in plan.items():
        if style not in STYLES:
            raise ShardingError(f"tensor_parallel: {pat!r} has style {style!r}; use \"colwise\" or \"rowwise\"")
        hits = [n for n in names if path_pattern(pat).match(n)]
        if not hits:
            raise ShardingError(f"tensor_parallel: pattern {pat!r} matches no submodule of {type(module).__name__}")
        for n in hits:
            mod = module.get_submodule(n)
            if out.get(n, style) != style:
                raise ShardingError(f"tensor_parallel: module {n} is annotated both {out[n]} and {style}")
            if not any(n == u or n.startswith(u + ".") for u in units):
                raise ShardingError(f"tensor_parallel: module {n} belongs to no unit")
            if isinstance(mod, nn.Embedding):
                if style != "rowwise":
                    raise ShardingError(f"tensor_parallel: embedding {n} can only be \"rowwise\" (vocabulary rows)")
                if mod.padding_idx is not None or mod.max_norm is not None or mod.sparse:
                    raise ShardingError(f"tensor_parallel: embedding {n} has padding_idx, max_norm or sparse set; "
                                        "a vocabulary-parallel embedding takes none of them")
            elif type(mod) is not nn.Linear:
                raise ShardingError(f"tensor_parallel: module {n} is a {type(mod).__name__}; annotate nn.Linear "
                                    "(colwise, rowwise) or nn.Embedding (rowwise) modules")
            out[n] = style
    return {n: out[n] for n in names if n in out}


def sharded_dim(style: str, mod: nn.Module) -> tuple[str, int]:
    """(name, size) of the dimension ``style`` splits: a colwise linear's output features, a
    rowwise linear's input features, a rowwise embedding's vocabulary."""
    import torch.nn as nn

    if isinstance(mod, nn.Embedding):
        return "num_embeddings", mod.num_embeddings
    return ("out_features", mod.out_features) if style == "colwise" else ("in_features", mod.in_features)


def unit_plan(plan: dict[str, str], unit: str) -> dict[str, str]:
    """The annotations inside ``unit``, by path inside it ('' for the unit itself)."""
    return {p[len(unit) + 1:]: s for p, s in plan.items() if p == unit or p.startswith(unit + ".")}


class TPOps(Protocol):
    """The collectives a sharded unit performs (autograd-aware; ``label`` names the op)."""

    size: int
    index: int
    sp: bool

    def column_input(self, x: torch.Tensor, label: str) -> torch.Tensor: ...
    def row_output(self, y: torch.Tensor, label: str) -> torch.Tensor: ...
    def gather_tokens(self, t: torch.Tensor, label: str) -> torch.Tensor: ...


@dataclass
class Region:
    """One unit's state while it runs: the last column group's input and output (linears that
    read the same tensor share its ``f``) and whether a column-to-row region is open."""

    last_in: Any = None
    last_out: Any = None
    label: str = ""
    inside: bool = False

    def reset(self) -> None:
        self.last_in = self.last_out = None
        self.label, self.inside = "", False


def _column_input(ops: TPOps, region: Region, x: torch.Tensor, label: str) -> torch.Tensor:
    if x is not region.last_in:
        region.last_in, region.last_out, region.label = x, ops.column_input(x, label), label
    region.inside = True
    return region.last_out


@functools.lru_cache(maxsize=None)
def _wrappers():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from piper_sim.models import vocab_shard_lookup

    class ColwiseLinear(nn.Module):
        """A column-parallel ``nn.Linear`` (this rank's output rows; same parameter names)."""

        def __init__(self, base: nn.Linear, ops: TPOps, region: Region, label: str):
            super().__init__()
            self.weight, self.bias = base.weight, base.bias
            self.ops, self.region, self.label = ops, region, label

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(_column_input(self.ops, self.region, x, self.label), self.weight, self.bias)

    class RowwiseLinear(nn.Module):
        """A row-parallel ``nn.Linear``: partial products summed over the group (SP:
        reduce-scattered), then the bias once."""

        def __init__(self, base: nn.Linear, ops: TPOps, region: Region, label: str):
            super().__init__()
            self.weight, self.bias = base.weight, base.bias
            self.ops, self.region, self.label = ops, region, label

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.ops.row_output(F.linear(x, self.weight), self.label)
            self.region.inside = False
            return y + self.bias if self.bias is not None else y

    class RowwiseEmbedding(nn.Module):
        """A vocabulary-parallel ``nn.Embedding``: rows ``[lo, lo + V/T)``, other ids give zeros,
        the group's sum (SP: reduce-scattered, after gathering the ids) is the embedding."""

        def __init__(self, base: nn.Embedding, ops: TPOps, region: Region, label: str, lo: int):
            super().__init__()
            self.weight, self.ops, self.region, self.label, self.lo = base.weight, ops, region, label, lo

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            if self.ops.sp:
                ids = self.ops.gather_tokens(ids, f"{self.label}.tokens")
            return self.ops.row_output(vocab_shard_lookup(ids, self.weight, self.lo), self.label)

    return ColwiseLinear, RowwiseLinear, RowwiseEmbedding


def shard_unit(unit: str, mod: nn.Module, plan: dict[str, str], ops: TPOps, region: Region,
               take: Callable[[str, nn.Module, str, int], None]) -> nn.Module:
    """Make ``mod`` (unit ``unit``, built whole) this rank's tensor-parallel shard (in place;
    returned, a wrapper where the unit is itself annotated):
    ``take(path, module, parameter, dim)`` replaces one parameter by this rank's slice, then
    each annotated module is wrapped to perform its collectives through ``ops``. A hook resets
    ``region`` as the unit starts (a recomputed forward groups its own tensors)."""
    import torch.nn as nn

    colwise, rowwise, embedding = _wrappers()
    annotated = unit_plan(plan, unit)
    for path, style in annotated.items():
        m = mod.get_submodule(path)
        label = f"{unit}.{path}" if path else unit
        if isinstance(m, nn.Embedding):
            take(path, m, "weight", 0)
            new: nn.Module = embedding(m, ops, region, label, ops.index * m.weight.shape[0])
        elif style == "colwise":
            take(path, m, "weight", 0)
            take(path, m, "bias", 0)
            new = colwise(m, ops, region, label)
        else:
            take(path, m, "weight", 1)
            new = rowwise(m, ops, region, label)
        parent, _, leaf = path.rpartition(".")
        if path:
            setattr(mod.get_submodule(parent) if parent else mod, leaf, new)
        else:  # the unit is the annotated module
            mod = new
    mod.register_forward_pre_hook(lambda _m, _a: region.reset())
    return mod


# --------------------------------------------------------------------------- the compiler's side


@dataclass
class MetaOps:
    """`TPOps` on ``meta``: the shapes of the collectives, each logged as (pass, name, kind,
    bytes) with bytes of the whole (gathered) tensor, as the zoo's lowering counts them."""

    size: int
    sp: bool
    index: int = 0
    log: list[tuple[str, str, str, float]] = field(default_factory=list)

    def record(self, pas: str, name: str, kind: str, t: torch.Tensor) -> None:
        self.log.append((pas, name, kind, float(t.numel() * t.element_size())))

    def column_input(self, x: torch.Tensor, label: str) -> torch.Tensor:
        return _meta_fn().apply(x, self, f"{label}.ag" if self.sp else "", f"{label}.rs" if self.sp else f"{label}.ar",
                                "ALL_GATHER", "REDUCE_SCATTER" if self.sp else "ALLREDUCE", self.size if self.sp else 1)

    def row_output(self, y: torch.Tensor, label: str) -> torch.Tensor:
        if self.sp:
            return _meta_fn().apply(y, self, f"{label}.rs", f"{label}.ag", "REDUCE_SCATTER", "ALL_GATHER",
                                    -self.size)
        return _meta_fn().apply(y, self, f"{label}.ar", "", "ALLREDUCE", "", 1)

    def gather_tokens(self, t: torch.Tensor, label: str) -> torch.Tensor:
        full = t.repeat(1, self.size, *[1] * (t.dim() - 2))
        self.record("F", f"{label}.ag", "ALL_GATHER", full)
        return full


_META_FN: Any = None


def _meta_fn():
    """An autograd function standing for one collective on ``meta``: ``scale`` > 1 gathers
    along dim 1 (that many times the tokens), < -1 scatters; logs the forward and backward
    collective (an empty name: none in that pass)."""
    global _META_FN
    if _META_FN is not None:
        return _META_FN
    import torch

    def resize(t: torch.Tensor, scale: int) -> torch.Tensor:
        if scale > 1:
            return t.repeat(1, scale, *[1] * (t.dim() - 2))
        if scale < -1:
            return t.narrow(1, 0, t.shape[1] // -scale).clone()
        return t.clone()

    class _Meta(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, ops: MetaOps, fwd: str, bwd: str, fkind: str, bkind: str, scale: int):
            ctx.ops, ctx.bwd, ctx.bkind, ctx.scale = ops, bwd, bkind, scale
            y = resize(x, scale)
            if fwd:
                ops.record("F", fwd, fkind, y if scale > 1 else x)
            return y

        @staticmethod
        def backward(ctx, g):
            gx = resize(g, -ctx.scale if abs(ctx.scale) > 1 else 1)
            if ctx.bwd:
                ctx.ops.record("B", ctx.bwd, ctx.bkind, g if ctx.scale > 1 else gx)
            return gx, None, None, None, None, None, None

    _META_FN = _Meta
    return _META_FN


@dataclass
class UnitTP:
    """One unit under tensor parallelism: its collectives per pass ``F`` / ``B`` as (name, kind,
    bytes), in the order they run, and its replicated parameters whose gradients are partial
    (full names, and their elements: `piper_sim.profiling.SegmentCost.tp_partial_params`)."""

    ops: dict[str, list[tuple[str, str, float]]]
    partial: frozenset[str]
    partial_params: int


def meta_shard(unit: str, mod: nn.Module, plan: dict[str, str], size: int, sp: bool) -> tuple[nn.Module, MetaOps,
                                                                                               Region]:
    """A ``meta`` copy of ``mod`` sharded for one rank of ``size`` (`shard_unit` with `MetaOps`)."""
    import torch.nn as nn

    ops, region = MetaOps(size, sp), Region()

    def take(path: str, m: nn.Module, attr: str, dim: int) -> None:
        p = getattr(m, attr)
        if p is not None:
            setattr(m, attr, nn.Parameter(p.detach().narrow(dim, 0, p.shape[dim] // size).clone()))
    return shard_unit(unit, mod, plan, ops, region, take), ops, region


def _partial_tracer(sharded: nn.Module, unit: str, sp: bool):
    """A TorchFunctionMode that finds the replicated parameters whose gradients are partial
    per rank: any that an op reads (directly or through ops of parameters alone) together with
    a *split* tensor -- the output of a column-parallel linear and everything computed from it
    up to a row-parallel linear (whose partial sums the group reduces) -- or, under sequence
    parallelism, any at all (every rank sees its own tokens)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    colwise, rowwise, embedding = _wrappers()
    starts, ends, names = set(), set(), {}
    for m in sharded.modules():
        if isinstance(m, colwise):
            starts.update(id(p) for p in (m.weight, m.bias) if p is not None)
        elif isinstance(m, (rowwise, embedding)):
            ends.add(id(m.weight))
    for n, p in sharded.named_parameters():
        if id(p) not in starts | ends:
            names[id(p)] = f"{unit}.{n}"

    class Tracer(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.split: dict[int, torch.Tensor] = {}   # id -> tensor (kept alive: ids stay unique)
            self.origin: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}  # computed from parameters alone
            self.partial: set[str] = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            ids = {id(t) for t in ins}
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            reads = set().union(*[{names[id(t)]} if id(t) in names else self.origin.get(id(t), (None, set()))[1]
                                  for t in ins])
            if ids & ends:
                return out  # a row-parallel product: reduced over the group next
            split = bool(ids & starts) or any(id(t) in self.split for t in ins)
            if split or sp:
                self.partial |= reads
            if split:
                self.split.update({id(t): t for t in outs})
            elif reads and all(id(t) in names or id(t) in self.origin for t in ins):
                self.origin.update({id(t): (t, frozenset(reads)) for t in outs})
            return out

    return Tracer()


def analyse_unit(unit: str, mod: nn.Module, x: torch.Tensor, loss: Callable | None, plan: dict[str, str],
                 size: int, sp: bool, first: bool) -> tuple[UnitTP, torch.Tensor]:
    """Shard ``mod`` (a ``meta`` copy, `meta_shard`), run it forward (traced: `_partial_tracer`)
    and backward on ``meta`` and log its collectives; ``loss(out)`` for the last unit; ``first``:
    the model's first unit (its input, the batch's, needs no gradient). Returns the unit's
    output too."""
    import torch

    shard, ops, region = meta_shard(unit, mod, plan, size, sp)
    x = x.detach().requires_grad_(x.is_floating_point() and not first)
    tracer = _partial_tracer(shard, unit, sp)
    with tracer:
        y = shard(x)
        if region.inside:
            raise ShardingError(f"tensor_parallel: unit {unit} hands on the output of column-parallel {region.label} "
                                "(split over the TP group) with no row-parallel linear after it; annotate the linear "
                                "that reads it \"rowwise\" or drop the \"colwise\"")
        out = y if loss is None else loss(y)
    params = [p for p in shard.parameters() if p.requires_grad]
    leaves = ([x] if x.requires_grad else []) + params
    n_f = len(ops.log)
    if out.requires_grad:
        torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
    fwd = [(n, k, b) for _, n, k, b in ops.log[:n_f]]
    bwd = [(n, k, b) for _, n, k, b in ops.log[n_f:]]
    named = {f"{unit}.{n}": p for n, p in shard.named_parameters()}
    partial = frozenset(tracer.partial)
    return UnitTP({"F": fwd, "B": bwd}, partial, sum(named[n].numel() for n in partial)), y.detach()


def analyse_units(model, micro_batch: int, seq_len: int, dtype: torch.dtype, size: int,
                  sp: bool) -> dict[str, UnitTP]:
    """`analyse_unit` of every unit of a user model (`piper_sim.annotate.UserModel`), in order on
    the tensors the chain hands on (under SP: the rank's shard of the batch's sequence)."""
    x, targets = model.example_batch(micro_batch, seq_len, "meta", dtype, 0)
    if sp:
        x, targets = (t.narrow(1, 0, t.shape[1] // size) for t in (x, targets))
    out = {}
    for i, name in enumerate(model.units):
        last = i == len(model.units) - 1
        loss = (lambda y: model.loss(y, targets)) if last else None
        out[name], x = analyse_unit(name, model.meta_unit(name, dtype), x, loss, model.tp_plan, size, sp, i == 0)
    return out
