"""Microbenchmarks behind `piper-sim calibrate`: they measure, `costmodel.fit` fits.

What runs, all through torch on the machine at hand (CUDA + NCCL when a GPU is there,
else CPU + gloo):

- matmul sweep over shapes and dtypes -> achieved FLOP/s per shape;
- memory-bound ops (copy, add) on large tensors -> achieved memory bandwidth;
- F / BI / BW / B of the zoo's tiny models, segment by segment, next to their flops from
  `piper_sim.profiling` (BI = grad w.r.t. the segment input, B = w.r.t. input and
  parameters, BW = B - BI as in the profiler's flop split; `BW_params` = grad w.r.t. the
  parameters alone, which recomputes the activation-gradient chain);
- in worker processes (`torch.multiprocessing`, forkserver where available, else spawn;
  rendezvous on a free 127.0.0.1 port):
  send/recv ping-pong and every collective over message sizes and group sizes, then
  matmul throughput with one rank computing alone, all ranks computing at once
  (contention) and all ranks computing while their own async all-reduces run (overlap).

Each rank of a group is one "device": on CPU it gets `threads` intra-op threads (default
$OMP_NUM_THREADS, else 1 -- what torchrun gives each executor rank), and so does the
parent process that measures compute. Every result is a plain JSON-ready dict or list.

Timing: `time.perf_counter` on CPU, CUDA events (after a synchronize) on GPU. Each
benchmark runs in `repeats` rounds over all its points (shapes, segments, sizes), a
point's loop lasting about `target_s / repeats` per round; a point reports its fastest
round, per call. Interleaving spreads every point over the whole benchmark, so a burst of
other work on a shared machine spoils a round of every point rather than all rounds of a
few. A collective's time is the slowest rank's.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import queue as queue_lib
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from costmodel.dtypes import torch_dtype
from executor.collectives import all_gather_flat, reduce_scatter_flat
from piper_sim.progress import Counter

KIB, MIB = 1 << 10, 1 << 20
COLLECTIVES = ("ALLREDUCE", "REDUCE_SCATTER", "ALL_GATHER", "ALL_TO_ALL")

# Bump when what a calibration measures or holds changes: cached calibrations of an older
# method are measured again (`fingerprint`). 2: collective fits carry their measured points
# (the "table" of costmodel.calibration), the quick sweep a point every 4x in size; gloo
# all-gathers as the executor runs them (`all_gather_flat`). 3: gloo reduce-scatters as an
# all-to-all and a sum (`reduce_scatter_flat`), no longer an all-reduce. 4: the host time of
# the call that posts each async collective, send and receive (`post_times`, "post"). 5: comm
# slowed while computing is against all-reduces queued back to back, not one alone; on CPU
# posts are timed with the ranks computing between them, as the executor posts.
METHOD = 5
POST_CALLS = 10  # posts timed per point (quick: the median of them), 20 in a full run


class CalibrationError(ValueError):
    """Bad calibration input or a failed benchmark run (the CLI prints one line)."""


# --------------------------------------------------------------------------- configuration


@dataclass
class BenchConfig:
    """What to measure. Build it with `make_config`."""

    quick: bool
    device: str  # "cpu" or "cuda"
    nproc: int  # largest group of worker processes
    threads: int  # intra-op threads per rank (and in the parent)
    dtype: str  # the dtype compute is calibrated for
    group_sizes: tuple[int, ...]
    target_s: float  # wall time per measured point
    repeats: int
    matmul_shapes: dict[str, list[tuple[int, int, int]]]  # dtype -> shapes
    memory_mib: tuple[int, ...]
    # model -> (micro_batch, seq_len)s; chosen so the two models' dominant-GEMM sizes differ
    # (the efficiency table is keyed by it; moe-tiny's 8192·tokens would meet gpt-tiny's
    # 32768·tokens at 4x the tokens)
    segment_batches: dict[str, tuple[tuple[int, int], ...]]
    comm_sizes: tuple[int, ...]  # bytes
    overlap_bytes: int  # all-reduce size kept running during the overlap phase
    phase_matmul: int  # square matmul size of the contention / overlap phases
    phase_s: float
    timeout_s: float  # per worker group
    max_call_s: float = 0.5  # skip matmul shapes predicted slower than this per call
    cores: int = field(default_factory=lambda: _cores())


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def make_config(quick: bool = False, nproc: int | None = None, threads: int | None = None,
                device: str = "auto") -> BenchConfig:
    """Defaults for this machine; raises CalibrationError on impossible requests."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise CalibrationError(f"device must be auto, cpu or cuda, got {device!r}")
    cores = _cores()
    if device == "cuda":
        if not torch.cuda.is_available():
            raise CalibrationError("--device cuda: no CUDA device available")
        gpus = torch.cuda.device_count()  # one GPU: compute only, no collectives
        if nproc is not None and not 2 <= nproc <= gpus:
            raise CalibrationError(f"--nproc {nproc}: NCCL needs one GPU per rank, 2..{gpus} on this machine")
        nproc = gpus if nproc is None else nproc
    else:
        nproc = (4 if cores >= 4 else 2) if nproc is None else nproc
        if nproc < 2:
            raise CalibrationError(f"--nproc must be at least 2 (collectives need a group), got {nproc}")
    if threads is None:  # what torchrun gives each rank of the executor
        threads = _int_env("OMP_NUM_THREADS", 1)
    if threads < 1:
        raise CalibrationError(f"--threads must be at least 1, got {threads}")
    gpu = device == "cuda"
    return BenchConfig(
        quick=quick, device=device, nproc=nproc, threads=threads, dtype="bf16" if gpu else "fp32",
        group_sizes=tuple(sorted({n for n in (2, 4, nproc) if 2 <= n <= nproc})),
        target_s=0.05 if quick else 0.25, repeats=3 if quick else 7,
        phase_matmul=4096 if gpu else 384, phase_s=0.15 if quick else 0.5,
        timeout_s=180.0 if quick else 600.0, cores=cores, **_sweeps(quick, gpu),
    )


def _sweeps(quick: bool, gpu: bool) -> dict:
    """Shapes and sizes: GPUs need bigger ones to reach their plateaus."""
    if quick:
        squares = [256, 1024, 4096] if gpu else [64, 256, 512, 1024]
        rect = [(1024, 4096, 1024)] if gpu else [(128, 256, 64), (1024, 256, 64)]
        other = [1024, 4096] if gpu else [256]
        sizes = [4 * KIB * 4 ** i for i in range(7)]  # 4 KiB .. 16 MiB, a point every 4x
        batches = {"gpt-tiny": ((1, 16), (4, 128)), "moe-tiny": ((2, 128),)}
        out = dict(segment_batches=batches, memory_mib=(256,) if gpu else (64,),
                   overlap_bytes=(16 if gpu else 1) * MIB)
    else:
        squares = [256, 512, 1024, 2048, 4096, 8192] if gpu else [32, 64, 128, 256, 512, 1024, 2048]
        rect = ([(2048, 4096, 1024), (8192, 4096, 4096), (4096, 14336, 4096), (4096, 4096, 256)] if gpu else
                [(16, 256, 64), (128, 256, 64), (1024, 256, 64), (4096, 256, 64), (512, 1024, 1024),
                 (2048, 4096, 1024)])
        other = [512, 2048, 8192] if gpu else [128, 256, 512, 1024]
        sizes = [4 * KIB * 4 ** i for i in range(10 if gpu else 8)]  # 4 KiB .. 64 MiB (1 GiB on GPU)
        batches = {"gpt-tiny": ((1, 16), (2, 64), (4, 128), (8, 128)),
                   "moe-tiny": ((1, 16), (2, 128), (6, 128), (12, 128))}
        out = dict(segment_batches=batches,
                   memory_mib=(256, 1024) if gpu else (4, 64, 256), overlap_bytes=(64 if gpu else 4) * MIB)
    main, second = ("bf16", "fp32") if gpu else ("fp32", "bf16")
    shapes = {main: sorted([(n, n, n) for n in squares] + rect, key=math.prod), second: [(n, n, n) for n in other]}
    return dict(matmul_shapes=shapes, comm_sizes=tuple(sizes), **out)


def _int_env(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name) or default)
    except ValueError:
        raise CalibrationError(f"${name} must be an integer, got {os.environ[name]!r}") from None


def step_count(cfg: BenchConfig) -> int:
    """Progress steps of `run_calibration`."""
    n = 1 + sum(len(s) for s in cfg.matmul_shapes.values()) + 2 * len(cfg.memory_mib)
    n += sum(len(batches) * len(_segment_kinds(m)) for m, batches in cfg.segment_batches.items())
    for world in cfg.group_sizes:
        n += len(COLLECTIVES) * len(cfg.comm_sizes) + (len(cfg.comm_sizes) if world == 2 else 0) + 1
    return n


# --------------------------------------------------------------------------- progress


Tick = Callable[..., None]  # tick(label, steps=1.0): progress


class Progress(Counter):
    """The calibration's bar on stderr (`piper_sim.progress.Counter`: whole steps, no bar when
    stderr is not a terminal); call it per step."""

    def __init__(self, total: int, enabled: bool = True):
        super().__init__(total, "calibrate", "step", enabled)


# --------------------------------------------------------------------------- timing


def _loop_seconds(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return time.perf_counter() - t0


def time_rounds(fns: dict, device: torch.device, target_s: float, repeats: int, warmup: int = 2,
                agree: Callable[[float], float] = float, before: Callable[[], None] = lambda: None,
                tick: Tick = lambda label, steps=1.0: None) -> dict:
    """Seconds per call of each of `fns` (key -> callable): `repeats` rounds over all of
    them, the fastest round of each. `agree` maps the estimated time per call to a value
    every rank shares (so all run the same iterations); `before` runs before each loop."""
    iters = {}
    for key, fn in fns.items():
        for _ in range(warmup):
            fn()
        est = agree(_loop_seconds(fn, 3, device) / 3)
        iters[key] = int(min(10_000, max(1, target_s / repeats / max(est, 1e-7))))
    best = dict.fromkeys(fns, math.inf)
    for r in range(repeats):
        for key, fn in fns.items():
            before()
            best[key] = min(best[key], _loop_seconds(fn, iters[key], device) / iters[key])
            tick(f"{key} round {r + 1}/{repeats}", 1 / repeats)
    return best


def time_op(fn: Callable[[], object], device: torch.device, target_s: float, repeats: int = 3,
            warmup: int = 2) -> float:
    """Seconds per call of one callable (fastest of `repeats` loops)."""
    return time_rounds({"op": fn}, device, target_s, repeats, warmup)["op"]


# --------------------------------------------------------------------------- compute


def bench_launch(device: torch.device, target_s: float) -> float:
    """Seconds of a trivial op: the per-op dispatch / launch overhead."""
    x = torch.zeros(1, device=device)
    return time_op(lambda: x.add_(1.0), device, target_s, warmup=10)


def bench_matmul(shapes, dtype: str, device: torch.device, target_s: float, repeats: int,
                 max_call_s: float, tick: Tick) -> list[dict]:
    """Achieved FLOP/s of `torch.mm` per (m, n, k); shapes whose first call takes longer
    than `max_call_s` are dropped."""
    dt, fns = torch_dtype(dtype), {}
    for m, n, k in shapes:
        a, b = torch.randn(m, k, device=device).to(dt), torch.randn(k, n, device=device).to(dt)
        out = torch.empty(m, n, device=device, dtype=dt)
        fn = (lambda a, b, out: lambda: torch.mm(a, b, out=out))(a, b, out)
        if _loop_seconds(fn, 1, device) > max_call_s:
            tick(f"mm {dtype} {m}x{n}x{k} skipped (too slow)")
            continue
        fns[(m, n, k)] = fn
    times = time_rounds(fns, device, target_s, repeats, tick=lambda label, steps=1.0: tick(f"mm {dtype}", steps))
    return [{"m": m, "n": n, "k": k, "dtype": dtype, "seconds": t, "flops_per_s": 2.0 * m * n * k / t}
            for (m, n, k), t in times.items()]


def bench_memory(sizes_mib, device: torch.device, target_s: float, repeats: int, tick: Tick) -> list[dict]:
    """Bandwidth of copy (read + write) and add (2 reads + write) on fp32 tensors."""
    fns, moved = {}, {}
    for mib in sizes_mib:
        a, b, c = (torch.rand(mib * MIB // 4, device=device) for _ in range(3))
        fns[("copy", mib)] = (lambda a, c: lambda: c.copy_(a))(a, c)
        fns[("add", mib)] = (lambda a, b, c: lambda: torch.add(a, b, out=c))(a, b, c)
        moved[("copy", mib)], moved[("add", mib)] = 2 * mib * MIB, 3 * mib * MIB
    times = time_rounds(fns, device, target_s, repeats, tick=lambda label, steps=1.0: tick("memory", steps))
    return [{"op": op, "mib": mib, "bytes_moved": moved[op, mib], "seconds": t, "bw_Bps": moved[op, mib] / t}
            for (op, mib), t in times.items()]


def _segment_kinds(model: str) -> list[str]:
    from piper_sim.sources import resolve_model

    cfg = resolve_model(model)
    mid = ["dense"] * (not cfg.is_moe or cfg.first_dense > 0) + ["moe_pre", "moe_experts"] * cfg.is_moe
    return ["embed", *mid, "head"]


def _segment_fn(cfg, kind: str, mb: int, seq: int, dtype: torch.dtype, device: torch.device):
    """(fn, inputs, params) running one segment as `piper_sim.profiling.profile_kind` costs it."""
    from piper_sim.models import build_units, lm_loss

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(cfg.vocab, (mb, seq), generator=g).to(device)
    hidden = torch.randn(mb, seq, cfg.hidden, generator=g).to(device, dtype).requires_grad_()
    unit = {"embed": "embed", "head": "head", "dense": "layers.0"}.get(kind, f"layers.{cfg.first_dense}")
    mod = build_units(cfg, [unit], device=device, dtype=dtype)[unit]
    params = list(mod.parameters())
    if kind == "embed":
        return mod, [tokens], params
    if kind == "dense":
        return mod, [hidden], params
    if kind == "head":
        return (lambda x: lm_loss(mod(x), tokens)), [hidden], params
    experts = mod.moe.experts
    if kind == "moe_pre":
        expert_ids = {id(p) for p in experts.parameters()}
        return mod.forward_pre, [hidden], [p for p in params if id(p) not in expert_ids]
    per = math.ceil(mb * seq * cfg.top_k / cfg.n_experts)  # uniform routing, as profiled
    x = torch.randn(cfg.n_experts * per, cfg.hidden, generator=g).to(device, dtype).requires_grad_()
    return (lambda x: tuple(e(c) for e, c in zip(experts, x.split(per)))), [x], list(experts.parameters())


def _segment_timers(fn, inputs, params) -> dict[str, Callable[[], object]]:
    """F (forward, building the graph), B (grad w.r.t. inputs and parameters), BI (w.r.t.
    inputs), BW_params (w.r.t. parameters), the backward ones on one retained graph."""
    def forward():
        outs = fn(*inputs)
        outs = outs if isinstance(outs, (tuple, list)) else [outs]
        return [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]

    xs = [x for x in inputs if x.requires_grad]
    outs = forward()
    grads = [torch.ones_like(o) for o in outs]

    def grad(wrt):
        return lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=True, allow_unused=True)

    timers = {"F": forward, "B": grad([*xs, *params]), "BW_params": grad(params)}
    if xs:
        timers["BI"] = grad(xs)
    return timers


def bench_segments(cfg: BenchConfig, device: torch.device, tick: Tick) -> list[dict]:
    """Measured times of every segment kind of the tiny models, with their profiled costs."""
    from piper_sim.profiling import profile_kind
    from piper_sim.sources import resolve_model

    dtype, rows, fns = torch_dtype(cfg.dtype), [], {}
    for model, batches in cfg.segment_batches.items():
        mcfg = resolve_model(model)
        for mb, seq in batches:
            for kind in _segment_kinds(model):
                cost = profile_kind(mcfg, kind, mb, seq, dtype)
                for op, timer in _segment_timers(*_segment_fn(mcfg, kind, mb, seq, dtype, device)).items():
                    fns[(len(rows), op)] = timer
                rows.append({
                    "model": model, "kind": kind, "micro_batch": mb, "seq_len": seq, "tokens": cost.tokens,
                    "flops": {"F": cost.fwd_flops, "BI": cost.bwd_input_flops, "BW": cost.bwd_weight_flops,
                              "B": cost.bwd_flops},
                    "gemm": [cost.gemm_m, cost.gemm_n, cost.gemm_k],
                    # what the compiler hands the simulator as an op's memory traffic (piper_sim.ir)
                    "mem_bytes": cost.param_bytes + 2 * cost.saved_act_bytes,
                    "seconds": {"BI": 0.0},
                })
    per_segment = len(fns) / len(rows)
    times = time_rounds(fns, device, cfg.target_s, cfg.repeats,
                        tick=lambda label, steps=1.0: tick("segments", steps / per_segment))
    for (i, op), t in times.items():
        rows[i]["seconds"][op] = t
    for row in rows:
        sec = row["seconds"]
        sec["BW"] = max(sec["B"] - sec["BI"], 0.0)  # the profiler's split: BW flops = B - BI
    return rows


# --------------------------------------------------------------------------- communication


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective(kind: str, nbytes: int, world: int, device: torch.device, async_op: bool = False):
    """(op, actual S in bytes) for one collective in costmodel.collectives' convention of S;
    with ``async_op`` the op returns its work (what the executor posts)."""
    n = max(world, nbytes // 4 // world * world)  # fp32 elements, divisible by the group
    part = n // world
    zeros = lambda k: torch.zeros(k, device=device)  # noqa: E731 (zeros: repeated sums stay finite)
    if kind == "ALLREDUCE":
        x = zeros(n)
        return (lambda: dist.all_reduce(x, async_op=async_op)), 4 * n
    if kind == "REDUCE_SCATTER":  # as the executor runs it (an all-to-all and a sum on gloo)
        inp = zeros(n)
        if async_op:
            return (lambda: reduce_scatter_flat(inp, dist.get_rank(), world, async_op=True)[0]), 4 * n
        return (lambda: reduce_scatter_flat(inp, dist.get_rank(), world)), 4 * n
    if kind == "ALL_GATHER":  # as the executor runs it (broadcasts on gloo)
        inp, out = zeros(part), zeros(n)
        return (lambda: all_gather_flat(out, inp, dist.get_rank(), world, async_op=async_op)), 4 * n
    if kind == "ALL_TO_ALL":
        inp, out = zeros(n), zeros(n)
        return (lambda: dist.all_to_all_single(out, inp, async_op=async_op)), 4 * n
    raise CalibrationError(f"unknown collective {kind!r}; expected one of {', '.join(COLLECTIVES)}")


def _ping_pong(nbytes: int, rank: int, device: torch.device):
    """Rank 0 sends to 1, 1 sends back: one call = two one-way transfers."""
    buf = torch.zeros(max(1, nbytes // 4), device=device)

    def op():
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
    return op


def post_times(g: "_Group", posts: dict, calls: int, load: Callable[[], None] | None = None,
               depth: int = 2) -> dict:
    """Host seconds of the call that posts each async op (key -> callable returning its
    work, or None where this rank posts nothing): the median of ``calls`` posts, every
    rank's. Without ``load`` each post is waited for before the next, on idle ranks. With
    ``load`` (CPU) they are timed as the executor posts them: every rank runs ``load``
    (compute) after each post, the earlier posts' transfers still going (at most ``depth``
    in flight: a post first waits for the one ``depth`` before it); gloo's threads then
    share the cores, and a post takes 2-5x its idle time (2 ranks, 2-core VM, 4 MiB
    all-gather: 0.35 ms idle, 0.9-1.8 ms between 20 ms of matmuls). Returns key ->
    [seconds per rank]."""
    out = {}
    in_flight = 1 if load is None else depth
    for key, post in posts.items():
        times, works = [], []
        for i in range(calls + 2):  # two warm-up posts
            while len(works) >= in_flight:
                works.pop(0).wait()
            if load is None or i == 0:
                g.barrier()
            t = time.perf_counter()
            work = post()
            if i >= 2:
                times.append(time.perf_counter() - t)
            if work is not None:
                works.append(work)
            if load is not None:
                load()
        for w in works:
            w.wait()
        out[key] = g.gather(statistics.median(times))
    return out


def _p2p_post(nbytes: int, rank: int, device: torch.device) -> Callable[[], object]:
    """Rank 0's ``isend`` to rank 1 and rank 1's ``irecv`` from 0, as the executor posts them."""
    buf = torch.zeros(max(1, nbytes // 4), device=device)
    return (lambda: dist.isend(buf, 1)) if rank == 0 else (lambda: dist.irecv(buf, 0))


class _Group:
    """Helpers for code that runs on every rank of a worker group."""

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device

    def barrier(self) -> None:
        dist.all_reduce(torch.zeros(1, device=self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def gather(self, value: float) -> list[float]:
        t = torch.zeros(self.world, dtype=torch.float64, device=self.device)
        t[self.rank] = value
        dist.all_reduce(t)
        return t.tolist()

    def max_all(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def time_rounds(self, fns: dict, target_s: float, repeats: int, tick: Tick) -> dict:
        """`time_rounds` on every rank in step (same iterations, a barrier before each
        loop); each time is the slowest rank's."""
        times = time_rounds(fns, self.device, target_s, repeats, agree=self.max, before=self.barrier, tick=tick)
        return dict(zip(times, self.max_all(list(times.values()))))


def _phases(g: _Group, spec: dict, allreduce_s: float, tick: Tick) -> dict:
    """Matmul seconds per call, in interleaved rounds (fastest round kept): rank 0 alone,
    every rank at once, every rank while its own async all-reduces run; on CPU the first
    two again with one thread per core (not interleaved: the other ranks' OpenMP workers
    would still spin while rank 0 runs alone). With several ranks a round's time is the
    slowest rank's: ranks that finish early would otherwise hide the contention."""
    m, dev, reps = spec["phase_matmul"], g.device, spec["repeats"]
    dt = torch_dtype(spec["dtype"])
    a, b = torch.randn(m, m, device=dev).to(dt), torch.randn(m, m, device=dev).to(dt)
    c = torch.empty(m, m, device=dev, dtype=dt)
    x = torch.zeros(spec["overlap_bytes"] // 4, device=dev)  # zeros: repeated sums stay finite

    def mm():
        torch.mm(a, b, out=c)

    def loop(iters, ranks=None) -> float:
        g.barrier()
        return _loop_seconds(mm, iters, dev) / iters if ranks is None or g.rank in ranks else math.inf

    def iterations() -> int:
        for _ in range(2):
            mm()
        return max(3, int(spec["phase_s"] / reps / max(g.max(_loop_seconds(mm, 1, dev)), 1e-7)))

    iters = iterations()
    k = min(2000, math.ceil(3 * iters * g.max(_loop_seconds(mm, 1, dev)) / max(allreduce_s, 1e-7)) + 2)
    alone = together = overlapped = comm_under = queued = math.inf
    covered = True
    for r in range(reps):
        # all-reduces posted back to back, no compute: seconds per all-reduce in a queue
        # (a third of the queue below; comm_overlap_slowdown divides by this, not by one alone)
        g.barrier()
        t0 = time.perf_counter()
        works = [dist.all_reduce(x, async_op=True) for _ in range(max(4, math.ceil(k / 3)))]
        for w in works:
            w.wait()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        queued = min(queued, g.max((time.perf_counter() - t0) / len(works)))
        alone = min(alone, loop(iters, ranks=(0,)))
        together = min(together, g.max(loop(iters)))
        g.barrier()
        works = [dist.all_reduce(x, async_op=True) for _ in range(k)]
        t = _loop_seconds(mm, iters, dev) / iters
        covered &= not works[-1].is_completed()
        finished = sum(w.is_completed() for w in works)  # in issue order: the ones done while computing
        for w in works:
            w.wait()
        overlapped = min(overlapped, g.max(t))
        # all-reduces done per second while the ranks compute, as seconds per all-reduce
        comm_under = min(comm_under, g.max(t * iters / max(finished, 0.5)))
        tick(f"overlap / contention n={g.world} round {r + 1}/{reps}", 1 / reps)
    out = {"matmul": m, "dtype": spec["dtype"], "threads": torch.get_num_threads(), "iters": iters,
           "alone_s": g.max(alone if g.rank == 0 else 0.0), "together_s": together,
           "overlap_s": overlapped, "overlap_allreduce_bytes": spec["overlap_bytes"],
           "overlap_allreduces": k, "overlap_covered": g.max(0.0 if covered else 1.0) == 0.0,
           "allreduce_alone_s": allreduce_s, "allreduce_queued_s": queued, "allreduce_computing_s": comm_under}
    if dev.type == "cpu" and spec["cores"] != spec["threads"]:
        torch.set_num_threads(spec["cores"])
        iters = iterations()
        time.sleep(0.5)  # idle OpenMP workers spin a while after a parallel region: let them sleep
        alone = min(loop(iters, ranks=(0,)) for _ in range(reps))
        together = min(g.max(loop(iters)) for _ in range(reps))
        out["default_threads"] = {"threads": spec["cores"], "alone_s": g.max(alone if g.rank == 0 else 0.0),
                                  "together_s": together}
        torch.set_num_threads(spec["threads"])
    return out


def _matmul_load(spec: dict, device: torch.device, seconds: float = 0.01) -> Callable[[], None]:
    """Square matmuls (the overlap phase's size) for ``seconds``: a rank computing."""
    m = spec["phase_matmul"]
    a, b = torch.randn(m, m, device=device), torch.randn(m, m, device=device)

    def load() -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            torch.mm(a, b)
    return load


def _warm_up(g: _Group) -> None:
    """Fresh connections are slow at first (buffer allocation, TCP windows): exercise them."""
    for nbytes in (64 * KIB, MIB, 4 * MIB):
        x = torch.zeros(nbytes // 4, device=g.device)
        for _ in range(10):
            dist.all_reduce(x)
    g.barrier()


def _comm_worker(rank: int, world: int, port: int, spec: dict, q) -> None:
    """One rank of a benchmark group; rank 0 reports ticks and the result on `q`."""
    torch.set_num_threads(spec["threads"])
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    g = _Group(rank, world, device)
    tick = (lambda label, steps=1.0: q.put(("tick", label, steps))) if rank == 0 else (lambda *a, **k: None)
    try:
        _warm_up(g)
        fns, nbytes = {}, {}
        for size in spec["p2p_sizes"] if world == 2 else []:
            fns["p2p", size], nbytes["p2p", size] = _ping_pong(size, rank, device), max(4, size // 4 * 4)
        for kind in spec["kinds"]:
            for size in spec["sizes"]:
                fns[kind, size], nbytes[kind, size] = _collective(kind, size, world, device)
        times = g.time_rounds(fns, spec["target_s"], spec["repeats"],
                              lambda label, steps=1.0: tick(f"comm n={world}", steps))
        out: dict = {"collectives": {kind: [] for kind in spec["kinds"]}, "p2p": []}
        for (kind, size), t in times.items():
            if kind == "p2p":
                out["p2p"].append([nbytes[kind, size], t / 2])  # a ping-pong is two transfers
            else:
                out["collectives"][kind].append([nbytes[kind, size], t])
        if spec.get("post_calls"):  # the host time of posting each, as the executor does
            posts = {}
            for size in spec["p2p_sizes"] if world == 2 else []:
                posts["p2p", size] = _p2p_post(size, rank, device)
            for kind in spec["kinds"]:
                for size in spec["sizes"]:
                    posts[kind, size] = _collective(kind, size, world, device, async_op=True)[0]
            tick(f"posting n={world}", 0.0)
            post = post_times(g, posts, spec["post_calls"], None if cuda else _matmul_load(spec, device))
            out["post"] = {kind: [] for kind in [*spec["kinds"], "SEND", "RECV"]}
            for (kind, size), per_rank in post.items():
                if kind == "p2p":
                    out["post"]["SEND"].append([nbytes[kind, size], per_rank[0]])
                    out["post"]["RECV"].append([nbytes[kind, size], per_rank[1]])
                else:
                    out["post"][kind].append([nbytes[kind, size], max(per_rank)])
            out["post"] = {k: v for k, v in out["post"].items() if v}
        if spec.get("phases"):
            ar = times.get(("ALLREDUCE", spec["overlap_bytes"])) or times[next(iter(times))]
            out["phases"] = _phases(g, spec, ar, tick)
        del fns
        if rank == 0:
            q.put(("result", out))
        g.barrier()
    finally:
        dist.destroy_process_group()


def run_group(world: int, spec: dict, tick: Tick = lambda label, steps=1.0: None) -> dict:
    """Spawn `world` ranks running `_comm_worker(spec)`; returns rank 0's result."""
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if method == "forkserver":  # import torch once in the server, not in every rank of every group
        mp.set_forkserver_preload([__name__])
    q = mp.get_context(method).Queue()
    procs = mp.start_processes(_comm_worker, args=(world, free_port(), spec, q), nprocs=world,
                               join=False, start_method=method)
    deadline, result = time.monotonic() + spec["timeout_s"], None

    def drain():
        nonlocal result
        while True:
            try:
                what, *payload = q.get_nowait()
            except queue_lib.Empty:
                return
            if what == "tick":
                tick(*payload)
            else:
                result = payload[0]

    try:
        while not procs.join(timeout=0.1):
            drain()
            if time.monotonic() > deadline:
                raise CalibrationError(f"benchmark group of {world} ranks exceeded {spec['timeout_s']:.0f} s")
    except mp.ProcessRaisedException as e:
        raise CalibrationError(f"benchmark worker failed: {str(e).strip().splitlines()[-1]}") from None
    except mp.ProcessExitedException as e:
        raise CalibrationError(f"benchmark worker died: {e}") from None
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
    time.sleep(0.05)
    drain()
    if result is None:
        raise CalibrationError(f"benchmark group of {world} ranks returned no result")
    return result


def _comm_spec(cfg: BenchConfig) -> dict:
    return {"device": cfg.device, "threads": cfg.threads, "cores": cfg.cores, "dtype": cfg.dtype,
            "kinds": list(COLLECTIVES), "sizes": list(cfg.comm_sizes), "p2p_sizes": list(cfg.comm_sizes),
            "target_s": cfg.target_s, "repeats": cfg.repeats, "timeout_s": cfg.timeout_s, "phases": True,
            "post_calls": POST_CALLS if cfg.quick else 2 * POST_CALLS,
            "phase_matmul": cfg.phase_matmul, "phase_s": cfg.phase_s, "overlap_bytes": cfg.overlap_bytes}


def measure_collective(kind: str, nbytes: int, world: int = 2, quick: bool = True, device: str = "cpu",
                       threads: int | None = None) -> float:
    """Seconds of one collective of S = nbytes over `world` fresh worker processes."""
    cfg = make_config(quick=quick, nproc=world, threads=threads, device=device)
    spec = {**_comm_spec(cfg), "kinds": [kind], "sizes": [nbytes], "p2p_sizes": [], "phases": False,
            "post_calls": 0}
    return run_group(world, spec)["collectives"][kind][0][1]


# --------------------------------------------------------------------------- everything


def machine_info(cfg: BenchConfig) -> dict:
    info = {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cores": cfg.cores, "device": cfg.device}
    if cfg.device == "cuda":
        info["device_name"] = torch.cuda.get_device_name(0)
        v = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    else:
        info["device_name"] = _cpu_name()
    return info


def fingerprint(device: str = "cpu", threads: int | None = None) -> dict:
    """What a calibration of this machine depends on: processor model, usable cores, torch
    version, intra-op threads per rank (default as `make_config`: $OMP_NUM_THREADS, else 1)
    and the measuring method (`METHOD`)."""
    if threads is None:
        threads = _int_env("OMP_NUM_THREADS", 1)
    name = torch.cuda.get_device_name(0) if device == "cuda" else _cpu_name()
    return {"device": device, "device_name": name, "cores": _cores(), "torch": torch.__version__,
            "threads": threads, "method": METHOD}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def run_calibration(cfg: BenchConfig, progress: bool = True) -> dict:
    """Run every benchmark of `cfg`; returns the raw measurements (see module docstring)."""
    t0, load_before = time.perf_counter(), _load_avg()
    bar = Progress(step_count(cfg), enabled=progress)
    device = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        raw = {"config": {k: v for k, v in asdict(cfg).items() if k != "matmul_shapes"},
               "machine": machine_info(cfg),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        phase_s = raw["phase_s"] = {}

        def timed(name, fn):
            t = time.perf_counter()
            raw[name] = fn()
            phase_s[name] = round(time.perf_counter() - t, 2)

        timed("launch_s", lambda: bench_launch(device, cfg.target_s))
        bar("launch overhead")
        timed("matmul", lambda: [row for dtype, shapes in cfg.matmul_shapes.items()
                                 for row in bench_matmul(shapes, dtype, device, cfg.target_s, cfg.repeats,
                                                         cfg.max_call_s, bar)])
        timed("memory", lambda: bench_memory(cfg.memory_mib, device, cfg.target_s, cfg.repeats, bar))
        timed("segments", lambda: bench_segments(cfg, device, bar))
        timed("comm", lambda: {str(w): run_group(w, _comm_spec(cfg), bar) for w in cfg.group_sizes})
    finally:
        torch.set_num_threads(saved_threads)
        bar.close()
    raw["run_s"] = time.perf_counter() - t0
    raw["load_avg"] = {"before": load_before, "after": _load_avg()}
    return raw


def _load_avg() -> float | None:
    """1-minute load average (other processes skew CPU measurements), None where unknown."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None
