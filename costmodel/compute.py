"""Roofline compute time with a size-dependent matmul efficiency.

    t = max(flops / (peak · eff), mem_bytes / hbm_bw) + launch

`eff` is interpolated linearly in log(size) from an efficiency table, where size is the
GEMM's FLOPs 2·m·n·k when the shape is known and the op's FLOPs otherwise (a big fused
segment lands on the table's plateau). It is capped at the GPU's MAMF.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from costmodel.hardware import GPU, H100
from costmodel.stack import Stack

# Measured BF16 GEMM throughput on sm_90 (H100 assumed), XLA's GPU cost model [XLA],
# as (m, n, k, TFLOP/s); efficiency = TFLOP/s / 989 (inferred).
HOPPER_BF16_GEMMS = (
    (256, 256, 256, 6.5),
    (1024, 1024, 1024, 236.0),
    (4096, 4096, 256, 392.0),
    (2048, 2048, 2048, 632.0),
    (1024, 4096, 4096, 738.0),
    (4096, 4096, 4096, 783.0),
)


def gemm_flops(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


@dataclass(frozen=True)
class EfficiencyTable:
    """Points (flops, eff) sorted by flops; lookups interpolate in log(flops), clamped at the ends."""

    points: tuple[tuple[float, float], ...]

    @classmethod
    def from_rows(cls, rows) -> "EfficiencyTable":
        """Rows are [m, n, k, eff] or [flops, eff] (the calibration JSON forms)."""
        pts = []
        for row in rows:
            if len(row) == 4:
                pts.append((gemm_flops(*row[:3]), float(row[3])))
            elif len(row) == 2:
                pts.append((float(row[0]), float(row[1])))
            else:
                raise ValueError(f"efficiency table row {row!r} must be [m, n, k, eff] or [flops, eff]")
        if not pts or any(f <= 0 or not 0 < e <= 1 for f, e in pts):
            raise ValueError("efficiency table needs rows with flops > 0 and 0 < eff <= 1")
        return cls(tuple(sorted(pts)))

    def __call__(self, flops: float) -> float:
        xs = [f for f, _ in self.points]
        i = bisect.bisect_left(xs, flops)
        if i == 0:
            return self.points[0][1]
        if i == len(xs):
            return self.points[-1][1]
        (f0, e0), (f1, e1) = self.points[i - 1], self.points[i]
        w = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
        return e0 + w * (e1 - e0)

    def scaled(self, factor: float) -> "EfficiencyTable":
        return EfficiencyTable(tuple((f, e * factor) for f, e in self.points))


HOPPER_BF16 = EfficiencyTable.from_rows([(m, n, k, tf * 1e12 / H100.peak("bf16")) for m, n, k, tf in HOPPER_BF16_GEMMS])


def default_table(gpu: GPU) -> EfficiencyTable:
    """The Hopper table scaled by the GPU's MAMF relative to H100's."""
    return HOPPER_BF16.scaled(gpu.mamf_eff / H100.mamf_eff)


def efficiency(gpu: GPU, flops: float, gemm: tuple[int, int, int] | None = None,
               table: EfficiencyTable | None = None) -> float:
    size = gemm_flops(*gemm) if gemm is not None else flops
    if size <= 0:
        return gpu.mamf_eff
    if table is not None:  # a calibration's measured table: as measured
        return min(table(size), gpu.mamf_eff)
    # the sourced (burst) table at the clock a training run sustains (costmodel.hardware)
    return min(default_table(gpu)(size), gpu.mamf_eff) * gpu.sustained_ratio


def compute_time(gpu: GPU, flops: float, mem_bytes: float = 0.0, gemm: tuple[int, int, int] | None = None,
                 dtype: str = "bf16", table: EfficiencyTable | None = None) -> float:
    """Seconds for one op; 0 for an op with no work."""
    if flops <= 0 and mem_bytes <= 0:
        return 0.0
    t_flops = flops / (gpu.peak(dtype) * efficiency(gpu, flops, gemm, table)) if flops > 0 else 0.0
    return max(t_flops, mem_bytes / gpu.hbm_bw) + gpu.launch_s


# Mixed-precision Adam per parameter: read bf16 grad (2), read+write fp32 master, m, v
# (3·8), write bf16 param (2) = 28 bytes; ≈12 fp32 FLOPs (assumed). Memory-bound.
ADAM_BYTES_PER_PARAM = 28.0
ADAM_FLOPS_PER_PARAM = 12.0


# torch's AdamW(foreach=True) moves 84 bytes per fp32 parameter: its step is 8 multi-tensor kernels
# (lerp_ m, mul_ v, addcmul_ v, mul_ p (weight decay), sqrt v -> tmp, div_ tmp, add_ tmp eps,
# addcdiv_ p), measured by recording the aten ops of torch 2.13's AdamW step
# (tests/test_stack.py re-measures it); the fused kernel reads p, g, m, v and writes p, m, v once:
# 28 bytes. The foreach step moves 3x the bytes of the fused one.
FOREACH_ADAM_BYTES = 84.0
FUSED_ADAM_BYTES = 28.0
OPTIMIZER_BYTES_RATIO = {"fused": 1.0, "foreach": FOREACH_ADAM_BYTES / FUSED_ADAM_BYTES}


def optimizer_bytes_ratio(implementation: str) -> float:
    """Bytes an AdamW implementation moves over the fused kernel's (``costmodel.stack`` optimizer)."""
    return OPTIMIZER_BYTES_RATIO[implementation]


def adam_step_bytes(stack: Stack, param_bytes: int) -> float:
    """Bytes the fused AdamW step moves per parameter as the stack stores its tensors: it reads
    the gradient (``grad_dtype``), reads and writes both moments and the master copy, and writes
    the parameter; it reads the parameter too when no separate fp32 master exists (fp32
    parameters, ``master_dtype`` none, or remainders: TE's multi_tensor_adam_param_remainder
    rebuilds the fp32 value from the bf16 parameter and its int16 remainder). The default stack's
    bf16 step is `ADAM_BYTES_PER_PARAM`, 28 B; `optimizer_bytes_ratio` scales it for foreach."""
    master = stack.master_bytes(param_bytes)
    reads_param = master < 4
    return (stack.grad_bytes(param_bytes) + param_bytes * (2 if reads_param else 1) + 2 * master
            + 2 * stack.moment_bytes())


def optimizer_time(gpu: GPU, params: float) -> float:
    """Adam step on `params` local (already sharded) parameters, elementwise on fp32."""
    if params <= 0:
        return 0.0
    return optimizer_step_time(gpu, ADAM_FLOPS_PER_PARAM * params, ADAM_BYTES_PER_PARAM * params)


# torch's fused AdamW reaches ≈90% of HBM bandwidth (PR pytorch/pytorch#119842: 3.564 ms for a
# Llama-2-70B shard over 128 ranks on H100, ≈2.1 TB/s of 2.4; inferred in reference/kernels.md §4).
FUSED_ADAM_BW_EFF = 0.9


def optimizer_step_time(gpu: GPU, flops: float, mem_bytes: float) -> float:
    """A fused optimizer step moving ``mem_bytes`` (memory-bound) with ``flops`` fp32 work."""
    if flops <= 0 and mem_bytes <= 0:
        return 0.0
    t_flops = flops / gpu.peak("fp32") if "fp32" in gpu.peak_flops else 0.0
    return max(t_flops, mem_bytes / (gpu.hbm_bw * FUSED_ADAM_BW_EFF)) + gpu.launch_s
