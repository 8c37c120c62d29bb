"""How far to trust a simulated GPU step: an error band from the published-results suite.

``benchmarks/published/run.py --write-bands`` simulates every published run of the suite and
writes, per run class, the speed ratios (simulated / published throughput, > 1: the simulator
was optimistic) to :data:`BANDS_FILE`. Nothing in the cost model is fitted to those runs, so
each ratio is an out-of-sample error of the model. A prediction's band is the step time times
the class's ratios at the split-conformal ranks ``floor((n+1)·0.1)`` and ``ceil((n+1)·0.9)``
of its ``n`` sorted ratios (a real step of ``t_sim * ratio``): a new run of the class falls
inside with probability >= 80% when the runs are exchangeable (Vovk et al., "Algorithmic
Learning in a Random World"; Lei et al. 2018, "Distribution-free predictive inference"), where
plain 10th/90th percentiles of a dozen runs cover less (68% leave-one-out on the suite).

Classes (:func:`run_class`, the structure that decides which cost-model parts dominate):
``moe`` (expert parallel / MoE model), ``tp`` (tensor parallel), ``pp`` (pipeline parallel),
``fsdp`` (data parallel with ZeRO/FSDP sharding), ``ddp`` (plain data parallel), ``single``.
A class with fewer than :data:`MIN_RUNS` runs is not judged on its own: the band of every run
is shown, and the band says so.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

BANDS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "error_bands.json")
BANDS_VERSION = 1
# below 9 runs the conformal ranks fall outside 1..n and the band would cover less than 80%
MIN_RUNS = 9
LOW_Q, HIGH_Q = 0.10, 0.90  # an 80% band
CLASSES = ("moe", "tp", "pp", "fsdp", "ddp", "single")


@dataclass(frozen=True)
class Band:
    """An 80% band of the real step time around a simulated one."""

    step_low_s: float
    step_high_s: float
    run_class: str
    runs: int  # published runs the band comes from
    pooled: bool  # True: too few runs of this class, the band of all classes
    ratio_low: float
    ratio_high: float

    def describe(self, step_s: float) -> str:
        """``step 2.31 s, 80% band 2.05-2.52 s from 14 published runs of this class (fsdp)``."""
        where = (f"all {self.runs} published runs (too few of class {self.run_class} to judge)" if self.pooled
                 else f"{self.runs} published runs of this class ({self.run_class})")
        return f"step {step_s:.4g} s, 80% band {self.step_low_s:.4g}-{self.step_high_s:.4g} s from {where}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_class(meta: dict[str, Any], pp: int, ep: int, dp: int = 1) -> str:
    """The class of a plan (see the module docstring), from its meta and its pp/ep/dp degrees."""
    if ep > 1 or meta.get("moe"):
        return "moe"
    if meta.get("tensor_parallel"):
        return "tp"
    if pp > 1 or int(meta.get("num_stages", 1)) > 1:
        return "pp"
    if dp > 1:
        return "fsdp" if meta.get("zero", 0) else "ddp"
    return "single"


def conformal_bounds(values: list[float], low: float = LOW_Q, high: float = HIGH_Q) -> tuple[float, float]:
    """The sorted values at the split-conformal ranks ``floor((n+1)·low)`` and
    ``ceil((n+1)·high)`` (1-based, clamped to the first and last)."""
    xs = sorted(values)
    n = len(xs)
    k_low = max(math.floor((n + 1) * low), 1)
    k_high = min(math.ceil((n + 1) * high), n)
    return xs[k_low - 1], xs[k_high - 1]


@lru_cache(maxsize=4)
def load_bands(path: str = BANDS_FILE) -> dict[str, Any] | None:
    """The bands file, or None when it is missing or of another version."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if data.get("version") == BANDS_VERSION else None


def band_for(step_s: float, cls: str, data: dict[str, Any] | None = None) -> Band | None:
    """The band of a simulated step of class ``cls``; None without a bands file."""
    data = data if data is not None else load_bands()
    if not data or step_s <= 0:
        return None
    ratios = list(data["classes"].get(cls, {}).get("ratios", []))
    pooled = len(ratios) < MIN_RUNS
    if pooled:
        ratios = [r for c in data["classes"].values() for r in c["ratios"]]
    if not ratios:
        return None
    lo, hi = conformal_bounds(ratios)
    return Band(step_low_s=step_s * lo, step_high_s=step_s * hi, run_class=cls, runs=len(ratios),
                pooled=pooled, ratio_low=lo, ratio_high=hi)


def bands_from_results(rows: list[tuple[str, str, float]], source: str) -> dict[str, Any]:
    """The bands file's content from ``(run id, class, speed ratio)`` rows."""
    classes: dict[str, dict[str, list]] = {}
    for run_id, cls, ratio in rows:
        c = classes.setdefault(cls, {"ids": [], "ratios": []})
        c["ids"].append(run_id)
        c["ratios"].append(round(ratio, 4))
    summary = {cls: {"runs": len(c["ratios"]), "median_ratio": round(statistics.median(c["ratios"]), 4)}
               for cls, c in classes.items()}
    return {"version": BANDS_VERSION, "source": source, "ratio": "simulated / published throughput",
            "summary": summary, "classes": classes}


def leave_one_out_coverage(rows: list[tuple[str, str, float]]) -> tuple[int, int]:
    """(runs inside the 80% band built without them, runs): how honest the band is."""
    inside = 0
    for i, (_, cls, ratio) in enumerate(rows):
        rest = bands_from_results([r for j, r in enumerate(rows) if j != i], "loo")
        band = band_for(1.0, cls, rest)
        if band is not None and band.ratio_low <= ratio <= band.ratio_high:
            inside += 1
    return inside, len(rows)
