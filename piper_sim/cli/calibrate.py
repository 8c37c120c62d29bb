"""`piper-sim calibrate`: microbenchmark this machine and write a calibration JSON.

    piper-sim calibrate -o traces/calibration/NAME.json [--quick] [--nproc N] [--threads T]
                        [--device auto|cpu|cuda] [-q | --no-progress] [--refit OLD.json ...]

Measures (calibration.microbench) matmul throughput, memory bandwidth, the tiny zoo models'
segment times, p2p and collectives over 2..N worker processes (gloo on CPU, NCCL on
CUDA), compute contention and comm/compute overlap; fits (costmodel.fit) and writes
the parameters plus the raw measurements. `--refit` re-fits the raw measurements stored
in earlier calibration files instead of measuring (several runs of one machine: each
point's fastest time). Use the result with
`--costmodel path.json` wherever the simulator takes a cost model.

`add_calibrate_parser(subparsers)` registers the command on `piper_sim.cli.commands`'s parser; bad
input raises `CalibrationError` (a ValueError), which the CLI prints as one line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from piper_sim.cli.common import progress_enabled


DESCRIPTION = """Measure this machine (matmul throughput, memory bandwidth, the tiny models' layer times,
send/recv and collectives over 2..N worker processes, compute/communication overlap), fit the
cost model's parameters and write them with the raw measurements to a calibration file.
Simulate with it by passing --costmodel FILE.json to simulate, explore or validate.

examples:
  piper-sim calibrate -o traces/calibration/mybox.json --quick     well under a minute
  piper-sim calibrate -o mybox.json --nproc 4 --threads 1
  piper-sim calibrate -o merged.json --refit run1.json run2.json    re-fit earlier measurements"""


class CalibrationError(ValueError):
    """Bad `calibrate` arguments (the benchmarks raise calibration.microbench.CalibrationError)."""


def add_calibrate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate", help="microbenchmark this machine and write a calibration JSON (cost-model parameters)",
        description=DESCRIPTION)
    p.add_argument("-o", "--output", help="calibration file to write (.json), e.g. traces/calibration/NAME.json")
    p.add_argument("--quick", action="store_true", help="fewer shapes, sizes and repeats (well under a minute)")
    p.add_argument("--nproc", metavar="N", help="largest worker group (default: 4 if the cores allow, else 2; "
                                                "on CUDA the GPU count); groups of 2, 4 and N are measured")
    p.add_argument("--threads", metavar="T",
                   help="intra-op threads per rank (default: $OMP_NUM_THREADS, else 1, as under torchrun)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda")
    p.add_argument("--refit", metavar="OLD.json", nargs="+",
                   help="re-fit the raw measurements stored in calibration files (several: each point's fastest)")
    p.set_defaults(func=cmd_calibrate)
    return p


def _int_arg(value, name: str, minimum: int) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise CalibrationError(f"{name} must be an integer, got {value!r}") from None
    if n < minimum:
        raise CalibrationError(f"{name} must be at least {minimum}, got {n}")
    return n


def check_output(path: str | None) -> str:
    if not path:
        raise CalibrationError("calibrate needs -o/--output PATH.json (e.g. traces/calibration/NAME.json)")
    if not path.lower().endswith(".json"):
        raise CalibrationError(f"output {path!r} must end in .json")
    if os.path.isdir(path):
        raise CalibrationError(f"output {path!r} is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise CalibrationError(f"output {path!r}: {parent!r} is not a directory")
    return path


def _load_raw(path: str) -> dict:
    from costmodel.calibration import load_calibration

    raw = load_calibration(path).get("meta", {}).get("raw")
    if not isinstance(raw, dict) or "config" not in raw:
        raise CalibrationError(f"{path!r} holds no raw measurements (meta.raw) to re-fit")
    return raw


def cmd_calibrate(args: argparse.Namespace) -> None:
    out = check_output(args.output)
    nproc = _int_arg(args.nproc, "--nproc", 2)
    threads = _int_arg(args.threads, "--threads", 1)
    if args.device not in ("auto", "cpu", "cuda"):
        raise CalibrationError(f"--device must be auto, cpu or cuda, got {args.device!r}")
    t0 = time.perf_counter()
    if args.refit:
        from costmodel.fit import build_calibration, merge_raw

        calib = build_calibration(merge_raw([_load_raw(path) for path in args.refit]))
    else:
        calib = calibrate_machine(quick=args.quick, nproc=nproc, threads=threads, device=args.device,
                                  progress=progress_enabled(args))
    write_calibration(calib, out)
    print("\n".join(summary_lines(calib)))
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")


def calibrate_machine(quick: bool = False, nproc: int | None = None, threads: int | None = None,
                      device: str = "auto", progress: bool = True) -> dict:
    """Measure this machine and fit: the calibration dict (costmodel.calibration schema)."""
    from costmodel.fit import build_calibration
    from calibration.microbench import make_config, run_calibration  # torch: import only when measuring

    cfg = make_config(quick=quick, nproc=nproc, threads=threads, device=device)
    _warn_if_busy(cfg)
    return build_calibration(run_calibration(cfg, progress=progress))


def write_calibration(calib: dict, out: str) -> None:
    """Save atomically and check the simulator can load it."""
    import json

    from costmodel.calibration import check_calibration
    from costmodel.hardware import parse_cluster
    from costmodel.model import get_costmodel
    from piper_sim.files import atomic_write

    check_calibration(calib, out)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with atomic_write(out) as f:
        json.dump(calib, f, indent=2)
    get_costmodel(out, parse_cluster(f"cpu:{calib.get('meta', {}).get('nproc', 2)}"))


# --------------------------------------------------------------------------- per-machine cache


def cached_calibration(quick: bool = True, device: str = "cpu", progress: bool = True,
                       announce=None) -> tuple[str, bool]:
    """This machine's calibration file, measured (`calibrate --quick`, ~15 s on 2 cores) on
    first use and cached per machine fingerprint (processor, cores, torch version, threads
    per rank, measuring method; `calibration.microbench.fingerprint`). Returns (path, measured now).
    `announce(message)` is called before measuring."""
    import hashlib
    import json

    from costmodel.calibration import load_calibration
    from calibration.microbench import fingerprint
    from piper_sim.files import cache_dir

    fp = fingerprint(device)
    key = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), f"calibration-{fp['device']}-{key}.json")
    if os.path.isfile(path):
        try:
            if load_calibration(path).get("meta", {}).get("fingerprint") == fp:
                return path, False
        except ValueError:
            pass  # unreadable or stale: measure again
    if announce is not None:
        announce(f"calibrating this machine once ({fp['device_name']}, {fp['cores']} cores, torch {fp['torch']}, "
                 f"{fp['threads']} thread(s)/rank; quick, about 15 s); cache: {path}")
    calib = calibrate_machine(quick=quick, threads=fp["threads"], device=device, progress=progress)
    calib.setdefault("meta", {})["fingerprint"] = fp
    write_calibration(calib, path)
    return path, True


def _warn_if_busy(cfg) -> None:
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return
    if cfg.device == "cpu" and load > 0.5 * cfg.cores:
        print(f"piper-sim: warning: load average {load:.1f} on {cfg.cores} cores: other processes will skew "
              f"the CPU measurements", file=sys.stderr)
    if cfg.device == "cpu" and cfg.nproc * cfg.threads > cfg.cores:
        print(f"piper-sim: warning: {cfg.nproc} ranks x {cfg.threads} threads oversubscribe {cfg.cores} cores",
              file=sys.stderr)


def summary_lines(calib: dict) -> list[str]:
    """The headline numbers of a calibration, one per line."""
    meta = calib.get("meta", {})
    lines = [f"device {calib.get('device')} ({calib.get('dtype')}, {meta.get('threads_per_rank')} thread(s)/rank)",
             f"peak matmul {calib['peak_flops'] / 1e9:.1f} GFLOP/s; memory {calib['hbm_bw'] / 1e9:.2f} GB/s; "
             f"launch {calib['launch_s'] * 1e6:.1f} us"]
    for dtype, flops in meta.get("peak_flops_by_dtype", {}).items():
        if dtype != calib.get("dtype"):
            lines.append(f"peak matmul {dtype} {flops / 1e9:.2f} GFLOP/s")
    for kind, fits in calib.get("collectives", {}).items():
        for n, fit in fits.items():
            lines.append(f"{kind:<15} n={n}: alpha {fit['alpha_s'] * 1e6:8.1f} us, bw {fit['bw_Bps'] / 1e9:6.3f} GB/s")
    if "p2p" in calib:
        p = calib["p2p"]
        lines.append(f"{'send/recv':<15}    : alpha {p['alpha_s'] * 1e6:8.1f} us, bw {p['bw_Bps'] / 1e9:6.3f} GB/s")
    if "overlap_slowdown" in calib:
        lines.append(f"overlap slowdown {calib['overlap_slowdown']:.2f}")
    cont = meta.get("contention", {})
    if cont:
        factor = ", ".join(f"{n} ranks {f:.2f}" for n, f in cont["factor"].items() if n != "1")
        lines.append(f"contention ({cont['threads_per_rank']} thread(s)/rank): {factor}")
        d = cont.get("default_threads")
        if d:
            factor = ", ".join(f"{n} ranks {f:.2f}" for n, f in d["factor"].items() if n != "1")
            lines.append(f"contention ({d['threads_per_rank']} threads/rank): {factor}")
    summary = meta.get("residuals", {}).get("segments_summary", {})
    if summary:
        lines.append("segment fit |pred/meas - 1|: " + ", ".join(
            f"{k} median {v['median']:.0%} max {v['max']:.0%}" for k, v in summary.items()))
    return lines

