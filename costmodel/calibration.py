"""Calibration file: measured cost-model parameters, written by a calibration run.

Schema (JSON; every key but "kind" optional; seconds, bytes, bytes/s)::

    {
      "kind": "calibration",
      "device": "CPU",                     # informative: what was measured
      "dtype": "fp32",                     # dtype compute ops run in (else the model's default)
      "peak_flops": 1.2e11,                # FLOP/s of that dtype the efficiencies refer to
      "efficiency_table": [[m, n, k, eff], ...]  or  [[flops, eff], ...],
      "launch_s": 1e-5,                    # fixed per-op overhead
      "hbm_bw": 2e10,                      # memory bandwidth (bytes moved / s) of memory-bound ops
      "memory_bw_table": [[bytes, bw], ...], # that bandwidth by bytes moved per op (caches), optional
      "collectives": {                     # t = alpha_s + S / bw_Bps, S as in costmodel.collectives
        "ALLREDUCE": {"2": {"alpha_s": 5e-5, "bw_Bps": 1.5e9,
                            "table": [[S, t], ...]}, # measured points, optional (`fit_time`)
                      "4": {...}},
        "ALL_TO_ALL": {...}
      },
      "p2p": {"alpha_s": 3e-5, "bw_Bps": 2e9},       # or {"intra": {...}, "inter": {...}}; "table" too
      "post": {"ALL_GATHER": {"alpha_s": 2e-4, "bw_Bps": 3e9, "table": [...]},  # host seconds the
               "SEND": {...}, ...},        # call that posts an async op takes (collective kinds, SEND, RECV)
      "overlap_slowdown": 1.15,            # compute slowdown while a comm kernel runs
      "comm_overlap_slowdown": 1.0,        # comm slowdown while its rank computes (CPU: shared cores)
      "meta": {...}                        # free-form: host, date, tool version
    }

`piper-sim calibrate` (costmodel.fit) also writes, under "meta": "contention"
({"threads_per_rank": T, "factor": {"1": 1.0, "2": 1.1, ...}}: compute slowdown when that
many ranks of one host compute at once, vs one alone), "overlap", "residuals" and "raw"
(the measurements). See traces/calibration/README.md.

A collective fit is used for its group size; another size takes the nearest fitted one,
keeping its busbw and scaling alpha by the ring step count (2(n−1) or n−1). A fit's
optional "table" holds the measured points: between the smallest and largest measured S
the time is interpolated linearly between neighbouring points, outside them it follows
the line's slope from the nearest end point (`fit_time`). Measured curves are not one line: on a CPU a message
that fits the caches moves faster per byte than a larger one, NCCL switches protocols and
algorithms with size; one alpha-beta line through 4 KiB..64 MiB misses a 4 MiB gather by 2x.
`fit_alpha_beta` turns (bytes, seconds) samples into one such entry.

"post" is host time, not transfer time: the seconds the calling thread spends in the call
that posts an async op (gloo copies the rank's own piece of a gather and writes a send on
the caller's thread), measured on CPU with every rank computing between posts, as in a
step. The simulator charges it on the rank's host (`CostModel.post_time`).
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile

from costmodel.collectives import KINDS

CALIBRATION_KEYS = {"kind", "device", "dtype", "peak_flops", "efficiency_table", "launch_s", "hbm_bw",
                    "memory_bw_table",
                    "collectives", "p2p", "post", "overlap_slowdown", "comm_overlap_slowdown", "meta"}
POST_KINDS = KINDS + ("SEND", "RECV")  # ops whose posting a calibration times ("post")


def load_calibration(path: str) -> dict:
    """Read and check a calibration file; returns its dict."""
    if not os.path.isfile(path):
        raise ValueError(f"calibration file {path!r} not found")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"calibration file {path!r} is not valid JSON: {e}") from None
    check_calibration(data, path)
    return data


def check_calibration(data: dict, where: str = "calibration") -> None:
    if not isinstance(data, dict) or data.get("kind") != "calibration":
        raise ValueError(f"{where}: expected a JSON object with \"kind\": \"calibration\"")
    unknown = set(data) - CALIBRATION_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(CALIBRATION_KEYS)}")
    for kind, fits in data.get("collectives", {}).items():
        if kind not in KINDS:
            raise ValueError(f"{where}: unknown collective {kind!r}; expected one of {', '.join(KINDS)}")
        for size, fit in fits.items():
            if not str(size).isdigit() or int(size) < 2:
                raise ValueError(f"{where}: {kind} group size {size!r} must be an integer >= 2")
            _check_fit(fit, f"{where}: {kind}[{size}]")
    p2p = data.get("p2p")
    if p2p is not None:
        for name, fit in (p2p.items() if "alpha_s" not in p2p else [("p2p", p2p)]):
            if name not in ("p2p", "intra", "inter"):
                raise ValueError(f"{where}: p2p keys are alpha_s/bw_Bps or intra/inter, got {name!r}")
            _check_fit(fit, f"{where}: p2p {name}")
    for kind, fit in data.get("post", {}).items():
        if kind not in POST_KINDS:
            raise ValueError(f"{where}: post[{kind!r}]: expected one of {', '.join(POST_KINDS)}")
        _check_fit(fit, f"{where}: post {kind}")


def _check_fit(fit, where: str) -> None:
    if not isinstance(fit, dict) or fit.get("bw_Bps", 0) <= 0 or fit.get("alpha_s", -1) < 0:
        raise ValueError(f"{where} needs alpha_s >= 0 and bw_Bps > 0, got {fit!r}")
    table = fit.get("table")
    if table is None:
        return
    ok = isinstance(table, list) and len(table) >= 2 and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, (int, float)) and x > 0 for x in p)
        for p in table)
    if not ok or any(a[0] >= b[0] for a, b in zip(table, table[1:])):
        raise ValueError(f"{where}: table must be [[bytes, seconds], ...], at least two points, bytes strictly "
                         f"ascending, all positive; got {table!r}")


def fit_time(fit: dict, nbytes: float) -> float:
    """Seconds of one transfer of `nbytes` (S) under a collective or p2p fit: without a
    "table", `alpha_s + S / bw_Bps`; with one, its points interpolated linearly where S lies
    within them, and outside them the line's slope `1 / bw_Bps` from the nearest end point,
    below the first not under `alpha_s` (continuous, and never faster for more bytes when
    the table is monotone)."""
    table = fit.get("table")
    if not table:
        return fit["alpha_s"] + nbytes / fit["bw_Bps"]
    (first_s, first_t), (last_s, last_t) = table[0], table[-1]
    if nbytes >= last_s:
        return last_t + (nbytes - last_s) / fit["bw_Bps"]
    if nbytes <= first_s:  # down to the line's latency, at most the first point's time
        return min(first_t, max(fit["alpha_s"], first_t - (first_s - nbytes) / fit["bw_Bps"]))
    i = bisect.bisect_left([s for s, _ in table], nbytes)
    (s0, t0), (s1, t1) = table[i - 1], table[i]
    return t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0)


def fit_alpha_beta(nbytes: list[float], seconds: list[float]) -> dict[str, float]:
    """Least-squares t = alpha + S / bw over samples; alpha clamped at 0."""
    n = len(nbytes)
    if n < 2 or len(seconds) != n:
        raise ValueError("fit_alpha_beta needs at least two (bytes, seconds) samples")
    mx, my = sum(nbytes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in nbytes)
    if sxx == 0:
        raise ValueError("fit_alpha_beta needs at least two distinct sizes")
    slope = sum((x - mx) * (y - my) for x, y in zip(nbytes, seconds)) / sxx
    if slope <= 0:
        raise ValueError("fit_alpha_beta: time does not grow with size; cannot fit a bandwidth")
    return {"alpha_s": max(0.0, my - slope * mx), "bw_Bps": 1.0 / slope}


def save_calibration(data: dict, path: str) -> None:
    """Write atomically (a temporary file in the same folder, then os.replace): a reader
    never sees half a file, even when two processes write the same path."""
    check_calibration(data, path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".calibration-", suffix=".json.tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
