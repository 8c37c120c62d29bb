"""Model-state memory and data-parallel traffic under ZeRO (arXiv 1910.02054; schedules.md §5).

Ψ parameters, N data-parallel ranks, bf16 params and grads, fp32 Adam master + m + v (12 B):
  ZeRO-0  16Ψ        ZeRO-1  4Ψ + 12Ψ/N      ZeRO-2  2Ψ + 14Ψ/N      ZeRO-3  16Ψ/N
"""

from __future__ import annotations

import math


def _check(dp: int, zero: int) -> None:
    if dp < 1:
        raise ValueError(f"data-parallel degree must be >= 1, got {dp}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero}")


def adam_state_bytes(param_bytes: float) -> float:
    """Optimizer state per parameter: Adam's m and v in fp32 (8 B), plus an fp32 master copy
    (4 B) when the parameters are narrower than fp32 (mixed precision)."""
    return 8.0 if param_bytes >= 4 else 12.0


def model_state_bytes(params: float, dp: int, zero: int, param_bytes: float = 2, grad_bytes: float = 2,
                      optim_bytes: float = 12) -> dict[str, float]:
    """Bytes per rank of params, grads and optimizer state (and their total)."""
    _check(dp, zero)
    out = {
        "params_bytes": params * param_bytes / (dp if zero >= 3 else 1),
        "grads_bytes": params * grad_bytes / (dp if zero >= 2 else 1),
        "optimizer_bytes": params * optim_bytes / (dp if zero >= 1 else 1),
    }
    out["total_bytes"] = sum(out.values())
    return out


def dp_collectives(params: float, dp: int, zero: int, param_bytes: float = 2,
                   grad_bytes: float = 2, microbatches: int = 1,
                   reduce: str = "per_microbatch") -> list[tuple[str, float]]:
    """The data-parallel collectives of one step as (kind, S), S as in `collectives`.

    ZeRO-0: all-reduce of the grads. ZeRO-1/2: reduce-scatter of the grads, all-gather of
    the updated params. ZeRO-3: all-gather in forward and in backward, reduce-scatter of grads.
    With ``microbatches`` per step: ZeRO-0/1 accumulate full gradients and sync once;
    ZeRO-2/3 reduce-scatter every micro-batch's gradients (``reduce="per_microbatch"``, FSDP's
    and DeepSpeed's default; ``"per_step"``: once); ZeRO-3 gathers for every micro-batch.
    """
    _check(dp, zero)
    if dp == 1:
        return []
    grads, weights = params * grad_bytes, params * param_bytes
    rs = [("REDUCE_SCATTER", grads)] * (microbatches if reduce == "per_microbatch" else 1)
    if zero == 0:
        return [("ALLREDUCE", grads)]
    if zero == 1:
        return [("REDUCE_SCATTER", grads), ("ALL_GATHER", weights)]
    if zero == 2:
        return rs + [("ALL_GATHER", weights)]
    if reduce == "per_microbatch":
        return [("ALL_GATHER", weights), ("ALL_GATHER", weights), ("REDUCE_SCATTER", grads)] * microbatches
    return [("ALL_GATHER", weights), ("ALL_GATHER", weights)] * microbatches + rs


def bucket_sizes(total_bytes: float, bucket_mb: float) -> list[float]:
    """Split `total_bytes` into buckets of `bucket_mb` MiB (the last one smaller)."""
    if total_bytes <= 0:
        return []
    if bucket_mb <= 0:
        return [total_bytes]
    size = bucket_mb * 2**20
    n = math.ceil(total_bytes / size)
    return [size] * (n - 1) + [total_bytes - size * (n - 1)]


def comm_buffer_bytes(bucket_bytes: float, dp: int, zero: int) -> float:
    """Transient bytes a rank holds for one in-flight DP bucket.

    ZeRO-0..2 reduce in place on the gradient buffer (0 extra, bucket views); ZeRO-3
    materialises the unsharded bucket for its all-gather (the local 1/N shard excluded).
    """
    _check(dp, zero)
    return bucket_bytes * (dp - 1) / dp if zero == 3 else 0.0


def fits(peak_bytes: float, capacity_bytes: float) -> bool:
    """Whether a rank whose memory peaks at ``peak_bytes`` fits a device with
    ``capacity_bytes`` (the catalog's memory per GPU; no reserve is taken for the CUDA
    context, communication buffers or fragmentation). The one check behind the
    simulator's ``fits`` verdict and the explorer's out-of-memory rows."""
    return peak_bytes <= capacity_bytes
