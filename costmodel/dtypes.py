"""Floating-point formats by name: one table for the whole project (torch-free).

``DTYPES`` lists every format we name (``fp8`` only in cost and trace tables); the torch
dtype of a name is resolved lazily by `torch_dtype`, so this module (and the plan, the
cost model) import without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any


@dataclass(frozen=True)
class DType:
    """One format: its bytes per element, torch attribute, and NCCL / profiler names."""

    name: str
    bytes: int
    torch_name: str
    nccl_name: str
    profiler_name: str  # as torch's profiler writes it ("BFloat16")


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("fp32", 4, "float32", "f32", "Float"),
    DType("bf16", 2, "bfloat16", "bf16", "BFloat16"),
    DType("fp16", 2, "float16", "f16", "Half"),
    DType("fp8", 1, "float8_e4m3fn", "f8e4m3", "Float8_e4m3fn"),
    DType("fp64", 8, "float64", "f64", "Double"),
)}
TRAINING_DTYPES = ("bf16", "fp16", "fp32")  # what a strategy may train in
DTYPE_BYTES: dict[str, int] = {name: d.bytes for name, d in DTYPES.items()}
# other spellings of the formats: torch's attribute names (also as ``torch.bfloat16``), as
# Hugging Face configs (``torch_dtype``/``dtype``) and torch write them, and the usual short ones
DTYPE_SPELLINGS: dict[str, str] = {
    **{d.torch_name: d.name for d in DTYPES.values()},
    "half": "fp16", "float": "fp32", "double": "fp64", "float8": "fp8",
    "bfloat": "bf16", "f32": "fp32", "f16": "fp16", "f64": "fp64",
}


def dtype_from_spelling(value: Any) -> str | None:
    """The format name of any spelling (``bf16``, ``bfloat16``, ``torch.bfloat16``, ``BF16``), or None."""
    if not isinstance(value, str):
        return None
    text = value.strip().lower().removeprefix("torch.")
    return text if text in DTYPES else DTYPE_SPELLINGS.get(text)


def training_dtype(value: Any, where: str, allowed: tuple[str, ...] = TRAINING_DTYPES) -> str:
    """``value`` as one of ``allowed`` format names, whichever way it is spelled (torch's and
    Hugging Face's ``"bfloat16"`` is ``"bf16"``); a one-line ValueError naming ``where`` otherwise."""
    name = dtype_from_spelling(value)
    if name not in allowed:
        spellings = ", ".join(DTYPES[n].torch_name for n in allowed)
        raise ValueError(f"{where} must be one of {', '.join(allowed)} (or {spellings}, also as torch.NAME); "
                         f"got {value!r}")
    return name


def torch_dtype(name: Any) -> Any:
    """The ``torch.dtype`` of a format name (imports torch on first use); a ``torch.dtype``
    is returned as it is."""
    if not isinstance(name, str):
        return name
    import torch

    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    return getattr(torch, DTYPES[name].torch_name)


@lru_cache(maxsize=None)
def dtype_name(dtype: Any) -> str:
    """The short name of a ``torch.dtype`` (``torch.bfloat16`` -> ``bf16``; others as torch
    spells them without the ``torch.`` prefix); a name is returned as it is."""
    text = str(dtype).removeprefix("torch.")
    return next((d.name for d in DTYPES.values() if d.torch_name == text), text)


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a format name or a ``torch.dtype`` (no torch import for a name)."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
        return DTYPES[dtype].bytes
    return dtype.itemsize
