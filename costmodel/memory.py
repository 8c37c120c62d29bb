"""Model-state memory and data-parallel traffic under ZeRO (arXiv 1910.02054; schedules.md §5).

Ψ parameters, N data-parallel ranks, bf16 params and grads, fp32 Adam master + m + v (12 B):
  ZeRO-0  16Ψ        ZeRO-1  4Ψ + 12Ψ/N      ZeRO-2  2Ψ + 14Ψ/N      ZeRO-3  16Ψ/N
The stack's ``grad_dtype``, ``master_dtype`` and ``moment_dtype`` change the 2 B of gradients and
the 12 B of optimizer state (`adam_state_bytes`; costmodel.stack).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from costmodel.stack import DEFAULT as DEFAULT_STACK, Stack


def _check(dp: int, zero: int) -> None:
    if dp < 1:
        raise ValueError(f"data-parallel degree must be >= 1, got {dp}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero}")


def adam_state_bytes(param_bytes: float, stack: Stack = DEFAULT_STACK) -> float:
    """Optimizer state per parameter: Adam's m and v (fp32 by default: 8 B), plus a master copy
    (fp32 by default: 4 B) when the parameters are narrower than fp32 (mixed precision), as
    the stack stores them (`Stack.optimizer_state_bytes`)."""
    return float(stack.optimizer_state_bytes(int(param_bytes)))


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
    """Whether ``peak_bytes`` (what `memory_need` totals: reserved tensors plus the process's
    runtime memory) fits a device with ``capacity_bytes``. The one check behind the
    simulator's ``fits`` verdict and the explorer's out-of-memory rows; `memory_verdict`
    adds the headroom."""
    return peak_bytes <= capacity_bytes


# --- memory as the caching allocator and the runtime hold it ---------------------------------
# Sources: [PT-CCA] pytorch c10/cuda/CUDACachingAllocator.cpp @001074d2; [PT-CUDA] PyTorch docs
# notes/cuda.rst "Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF" and "cuBLAS workspaces";
# [PT-BLAS] aten/src/ATen/cuda/CublasHandlePool.cpp @26a39059; [MLE-P] stas00/ml-engineering
# @744d01e1 training/performance/README.md and debug/pytorch.md; [NCCL964], [NCCL1685]:
# NVIDIA/nccl issues #964 and #1685; [LC120] meta-llama/llama-cookbook issue #120; [MLF150]
# ISEEKYAN/Megatron-LM issue #150 (third-party fork); [DEVLOG] pytorch/devlogs
# content/eager/2026-06-01-cuda-caching-allocator.md.

GiB = 2**30
MiB = 2**20

# CUDA context with lazy module loading (the default since CUDA 12.2, forced by PyTorch since
# 1.13): 0.47 GiB measured on A100-80GB, torch 2.1.1+cu121 [MLE-P] README L379-411; the first
# cuBLAS / attention calls load about half a GB more [MLE-P] debug/pytorch.md L1071.
CUDA_CONTEXT_BYTES = 0.47 * GiB
LIBRARY_KERNELS_BYTES = 0.5 * GiB

# cuBLAS workspace per (handle, stream), from the caching allocator and never freed [PT-BLAS]
# parseChosenWorkspaceSize: 32 MiB on Hopper and Blackwell; elsewhere :4096:2:16:8 = 8.125 MiB,
# which sits alone in a 20 MiB segment [PT-CCA kLargeBuffer]. Two handles: the forward thread's
# and autograd's device thread's (inferred: handles are per thread).
CUBLAS_WORKSPACE_BYTES = {"hopper": 32 * MiB, "blackwell": 32 * MiB, "ampere": 20 * MiB}
CUBLAS_HANDLES = 2

# NCCL memory per communicator, measured through PyTorch on 4xA100 NVLink (4 MB all-reduce):
# 544 MB for a 2-rank group (a pipeline send/recv pair), 688 MB for more ranks [NCCL964]. An
# all-to-all group connects every pair: 1.06 -> 4.34 GB on its first all_to_all_single over 8
# H100 [NCCL1685], 3.28 GB for 7 peers, taken as linear in peers (inferred).
NCCL_PAIR_BYTES = 544e6
NCCL_GROUP_BYTES = 688e6
NCCL_ALL_TO_ALL_BYTES_PER_PEER = (4.34e9 - 1.06e9) / 7

# DeepEP's normal-kernel buffers, what Megatron-Core's fused_a2a.get_buffer allocates for an
# expert-parallel group instead of NCCL all-to-all connections: the larger of the dispatch and
# combine configs' size hints (megatron/core/transformer/moe/fused_a2a.py:44-65, megatron-core
# 0.16.1), from DeepEP's Config.get_nvl_buffer_size_hint / get_rdma_buffer_size_hint
# (deepseek-ai/DeepEP csrc/legacy/config.hpp @dd758ca) with Buffer.num_sms = 20 and the recommended
# configs per EP size (deep_ep/buffers/legacy.py:246-287): EP ranks -> (NVL chunked send, NVL
# chunked recv, RDMA chunked send, RDMA chunked recv) tokens. NVLink peers per node: 8
# (LEGACY_NUM_MAX_NVL_PEERS); top-k slots 128, scales 128, SourceMeta 8 bytes, int64 top-k ids.
DEEPEP_NUM_SMS = 20
DEEPEP_NVL_PEERS = 8
DEEPEP_DISPATCH_CONFIGS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                           24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128),
                           64: (32, 288, 8, 128), 96: (20, 480, 12, 128), 128: (20, 560, 12, 128),
                           144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
DEEPEP_COMBINE_CONFIGS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                          24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                          96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def deepep_buffer_bytes(hidden_bytes: int, ranks: int) -> float:
    """Bytes of the DeepEP buffers one rank of a ``ranks``-rank expert-parallel group allocates for
    tokens of ``hidden_bytes`` (the config of the nearest EP size at or above it; the largest
    beyond 160)."""
    if ranks < 2:
        return 0.0
    key = min((k for k in DEEPEP_DISPATCH_CONFIGS if k >= ranks), default=max(DEEPEP_DISPATCH_CONFIGS))
    channels, meta, topk, scales = DEEPEP_NUM_SMS // 2, 8, 128, 128
    nvl_ranks, rdma_ranks = min(ranks, DEEPEP_NVL_PEERS), max(ranks // DEEPEP_NVL_PEERS, 1)
    per_token = hidden_bytes + meta + topk * 8 + topk * 4 + scales * 4
    best = 0.0
    for configs in (DEEPEP_DISPATCH_CONFIGS, DEEPEP_COMBINE_CONFIGS):
        _, nvl_recv, rdma_send, rdma_recv = configs[key]
        rdma_recv = -(-rdma_recv // rdma_send) * rdma_send  # Config aligns it up to the send chunk
        nvl = channels * nvl_ranks * ((2 * rdma_ranks + 3) * 4 + nvl_recv * per_token)
        rdma = 0.0 if ranks <= DEEPEP_NVL_PEERS else \
            channels * rdma_ranks * 2 * ((DEEPEP_NVL_PEERS * 2 + 2) * 4 + rdma_recv * (per_token + 16))
        best = max(best, nvl + rdma)
    return best


# Reserved / allocated at the peak. The default allocator (segments split, per-stream pools):
# 1.38-1.50 measured for Llama-2-70B FSDP on 16 A100 [LC120], 1.46-1.62 for FSDP2 + TP on 16
# H100 [MLF150]; the lowest, 1.38, is taken. expandable_segments:True [PT-CUDA] maps 20 MiB
# pages into one range per pool and stream: +9% in the devlog's example [DEVLOG], 1.07-1.15
# for Megatron-FSDP [MLF150]; 1.10 is taken.
RESERVED_OVER_ALLOCATED = {False: 1.38, True: 1.10}

# Default headroom between the predicted need and the GPU's memory: NCCL grows with the
# algorithms a run first uses (lazy connect since NCCL 2.22, [NCCL1685] +3.3 GB for one
# all-to-all), libraries load kernels on first use, and ml-engineering's GPU check keeps "a few
# GiBs" free on an 80 GB A100 [MLE-P orchestration/slurm/users.md L944]: 2 GiB (inferred).
DEFAULT_HEADROOM_BYTES = 2 * GiB


@dataclass(frozen=True)
class MemoryNeed:
    """One rank's memory at its peak as the device sees it."""

    allocated: float  # live tensors at the peak (the simulator's peak: model states + transient)
    reserved: float  # what the caching allocator holds for them
    runtime: float  # CUDA context, library kernels, cuBLAS workspaces, NCCL communicators

    @property
    def total(self) -> float:
        """The expected need: reserved + runtime."""
        return self.reserved + self.runtime

    @property
    def least(self) -> float:
        """The need with no fragmentation at all (allocated + runtime): below it nothing runs."""
        return self.allocated + self.runtime


def runtime_bytes(family: str, pairs: int = 0, groups: int = 0, all_to_all_peers: int = 0,
                  deepep: float = 0.0) -> float:
    """What a training process holds on its GPU beyond its tensors: the CUDA context and
    library kernels, its cuBLAS workspaces and the NCCL memory of its communicators (``pairs``
    2-rank groups, ``groups`` larger ones, NCCL all-to-all groups with ``all_to_all_peers`` peers
    in all) and ``deepep`` bytes of DeepEP buffers (`deepep_buffer_bytes`). 0 for CPU ranks (gloo
    on host memory)."""
    if family == "cpu":
        return 0.0
    workspace = CUBLAS_WORKSPACE_BYTES.get(family, 32 * MiB) * CUBLAS_HANDLES  # other families: 32 MiB (assumed)
    nccl = pairs * NCCL_PAIR_BYTES + groups * NCCL_GROUP_BYTES + all_to_all_peers * NCCL_ALL_TO_ALL_BYTES_PER_PEER
    return CUDA_CONTEXT_BYTES + LIBRARY_KERNELS_BYTES + workspace + nccl + deepep


def memory_need(static: float, transient: float, family: str, expandable_segments: bool = False, pairs: int = 0,
                groups: int = 0, all_to_all_peers: int = 0, deepep: float = 0.0) -> MemoryNeed:
    """A rank's need at its peak from the bytes it holds all step (``static``: parameters,
    gradients, optimizer state, allocated once in large blocks: rounded to 2 MiB pages, taken
    as exact) and those it allocates and frees during the step (``transient``: activations,
    gathered parameters, buffers), which fragment the caching allocator's segments
    (`RESERVED_OVER_ALLOCATED`, applied to them only: inferred), plus `runtime_bytes`."""
    ratio = 1.0 if family == "cpu" else RESERVED_OVER_ALLOCATED[bool(expandable_segments)]
    return MemoryNeed(allocated=static + transient, reserved=static + transient * ratio,
                      runtime=runtime_bytes(family, pairs, groups, all_to_all_peers, deepep))


def memory_verdict(need: MemoryNeed, capacity: float, headroom: float = DEFAULT_HEADROOM_BYTES) -> str:
    """``fits``: the expected need (`MemoryNeed.total`) stays below capacity minus headroom;
    ``oom``: even unfragmented (`MemoryNeed.least`) it exceeds the capacity; ``tight`` in
    between: it may run out, as fragmentation (measured 1.07-1.62 across runs), NCCL and
    libraries decide."""
    if not fits(need.least, capacity):
        return "oom"
    return "fits" if fits(need.total, capacity - headroom) else "tight"
