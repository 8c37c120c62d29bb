"""Operator-level kernel prices: GEMM by shape, flash attention by shape, memory-bound ops.

A segment's profile is a table of kernel rows ``(cls, name, shape, dtype, count, flops,
bytes)`` (see ``piper_sim.kernels``); :func:`table_time` prices one table on one GPU:

``gemm``      ``max(flops / (peak · eff(m, n, k)), bytes / HBM)``, eff from XLA's measured
              matmul table of the GPU's architecture [XLA] (``costmodel/data/xla_matmul.csv``:
              sm_90 measured on H100, sm_100 on B200; `XLA_TABLES`), interpolated in
              log2(m, n, k) and clamped at its 256..4096 edges (a skinny GEMM below the table
              is bounded by the roofline's bytes term, not by a guessed derate), capped at the
              GPU's MAMF [MLE-A]; other GPUs of a family scale it by their MAMF over the
              measured GPU's, other families use the sm_90 table so scaled.
``attn_*``    flash-attention throughput by (sequence, head dim, causal) from the
              FlashAttention-2 benchmark on H100 / A100 [FA-repo] (the kernel PyTorch's SDPA
              flash backend runs); the backward's throughput is derived from the fwd+bwd and
              fwd figures (FA convention: bwd = 2.5 × fwd FLOPs, causal counts half). The row's
              name is the kernel the stack runs (``costmodel.stack``): ``flash`` (FA2),
              ``flash3``, ``cudnn``, ``triton``, each FA2 times its measured ratio to FA2.
sustained     tensor-core work (GEMM, attention) runs at ``GPU.sustained_ratio`` of the burst
              those benchmarks measure (``costmodel.hardware`` SUSTAINED_*).
``mem``       ``bytes / (hbm_bw · mem_bw_eff)``: well-written memory-bound kernels reach
              ≈90% of HBM peak on H100 (Quack RMSNorm/softmax/CE, 3.01 of 3.35 TB/s [Quack]).
every kernel  ``+ launch_s`` per launch (``count``).

Sources (tags as in shared/reference/kernels.md): [XLA] tensorflow/tensorflow
``third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h``; [MLE-A]
stas00/ml-engineering MAMF table; [FA-repo] Dao-AILab/flash-attention
``assets/flash2_h100_fwd_bwd_benchmark.png``, ``flash2_a100_fwd_bwd_benchmark.png``,
``flash3_fp16_fwd.png`` (FA2 fwd bars); [Quack] Dao-AILab/quack
``media/2025-07-10-membound-sol.md``.
"""

from __future__ import annotations

import bisect
import csv
import functools
import math
import os
from typing import Iterable

from costmodel.hardware import B200, GPU, H100

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")

# --- GEMM --------------------------------------------------------------------------------

# The table's smallest dimension. Below it the efficiency is the edge's (clamped): a skinny
# GEMM's time is then bounded by its bytes (``table_time`` takes the roofline's max), which is
# what measured skinny shapes show; the former d/256 derate priced a k = 96 bmm at 9% of peak.
GEMM_TABLE_MIN_DIM = 256


@functools.lru_cache(maxsize=4)
def xla_gemm_points(gpu_key: str = "sm_90", dtype: str = "bf16") -> dict[tuple[int, int, int], float]:
    """{(m, n, k): FLOP/s} of the unbatched (b = 1) GEMMs measured for XLA's GPU cost model
    (the full 256..4096 grid); a batched GEMM is priced as one with m·batch rows."""
    acc: dict[tuple[int, int, int], list[float]] = {}
    with open(os.path.join(DATA_DIR, "xla_matmul.csv")) as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        for r in rows:
            if r["gpu"] == gpu_key and r["dtype"] == dtype and r["b"] == "1":
                key = (int(r["m"]), int(r["n"]), int(r["k"]))
                acc.setdefault(key, []).append(float(r["flops_per_s"]))
    if not acc:
        raise ValueError(f"no XLA matmul points for {gpu_key} {dtype} in {DATA_DIR}/xla_matmul.csv")
    return {k: sum(v) / len(v) for k, v in acc.items()}


# The XLA table of each GPU family and the GPU it was measured on [XLA]: sm_90 on H100 (assumed
# for the older table), sm_100 on B200 (the table names that key "sm_100_B200" from openxla/xla
# PR #36518 on). Families without a table of their own (ampere, cdna3, cpu) use sm_90's,
# scaled by their MAMF (as before; no measured table of theirs is transcribed).
XLA_MEASURED_ON: dict[str, GPU] = {"sm_90": H100, "sm_100": B200}  # table key -> its GPU
XLA_TABLES: dict[str, str] = {"blackwell": "sm_100"}  # family -> table key; others: sm_90
XLA_DEFAULT_TABLE = "sm_90"


def xla_table(family: str) -> str:
    """The key of the XLA table that prices GEMMs of a GPU of ``family``."""
    return XLA_TABLES.get(family, XLA_DEFAULT_TABLE)


@functools.lru_cache(maxsize=4)
def _gemm_grid(gpu_key: str = XLA_DEFAULT_TABLE) -> tuple[list[int], dict]:
    """Efficiencies (vs the bf16 peak of the GPU the table was measured on) on the full log2
    grid of the table's dims; holes are filled from the nearest measured point (in log2
    distance)."""
    pts = xla_gemm_points(gpu_key)
    peak = XLA_MEASURED_ON[gpu_key].peak("bf16")
    dims = sorted({d for key in pts for d in key if GEMM_TABLE_MIN_DIM <= d <= 4096})
    logs = {k: tuple(math.log2(x) for x in k) for k in pts}
    grid = {}
    for m in dims:
        for n in dims:
            for k in dims:
                if (m, n, k) in pts:
                    grid[(m, n, k)] = pts[(m, n, k)] / peak
                    continue
                q = (math.log2(m), math.log2(n), math.log2(k))
                near = min(pts, key=lambda p: sum((a - b) ** 2 for a, b in zip(logs[p], q)))
                grid[(m, n, k)] = pts[near] / peak
    return dims, grid


def _bracket(dims: list[int], x: float) -> tuple[int, int, float]:
    x = min(max(x, dims[0]), dims[-1])
    i = min(bisect.bisect_right(dims, x), len(dims) - 1)
    lo, hi = dims[max(i - 1, 0)], dims[i]
    w = 0.0 if hi == lo else (math.log2(x) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return lo, hi, min(max(w, 0.0), 1.0)


def gemm_efficiency(gpu: GPU, m: int, n: int, k: int, batch: int = 1) -> float:
    """Achieved fraction of the GPU's bf16 peak for one (batched) GEMM, at sustained clocks."""
    if not gpu.gemm_by_shape:
        return gpu.mamf_eff
    return _shape_efficiency(m * batch, n, k, gpu.mamf_eff, gpu.family) * gpu.sustained_ratio


@functools.lru_cache(maxsize=65536)
def _shape_efficiency(rows: int, n: int, k: int, mamf_eff: float, family: str = "hopper") -> float:
    """`gemm_efficiency` of a GEMM with ``rows`` (m · batch) rows on a GPU of this MAMF and
    family (a model prices the same few shapes millions of times: memoised)."""
    key = xla_table(family)
    dims, grid = _gemm_grid(key)
    (m0, m1, wm), (n0, n1, wn), (k0, k1, wk) = (_bracket(dims, rows), _bracket(dims, n), _bracket(dims, k))
    eff = 0.0
    for mm, a in ((m0, 1 - wm), (m1, wm)):
        for nn, b in ((n0, 1 - wn), (n1, wn)):
            for kk, c in ((k0, 1 - wk), (k1, wk)):
                eff += a * b * c * grid[(mm, nn, kk)]
    return min(eff * mamf_eff / XLA_MEASURED_ON[key].mamf_eff, mamf_eff)


# FP8 MAMF vs BF16 MAMF on H100: 1402.6 / 1979 = 70.9% vs 80.3% [MLE-A].
FP8_EFF_RATIO = 0.709 / 0.803


def gemm_time(gpu: GPU, m: int, n: int, k: int, batch: int = 1, dtype: str = "bf16") -> float:
    """Seconds for one GEMM, without launch overhead."""
    flops = 2.0 * m * n * k * batch
    eff = gemm_efficiency(gpu, m, n, k, batch)
    if dtype == "fp8":
        eff *= FP8_EFF_RATIO
    return flops / (gpu.peak(dtype if dtype in gpu.peak_flops else "bf16") * eff)


# --- flash attention ---------------------------------------------------------------------

ATTN_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
# FlashAttention-2 TFLOP/s, batch·seq = 16k, hidden 2048 [FA-repo]; keys (head_dim, causal).
# H100 SXM5, fwd+bwd:
FA2_H100_FWD_BWD = {
    (64, False): (215, 254, 274, 288, 294, 296),
    (128, False): (248, 294, 320, 326, 335, 338),
    (64, True): (141, 192, 232, 257, 273, 284),
    (128, True): (163, 221, 265, 294, 308, 328),
}
# H100, FA2 forward only (the FA2 bars of flash3_fp16_fwd.png), head dim 128:
FA2_H100_FWD = {
    (128, False): (309, 350, 362, 368, 370, 370),
    (128, True): (191, 260, 298, 319, 333, 335),
}
# A100 80GB SXM4, fwd+bwd (512/1k of hd128 non-causal are hidden in the figure: the 2k
# value is used for them, a conservative fill):
FA2_A100_FWD_BWD = {
    (64, False): (132, 147, 162, 171, 175, 176),  # 1k hidden in the figure: midpoint of 512 and 2k
    (128, False): (187, 187, 187, 196, 201, 203),
    (64, True): (88, 119, 140, 156, 165, 171),
    (128, True): (99, 133, 155, 173, 182, 189),
}
FA_BWD_FLOPS_RATIO = 2.5  # backward FLOPs / forward FLOPs (FA convention, recomputes scores)


def _interp_seq(values: tuple, seq: float) -> float:
    xs = [math.log2(s) for s in ATTN_SEQS]
    x = min(max(math.log2(max(seq, 1)), xs[0]), xs[-1])
    i = min(bisect.bisect_right(xs, x), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    w = (x - x0) / (x1 - x0)
    return values[i - 1] + w * (values[i] - values[i - 1])


# Other attention kernels, as their measured throughput over FA2's at the same point (by
# sequence, ATTN_SEQS), for (forward, backward) x causal. Forward ratios: H100, head dim 128,
# flash3_fp16_fwd.png [FA-repo] bars of FA3 / cuDNN over the FA2 bars (FA2_H100_FWD).
_FA2_FWD_NC, _FA2_FWD_C = FA2_H100_FWD[(128, False)], FA2_H100_FWD[(128, True)]
FA3_FWD = {False: (467, 565, 625, 638, 646, 648), True: (292, 423, 521, 579, 602, 616)}
CUDNN_FWD = {False: (497, 574, 617, 609, 600, 595), True: (315, 410, 484, 518, 529, 539)}
# Backward, H100 hd128, arXiv 2407.08608 (FA3 paper) Fig. 6 as transcribed by a third party
# (subtext.edge.nugit.net; lower confidence, not checked against the PDF): FA2 / cuDNN / FA3 at
# seq 512..16k. Each kernel's ratio to the figure's own FA2 bars; applied to causal too (inferred).
FIG6_BWD_FA2 = (214, 260, 291, 310, 318, 322)
CUDNN_BWD = (305, 408, 465, 499, 518, 516)
FA3_BWD = (316, 424, 501, 542, 559, 561)
# Triton flash attention (flash_attn_triton, llm-foundry's attn_impl='triton') over FA2, A100,
# fwd+bwd, causal, hd128, flash2_a100_fwd_bwd_benchmark.png [FA-repo]: Triton 50/61/68/74/78/80
# vs FA2 99/133/155/173/182/189 TFLOP/s. Only fwd+bwd is measured: the same ratio for each pass
# and for non-causal, and on other GPUs (inferred).
TRITON_FA = (50, 61, 68, 74, 78, 80)
_FA2_A100_C = FA2_A100_FWD_BWD[(128, True)]
ATTENTION_KERNEL_NAMES = ("flash", "flash3", "cudnn", "triton")


def _ratio(num: tuple, den: tuple) -> tuple:
    return tuple(a / b for a, b in zip(num, den))


def attention_kernel_ratio(kernel: str, seq: float, causal: bool, backward: bool) -> float:
    """Throughput of ``kernel`` over FA2's at this point (1 for ``flash``, FA2 itself)."""
    if kernel == "flash":
        return 1.0
    if kernel == "triton":
        return _interp_seq(_ratio(TRITON_FA, _FA2_A100_C), seq)
    fa2_fwd = _FA2_FWD_C if causal else _FA2_FWD_NC
    if kernel in ("cudnn", "flash3"):
        if backward:
            return _interp_seq(_ratio(CUDNN_BWD if kernel == "cudnn" else FA3_BWD, FIG6_BWD_FA2), seq)
        return _interp_seq(_ratio((CUDNN_FWD if kernel == "cudnn" else FA3_FWD)[causal], fa2_fwd), seq)
    raise ValueError(f"unknown attention kernel {kernel!r}; known: {', '.join(ATTENTION_KERNEL_NAMES)}")


def attention_tflops(gpu: GPU, seq: float, head_dim: int, causal: bool, backward: bool,
                     kernel: str = "flash") -> float:
    """Achieved TFLOP/s (FA convention) of one attention kernel's forward or backward, at
    sustained clocks; ``kernel`` a profile row's name (``flash`` = FA2)."""
    return _attention_tflops(gpu.peak("bf16"), gpu.family, seq, head_dim, causal, backward, kernel) * \
        gpu.sustained_ratio


@functools.lru_cache(maxsize=4096)
def _attention_tflops(peak_bf16: float, family: str, seq: float, head_dim: int, causal: bool, backward: bool,
                      kernel: str = "flash") -> float:
    """`attention_tflops` at burst clocks on a GPU of this bf16 peak and family (memoised)."""
    return _fa2_tflops(peak_bf16, family, seq, head_dim, causal, backward) * \
        attention_kernel_ratio(kernel, seq, causal, backward)


# The FlashAttention-2 fwd+bwd chart that prices each GPU family, and the bf16 peak of the GPU it
# was measured on (other GPUs of the family are scaled by their peak, assumed). A CPU has no
# flash-attention measurement: the A100 chart scaled by its peak stands in (as before; CPU runs
# are priced from calibration).
FA2_CHART_BY_FAMILY = {"ampere": (FA2_A100_FWD_BWD, 312e12), "cpu": (FA2_A100_FWD_BWD, 312e12)}
FA2_DEFAULT_CHART = (FA2_H100_FWD_BWD, H100.peak("bf16"))  # hopper, blackwell, cdna3: H100's chart


@functools.lru_cache(maxsize=4096)
def _fa2_tflops(peak_bf16: float, family: str, seq: float, head_dim: int, causal: bool, backward: bool) -> float:
    """FA2's FLOP/s on a GPU of this bf16 peak and family, at the benchmark's (burst) clocks."""
    hd = 64 if head_dim <= 64 else 128  # other head dims use the nearest measured one (assumed)
    chart, measured_on_peak = FA2_CHART_BY_FAMILY.get(family, FA2_DEFAULT_CHART)
    both = _interp_seq(chart[(hd, causal)], seq)
    # the forward share of fwd+bwd, measured on H100 at hd128; other cases reuse it (inferred)
    fwd_h100 = _interp_seq(FA2_H100_FWD[(128, causal)], seq)
    both_h100 = _interp_seq(FA2_H100_FWD_BWD[(128, causal)], seq)
    fwd = both * fwd_h100 / both_h100
    if not backward:
        tf = fwd
    else:  # t_bwd = t_both - t_fwd for 1 + 2.5 units of work
        t = (1 + FA_BWD_FLOPS_RATIO) / both - 1 / fwd
        tf = FA_BWD_FLOPS_RATIO / t
    return tf * 1e12 * peak_bf16 / measured_on_peak  # other GPUs: scaled by their peak (assumed)


def attention_time(gpu: GPU, shape: tuple, backward: bool, kernel: str = "flash") -> float:
    """Seconds for one attention call of ``shape = (b, heads, sq, skv, d, causal)``."""
    b, h, sq, skv, d, causal = shape
    fwd_flops = 4.0 * b * h * sq * skv * d / (2 if causal else 1)
    flops = fwd_flops * (FA_BWD_FLOPS_RATIO if backward else 1.0)
    return flops / attention_tflops(gpu, skv, d, bool(causal), backward, kernel)


# --- memory-bound ------------------------------------------------------------------------

# Achieved share of HBM peak by memory-bound kernels: 3.01 / 3.35 TB/s [Quack].
MEM_BW_EFF = 0.9


def memory_time(gpu: GPU, nbytes: float, bw_eff: float = MEM_BW_EFF) -> float:
    return nbytes / (gpu.hbm_bw * bw_eff)


# --- a whole table -----------------------------------------------------------------------


class BandwidthTable:
    """Measured bandwidth by bytes moved per op, interpolated in log(bytes), clamped at the
    ends (a calibration's ``memory_bw_table``: caches make small ops faster)."""

    def __init__(self, rows):
        pts = sorted((float(b), float(bw)) for b, bw in rows)
        if not pts or any(b <= 0 or bw <= 0 for b, bw in pts):
            raise ValueError("memory_bw_table needs rows [bytes > 0, bytes/s > 0]")
        self.xs = [math.log(b) for b, _ in pts]
        self.ys = [bw for _, bw in pts]

    def __call__(self, nbytes: float) -> float:
        x = math.log(max(nbytes, 1.0))
        if x <= self.xs[0]:
            return self.ys[0]
        if x >= self.xs[-1]:
            return self.ys[-1]
        i = bisect.bisect_right(self.xs, x)
        w = (x - self.xs[i - 1]) / (self.xs[i] - self.xs[i - 1])
        return self.ys[i - 1] + w * (self.ys[i] - self.ys[i - 1])


def table_time(gpu: GPU, rows: Iterable, gemm_dtype: str | None = None, gemm_table=None,
               bw_eff: float = MEM_BW_EFF, mem_bw: BandwidthTable | None = None) -> float:
    """Seconds to run every kernel of a profile table once, back to back.

    ``gemm_dtype`` overrides the dtype GEMMs run in (e.g. "fp8"); ``gemm_table`` (a
    ``costmodel.compute.EfficiencyTable``, from a calibration) replaces the shape surface
    and prices attention as GEMM work of the same size (CPU: no flash kernels);
    ``mem_bw`` (measured bandwidth by bytes per op) replaces ``hbm_bw · bw_eff`` for
    memory-bound kernels.
    """
    total = 0.0
    for cls, name, shape, dtype, count, flops, nbytes in rows:
        total += count * gpu.launch_s
        if cls == "gemm":
            m, n, k, b = shape
            per_call = flops / count
            if gemm_table is not None:
                t = per_call / (gpu.peak(_peak_dtype(gpu, dtype)) * gemm_table(per_call))
            else:
                t = gemm_time(gpu, m, n, k, b, gemm_dtype or dtype)
            total += count * max(t, memory_time(gpu, nbytes / count, bw_eff))
        elif cls in ("attn_fwd", "attn_bwd"):
            if gemm_table is not None:
                per_call = flops / count
                total += count * per_call / (gpu.peak(_peak_dtype(gpu, dtype)) * gemm_table(per_call))
            else:
                total += count * attention_time(gpu, tuple(shape), cls == "attn_bwd", name)
        elif mem_bw is not None:
            total += nbytes / mem_bw(nbytes / count)
        else:
            total += memory_time(gpu, nbytes, bw_eff)
    return total


def _peak_dtype(gpu: GPU, dtype: str) -> str:
    return dtype if dtype in gpu.peak_flops else next(iter(gpu.peak_flops))
