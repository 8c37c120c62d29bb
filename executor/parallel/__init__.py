"""The executor's parallelism axes, one module each (torchtitan's one ``apply_*`` per technique).

Each axis (`axis.Axis`) sets itself up on a rank's runtime, gives it instruction handlers and
hooks into its step; the runtime never asks which axes a plan uses. `AXES` is their order of
set-up: tensor and context parallelism replace the stages' modules before data parallelism
flattens the parameters that result.

    tensor   Megatron shards and their collectives (TP, sequence parallelism)
    context  CP chunks, all-gather and ring attention
    data     flat parameter buffers, DP gradient syncs, ZeRO 1-3 shards and gathers (HSDP too), clipping
    expert   the all-to-all token exchanges of expert blocks
    tied     a tied embedding's gradient all-reduce between the first and the last stage
"""

from __future__ import annotations

from executor.parallel.axis import Axis
from executor.parallel.context import ContextParallel
from executor.parallel.data import DataParallel
from executor.parallel.expert import ExpertParallel
from executor.parallel.tensor import TensorParallel
from executor.parallel.tied import TiedEmbeddings

AXES: tuple[type[Axis], ...] = (TensorParallel, ContextParallel, DataParallel, ExpertParallel, TiedEmbeddings)


def apply_axes(rt) -> list[Axis]:
    """Set up, in order, every axis the rank's plan uses."""
    return [axis(rt) for axis in AXES if axis.applies(rt)]
