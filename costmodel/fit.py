"""Fit microbenchmark measurements (`calibration.microbench.run_calibration`) into a
calibration dict (schema in `costmodel.calibration`).

- `peak_flops`: the best matmul FLOP/s measured in the calibration dtype (a MAMF, not a
  datasheet number); GEMM efficiency = achieved / peak.
- `efficiency_table`: the simulator times a compute op as
  `max(flops / (peak · eff(2mnk)), mem_bytes / hbm_bw) + launch_s`, with (m, n, k) the
  op's dominant matmul. At the dominant-GEMM size of each measured segment the table holds
  the efficiency that reproduces the summed F and B times of the segments of that size
  (total flops / (peak · total time), as for a stage op that sums them; the BI / BW split
  of B is only checked). Beyond the
  largest measured segment it rises towards the GEMM sweep as a fixed overhead would let
  it: `eff(K) = 1 / (1/eff_gemm(K) + c/K)`, `c` (in FLOPs: a segment loses the time of `c`
  peak FLOPs to non-GEMM work and dispatch) set so the curve meets the largest segment.
- `hbm_bw`: mean copy/add bandwidth at the largest size; `launch_s`: a trivial op.
- `collectives` / `p2p`: `t = alpha_s + S / bw_Bps` per kind and group size, by
  least squares on *relative* error (`fit_alpha_bw`; plain least squares would let the
  largest messages decide alpha), and the measured points as the fit's "table": within
  the measured sizes the simulator interpolates them, outside it follows the line's slope
  from the nearest point. `meta.residuals` are the line's, against the points.
- `post`: per kind (collectives, SEND, RECV) the host seconds of the call that posts the async
  op, measured in the smallest group: the same line and "table" as a collective's.
- `comm_overlap_slowdown`: seconds per all-reduce while every rank runs matmuls (all-reduces
  queued, counted as they finish) / the same all-reduces queued while nobody computes (files
  of METHOD < 5: / one all-reduce alone, which queued ones beat): on a CPU gloo's thread
  shares the cores.
- `overlap_slowdown`: matmul time while each rank's own async all-reduces run / without,
  every rank computing in both cases; `meta.contention`: matmul time with every rank
  computing / one rank alone (slowest rank; see traces/calibration/README.md).
- `merge_raw`: several runs on one machine as one, each point's fastest time.

Residuals of every fit are kept in `meta.residuals`, the measurements in `meta.raw`.
"""

from __future__ import annotations

import datetime
import math
import statistics

from costmodel.calibration import check_calibration
from costmodel.compute import EfficiencyTable, gemm_flops
from costmodel.hardware import CPU, Cluster
from costmodel.model import AnalyticCostModel

FIT_KINDS = ("F", "B")  # F + B = a segment's training time; BI and BW only get residuals
OP_KINDS = ("F", "BI", "BW", "B")
MIN_EFF = 1e-4


def fit_alpha_bw(nbytes, seconds) -> dict[str, float]:
    """`t = alpha + S / bw` minimising the squared *relative* error; alpha clamped at 0."""
    pts = [(float(s), float(t)) for s, t in zip(nbytes, seconds)]
    if len(pts) < 2 or len({s for s, _ in pts}) < 2 or any(t <= 0 for _, t in pts):
        raise ValueError("fit_alpha_bw needs at least two distinct sizes with positive times")
    # rows (1/t, S/t) · (alpha, 1/bw) ≈ 1
    a11 = sum(1 / t ** 2 for _, t in pts)
    a12 = sum(s / t ** 2 for s, t in pts)
    a22 = sum((s / t) ** 2 for s, t in pts)
    b1, b2 = sum(1 / t for _, t in pts), sum(s / t for s, t in pts)
    det = a11 * a22 - a12 ** 2
    alpha = (b1 * a22 - b2 * a12) / det if det > 0 else -1.0
    beta = (a11 * b2 - a12 * b1) / det if det > 0 else 0.0
    if alpha < 0 or beta <= 0:  # best fit through alpha = 0
        alpha, beta = 0.0, b2 / a22
    return {"alpha_s": alpha, "bw_Bps": 1.0 / beta}


def measured_table(points) -> list[list[float]]:
    """(bytes, seconds) points as a fit's "table" (`costmodel.calibration.fit_time`): sorted
    by size, one point per size (the fastest), each no slower than any larger message's (a
    bigger message cannot take less time; a small message that did was disturbed, by other
    work on a shared machine, and the larger one's time bounds it)."""
    best: dict = {}
    for s, t in points:
        best[float(s)] = min(float(t), best.get(float(s), math.inf))
    table, bound = [], math.inf
    for s in sorted(best, reverse=True):
        bound = min(bound, best[s])
        table.append([s, bound])
    return table[::-1]


def relative_errors(fit: dict, points) -> list[float]:
    """predicted / measured - 1 for each (bytes, seconds) point."""
    return [(fit["alpha_s"] + s / fit["bw_Bps"]) / t - 1 for s, t in points]


def fit_comm(comm: dict) -> tuple[dict, dict | None, dict]:
    """(collectives, p2p, residuals) from `raw["comm"]` ({group size: worker result})."""
    coll: dict = {}
    resid: dict = {}
    for world, res in sorted(comm.items(), key=lambda kv: int(kv[0])):
        for kind, pts in res["collectives"].items():
            fit = {**fit_alpha_bw(*zip(*pts)), "table": measured_table(pts)}
            coll.setdefault(kind, {})[str(world)] = fit
            resid.setdefault(kind, {})[str(world)] = _rounded(relative_errors(fit, pts))
    p2p_pts = next((res["p2p"] for _, res in sorted(comm.items(), key=lambda kv: int(kv[0])) if res.get("p2p")), [])
    p2p = {**fit_alpha_bw(*zip(*p2p_pts)), "table": measured_table(p2p_pts)} if len(p2p_pts) >= 2 else None
    if p2p:
        resid["p2p"] = _rounded(relative_errors(p2p, p2p_pts))
    return coll, p2p, resid


def fit_post(comm: dict) -> dict:
    """`post` fits from the smallest group's posting times (`calibration.microbench.post_times`)."""
    res = next((res for _, res in sorted(comm.items(), key=lambda kv: int(kv[0])) if res.get("post")), {})
    return {kind: {**fit_alpha_bw(*zip(*pts)), "table": measured_table(pts)}
            for kind, pts in res.get("post", {}).items() if len({s for s, _ in pts}) >= 2}


def gemm_efficiency(matmul: list[dict], dtype: str) -> tuple[float, list[list]]:
    """(peak FLOP/s, rows [m, n, k, eff]) of the matmul sweep in `dtype`."""
    rows = [r for r in matmul if r["dtype"] == dtype]
    if not rows:
        raise ValueError(f"no matmul measurements in {dtype}")
    peak = max(r["flops_per_s"] for r in rows)
    by_size: dict[float, list] = {}  # shapes of equal 2mnk share one row: the mean efficiency
    for r in rows:
        by_size.setdefault(gemm_flops(r["m"], r["n"], r["k"]), []).append(r)
    table = [[same[0]["m"], same[0]["n"], same[0]["k"], statistics.fmean(r["flops_per_s"] for r in same) / peak]
             for _, same in sorted(by_size.items())]
    return peak, table


def segment_table(segments: list[dict], peak: float, launch_s: float, hbm_bw: float,
                  gemm_rows: list[list]) -> tuple[list[list], float]:
    """(efficiency table rows, overhead c in FLOPs) reproducing the segment times; see module doc."""
    work: dict[float, list[float]] = {}  # size -> [flops, seconds] summed over ops
    shape: dict[float, list[int]] = {}
    for row in segments:
        size = gemm_flops(*row["gemm"])
        if size <= 0:
            continue  # no matmul (embedding): the simulator times it by memory traffic
        for kind in FIT_KINDS:
            flops, t = row["flops"][kind], row["seconds"][kind] - launch_s
            if flops <= 0 or t <= 0 or row["mem_bytes"] / hbm_bw >= t:
                continue
            acc = work.setdefault(size, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + flops, acc[1] + t
            shape.setdefault(size, list(row["gemm"]))
    if not work:
        return gemm_rows, 0.0
    knots = {size: _clamp(flops / (peak * t)) for size, (flops, t) in work.items()}
    gemm = EfficiencyTable.from_rows(gemm_rows)
    largest = max(knots)
    c = max(0.0, largest * (1 / knots[largest] - 1 / gemm(largest)))  # continuous at the largest segment
    rows = [[*shape[size], e] for size, e in sorted(knots.items())]
    rows += [[m, n, k, _clamp(1 / (1 / e + c / gemm_flops(m, n, k)))]
             for m, n, k, e in gemm_rows if gemm_flops(m, n, k) > largest]
    return rows, c


def segment_residuals(calibration: dict, segments: list[dict]) -> list[dict]:
    """Per segment and kind: measured and predicted seconds, as the simulator would predict."""
    cm = cost_model(calibration)
    out = []
    for row in segments:
        gemm = tuple(row["gemm"])
        for kind in OP_KINDS:
            meas = row["seconds"][kind]
            if row["flops"][kind] <= 0 and meas <= 0:
                continue
            pred = cm.compute_time(kind, row["flops"][kind], mem_bytes=row["mem_bytes"], gemm=gemm)
            out.append({"model": row["model"], "segment": row["kind"], "tokens": row["tokens"], "op": kind,
                        "measured_s": meas, "predicted_s": pred, "error": pred / meas - 1 if meas > 0 else None})
    return out


def residual_summary(residuals: list[dict]) -> dict:
    """Per op kind, over segments with matmuls: median and worst |predicted / measured - 1|,
    and the bias (geometric mean of predicted / measured; > 1 = the model is too slow)."""
    out = {}
    for kind in OP_KINDS:
        errs = [r["error"] for r in residuals if r["op"] == kind and r["error"] is not None
                and r["error"] > -1 and r["segment"] != "embed"]
        if errs:
            bias = math.exp(statistics.fmean(math.log(1 + e) for e in errs))
            out[kind] = {"median": round(statistics.median(abs(e) for e in errs), 3),
                         "max": round(max(abs(e) for e in errs), 3), "bias": round(bias, 3), "n": len(errs)}
    return out


def phase_factors(phases: dict) -> dict:
    """contention = matmul time with every rank computing / one rank alone; overlap =
    (every rank computing while its all-reduces run) / (every rank computing)."""
    together = _mean(phases["together_s"])
    out = {"contention": together / phases["alone_s"],
           "overlap_slowdown": _mean(phases["overlap_s"]) / together,
           "overlap_covered": phases["overlap_covered"]}
    if phases.get("allreduce_computing_s"):  # files before it kept no such measurement
        alone = phases.get("allreduce_queued_s") or phases["allreduce_alone_s"]
        out["comm_overlap_slowdown"] = phases["allreduce_computing_s"] / alone
    d = phases.get("default_threads")
    if d:
        out["default_threads"] = {"threads": d["threads"], "contention": _mean(d["together_s"]) / d["alone_s"]}
    return out


def _mean(x) -> float:
    """Times are one number (the slowest rank's); older files kept one per rank."""
    return statistics.fmean(x) if isinstance(x, list) else x


def cost_model(calibration: dict, ranks: int = 2) -> AnalyticCostModel:
    """The analytic model `get_costmodel` builds from this calibration (on a cpu:N cluster)."""
    overrides = {k: v for k, v in calibration.items() if k not in ("kind", "device", "meta")}
    return AnalyticCostModel(Cluster(CPU, 1, ranks), overrides, name="calibration")


def memory_bw_table(memory: list[dict]) -> list[list[float]]:
    """[bytes moved per op, bytes/s] at each measured size (mean of copy and add): small
    tensors stay in cache and move faster than `hbm_bw`, the largest size's bandwidth."""
    sizes = sorted({r["bytes_moved"] for r in memory})
    return [[float(b), statistics.fmean(r["bw_Bps"] for r in memory if r["bytes_moved"] == b)] for b in sizes]


def build_calibration(raw: dict) -> dict:
    """The calibration dict (with meta: contention, residuals, raw) from raw measurements."""
    cfg = raw["config"]
    dtype = cfg["dtype"]
    peak, gemm_rows = gemm_efficiency(raw["matmul"], dtype)
    largest = max(r["mib"] for r in raw["memory"])
    hbm_bw = statistics.fmean(r["bw_Bps"] for r in raw["memory"] if r["mib"] == largest)
    mem_table = memory_bw_table(raw["memory"])
    launch_s = raw["launch_s"]
    table, overhead = segment_table(raw["segments"], peak, launch_s, hbm_bw, gemm_rows)
    coll, p2p, comm_resid = fit_comm(raw["comm"])
    factors = {w: phase_factors(res["phases"]) for w, res in raw["comm"].items() if res.get("phases")}
    smallest = min(factors, key=int) if factors else None
    machine = raw.get("machine", {})
    calib = {
        "kind": "calibration",
        "device": machine.get("device_name", cfg["device"]),
        "dtype": dtype,
        "peak_flops": peak,
        "efficiency_table": table,
        "launch_s": launch_s,
        "hbm_bw": hbm_bw,
        "memory_bw_table": mem_table,
        "collectives": coll,
        **({"p2p": p2p} if p2p else {}),
        **({"post": post} if (post := fit_post(raw["comm"])) else {}),
        **({"overlap_slowdown": max(1.0, factors[smallest]["overlap_slowdown"])} if smallest else {}),
        **({"comm_overlap_slowdown": max(1.0, factors[smallest]["comm_overlap_slowdown"])}
           if smallest and "comm_overlap_slowdown" in factors[smallest] else {}),
    }
    contention = {"threads_per_rank": cfg["threads"], "matmul": raw["comm"][smallest]["phases"]["matmul"],
                  "factor": {"1": 1.0, **{w: f["contention"] for w, f in factors.items()}}} if smallest else {}
    if smallest and "default_threads" in factors[smallest]:
        contention["default_threads"] = {
            "threads_per_rank": factors[smallest]["default_threads"]["threads"],
            "factor": {"1": 1.0, **{w: f["default_threads"]["contention"] for w, f in factors.items()}}}
    calib["meta"] = {
        "tool": "piper-sim calibrate" + (" --quick" if cfg["quick"] else ""),
        "date": raw.get("date") or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine, "threads_per_rank": cfg["threads"], "nproc": cfg["nproc"],
        "run_s": raw.get("run_s"), "load_avg": raw.get("load_avg"),
        "peak_flops_by_dtype": {d: max(r["flops_per_s"] for r in raw["matmul"] if r["dtype"] == d)
                                for d in sorted({r["dtype"] for r in raw["matmul"]})},
        "gemm_efficiency_table": gemm_rows,
        "segment_overhead_flops": overhead,
        "contention": contention,
        "overlap": factors,
    }
    check_calibration(calib)
    seg_resid = segment_residuals(calib, raw["segments"])
    calib["meta"]["residuals"] = {"segments_summary": residual_summary(seg_resid), "segments": seg_resid,
                                  "comm": comm_resid}
    calib["meta"]["raw"] = raw
    return calib


def merge_raw(raws: list[dict]) -> dict:
    """Several runs' raw measurements of one machine as one: every point's fastest time
    (the least disturbed, as within a run). Runs must share the configuration."""
    if len(raws) == 1:
        return raws[0]
    if any(r["config"] != raws[0]["config"] for r in raws):
        raise ValueError("raw measurements to merge were taken with different configurations")
    out = {**raws[0], "runs": len(raws), "run_s": sum(r.get("run_s") or 0 for r in raws),
           "load_avg": [r.get("load_avg") for r in raws], "launch_s": min(r["launch_s"] for r in raws)}
    out["matmul"] = _fastest([r["matmul"] for r in raws], ("m", "n", "k", "dtype"), "seconds")
    for row in out["matmul"]:
        row["flops_per_s"] = 2.0 * row["m"] * row["n"] * row["k"] / row["seconds"]
    out["memory"] = _fastest([r["memory"] for r in raws], ("op", "mib"), "seconds")
    for row in out["memory"]:
        row["bw_Bps"] = row["bytes_moved"] / row["seconds"]
    segs = [{**row, "seconds": dict(row["seconds"])} for row in raws[0]["segments"]]
    for other in raws[1:]:
        for row, o in zip(segs, other["segments"]):
            row["seconds"] = {op: min(t, o["seconds"][op]) for op, t in row["seconds"].items()}
    for row in segs:
        row["seconds"]["BW"] = max(row["seconds"]["B"] - row["seconds"]["BI"], 0.0)
    out["segments"] = segs
    out["comm"] = {w: _merge_comm([r["comm"][w] for r in raws]) for w in raws[0]["comm"]}
    return out


def _fastest(lists: list[list[dict]], key: tuple, field: str) -> list[dict]:
    best: dict = {}
    for rows in lists:
        for row in rows:
            k = tuple(row[f] for f in key)
            if k not in best or row[field] < best[k][field]:
                best[k] = dict(row)
    return list(best.values())


def _merge_comm(results: list[dict]) -> dict:
    def points(lists):
        return [[s, min(t for pts in lists for s2, t in pts if s2 == s)] for s, _ in lists[0]]

    out = {"collectives": {k: points([r["collectives"][k] for r in results]) for k in results[0]["collectives"]},
           "p2p": points([r["p2p"] for r in results]) if results[0]["p2p"] else []}
    if all(r.get("post") for r in results):
        out["post"] = {k: points([r["post"][k] for r in results]) for k in results[0]["post"]}
    if results[0].get("phases"):
        phases = [r["phases"] for r in results]
        merged = {**phases[0], "alone_s": min(p["alone_s"] for p in phases),
                  "overlap_covered": all(p["overlap_covered"] for p in phases)}
        for key in ("together_s", "overlap_s"):
            merged[key] = min(_mean(p[key]) for p in phases)
        under = [p for p in phases if p.get("allreduce_computing_s")]  # older runs lack it
        if under:
            merged["allreduce_alone_s"] = min(p["allreduce_alone_s"] for p in under)
            merged["allreduce_computing_s"] = min(p["allreduce_computing_s"] for p in under)
        if "default_threads" in phases[0]:
            d = [p["default_threads"] for p in phases]
            merged["default_threads"] = {**d[0], "alone_s": min(x["alone_s"] for x in d),
                                         "together_s": min(_mean(x["together_s"]) for x in d)}
        out["phases"] = merged
    return out


def _clamp(eff: float) -> float:
    return min(1.0, max(MIN_EFF, eff))


def _rounded(xs) -> list[float]:
    return [round(x, 4) for x in xs]
