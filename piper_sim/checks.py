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


class StrategyError(ValueError):
    """Bad strategy input; the message is one line naming the directive/field and the fix
    (`piper_sim.strategy` re-exports it)."""

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
# Ranks of one plan, strategy or cluster (its world size). The largest training clusters
# built hold about 100,000 GPUs (2024-25); 2**17 leaves room above them, while a plan of this
# size still compiles in about a second and simulates in seconds (a data-parallel gpt-tiny
# plan of 1,000,000 ranks took 6.5 s to compile and 45 s / 570 MB to simulate on 2 cores).
# Checked before any per-rank list is built: a plan claiming 1e9 ranks grew to 22 GB before.
MAX_WORLD_SIZE = 2**17
# Layers of one model (model files, Hugging Face configs). Published models have at most a
# few hundred (126: Llama 3 405B); every layer is a unit the compiler profiles and places,
# and 1e9 layers ran 41 s into a MemoryError before this limit.
MAX_LAYERS = 4096
# Strategies one `explore` search enumerates (each is screened, the survivors compiled and
# simulated). The zoo's largest searches: llama3-70b on 16,384 H100s about 2,400, deepseek-v3
# (MoE: every EP degree too) on 8,192 H100s at 32k tokens about 45,000; the screen checks a few
# hundred per second on 2 cores, so this bounds a search's screen to minutes, not hours.
MAX_EXPLORE_CANDIDATES = 100_000


def check_world_size(ranks: float, what: str, error: type[Exception] = ValueError) -> None:
    """Refuse more than `MAX_WORLD_SIZE` ranks: one line naming ``what`` and the limit."""
    if ranks > MAX_WORLD_SIZE:
        raise error(f"{what}: {ranks:,.0f} ranks exceed the limit of {MAX_WORLD_SIZE:,} "
                    "(piper_sim.checks.MAX_WORLD_SIZE)")

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


SIZE_SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}


def parse_size(text: str) -> float:
    """``"1T"`` -> 1e12, ``"300B"`` -> 3e11, ``"2.5e12"``, ``"15.6T"`` (K, M, B or G, T, P;
    any case); ValueError unless a finite number > 0."""
    t = str(text).strip().upper().replace("_", "").replace(",", "")
    scale = SIZE_SUFFIXES.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if t[-1:] in SIZE_SUFFIXES else t) * scale
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"expected a count like 1T, 300B or 2.5e12 (K, M, B, T, P), got {text!r}")
    return value


def arg_size(text: str) -> float:
    """An argparse ``type`` for `parse_size` (argparse's one-line error names the flag)."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


arg_size.__name__ = "size"


def arg_int_list(minimum: int = 1, maximum: int | None = MAX_COUNT):
    """An argparse ``type`` for a comma-separated list of integers in range (``2,4,8``);
    argparse's one-line error names the flag."""
    one = arg_int(minimum, maximum)

    def parse(text: str) -> list[int]:
        try:
            return [one(part.strip()) for part in text.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers "
                                             f"{_range(minimum, maximum)}, got {text!r}") from None
    parse.__name__ = "integer list"
    return parse
