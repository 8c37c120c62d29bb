"""Exact value checks shared by strategy files and command lines.

An integer is an ``int`` and not a ``bool`` (``true``, ``1.0`` and ``1.7`` are refused,
never truncated); a number is an ``int`` or ``float``, not a ``bool``, and finite (NaN
and infinities are refused). Each failure is one line naming the field.
This module imports only the standard library.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

# Counts (batch, sequence, degrees, micro-batches) above this are typos, not strategies.
MAX_COUNT = 2**31 - 1

# Resource limits: beyond them a compile takes minutes and gigabytes (or a launch starts
# more processes than the machine can hold), so the request is refused at once instead.
# Instructions of a plan (all rank classes) as estimated from the strategy before compiling
# (`compiler.estimated_instructions`); 200,000 compile in about 15-20 s and 1 GB on 2 cores.
MAX_PLAN_INSTRUCTIONS = 200_000
# Gradient buckets of one stage (`replicate.bucket_mb` cuts a stage's parameters into them).
MAX_BUCKETS_PER_STAGE = 4096
# Processes `piper-sim run` starts on one node per CPU core (CPU ranks share the cores).
MAX_CPU_RANKS_PER_CORE = 8

# Model sizes (model files, Hugging Face configs, `configs.FIELD_RANGES`): beyond these a size
# is a typo, and the tensors it implies overflow even on the meta device (hidden 2**40 does).
# Widths: hidden size, MLP widths, attention heads, head and low-rank dims (published models
# reach 16,384 hidden and 53,248 MLP width).
MAX_MODEL_WIDTH = 2**20
# Vocabulary rows of the embedding and head (published models: up to about 262,144).
MAX_VOCAB = 2**24
# Positions a model declares (``max_seq``, ``sliding_window``; 10M-token contexts exist).
MAX_POSITIONS = 2**27
# Routed (or shared) experts of one MoE layer (published models: up to 512; 4096 compile in
# about 10 s).
MAX_EXPERTS = 2**12
# Bytes of a model file or config.json: real ones are a few KB; a larger file is not one
# (weights given by mistake) and is refused before it is read.
MAX_MODEL_FILE_BYTES = 2**24


def _range(minimum, maximum, value=None) -> str:
    if maximum is not None and (maximum < MAX_COUNT or (isinstance(value, int) and value > maximum)):
        return f"in {minimum}..{maximum}"
    return f">= {minimum}"


def integer(value: Any, where: str, minimum: int = 1, maximum: int | None = MAX_COUNT,
            error: type[Exception] = ValueError) -> int:
    """``value`` if it is an int (not a bool) in [minimum, maximum]; else ``error`` naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum \
            or (maximum is not None and value > maximum):
        shown = repr(value) if not isinstance(value, int) or abs(value) < 10**12 else f"{float(value):.3g}"
        raise error(f"{where} must be an integer {_range(minimum, maximum, value)} (got {shown})")
    return value


def number(value: Any, where: str, minimum: float = 0.0, positive: bool = True,
           error: type[Exception] = ValueError) -> float:
    """``value`` as a float if it is a finite int/float (not a bool), > ``minimum`` when
    ``positive`` else >= ``minimum``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > minimum if positive else value >= minimum)
    if not ok:
        raise error(f"{where} must be a finite number {'>' if positive else '>='} {minimum:g} (got {value!r})")
    return float(value)


def arg_int(minimum: int = 1, maximum: int | None = MAX_COUNT):
    """An argparse ``type`` for integers in range (one-line error naming the value)."""
    def parse(text: str) -> int:
        try:
            return integer(int(text), "", minimum, maximum)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer {_range(minimum, maximum)}, got {text!r}") from None
    parse.__name__ = "integer"
    return parse


def arg_float(minimum: float = 0.0, positive: bool = True):
    """An argparse ``type`` for finite numbers (> minimum, or >= when not ``positive``)."""
    def parse(text: str) -> float:
        try:
            return number(float(text), "", minimum, positive)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a finite number {'>' if positive else '>='} {minimum:g}, "
                                             f"got {text!r}") from None
    parse.__name__ = "number"
    return parse
