"""Published-results suite: simulate real, published training runs and compare.

    python benchmarks/published/run.py [--costmodel analytic] [--csv results.csv] [--only ID[,ID...]]

Reads ``suite.yaml`` next to this file (every entry: a published measurement, its source and a
piper-sim strategy that expresses the run), compiles and simulates each strategy, converts the
simulated step into the published metric and prints, per run: published, simulated, the error
(simulated / published - 1, in the published metric), the simulated peak memory per GPU against the
GPU's memory; then "memory vs published": each published peak against the simulated figure of the
kind the source reports (allocated, reserved, or reserved + runtime for nvidia-smi; the entry's
published_memory_kind), and the runs that trained on their GPUs but are oom in simulation; then the
median and max |error| and every published ranking as PASS / FAIL.

It is a report: it exits 0 however large the errors are, and also when a strategy fails to compile
or simulate (that row says ERROR). It exits 2 with a one-line message when the suite file itself is
malformed (or --only names an unknown id).

Conventions. tokens/s/GPU = global_batch * seq_len / step_time / GPUs; samples/s/GPU =
global_batch / step_time / GPUs; GPU hours per trillion tokens = 1e12 / (tokens/s/GPU) / 3600. These
are the definitions the sources use (measured throughput, no FLOP convention involved). The "speed"
column is simulated / published throughput whatever the metric (> 1: the simulator is optimistic).

The Python API (used by notebooks/published.ipynb): load_suite, run_suite, check_rankings, check_series,
summarize, results_frame.
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere, without installing
    sys.path.insert(0, str(ROOT))

SUITE = HERE / "suite.yaml"
GIB = 2**30


class SuiteError(ValueError):
    """The suite file is malformed; the message is one line."""


# --------------------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Metric:
    label: str
    higher_is_better: bool
    # (SimResult, Plan) -> the metric's value for the simulated step
    value: Callable[[Any, Any], float]


def _tokens_per_s_per_gpu(sim, plan) -> float:
    return sim.tokens_per_s / sim.world_size


def _samples_per_s_per_gpu(sim, plan) -> float:
    return plan.meta["global_batch"] / sim.step_time_s / sim.world_size


def _gpu_hours_per_trillion_tokens(sim, plan) -> float:
    return 1e12 / _tokens_per_s_per_gpu(sim, plan) / 3600.0


def _model_tflops_per_gpu(sim, plan) -> float:
    # the simulator's own count (profiled FLOPs, causal attention counted as full s x s)
    return plan.meta["model_flops_per_step"] / sim.step_time_s / sim.world_size / 1e12


METRICS: dict[str, Metric] = {
    "tokens_per_s_per_gpu": Metric("tok/s/GPU", True, _tokens_per_s_per_gpu),
    "samples_per_s_per_gpu": Metric("samp/s/GPU", True, _samples_per_s_per_gpu),
    "gpu_hours_per_trillion_tokens": Metric("GPUh/Ttok", False, _gpu_hours_per_trillion_tokens),
    "model_tflops_per_gpu": Metric("TFLOP/s/GPU", True, _model_tflops_per_gpu),
    "mfu": Metric("MFU", True, lambda sim, plan: sim.mfu),
}
PRECISIONS = ("bf16", "fp16", "fp8", "fp32")

ENTRY_REQUIRED = {"id", "source", "metric", "published", "precision", "strategy", "stack_source"}
ENTRY_OPTIONAL = {"setup", "approximations", "notes", "published_memory_gib", "published_memory_gb", "run_options",
                  "set", "recompute_source", "layout_source", "schedule_source", "dp_source", "published_memory_kind",
                  "memory_source"}
PUBLISHED_MEMORY_KEYS = ("published_memory_gib", "published_memory_gb")
# what a published peak memory counts (the suite's `published_memory_kind`): the torch counter it
# was read from, or nvidia-smi (the process's whole footprint)
MEMORY_KINDS = ("allocated", "reserved", "nvidia-smi")
# |simulated / published - 1| counted as agreeing, in %: the bound the memory table reports against
# (issue 26 part 5, the project's acceptance criterion; not a cost-model constant)
MEMORY_WITHIN_PCT = 15.0
# `set`: "original" (default) or "added-later": runs added after the cost model's constants were
# fixed, reported apart (the out-of-sample test of constants looked up after seeing the others)
SETS = ("original", "added-later")
HELD_REQUIRED = {"id", "needs", "source", "metric", "published", "precision"}
HELD_OPTIONAL = {"setup", "strategy_sketch", "notes"}
RANKING_REQUIRED = {"id", "source", "faster"}
SERIES_REQUIRED = {"id", "source", "runs"}
SERIES_TOLERANCE_PP = 3.0  # issue 28: simulated per-GPU loss within +-3 points of the published loss
# what a scaling series' runs must share: only the GPU count (and what follows from it) changes
SERIES_SAME = ("metric", "precision")
SERIES_SAME_STRATEGY = ("model", "stack", "seq_len", "dtype")
MODEL_META = {"published_params", "notes"}


# ----------------------------------------------------------------------------------- the suite


@dataclass
class Suite:
    path: Path
    entries: list[dict[str, Any]]
    rankings: list[dict[str, Any]]
    held_back: list[dict[str, Any]]
    models: dict[str, dict[str, Any]]
    series: list[dict[str, Any]] = field(default_factory=list)

    def entry(self, entry_id: str) -> dict[str, Any]:
        for e in self.entries:
            if e["id"] == entry_id:
                return e
        raise KeyError(entry_id)


def _fail(where: str, msg: str) -> None:
    raise SuiteError(f"{where}: {msg}")


def _check_keys(item: Any, where: str, required: set[str], optional: set[str]) -> None:
    if not isinstance(item, dict):
        _fail(where, f"must be a mapping, got {type(item).__name__}")
    missing = required - item.keys()
    if missing:
        _fail(where, f"missing field(s) {', '.join(sorted(missing))}")
    unknown = item.keys() - required - optional
    if unknown:
        allowed = ", ".join(sorted(required | optional))
        _fail(where, f"unknown field(s) {', '.join(sorted(unknown))}; allowed: {allowed}")


def _check_measurement(item: dict, where: str) -> None:
    if not isinstance(item["id"], str) or not item["id"]:
        _fail(where, "id must be a non-empty string")
    if not isinstance(item["source"], str) or not item["source"].strip():
        _fail(where, "source must be a non-empty citation string")
    if item["metric"] not in METRICS:
        _fail(where, f"unknown metric {item['metric']!r}; known: {', '.join(METRICS)}")
    p = item["published"]
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not p > 0 or not math.isfinite(p):
        _fail(where, f"published must be a positive number, got {p!r}")
    if item["precision"] not in PRECISIONS:
        _fail(where, f"precision must be one of {', '.join(PRECISIONS)}, got {item['precision']!r}")


def _check_fp8(entry: dict, where: str) -> None:
    """An ``fp8`` run names its recipe in the strategy's stack (``stack.fp8``), a run in another
    precision none: the recipe decides which GEMMs run in FP8 and what the casts move."""
    from costmodel.stack import StackError, parse_stack

    try:
        recipe = parse_stack(entry["strategy"].get("stack"), "strategy.stack").fp8
    except StackError as e:
        _fail(where, str(e))
    if (entry["precision"] == "fp8") != (recipe != "none"):
        _fail(where, f"precision {entry['precision']} with strategy.stack.fp8 {recipe!r}: an fp8 run sets the "
                     "recipe its source used (tensorwise, blockwise, mxfp8), any other run leaves it none")


def _check_published_memory(e: dict, where: str) -> None:
    """A published memory is a positive number with the kind it counts and where that is read."""
    given = [k for k in PUBLISHED_MEMORY_KEYS if k in e]
    for key in given:
        if isinstance(e[key], bool) or not isinstance(e[key], (int, float)) or e[key] <= 0:
            _fail(where, f"{key} must be a positive number")
    if len(given) > 1:
        _fail(where, "give one of published_memory_gib and published_memory_gb, not both")
    if not given:
        for key in ("published_memory_kind", "memory_source"):
            if key in e:
                _fail(where, f"{key} describes a published memory: add published_memory_gib (or _gb) or drop it")
        return
    kind = e.get("published_memory_kind")
    if kind not in MEMORY_KINDS:
        got = "missing" if kind is None else f"got {kind!r}"
        _fail(where, f"published_memory_kind must be one of {', '.join(MEMORY_KINDS)} ({got}): what the "
                     f"source's {given[0]} counts")
    source = e.get("memory_source")
    if not isinstance(source, str) or not source.strip():
        _fail(where, "memory_source must name where the published memory's kind is read: the logging "
                     "code's file and line")


def load_suite(path: str | Path = SUITE) -> Suite:
    """Read and check a suite file; raises SuiteError (one line) when it is malformed."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SuiteError(f"{path}: suite file not found") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise SuiteError(f"{path}: malformed YAML{at}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(data, dict):
        raise SuiteError(f"{path}: the suite must be a mapping with 'entries'")
    unknown = data.keys() - {"version", "models", "entries", "rankings", "series", "held_back"}
    if unknown:
        raise SuiteError(f"{path}: unknown top-level key(s) {', '.join(sorted(unknown))}")
    entries = data.get("entries")
    if not isinstance(entries, list) or not entries:
        raise SuiteError(f"{path}: 'entries' must be a non-empty list")
    models = data.get("models") or {}
    rankings = data.get("rankings") or []
    series = data.get("series") or []
    held = data.get("held_back") or []
    if not isinstance(models, dict):
        raise SuiteError(f"{path}: 'models' must be a mapping of name -> ModelConfig fields")
    if not isinstance(rankings, list) or not isinstance(held, list) or not isinstance(series, list):
        raise SuiteError(f"{path}: 'rankings', 'series' and 'held_back' must be lists")

    seen: set[str] = set()
    for i, e in enumerate(entries):
        where = f"{path.name}: entries[{i}]" + (f" ({e.get('id')})" if isinstance(e, dict) else "")
        _check_keys(e, where, ENTRY_REQUIRED, ENTRY_OPTIONAL)
        _check_measurement(e, where)
        if e["id"] in seen:
            _fail(where, f"duplicate id {e['id']!r}")
        seen.add(e["id"])
        s = e["strategy"]
        if not isinstance(s, dict) or not isinstance(s.get("model"), str) or not isinstance(s.get("cluster"), str):
            _fail(where, "strategy must be a piper-sim strategy mapping with 'model' and 'cluster' strings")
        if not isinstance(e["stack_source"], str) or not e["stack_source"].strip():
            _fail(where, "stack_source must name where the run's stack (attention kernel, norms, optimizer, "
                         "reduce dtype, compile) comes from: the project's config file and line")
        _check_fp8(e, where)
        if e.get("set", "original") not in SETS:
            _fail(where, f"set must be one of {', '.join(SETS)} (got {e['set']!r})")
        _check_published_memory(e, where)
    for i, h in enumerate(held):
        where = f"{path.name}: held_back[{i}]" + (f" ({h.get('id')})" if isinstance(h, dict) else "")
        _check_keys(h, where, HELD_REQUIRED, HELD_OPTIONAL)
        _check_measurement(h, where)
        if not isinstance(h["needs"], list) or not h["needs"]:
            _fail(where, "needs must be a non-empty list of missing features")
        if h["id"] in seen:
            _fail(where, f"duplicate id {h['id']!r}")
        seen.add(h["id"])
    entry_ids = {e["id"]: e for e in entries}
    ranking_ids: set[str] = set()
    for i, r in enumerate(rankings):
        where = f"{path.name}: rankings[{i}]" + (f" ({r.get('id')})" if isinstance(r, dict) else "")
        _check_keys(r, where, RANKING_REQUIRED, {"notes"})
        if r["id"] in ranking_ids:
            _fail(where, f"duplicate ranking id {r['id']!r}")
        ranking_ids.add(r["id"])
        order = r["faster"]
        _check_entry_ids(order, where, entry_ids, "faster must list at least two distinct entry ids, fastest first")
        speeds = [_speed(entry_ids[eid]["metric"], entry_ids[eid]["published"]) for eid in order]
        if any(a <= b for a, b in zip(speeds, speeds[1:])):
            _fail(where, "the order contradicts the published numbers")
    for i, r in enumerate(series):
        _check_series(r, f"{path.name}: series[{i}]" + (f" ({r.get('id')})" if isinstance(r, dict) else ""),
                      entry_ids)
    for name, spec in models.items():
        if not isinstance(spec, dict):
            _fail(f"{path.name}: models.{name}", "must be a mapping of ModelConfig fields")
    _model_configs(models, path.name)  # field names and types
    return Suite(path=path, entries=entries, rankings=rankings, held_back=held, models=models, series=series)


def _gpus(entry: dict) -> int:
    """The run's GPU count, as its published setup gives it."""
    return int(entry["setup"]["gpus"])


def _check_entry_ids(ids: Any, where: str, entry_ids: dict[str, dict], shape: str) -> None:
    """A ranking's or a series' list of entries: two or more distinct known ids (else ``shape``)."""
    if not isinstance(ids, list) or len(ids) < 2 or len(set(ids)) != len(ids):
        _fail(where, shape)
    for eid in ids:
        if eid not in entry_ids:
            _fail(where, f"unknown entry id {eid!r}")


def _check_series(r: Any, where: str, entry_ids: dict[str, dict]) -> None:
    """A scaling series: two or more entries of one model and stack at growing GPU counts."""
    _check_keys(r, where, SERIES_REQUIRED, {"notes"})
    runs = r["runs"]
    _check_entry_ids(runs, where, entry_ids, "runs must list at least two distinct entry ids, fewest GPUs first")
    first = entry_ids[runs[0]]
    for eid in runs[1:]:
        e = entry_ids[eid]
        differ = [k for k in SERIES_SAME if e[k] != first[k]] + \
                 [f"strategy.{k}" for k in SERIES_SAME_STRATEGY if e["strategy"].get(k) != first["strategy"].get(k)]
        if differ:
            _fail(where, f"{eid} differs from {runs[0]} in {', '.join(differ)}: a scaling series changes only "
                         "the GPU count")
    if any(_gpus(entry_ids[a]) >= _gpus(entry_ids[b]) for a, b in zip(runs, runs[1:])):
        _fail(where, "runs must be in order of growing GPU count")


def _speed(metric: str, value: float) -> float:
    """Throughput-like number (higher = faster) for a metric value."""
    return value if METRICS[metric].higher_is_better else 1.0 / value


def _model_configs(models: dict[str, dict], where: str) -> dict:
    from piper_sim.models import ModelConfig

    out = {}
    for name, spec in models.items():
        kwargs = {k: v for k, v in spec.items() if k not in MODEL_META}
        try:
            out[name] = ModelConfig(name=name, **kwargs)
        except TypeError as e:
            raise SuiteError(f"{where}: models.{name}: {e}") from None
    return out


def register_models(suite: Suite) -> None:
    """Add the suite's models to the zoo (piper_sim.models.ZOO), in this process only.

    A name the zoo already holds must describe the same model (else SuiteError)."""
    from piper_sim.models import ZOO

    for name, cfg in _model_configs(suite.models, suite.path.name).items():
        if name in ZOO and ZOO[name] != cfg:
            raise SuiteError(f"{suite.path.name}: models.{name} differs from the zoo's {name}; rename it")
        ZOO[name] = cfg


def strategy_of(entry: dict, suite_dir: Path = HERE) -> dict:
    """The entry's strategy, with a cluster-file path made absolute (relative to the suite file)."""
    s = copy.deepcopy(entry["strategy"])
    s.setdefault("name", entry["id"])
    cluster = s["cluster"]
    if cluster.lower().endswith((".yaml", ".yml", ".json")) and not Path(cluster).is_absolute():
        s["cluster"] = str((suite_dir / cluster).resolve())
    return s


# ----------------------------------------------------------------------------------- running


@dataclass
class Result:
    id: str
    metric: str
    published: float
    precision: str
    gpus: int = 0
    simulated: float | None = None
    error_pct: float | None = None  # simulated / published - 1, in %, in the published metric
    speed_ratio: float | None = None  # simulated / published throughput
    step_time_s: float | None = None
    sim_mfu: float | None = None
    bubble_fraction: float | None = None
    peak_memory_gib: float | None = None  # max over ranks
    gpu_memory_gib: float | None = None
    fits: bool | None = None
    memory_verdict: str | None = None  # fits | tight | oom (costmodel.memory.memory_verdict)
    device_memory_gib: float | None = None  # reserved + runtime, max over ranks
    published_memory_gib: float | None = None
    compile_s: float | None = None
    simulate_s: float | None = None
    run_class: str = ""  # piper_sim.bands.run_class: moe | tp | pp | fsdp | ddp | single
    set: str = "original"  # or "added-later"
    status: str = "ok"  # ok | error
    message: str = ""
    # the published memory compared like with like (last, to keep the CSV's earlier columns in place)
    published_memory_kind: str | None = None  # allocated | reserved | nvidia-smi (the suite's field)
    memory_same_kind_gib: float | None = None  # the simulated figure of that kind, max over ranks
    memory_error_pct: float | None = None  # memory_same_kind_gib / published_memory_gib - 1, in %

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _published_memory_gib(entry: dict) -> float | None:
    if "published_memory_gib" in entry:
        return float(entry["published_memory_gib"])
    if "published_memory_gb" in entry:
        return float(entry["published_memory_gb"]) * 1e9 / GIB
    return None


def same_kind_memory_bytes(kind: str, rank_stats) -> float:
    """The simulated peak that a source's counter of ``kind`` reads, max over the ranks
    (`piper_sim.simulator.RankStats`): allocated (the simulator's peak of live tensors, as
    torch.cuda.max_memory_allocated), reserved (what the caching allocator holds for them,
    costmodel.memory.memory_need) or nvidia-smi (reserved + the process's runtime memory: CUDA
    context, library kernels, cuBLAS workspaces, NCCL communicators)."""
    read = {"allocated": lambda s: s.peak_memory_bytes, "reserved": lambda s: s.reserved_bytes,
            "nvidia-smi": lambda s: s.device_bytes}
    if kind not in read:
        raise ValueError(f"unknown memory kind {kind!r}; known: {', '.join(MEMORY_KINDS)}")
    return max(read[kind](s) for s in rank_stats)


def _costmodel_for(entry: dict, strategy: dict, costmodel: str):
    """The analytic model with the entry's ``run_options`` (e.g. DeepSeek-V3's node-limited
    routing and FP8 dispatch, as ``{"moe": {...}}`` cost-model overrides). Published facts, not
    fitted values. (An ``fp8`` run's FP8 GEMMs are its strategy's ``stack.fp8`` recipe.)"""
    if costmodel != "analytic":
        return costmodel
    from costmodel.hardware import parse_cluster
    from costmodel.model import AnalyticCostModel

    overrides = dict(entry.get("run_options", {}))
    return AnalyticCostModel(parse_cluster(strategy["cluster"]), overrides) if overrides else costmodel


def run_entry(entry: dict, costmodel: str = "analytic", suite_dir: Path = HERE) -> Result:
    """Compile and simulate one entry; never raises for a strategy the simulator rejects."""
    from costmodel.hardware import parse_cluster
    from piper_sim.api import compile
    from piper_sim.simulator import simulate

    from piper_sim.bands import run_class

    res = Result(id=entry["id"], metric=entry["metric"], published=float(entry["published"]),
                 precision=entry["precision"], published_memory_gib=_published_memory_gib(entry),
                 published_memory_kind=entry.get("published_memory_kind"), set=entry.get("set", "original"))
    try:
        strategy = strategy_of(entry, suite_dir)
        t0 = time.perf_counter()
        plan = compile(strategy)
        t1 = time.perf_counter()
        sim = simulate(plan, _costmodel_for(entry, strategy, costmodel))
        t2 = time.perf_counter()
        value = METRICS[entry["metric"]].value(sim, plan)
        hbm = parse_cluster(strategy["cluster"]).gpu.hbm_bytes
    except Exception as e:  # a report: one failing entry must not stop the others
        res.status, res.message = "error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return res
    peak = float(sim.per_rank["peak_memory_bytes"].max())
    res.run_class = run_class(plan.meta, plan.layout.pp, plan.layout.ep, plan.layout.dp)
    res.gpus = sim.world_size
    res.simulated = value
    res.error_pct = 100.0 * (value / res.published - 1.0)
    res.speed_ratio = _speed(res.metric, value) / _speed(res.metric, res.published)
    res.step_time_s, res.sim_mfu, res.bubble_fraction = sim.step_time_s, sim.mfu, sim.bubble_fraction
    # the simulator's verdict (costmodel.memory.memory_verdict, the one check simulate and explore use)
    res.peak_memory_gib, res.gpu_memory_gib, res.fits = peak / GIB, hbm / GIB, sim.fits
    res.memory_verdict = sim.memory_verdict
    res.device_memory_gib = max(x.device_bytes for x in sim.rank_stats) / GIB
    if res.published_memory_gib and res.published_memory_kind:
        res.memory_same_kind_gib = same_kind_memory_bytes(res.published_memory_kind, sim.rank_stats) / GIB
        res.memory_error_pct = 100.0 * (res.memory_same_kind_gib / res.published_memory_gib - 1.0)
    res.compile_s, res.simulate_s = t1 - t0, t2 - t1
    return res


def run_suite(suite: Suite, costmodel: str = "analytic", only: list[str] | None = None,
              progress: Callable[[Result], None] | None = None) -> list[Result]:
    """Simulate the suite's entries (those in `only`, when given), in file order."""
    register_models(suite)
    results = []
    for entry in suite.entries:
        if only is not None and entry["id"] not in only:
            continue
        res = run_entry(entry, costmodel, suite.path.parent)
        if progress:
            progress(res)
        results.append(res)
    return results


# ----------------------------------------------------------------------------------- reporting


@dataclass
class RankingCheck:
    id: str
    order: list[str]
    status: str  # PASS | FAIL | SKIP
    simulated: list[float | None] = field(default_factory=list)
    source: str = ""


def check_rankings(suite: Suite, results: list[Result]) -> list[RankingCheck]:
    """PASS when the simulated throughputs are strictly in the published order."""
    by_id = {r.id: r for r in results}
    out = []
    for rk in suite.rankings:
        order = rk["faster"]
        got = [by_id.get(i) for i in order]
        sims = [r.simulated if r and r.ok else None for r in got]
        if any(v is None for v in sims):
            status = "SKIP"
        else:
            speeds = [_speed(r.metric, r.simulated) for r in got]
            status = "PASS" if all(a > b for a, b in zip(speeds, speeds[1:])) else "FAIL"
        out.append(RankingCheck(id=rk["id"], order=list(order), status=status, simulated=sims, source=rk["source"]))
    return out


@dataclass
class SeriesCheck:
    id: str
    runs: list[str]
    gpus: list[int]
    published_loss_pct: float  # per-GPU throughput lost from the first run to the last, in %
    simulated_loss_pct: float | None
    status: str  # PASS (within SERIES_TOLERANCE_PP) | FAIL | SKIP


def check_series(suite: Suite, results: list[Result]) -> list[SeriesCheck]:
    """Per-GPU throughput loss from the fewest to the most GPUs of each series, published and
    simulated; PASS when they are within `SERIES_TOLERANCE_PP` points."""
    by_id = {r.id: r for r in results}
    out = []
    for sr in suite.series:
        a, b = (suite.entry(sr["runs"][0]), suite.entry(sr["runs"][-1]))
        pub = 100.0 * (1.0 - _speed(b["metric"], b["published"]) / _speed(a["metric"], a["published"]))
        ra, rb = by_id.get(a["id"]), by_id.get(b["id"])
        sim, status = None, "SKIP"
        if ra and rb and ra.ok and rb.ok:
            sim = 100.0 * (1.0 - _speed(rb.metric, rb.simulated) / _speed(ra.metric, ra.simulated))
            status = "PASS" if abs(sim - pub) <= SERIES_TOLERANCE_PP else "FAIL"
        out.append(SeriesCheck(sr["id"], list(sr["runs"]), [_gpus(suite.entry(i)) for i in sr["runs"]], pub, sim,
                               status))
    return out


def format_series(checks: list[SeriesCheck]) -> str:
    lines = [f"scaling series (per-GPU throughput lost from the fewest to the most GPUs; PASS within "
             f"{SERIES_TOLERANCE_PP:g} points): {sum(c.status == 'PASS' for c in checks)} PASS, "
             f"{sum(c.status == 'FAIL' for c in checks)} FAIL, {sum(c.status == 'SKIP' for c in checks)} SKIP"]
    for c in checks:
        sim = "?" if c.simulated_loss_pct is None else f"{c.simulated_loss_pct:+.1f}%"
        lines.append(f"  {c.status:<4} {c.id}: {' -> '.join(map(str, c.gpus))} GPUs, published "
                     f"{c.published_loss_pct:+.1f}%, simulated {sim}")
    return "\n".join(lines)


def summarize(results: list[Result]) -> dict[str, Any]:
    """Median and max |error| (all runs, without FP8 runs, per run class, and of the runs added
    later), and how often a run falls inside the 80% band built without it."""
    from piper_sim.bands import leave_one_out_coverage

    def stats(rs):
        errs = [abs(r.error_pct) for r in rs]
        return (statistics.median(errs) if errs else None, max(errs) if errs else None, len(errs))

    ok = [r for r in results if r.ok]
    med, mx, n = stats(ok)
    med16, mx16, n16 = stats([r for r in ok if r.precision != "fp8"])
    by_class = {c: stats([r for r in ok if r.run_class == c]) for c in sorted({r.run_class for r in ok})}
    later = stats([r for r in ok if r.set == "added-later"])
    inside, total = leave_one_out_coverage(band_rows(ok))
    return {"runs": len(results), "simulated": n, "errors": len(results) - n,
            "median_abs_error_pct": med, "max_abs_error_pct": mx,
            "median_abs_error_pct_no_fp8": med16, "max_abs_error_pct_no_fp8": mx16, "runs_no_fp8": n16,
            "by_class": by_class, "added_later": later, "band_coverage": (inside, total),
            "not_fitting": [r.id for r in ok if r.fits is False],
            "tight": [r.id for r in ok if r.memory_verdict == "tight"],
            "median_speed_ratio": statistics.median([r.speed_ratio for r in ok]) if ok else None,
            **memory_summary(ok)}


def memory_summary(results: list[Result]) -> dict[str, Any]:
    """Median and max |memory error| (same kind as the source), how many runs are within
    `MEMORY_WITHIN_PCT` (of those with a published memory), and the runs that trained on their
    GPUs but are oom in simulation."""
    ok = [r for r in results if r.ok]
    errs = [abs(r.memory_error_pct) for r in ok if r.memory_error_pct is not None]
    return {"memory_median_abs_error_pct": statistics.median(errs) if errs else None,
            "memory_max_abs_error_pct": max(errs) if errs else None,
            "memory_within": (sum(e <= MEMORY_WITHIN_PCT for e in errs), len(errs)),
            "trained_but_oom": [r.id for r in ok if r.memory_verdict == "oom"]}


def band_rows(results: list[Result]) -> list[tuple[str, str, float]]:
    """(id, class, speed ratio) of the simulated runs: what piper_sim.bands builds bands from."""
    return [(r.id, r.run_class, r.speed_ratio) for r in results if r.ok and r.speed_ratio]


def write_bands(results: list[Result], path: str, suite: Suite) -> None:
    """Write the error-band data file (piper_sim.bands) atomically."""
    import json

    from piper_sim.bands import bands_from_results
    from piper_sim.files import atomic_write

    data = bands_from_results(band_rows(results), f"benchmarks/published/run.py over {suite.path.name}")
    with atomic_write(path) as f:
        f.write(json.dumps(data, indent=1) + "\n")


def results_frame(results: list[Result]):
    """The results as a pandas DataFrame, one row per run."""
    import pandas as pd

    return pd.DataFrame([asdict(r) for r in results])


def _num(v: float | None, width: int) -> str:
    if v is None:
        return "-".rjust(width)
    if v >= 1e4:
        s = f"{v:,.0f}"
    elif v >= 100:
        s = f"{v:.0f}"
    elif v >= 10:
        s = f"{v:.1f}"
    else:
        s = f"{v:.3g}"
    return s.rjust(width)


def _verdict(v: str | None) -> str:
    """The memory column: fits, tight, OOM (capitals: the one to notice), - when unknown."""
    return "-" if v is None else v.upper() if v == "oom" else v


def format_table(results: list[Result], costmodel: str = "analytic") -> str:
    w = max([len(r.id) for r in results] + [2])
    head = (f"{'id':<{w}} {'GPUs':>5} {'prec':>4} {'metric':>11} {'published':>10} {'simulated':>10} "
            f"{'error':>8} {'speed':>6} {'peak GiB':>8} {'need GiB':>8} {'GPU GiB':>7} {'memory':>6} {'pub GiB':>7}")
    lines = [f"published-results suite, cost model: {costmodel}", head, "-" * len(head)]
    for r in results:
        if not r.ok:
            lines.append(f"{r.id:<{w}} {'':>5} {r.precision:>4} {METRICS[r.metric].label:>11} "
                         f"{_num(r.published, 10)} {'ERROR':>10}  {r.message}")
            continue
        lines.append(
            f"{r.id:<{w}} {r.gpus:>5} {r.precision:>4} {METRICS[r.metric].label:>11} {_num(r.published, 10)} "
            f"{_num(r.simulated, 10)} {r.error_pct:>+7.1f}% {r.speed_ratio:>5.2f}x {r.peak_memory_gib:>8.1f} "
            f"{r.device_memory_gib or 0:>8.1f} {r.gpu_memory_gib:>7.1f} {_verdict(r.memory_verdict):>6} "
            f"{_num(r.published_memory_gib, 7) if r.published_memory_gib else '-'.rjust(7)}")
    return "\n".join(lines)


def format_memory_table(results: list[Result]) -> str:
    """The "memory vs published" section: each published peak against the simulated figure of the
    kind the source reports, then every run that trained on its GPUs but is oom in simulation."""
    rows = [r for r in results if r.published_memory_gib]
    w = max([len(r.id) for r in rows] + [2])
    head = f"{'id':<{w}} {'kind':>10} {'pub GiB':>8} {'sim GiB':>8} {'error':>8} {'within':>6}"
    lines = [f"memory vs published (the simulated figure of the kind the source reports, max over ranks; "
             f"within: |error| <= {MEMORY_WITHIN_PCT:.0f}%)", head, "-" * len(head)]
    for r in rows:
        kind = r.published_memory_kind or "-"
        if r.memory_error_pct is None:
            why = "ERROR" if not r.ok else "-"
            lines.append(f"{r.id:<{w}} {kind:>10} {r.published_memory_gib:>8.1f} {why:>8}")
            continue
        within = "yes" if abs(r.memory_error_pct) <= MEMORY_WITHIN_PCT else "no"
        lines.append(f"{r.id:<{w}} {kind:>10} {r.published_memory_gib:>8.1f} {r.memory_same_kind_gib:>8.1f} "
                     f"{r.memory_error_pct:>+7.1f}% {within:>6}")
    s = memory_summary(results)
    k, n = s["memory_within"]
    if n:
        lines.append(f"|memory error|: median {s['memory_median_abs_error_pct']:.1f}%, max "
                     f"{s['memory_max_abs_error_pct']:.1f}%; {k} of {n} within {MEMORY_WITHIN_PCT:.0f}%")
    lines.append("trained on its GPUs but does not fit in simulation: " + (", ".join(s["trained_but_oom"]) or "none"))
    return "\n".join(lines)


def format_summary(summary: dict[str, Any], checks: list[RankingCheck]) -> str:
    def pct(v):
        return "-" if v is None else f"{v:.1f}%"

    s = summary
    lines = [
        f"runs: {s['runs']} ({s['simulated']} simulated, {s['errors']} failed)",
        f"|error|: median {pct(s['median_abs_error_pct'])}, max {pct(s['max_abs_error_pct'])}"
        f"   without FP8 runs ({s['runs_no_fp8']}): median {pct(s['median_abs_error_pct_no_fp8'])}, "
        f"max {pct(s['max_abs_error_pct_no_fp8'])}",
        "median speed (simulated / published throughput): "
        + ("-" if s["median_speed_ratio"] is None else f"{s['median_speed_ratio']:.2f}x"),
        "do not fit in GPU memory (oom: even unfragmented above it): "
        + (", ".join(s["not_fitting"]) if s["not_fitting"] else "none"),
        "tight in GPU memory (may run out; fragmentation decides): "
        + (", ".join(s.get("tight", [])) or "none"),
        "by run class (|error| median / max, runs): " + ", ".join(
            f"{c} {pct(m)} / {pct(x)} ({k})" for c, (m, x, k) in s["by_class"].items()),
        "added later (runs added after the constants were fixed): "
        + ("none" if not s["added_later"][2] else
           f"median {pct(s['added_later'][0])}, max {pct(s['added_later'][1])} ({s['added_later'][2]} runs)"),
        "80% band, leave-one-out: {} of {} runs inside the band built without them".format(*s["band_coverage"]),
        "",
        f"rankings: {sum(c.status == 'PASS' for c in checks)} PASS, {sum(c.status == 'FAIL' for c in checks)} FAIL, "
        f"{sum(c.status == 'SKIP' for c in checks)} SKIP",
    ]
    for c in checks:
        sims = " > ".join("?" if v is None else _num(v, 0) for v in c.simulated)
        lines.append(f"  {c.status:<4} {c.id}: {' > '.join(c.order)}   (simulated: {sims})")
    return "\n".join(lines)


def write_csv(results: list[Result], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[fl.name for fl in fields(Result)])
        w.writeheader()
        for r in results:
            w.writerow(asdict(r))


# ----------------------------------------------------------------------------------------- main


def _check_costmodel(spec: str) -> None:
    """Reject a cost-model spec no entry could use, before simulating anything."""
    from costmodel.model import UnitCostModel

    if spec.strip().lower() == "analytic":
        return
    if spec.strip().lower().startswith("unit"):
        try:
            UnitCostModel.parse(spec)
        except ValueError as e:
            raise SuiteError(f"--costmodel: {e}") from None
    elif not Path(spec).is_file():
        raise SuiteError(f"--costmodel: {spec!r} is not 'analytic', 'unit:...' or an existing calibration file")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--costmodel", default="analytic",
                    help="'analytic' (default), 'unit:...', or a calibration .json (as piper-sim simulate)")
    ap.add_argument("--csv", metavar="PATH", help="also write one row per run to this CSV file")
    ap.add_argument("--only", action="append", metavar="ID",
                    help="simulate only these entry ids (comma-separated, or repeat the flag)")
    ap.add_argument("--write-bands", nargs="?", const="", metavar="PATH",
                    help="write the error bands that simulate/explore/demo print (default: piper_sim/data/"
                         "error_bands.json); needs the whole suite (no --only)")
    ap.add_argument("--suite", default=str(SUITE), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        suite = load_suite(args.suite)
        only = None
        if args.only:
            only = [i.strip() for arg in args.only for i in arg.split(",") if i.strip()]
            known = {e["id"] for e in suite.entries}
            unknown = [i for i in only if i not in known]
            if unknown:
                held = {h["id"] for h in suite.held_back}
                why = " (held back: not simulated)" if set(unknown) <= held else ""
                raise SuiteError(f"--only: unknown entry id(s) {', '.join(unknown)}{why}")
        if args.write_bands is not None and (args.only or args.costmodel != "analytic"):
            raise SuiteError("--write-bands needs the whole suite with the analytic cost model (no --only, "
                             "no --costmodel)")
        register_models(suite)
        _check_costmodel(args.costmodel)
    except SuiteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def progress(r: Result) -> None:
        t = "" if r.compile_s is None else f" (compile {r.compile_s:.1f} s, simulate {r.simulate_s:.1f} s)"
        print(f"  {r.id}: {r.status}{t}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    results = run_suite(suite, args.costmodel, only, progress)
    checks = check_rankings(suite, results)
    print(format_table(results, args.costmodel))
    print()
    print(format_memory_table(results))
    print()
    print(format_summary(summarize(results), checks))
    if suite.series:
        print()
        print(format_series(check_series(suite, results)))
    if suite.held_back:
        print("\nheld back (not simulated): "
              + ", ".join(f"{h['id']} [{'+'.join(h['needs'])}]" for h in suite.held_back))
    print(f"\n{len(results)} runs in {time.perf_counter() - t0:.0f} s")
    if args.csv:
        write_csv(results, args.csv)
        print(f"wrote {args.csv}")
    if args.write_bands is not None:
        from piper_sim.bands import BANDS_FILE

        path = args.write_bands or BANDS_FILE
        write_bands(results, path, suite)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
