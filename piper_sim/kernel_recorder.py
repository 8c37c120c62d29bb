"""The recorder half of `piper_sim.kernels`: a ``TorchDispatchMode`` that files every aten op
of a meta forward or backward as a kernel row (row format and operator classes: see
`piper_sim.kernels`). Imports torch; `piper_sim.kernels` (the row arithmetic the IR and a
cached compile use) does not.
"""

from __future__ import annotations

import math

from costmodel.dtypes import dtype_name
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

_aten = torch.ops.aten
_GEMM = {_aten.mm.default: "mm", _aten.addmm.default: "addmm", _aten.bmm.default: "bmm",
         _aten.baddbmm.default: "baddbmm"}
_CONV = {_aten.convolution.default, _aten.convolution_backward.default}
_ATTN_FWD = {_aten._scaled_dot_product_flash_attention.default}
_ATTN_BWD = {_aten._scaled_dot_product_flash_attention_backward.default}
# ops that allocate without touching memory, or only read metadata
_NO_KERNEL = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "detach", "lift_fresh",
              "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "is_same_size", "alias"}


_listeners: list["KernelRecorder"] = []


def note_kernel(name: str, nbytes: int, dtype: torch.dtype) -> None:
    """Report a fused memory-bound kernel that a meta stand-in represents (one call)."""
    for rec in _listeners:
        rec.add("mem", name, (int(nbytes),), dtype_name(dtype), 0, nbytes)


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class KernelRecorder(TorchDispatchMode):
    """Records the kernel rows of everything run under it (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.rows: dict[tuple, list[float]] = {}

    def add(self, cls: str, name: str, shape: tuple, dtype: str, flops: float, nbytes: float) -> None:
        row = self.rows.setdefault((cls, name, shape, dtype), [0, 0.0, 0.0])
        row[0] += 1
        row[1] += flops
        row[2] += nbytes

    def __enter__(self):
        _listeners.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _listeners.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._record(func, args, kwargs, out)
        return out

    def _flops(self, func, args, kwargs, out) -> float:
        formula = flop_registry.get(func._overloadpacket)
        return float(formula(*args, **kwargs, out_val=out)) if formula else 0.0

    def _record(self, func, args, kwargs, out) -> None:
        name = func._overloadpacket.__name__
        if name in _NO_KERNEL:
            return
        ins, outs = _tensors(args) + _tensors(list(kwargs.values())), _tensors(out)
        if not outs and not name.endswith("_"):
            return
        dtype = dtype_name((ins or outs)[0].dtype)
        if func in _GEMM:
            a, b = args[-2], args[-1]
            batch = a.shape[0] if a.dim() == 3 else 1
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            nbytes = (_nbytes(a) + _nbytes(b) + sum(map(_nbytes, outs)))
            self.add("gemm", _GEMM[func], (m, n, k, batch), dtype, self._flops(func, args, kwargs, out), nbytes)
            return
        if func in _CONV:
            self._conv(func, args, dtype)
            return
        if func in _ATTN_FWD or func in _ATTN_BWD:
            bwd = func in _ATTN_BWD
            q, k = (args[1], args[2]) if bwd else (args[0], args[1])
            causal = bool(args[11] if bwd else (args[4] if len(args) > 4 else kwargs.get("is_causal", False)))
            shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], int(causal))
            nbytes = sum(map(_nbytes, ins)) + sum(map(_nbytes, outs))
            self.add("attn_bwd" if bwd else "attn_fwd", "flash", shape, dtype,
                     self._flops(func, args, kwargs, out), nbytes)
            return
        in_stores = {_storage(t) for t in ins}
        if all(_storage(t) in in_stores for t in outs) and not name.endswith("_"):
            return  # a view: no kernel
        nbytes = sum(map(_nbytes, ins)) + sum(_nbytes(t) for t in outs if _storage(t) not in in_stores)
        if name.endswith("_"):  # in place: the written input (a tensor list for _foreach_*_) counts once more
            nbytes += sum(map(_nbytes, _tensors(args[0]))) if args else 0
        self.add("mem", name, (int(nbytes),), dtype, self._flops(func, args, kwargs, out), nbytes)

    def _conv(self, func, args, dtype: str) -> None:
        """A convolution (or its backward, one row per gradient it computes) as the implicit
        GEMM of its forward; ``2 m n k batch`` flops each (torch's count, bias left out)."""
        bwd = func is _aten.convolution_backward.default
        grad_out, x, w = (args[0], args[1], args[2]) if bwd else (None, args[0], args[1])
        transposed, groups = (args[7], args[9]) if bwd else (args[6], args[8])
        if transposed:
            spatial = math.prod(x.shape[2:])
        elif bwd:
            spatial = math.prod(grad_out.shape[2:])
        else:  # output pixels, from the conv arithmetic
            spatial = _conv_pixels(x.shape[2:], w.shape[2:], *args[3:6])
        ksize = math.prod(w.shape[2:])
        if transposed:  # the forward of a transposed conv is the input-gradient GEMM of a conv
            m, n, k = x.shape[0] * spatial, w.shape[1] * ksize, w.shape[0] // groups
        else:
            m, n, k = x.shape[0] * spatial, w.shape[0] // groups, w.shape[1] * ksize
        shape, flops = (int(m), int(n), int(k), int(groups)), 2.0 * m * n * k * groups
        if not bwd:
            self.add("gemm", "conv", shape, dtype, flops, _nbytes(x) + _nbytes(w) + m * n * groups * x.element_size())
            return
        mask = args[10]
        if mask[0]:
            self.add("gemm", "conv_bwd_input", shape, dtype, flops, _nbytes(grad_out) + _nbytes(w) + _nbytes(x))
        if mask[1]:
            self.add("gemm", "conv_bwd_weight", shape, dtype, flops, _nbytes(grad_out) + _nbytes(x) + _nbytes(w))
        if mask[2]:
            self.add("mem", "conv_bwd_bias", (_nbytes(grad_out),), dtype, 0.0, _nbytes(grad_out))

    def table(self) -> tuple[KernelRow, ...]:
        return tuple((cls, name, shape, dtype, int(c), f, b)
                     for (cls, name, shape, dtype), (c, f, b) in sorted(self.rows.items()))


def _conv_pixels(size, kernel, stride, padding, dilation) -> int:
    out = 1
    for i, (n, kk) in enumerate(zip(size, kernel)):
        s, p, d = (v[i] if len(v) > 1 else v[0] for v in (stride, padding, dilation))
        out *= (n + 2 * p - d * (kk - 1) - 1) // s + 1
    return out
