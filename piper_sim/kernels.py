"""Operator-level profiles: every aten op a segment runs, as compact kernel rows.

A :class:`KernelRecorder` is a ``TorchDispatchMode`` that sees each aten op of a forward or
backward on the ``meta`` device and files it under one operator class:

``gemm``      mm / addmm / bmm / baddbmm; shape ``(m, n, k, batch)``; convolutions as their
              implicit GEMM (``conv``, and per computed gradient ``conv_bwd_input`` /
              ``conv_bwd_weight``): ``m`` output pixels x batch, ``n`` output channels per
              group, ``k`` input channels per group x kernel size, ``batch`` the groups
``attn_fwd``  flash attention forward; shape ``(batch, q_heads, seq_q, seq_kv, head_dim, causal)``
``attn_bwd``  flash attention backward; same shape
``mem``       everything else that launches a kernel (elementwise, norms, softmax, rotary,
              casts, reductions, index/scatter, embedding, cross-entropy); shape
              ``(bytes per call,)`` = tensor bytes read + written

Views (outputs aliasing an input) and allocations (``empty*``) launch nothing and are
dropped. Rows are grouped by ``(class, name, shape, dtype)`` with a call count, so a layer
is a few dozen rows whatever its size. A row is a plain tuple, JSON-able as a list:

    (cls, name, shape, dtype, count, flops, bytes)   # flops and bytes summed over count

Fused kernels that the models imitate on meta with an ``autograd.Function`` (RMSNorm)
report themselves through :func:`note_kernel` (see ``piper_sim.models``).

The recorder and ``note_kernel`` live in `piper_sim.kernel_recorder` (torch); this module is
the torch-free row arithmetic, so a compile that hits the profile cache imports no torch
(``kernels.KernelRecorder`` still works: it loads the recorder on first use).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Iterable

KernelRow = tuple  # (cls, name, shape, dtype, count, flops, bytes)
KERNEL_CLASSES = ("gemm", "attn_fwd", "attn_bwd", "mem")


def __getattr__(name: str):
    """The recorder half (`piper_sim.kernel_recorder`, imports torch) on first use."""
    if name in ("KernelRecorder", "note_kernel"):
        from piper_sim import kernel_recorder

        return getattr(kernel_recorder, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def subtract(full: Iterable[KernelRow], part: Iterable[KernelRow]) -> tuple[KernelRow, ...]:
    """Rows of ``full`` minus those of ``part`` (call counts subtracted per group)."""
    left = Counter({r[:4]: r[4] for r in full})
    per_call = {r[:4]: (r[5] / r[4], r[6] / r[4]) for r in full}
    for r in part:
        left[r[:4]] -= r[4]
    return tuple((*key, n, per_call[key][0] * n, per_call[key][1] * n)
                 for key, n in sorted(left.items()) if n > 0)


def scale(rows: Iterable[KernelRow], factor: float) -> tuple[KernelRow, ...]:
    """Rows with their counts (and totals) multiplied by ``factor`` (rounded counts)."""
    out = []
    for cls, name, shape, dtype, count, flops, nbytes in rows:
        n = max(1, round(count * factor))
        out.append((cls, name, shape, dtype, n, flops * n / count, nbytes * n / count))
    return tuple(out)


def merge(*tables: Iterable[KernelRow]) -> tuple[KernelRow, ...]:
    """One table from several (rows of the same group add up)."""
    acc: dict[tuple, list[float]] = {}
    for rows in tables:
        for cls, name, shape, dtype, count, flops, nbytes in rows:
            row = acc.setdefault((cls, name, tuple(shape), dtype), [0, 0.0, 0.0])
            row[0] += count
            row[1] += flops
            row[2] += nbytes
    return tuple((*key, int(c), f, b) for key, (c, f, b) in sorted(acc.items()))


def totals(rows: Iterable[KernelRow]) -> tuple[float, float, int]:
    """(flops, bytes, kernel launches) of a table."""
    rows = list(rows)
    return sum(r[5] for r in rows), sum(r[6] for r in rows), sum(r[4] for r in rows)


def table_key(rows: Iterable[KernelRow]) -> str:
    """A short content key for a table (identical tables share one entry in a plan)."""
    return "k" + hashlib.sha1(repr(tuple(rows)).encode()).hexdigest()[:10]


def regroup(rows: Iterable[KernelRow], factor: int, weight_grad: bool = False) -> tuple[KernelRow, ...]:
    """The same work in ``factor``x fewer, ``factor``x bigger calls: expert kernels under
    expert parallelism, where each rank runs 1/EP of the experts on EP x the tokens each.

    The tokens are a GEMM's m in the forward and the input gradient (``x @ W.T``, ``g @ W``)
    and its k in the weight gradient (``g.T @ x``: ``weight_grad=True``, the BW table); that
    dimension grows. A merged GEMM reads each expert weight once: its bytes are those of
    its new shape, ``(m k + k n + m n) * batch`` elements (the closed form). Memory-bound calls
    grow in bytes (their total is unchanged); FLOPs are unchanged."""
    out = []
    for cls, name, shape, dtype, count, flops, nbytes in rows:
        n = max(1, round(count / factor))
        grow = count / n
        if cls == "gemm":
            m, nn, k, b = shape
            elements = (m * k + k * nn + m * nn) * b
            itemsize = nbytes / count / elements if elements else 0.0
            m, k = (m, round(k * grow)) if weight_grad else (round(m * grow), k)
            shape = (m, nn, k, b)
            nbytes = n * itemsize * (m * k + k * nn + m * nn) * b
        elif cls == "mem":
            shape = (round(shape[0] * grow),)
        else:
            n = count
        out.append((cls, name, tuple(shape), dtype, n, flops, nbytes))
    return tuple(out)
