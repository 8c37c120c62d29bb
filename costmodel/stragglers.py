"""Stragglers: GPUs of one SKU do not run at one speed, and a synchronous step waits for the
slowest.

Every rank of a training step waits, directly or through the pipeline and the gradient sync,
for every other rank, so the step's compute runs at the pace of the job's slowest GPU. With
per-GPU speeds spread normally around the fleet's mean with relative standard deviation
``spread``, the expected slowest of ``n`` runs ``1 + spread · E[max of n standard normals]``
slower (`slowest_factor`). The spread is the GPU's ``speed_spread`` field
(`costmodel.hardware.GPU`), 0 for a CPU.

The default spread (`GPU_SPEED_SPREAD`) is derived from Sinha et al., "Not All GPUs Are
Created Equal: Characterizing Variability in Large-Scale, Accelerator-Rich Systems" (SC'22,
arXiv 2208.11035 v3, abstract): across >90% of the GPUs of five HPC clusters (Summit, Vortex,
Frontera, Longhorn, Corona), "8% (max 22%) average performance variation" between GPUs of
one SKU running the same kernel, "with outliers up to 1.5X slower than the median GPU".
Reading the 8% as the range of a cluster's GPUs (assumed: the paper's figures are box plots
over each cluster), a normal sample of 1,000-27,000 GPUs spans 6.5-8.2 standard deviations
(`expected_range_z`), so the spread is 1.0-1.2%; piper-sim takes the lower end, 1.0%. The
outliers (hardware faults, throttled nodes) are the what-if of ``simulate --slow-ranks``, not
part of the default.
"""

from __future__ import annotations

import math
from statistics import NormalDist

# relative standard deviation of per-GPU speed (see the module docstring: Sinha et al. SC'22)
GPU_SPEED_SPREAD = 0.010
_NORMAL = NormalDist()


def expected_max_z(n: int) -> float:
    """E[max of n independent standard normals], by Blom's approximation
    Φ⁻¹((n − 0.375) / (n + 0.25)) (G. Blom, Statistical Estimates and Transformed Beta-Variables,
    1958; within 5% of the exact value at n = 2 and within 1% from n = 20, tests/test_stragglers.py);
    0 for n <= 1."""
    if n <= 1:
        return 0.0
    return _NORMAL.inv_cdf((n - 0.375) / (n + 0.25))


def expected_range_z(n: int) -> float:
    """E[max − min] of n standard normals, in standard deviations."""
    return 2.0 * expected_max_z(n)


def slowest_factor(n: int, spread: float = GPU_SPEED_SPREAD) -> float:
    """How much slower the expected slowest of ``n`` GPUs computes than the mean GPU."""
    if not math.isfinite(spread) or spread < 0:
        raise ValueError(f"speed_spread must be a finite fraction >= 0, got {spread!r}")
    return 1.0 + spread * expected_max_z(n)


def check_slow_ranks(slow_ranks: dict[int, float], world_size: int) -> None:
    """A slow-rank what-if (rank -> how many times slower it computes): one ValueError line
    naming the bad rank or slowdown."""
    for rank, factor in slow_ranks.items():
        if not 0 <= rank < world_size:
            raise ValueError(f"slow rank {rank} is outside the plan's ranks 0..{world_size - 1}")
        if not (math.isfinite(factor) and factor >= 1.0):
            raise ValueError(f"slowdown of rank {rank} must be a finite factor >= 1 (1.2 = 20% slower), "
                             f"got {factor!r}")
