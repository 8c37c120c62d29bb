"""``--tokens`` and the run flags `simulate` and `explore` share: time to train, goodput,
GPU-hours, checkpoint interval, kWh and $ (costmodel.training_run), with the step's band."""

from __future__ import annotations

import argparse
from typing import Any

from costmodel.training_run import (FAILURES_PER_GPU_HOUR, NODE_OVERHEAD, PUE, RESTART_S, STORAGE_BW, RunOptions,
                                    duration, human)
from piper_sim.checks import arg_float, arg_size

RUN_FLAGS = ("failure_rate", "ckpt_bandwidth", "async_ckpt", "ckpt_interval_min", "restart_min",
             "price_per_gpu_hour", "pue", "node_overhead")


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("time to train (with --tokens)")
    g.add_argument("--tokens", type=arg_size, metavar="N",
                   help="tokens to train, e.g. 1T, 300B, 2.5e12: report time to train, goodput, GPU-hours, kWh")
    g.add_argument("--failure-rate", type=arg_float(0.0, positive=False), metavar="X",
                   help=f"interruptions per GPU-hour (default {FAILURES_PER_GPU_HOUR:.3g}: Llama 3, 419 in 54 days "
                        "on 16,384 GPUs)")
    g.add_argument("--ckpt-bandwidth", type=arg_float(0.0), metavar="GBPS",
                   help=f"checkpoint save/load GB/s per GPU (default {STORAGE_BW['shared'] / 1e9:.3g}: Llama 3's "
                        "2 TB/s storage over 16,384 GPUs)")
    g.add_argument("--async-ckpt", action="store_true",
                   help="asynchronous save: training waits only for the copy to host memory")
    g.add_argument("--ckpt-interval-min", type=arg_float(0.0), metavar="M",
                   help="minutes of training between checkpoints (default: Daly's optimum)")
    g.add_argument("--restart-min", type=arg_float(0.0, positive=False), metavar="M",
                   help=f"minutes to restart after a failure, before loading (default {RESTART_S / 60:g}, assumed)")
    g.add_argument("--price-per-gpu-hour", type=arg_float(0.0, positive=False), metavar="P",
                   help="$ per GPU-hour (no default: without it no $ is shown)")
    g.add_argument("--pue", type=arg_float(1.0, positive=False), metavar="X",
                   help=f"data centre power usage effectiveness (default {PUE:g}, Google's fleet)")
    g.add_argument("--node-overhead", type=arg_float(0.0, positive=False), metavar="F",
                   help=f"node power besides the GPUs, as a share of theirs (default {NODE_OVERHEAD:.2g}: 8xH100 "
                        "node measured at 8.4 kW)")


def run_options(args: argparse.Namespace) -> RunOptions | None:
    """The flags as `RunOptions`, None without ``--tokens``; ValueError (one line) when a run
    flag comes without it."""
    given = [f for f in RUN_FLAGS if getattr(args, f, None) not in (None, False)]
    if args.tokens is None:
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --tokens (the tokens to train)")
        return None
    kw: dict[str, Any] = {"tokens": args.tokens, "asynchronous": bool(args.async_ckpt),
                          "price_per_gpu_hour": args.price_per_gpu_hour}
    for flag, field, scale in (("failure_rate", "failures_per_gpu_hour", 1), ("ckpt_bandwidth", "save_bw", 1e9),
                               ("ckpt_interval_min", "interval_s", 60), ("restart_min", "restart_s", 60),
                               ("pue", "pue", 1), ("node_overhead", "node_overhead", 1)):
        if getattr(args, flag) is not None:
            kw[field] = getattr(args, flag) * scale
    return RunOptions(**kw)


def _band(low, high, attr: str, fmt) -> str:
    return "" if low is None else f" (80% band {fmt(getattr(low, attr))}-{fmt(getattr(high, attr))})"


def describe_run(mid, low=None, high=None, opts: RunOptions | None = None, gpu: str = "") -> list[str]:
    """The report's lines; ``low``/``high``: the run at the ends of the step's band."""
    lines = [f"time to train {human(mid.tokens)} tokens: {duration(mid.wall_s)}"
             f"{_band(low, high, 'wall_s', duration)}, goodput {100 * mid.goodput:.1f}%, "
             f"{human(mid.gpu_hours)} GPU-hours{_band(low, high, 'gpu_hours', human)} on {mid.world_size} GPUs",
             f"checkpoint {human(mid.checkpoint_bytes, 'B')} every {duration(mid.interval_s)} of training "
             f"({'given' if opts and opts.interval_s else 'Daly optimum'}), blocks {duration(mid.checkpoint_blocking_s)}"
             f"{' (async)' if opts and opts.asynchronous else ''}; {mid.interruptions:.3g} interruptions expected "
             f"(one every {duration(mid.mtbf_s)})"]
    if mid.kwh is None:
        lines.append(f"energy: no sourced board power for {gpu or 'this GPU'} (costmodel.hardware.TRAINING_POWER_W)")
    else:
        lines.append(f"energy {human(mid.kwh * 1e3, 'Wh')}{_band(low, high, 'kwh', lambda k: human(k * 1e3, 'Wh'))}, "
                     f"{human(mid.tokens_per_kwh)} tokens/kWh")
    if mid.cost is not None:
        lines.append(f"cost ${human(mid.cost)}{_band(low, high, 'cost', lambda c: '$' + human(c))}, "
                     f"${mid.cost_per_1m_tokens:.3g} per 1M tokens at ${opts.price_per_gpu_hour:g}/GPU-hour")
    return lines


def run_json(mid, low=None, high=None, opts: RunOptions | None = None) -> dict[str, Any]:
    """``{..the run.., "band": {"low": {...}, "high": {...}} | None, "options": {...}}``."""
    from dataclasses import asdict

    return {**mid.to_json(), "band": None if low is None else {"low": low.to_json(), "high": high.to_json()},
            "options": None if opts is None else asdict(opts)}


def plan_run(result, opts: RunOptions):
    """The run of a simulated plan (`SimResult`): (at the step time, at its band's low and high
    ends or None). Checkpoint bytes from the plan's model and dtype, the most one rank holds from
    its simulated model states."""
    from costmodel.dtypes import DTYPE_BYTES
    from costmodel.hardware import parse_cluster, training_power_w
    from costmodel.training_run import banded, checkpoint_bytes
    from piper_sim.sources import resolve_model

    if result.time_unit == "units":
        raise ValueError("--tokens: the unit cost model counts time units, not seconds; use the analytic one")
    meta = result.meta
    try:
        params = resolve_model(meta.get("model")).param_count()
    except ValueError as e:
        raise ValueError(f"--tokens: cannot size the checkpoint: {e}") from None
    try:
        gpu = parse_cluster(meta["cluster"]).gpu
    except (KeyError, ValueError):
        gpu = None
    band = None if result.band is None else (result.band.step_low_s, result.band.step_high_s)
    runs = banded(opts, result.step_time_s, band, tokens_per_step=result.tokens_per_s * result.step_time_s,
                  world_size=result.world_size, ckpt_bytes=checkpoint_bytes(params, DTYPE_BYTES[meta.get("dtype", "bf16")]),
                  rank_state_bytes=max(s.params_bytes + s.optimizer_bytes for s in result.rank_stats),
                  gpu_power_w=None if gpu is None else training_power_w(gpu))
    return runs, (gpu.name if gpu else "")
