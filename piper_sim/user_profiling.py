"""Profiling and activation memory of a user model's units (`piper_sim.annotate.UserModel`).

Each unit runs on ``meta`` (`piper_sim.profiling.measure`: flops, operator-level kernels,
saved bytes) on the tensor the previous unit hands it: shapes come from running the chain
(the first unit gets ``example_batch``'s inputs), never from a hidden size. The last unit's
profile includes the loss. Identical units (same type, structure, parameter shapes, input
shape and dtype) are measured once, so a deep stack of equal blocks profiles fast.
A unit's ``out_bytes``/``out_shape`` is the boundary tensor a pipeline SEND carries.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch

from piper_sim.annotate import UserModel, user_code
from piper_sim.memory import SegmentMemory
from piper_sim.profiling import SegmentCost, measure
from piper_sim.user_tp import UnitTP, analyse_unit, meta_shard, unit_plan


def _structure(mod: torch.nn.Module) -> tuple:
    return (type(mod).__qualname__, repr(mod),
            tuple((n, tuple(p.shape)) for n, p in mod.named_parameters()),
            tuple((n, tuple(b.shape)) for n, b in mod.named_buffers()))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class UserTP:
    """Tensor parallelism of a user model (`piper_sim.user_tp`): the degree and sequence parallelism."""

    degree: int = 1
    sp: bool = False


def _profile_unit(model: UserModel, name: str, x: torch.Tensor, targets: torch.Tensor | None,
                  dtype: torch.dtype, tokens: int, first: bool,
                  tp: UserTP) -> tuple[SegmentCost, torch.Tensor, UnitTP | None]:
    mod = model.meta_unit(name, dtype)
    unit_tp = None
    if tp.degree > 1:  # one rank's shard, its collectives logged on a second copy
        loss = None if targets is None else (lambda out: model.loss(out, targets))
        unit_tp = analyse_unit(name, model.meta_unit(name, dtype), x, loss, model.tp_plan, tp.degree, tp.sp, first)[0]
        mod = meta_shard(name, mod, model.tp_plan, tp.degree, tp.sp)[0]
    params = list(mod.parameters())
    # the model's inputs (first unit) need no gradient; a boundary tensor does
    x_in = torch.empty(x.shape, dtype=x.dtype, device="meta", requires_grad=x.is_floating_point() and not first)
    if targets is None:
        m = measure(mod, [x_in], params)
    else:
        m = measure(lambda t: model.loss(mod(t), targets), [x_in], params)
    with torch.no_grad():
        y = mod(x_in)
    n = sum(p.numel() for p in params)
    cost = SegmentCost(
        name=name, unit=name, is_expert=False, fwd_flops=m.fwd_flops, bwd_input_flops=m.bwd_input_flops,
        bwd_weight_flops=m.bwd_weight_flops, param_count=n, param_bytes=n * dtype.itemsize,
        saved_act_bytes=m.saved_act_bytes, out_bytes=4 if targets is not None else y.numel() * y.element_size(),
        tokens=tokens, gemm_m=m.gemm[0], gemm_n=m.gemm[1], gemm_k=m.gemm[2],
        kernels_f=m.kernels_f, kernels_bi=m.kernels_bi, kernels_bw=m.kernels_bw,
        out_shape=tuple(y.shape), out_dtype=_dtype_name(y.dtype),
        tp_partial_params=unit_tp.partial_params if unit_tp is not None else 0)
    return cost, y, unit_tp


def profile_user_model(model: UserModel, micro_batch: int, seq_len: int,
                       dtype: torch.dtype = torch.bfloat16, tp: UserTP = UserTP(),
                       tp_ops: dict[str, dict[str, list]] | None = None) -> list[SegmentCost]:
    """One segment per unit, in order, for one micro-batch; under tensor parallelism one
    rank's shard of each unit (`piper_sim.user_tp`; with sequence parallelism on the rank's
    ``seq_len / T`` tokens), its collectives per pass put in ``tp_ops`` (unit -> ``F``/``B`` ->
    (name, kind, bytes))."""
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"micro_batch and seq_len must be >= 1 (got {micro_batch}, {seq_len})")
    what = f"model: {model.source or model.name}: profiling in {_dtype_name(dtype)} on meta failed"
    if tp.degree > 1:
        what = (f"model: {model.source or model.name}: forward on one tensor-parallel rank's shards (tp {tp.degree}"
                f"{', sequence parallel' if tp.sp else ''}) on meta failed")
    hint = ("; reshape the sharded linears' outputs with -1 (heads per rank), as torchtitan's models do"
            + (", and read the sequence length from them (their input holds the rank's sequence shard)"
               if tp.sp else "")) if tp.degree > 1 else ""
    with user_code(what, hint, refused=f"model: {model.source or model.name}: "):
        x, targets = model.example_batch(micro_batch, seq_len, "meta", dtype, 0)
        if tp.sp:  # every rank holds its shard of the sequence (dim 1), from the batch on
            x, targets = (t.narrow(1, 0, t.shape[1] // tp.degree) for t in (x, targets))
        cache: dict[tuple, tuple[SegmentCost, torch.Tensor, UnitTP | None]] = {}
        out = []
        for i, name in enumerate(model.units):
            last = i == len(model.units) - 1
            key = (_structure(model.unit(name)), tuple(x.shape), x.dtype, last, i == 0,
                   tuple(unit_plan(model.tp_plan, name).items()) if tp.degree > 1 else ())
            if key not in cache:
                cache[key] = _profile_unit(model, name, x, targets if last else None, dtype, micro_batch * seq_len,
                                           i == 0, tp)
            cost, x, unit_tp = cache[key]
            out.append(replace(cost, name=name, unit=name))
            if tp_ops is not None and unit_tp is not None:
                tp_ops[name] = {p: [(n.replace(f"{cost.unit}.", f"{name}.", 1), k, b) for n, k, b in ops]
                                for p, ops in unit_tp.ops.items()}
    return out


def input_bytes(model: UserModel, micro_batch: int, seq_len: int, dtype: torch.dtype) -> int:
    """Bytes of one micro-batch of the model's inputs."""
    x, _ = model.example_batch(micro_batch, seq_len, "meta", dtype, 0)
    return x.numel() * x.element_size()


def user_model_memory(model: UserModel, segments: list[SegmentCost], micro_batch: int, seq_len: int,
                      dtype: torch.dtype) -> dict[str, SegmentMemory]:
    """`SegmentMemory` per unit: no attention core (selective recompute does not apply);
    under full recompute a unit keeps its input, the previous unit's output."""
    prev = float(input_bytes(model, micro_batch, seq_len, dtype))
    out = {}
    for seg in segments:
        out[seg.name] = SegmentMemory(kind="user", saved=float(seg.saved_act_bytes), selective=float(seg.saved_act_bytes),
                                      checkpoint=prev, temp=0.0, core_flops=0.0)
        prev = float(seg.out_bytes)
    return out


def boundaries(segments_by_stage: list[list[SegmentCost]]) -> list[dict]:
    """Shape and dtype of the tensor each stage sends on (its last unit's output)."""
    return [{"shape": list(segs[-1].out_shape), "dtype": segs[-1].out_dtype} for segs in segments_by_stage]
