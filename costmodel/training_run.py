"""Time, goodput, $ and energy to train N tokens, on top of one simulated step.

The run model (first order, as Young 1974 and Daly 2006 derive theirs): the job fails as a
Poisson process of rate ``world × failures_per_gpu_hour`` (mean time between failures M);
every ``interval_s`` of useful compute it saves a checkpoint, which stops training for
``blocking_s`` (the whole write when blocking, only the copy to host memory when async);
each failure costs the restart, the checkpoint load and the work since the last durable
checkpoint (half an interval on average; an async save in flight is not durable yet, so
its write time more). With W the useful compute time and c the cost of one failure:

    wall = W · (1 + blocking/interval) / (1 − c/M),    goodput = W / wall

Checkpoint bytes follow the executor's layout (executor/checkpoint.py `_state`: the flat
parameters and AdamW's exp_avg / exp_avg_sq, each tensor once) sized as the simulator
sizes model states (`costmodel.memory.adam_state_bytes`: fp32 moments, plus an fp32
master copy when the parameters are narrower). Energy: the GPUs' board power under
training (`costmodel.hardware.TRAINING_POWER_W`) plus the node's other parts, times the
data centre's PUE, over the whole wall time (restarts included: an upper estimate).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from costmodel.memory import adam_state_bytes

# Llama 3 (arXiv 2407.21783 §3.3.4): 419 unexpected interruptions in a 54-day snapshot of
# pre-training on 16,384 H100 GPUs: 419 / (16,384 × 54 × 24 GPU-hours) = 1.97e-5 per GPU-hour
# (inferred; a job of 16,384 GPUs fails every 3.1 h). The 47 planned interruptions are left out.
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16384
FAILURES_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_GPUS * LLAMA3_DAYS * 24)

# Save / load bandwidth per GPU by storage tier, bytes/s.
# "shared": Llama 3 §3.3.1, Tectonic serves the 16K-GPU job 2 TB/s sustained (7 TB/s peak):
# 2e12 / 16,384 = 122 MB/s per GPU (inferred). "host": the copy an async save makes before it
# returns, GPU -> pinned host memory over PCIe Gen5 x16, 64 GB/s per direction (NVIDIA H100
# datasheet: PCIe Gen5 128 GB/s both directions).
STORAGE_BW = {"shared": 2e12 / LLAMA3_GPUS, "host": 64e9}

# Restart: detect the failure, reschedule, re-initialise (NCCL, data loader) before loading the
# checkpoint (its read is counted separately). The Llama 3 paper gives no restart time; 10 min
# (assumed): with the paper's failure rate and this model it reproduces its "higher than 90%
# effective training time" (tests/test_training_run.py). Calibrate it for a real cluster.
RESTART_S = 600.0

# Node power besides the GPUs (CPUs, memory, NICs, fans, power supplies), as a share of the GPUs'
# board power: an 8×H100 HGX node training Llama2-13b drew at most 8.4 kW (Latif et al.,
# "Single-Node Power Demand During AI Training", IEEE Access 2025, arXiv 2412.08602, abstract);
# 8.4 kW / (8 × 700 W) − 1 = 0.5 (inferred, GPUs at their board power).
NODE_OVERHEAD = 8.4e3 / (8 * 700) - 1
# Power usage effectiveness: Google's fleet-wide trailing-twelve-month PUE, 1.10 (Google data
# centers "Efficiency" page; 1.10 for Q2 2021 as reported by CNBC 2022-04-13).
PUE = 1.10

# what `explore --rank-by` orders by; all but tokens_per_s need the training runs (--tokens)
RANK_BY = ("tokens_per_s", "time_to_train", "cost", "energy")


def young_interval(delta_s: float, mtbf_s: float) -> float:
    """Young 1974 ("A first order approximation to the optimum checkpoint interval", CACM
    17(9)): compute between checkpoints sqrt(2·δ·M)."""
    return math.sqrt(2 * delta_s * mtbf_s)


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    """Daly 2006 ("A higher order estimate of the optimum checkpoint interval for restart
    dumps", FGCS 22(3)): sqrt(2δM)·[1 + ⅓·sqrt(δ/2M) + ⅑·(δ/2M)] − δ for δ < 2M, else M."""
    if delta_s >= 2 * mtbf_s:
        return mtbf_s
    x = delta_s / (2 * mtbf_s)
    return math.sqrt(2 * delta_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - delta_s


def checkpoint_bytes(params: float, param_bytes: float) -> float:
    """Bytes of one checkpoint of ``params`` parameters of ``param_bytes`` each: the parameters
    and AdamW's state (`adam_state_bytes`), each tensor written once."""
    return params * (param_bytes + adam_state_bytes(param_bytes))


@dataclass(frozen=True)
class RunOptions:
    """What a user sets for the run (defaults sourced above). ``price_per_gpu_hour``: no
    default, no $ without it. ``interval_s``: None, the Daly optimum."""

    tokens: float
    failures_per_gpu_hour: float = FAILURES_PER_GPU_HOUR
    save_bw: float = STORAGE_BW["shared"]  # bytes/s per GPU, save and load
    asynchronous: bool = False  # the executor's save (dcp.save) blocks
    stage_bw: float = STORAGE_BW["host"]  # async: the blocking copy to host memory, bytes/s per GPU
    restart_s: float = RESTART_S
    interval_s: float | None = None
    price_per_gpu_hour: float | None = None
    node_overhead: float = NODE_OVERHEAD
    pue: float = PUE


@dataclass(frozen=True)
class TrainingRun:
    """The expected run: wall time, goodput (useful compute / wall), GPU-hours, the
    checkpoint interval (compute between saves), interruptions; $ and kWh when known."""

    tokens: float
    steps: int
    world_size: int
    step_time_s: float
    compute_s: float
    wall_s: float
    goodput: float
    gpu_hours: float
    interval_s: float
    interruptions: float
    mtbf_s: float
    checkpoint_bytes: float
    checkpoint_blocking_s: float
    checkpoint_write_s: float
    cost: float | None = None
    cost_per_1m_tokens: float | None = None
    kwh: float | None = None
    tokens_per_kwh: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The fields; an infinite MTBF (nothing fails) as None, valid JSON."""
        return {k: None if isinstance(v, float) and math.isinf(v) else v for k, v in asdict(self).items()}


def training_run(opts: RunOptions, step_time_s: float, tokens_per_step: float, world_size: int,
                 ckpt_bytes: float, rank_state_bytes: float = 0.0,
                 gpu_power_w: float | None = None) -> TrainingRun:
    """The expected run for ``opts.tokens`` (module docstring). ``ckpt_bytes``: one whole
    checkpoint; ``rank_state_bytes``: the most one rank holds (what an async save copies to
    host memory first; default ckpt_bytes / world_size). ValueError when the job fails faster
    than it can restart and redo its lost work."""
    if not (step_time_s > 0 and tokens_per_step > 0 and world_size >= 1):
        raise ValueError(f"training run: needs a step time > 0 and tokens per step > 0 "
                         f"(got {step_time_s:g} s, {tokens_per_step:g} tokens)")
    steps = math.ceil(opts.tokens / tokens_per_step)
    work = steps * step_time_s
    rate = opts.failures_per_gpu_hour * world_size / 3600  # failures per wall second
    mtbf = math.inf if rate == 0 else 1 / rate
    write = ckpt_bytes / (opts.save_bw * world_size)  # every rank writes its share in parallel
    stage = (rank_state_bytes or ckpt_bytes / world_size) / opts.stage_bw
    blocking = stage if opts.asynchronous else write
    if opts.interval_s is not None:
        interval = opts.interval_s
    elif math.isinf(mtbf):
        interval = work  # nothing fails: one checkpoint at the end is enough
    else:
        interval = daly_interval(blocking, mtbf)
    if opts.asynchronous:
        interval = max(interval, write)  # a save finishes before the next starts
    interval = max(interval, step_time_s)  # saves happen between steps
    lost = (interval + blocking) / 2 + (write if opts.asynchronous else 0.0)
    per_failure = opts.restart_s + write + lost  # restart, load the checkpoint, redo the lost work
    if per_failure >= mtbf:
        raise ValueError(f"training run: the job fails every {mtbf / 3600:.3g} h, faster than it restarts and "
                         f"redoes its lost work ({per_failure / 3600:.3g} h); it never finishes")
    wall = work * (1 + blocking / interval) / (1 - per_failure / mtbf)
    gpu_hours = wall * world_size / 3600
    cost = None if opts.price_per_gpu_hour is None else gpu_hours * opts.price_per_gpu_hour
    kwh = None
    if gpu_power_w is not None:
        kwh = gpu_hours * gpu_power_w * (1 + opts.node_overhead) * opts.pue / 1000
    tokens = steps * tokens_per_step
    return TrainingRun(
        tokens=tokens, steps=steps, world_size=world_size, step_time_s=step_time_s, compute_s=work, wall_s=wall,
        goodput=work / wall, gpu_hours=gpu_hours, interval_s=interval, interruptions=wall / mtbf, mtbf_s=mtbf,
        checkpoint_bytes=ckpt_bytes, checkpoint_blocking_s=blocking, checkpoint_write_s=write,
        cost=cost, cost_per_1m_tokens=None if cost is None else cost / tokens * 1e6,
        kwh=kwh, tokens_per_kwh=None if not kwh else tokens / kwh)


def banded(opts: RunOptions, step_time_s: float, band_s: tuple[float, float] | None, **kw: Any
           ) -> tuple[TrainingRun, TrainingRun | None, TrainingRun | None]:
    """The run at the simulated step time and at the ends of its band (None without one)."""
    mid = training_run(opts, step_time_s, **kw)
    if band_s is None:
        return mid, None, None
    return mid, training_run(opts, band_s[0], **kw), training_run(opts, band_s[1], **kw)


def duration(s: float) -> str:
    """``42 s``, ``12.5 min``, ``7.3 h``, ``54.1 d``."""
    for unit, div, limit in (("s", 1, 120), ("min", 60, 120 * 60), ("h", 3600, 72 * 3600)):
        if s < limit:
            return f"{s / div:.3g} {unit}"
    return f"{s / 86400:.3g} d"


def human(x: float, unit: str = "") -> str:
    """``2.36M``, ``410k``, ``57.1``; with a unit ``112 GB``, ``32.7 MWh``."""
    sep = " " if unit else ""
    for suffix, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{sep}{suffix}{unit}"
    return f"{x:.3g}{sep}{unit}"
