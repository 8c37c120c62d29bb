"""The published-results suite (benchmarks/published): its data is well formed and cited, every
strategy compiles, a few runs simulate end to end, and run.py reports (exit 0) or refuses a
malformed suite (exit 2, one line).

Fast: strategies with many micro-batches compile with 2 x PP of them (same model, cluster,
degrees and micro-batch size); run.py compiles the full-size ones.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SUITE_DIR = ROOT / "benchmarks" / "published"


def _load_module():
    spec = importlib.util.spec_from_file_location("published_run", SUITE_DIR / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


R = _load_module()


@pytest.fixture(scope="module")
def suite():
    """The suite, with its models registered in the zoo for this module only."""
    from piper_sim.models import ZOO

    saved = dict(ZOO)
    s = R.load_suite()
    R.register_models(s)
    yield s
    ZOO.clear()
    ZOO.update(saved)


def test_suite_has_enough_cited_runs(suite):
    assert len(suite.entries) >= 12
    for e in suite.entries + suite.held_back:
        assert e["source"].strip(), e["id"]
        assert isinstance(e["published"], (int, float)) and e["published"] > 0 and math.isfinite(e["published"])
        assert e["metric"] in R.METRICS and e["precision"] in R.PRECISIONS
    gpus = {int(e["setup"]["gpus"]) for e in suite.entries}
    assert min(gpus) == 8 and max(gpus) >= 2048, sorted(gpus)


def test_ids_are_unique(suite):
    ids = [e["id"] for e in suite.entries + suite.held_back]
    assert len(ids) == len(set(ids))
    rids = [r["id"] for r in suite.rankings]
    assert len(rids) == len(set(rids))


def test_published_memories_say_what_they_count(suite):
    """Every published peak memory names its kind (the counter the source read) and where."""
    with_memory = [e for e in suite.entries if "published_memory_gib" in e or "published_memory_gb" in e]
    assert len(with_memory) >= 10
    for e in with_memory:
        assert e["published_memory_kind"] in R.MEMORY_KINDS and e["memory_source"].strip(), e["id"]
    assert {e["published_memory_kind"] for e in with_memory if e["id"].startswith("tt-")} == {"reserved"}


def test_held_back_runs_say_what_they_need(suite):
    assert any("tensor_parallel" in h["needs"] for h in suite.held_back)
    for h in suite.held_back:
        assert h["needs"] and all(isinstance(n, str) for n in h["needs"])


def test_rankings_name_entries_in_published_order(suite):
    by_id = {e["id"]: e for e in suite.entries}
    for r in suite.rankings:
        speeds = [R._speed(by_id[i]["metric"], by_id[i]["published"]) for i in r["faster"]]
        assert speeds == sorted(speeds, reverse=True), r["id"]


def test_setup_matches_strategy(suite):
    """The strategy runs on the published number of GPUs with the published batch."""
    from costmodel.hardware import parse_cluster

    for e in suite.entries:
        s = R.strategy_of(e)
        assert parse_cluster(s["cluster"]).world_size == e["setup"]["gpus"], e["id"]
        if "global_batch" in e["setup"]:
            assert s["global_batch"] == e["setup"]["global_batch"], e["id"]
        if "seq_len" in e["setup"]:
            assert s["seq_len"] == e["setup"]["seq_len"], e["id"]


def test_registered_models_match_published_parameter_counts(suite):
    """The suite's models as published (tied embeddings, biases); only the learned position
    table (max_seq x hidden, not modelled) is missing: within 0.3%."""
    from piper_sim.models import get_config

    checked = 0
    for name, spec in suite.models.items():
        if "published_params" in spec:
            cfg = get_config(name)
            assert cfg.param_count() == pytest.approx(spec["published_params"], rel=0.003), name
            assert cfg.param_count() + cfg.max_seq * cfg.hidden == spec["published_params"], name
            checked += 1
    assert checked >= 5


def _small(strategy: dict) -> dict:
    """At most 2 x PP micro-batches (every schedule here accepts that; PP for pipelines of 32
    stages or more, whose TP collectives make a compile slow), same micro-batch size."""
    s = copy.deepcopy(strategy)
    pp = next((d["degree"] for d in s["directives"] if d["op"] == "pipeline"), 1)
    per = 1 if pp >= 32 else 2
    if s["microbatches"] > per * pp:
        s["global_batch"] = s["global_batch"] // s["microbatches"] * per * pp
        s["microbatches"] = per * pp
    return s


@pytest.mark.slow
def test_every_strategy_compiles(suite):
    from piper_sim.api import compile

    for e in suite.entries:
        plan = compile(_small(R.strategy_of(e)))
        assert plan.world_size == e["setup"]["gpus"], e["id"]


def test_scaling_series_compare_per_gpu_loss(suite):
    """A series' loss is the per-GPU throughput lost from its first run to its last, published
    and simulated (here from made-up simulated numbers), PASS within 3 points."""
    sr = next(x for x in suite.series if x["id"] == "mpt-7b-fsdp-128-to-512")
    a, b = (suite.entry(i) for i in sr["runs"])
    assert a["published"] == 10475 and b["published"] == 9670

    def result(e, simulated):
        return R.Result(id=e["id"], metric=e["metric"], published=e["published"], precision=e["precision"],
                        simulated=simulated, status="ok")

    for sim_b, status in ((10000 * 9670 / 10475, "PASS"), (9600.0, "FAIL"), (None, "SKIP")):
        results = [result(a, 10000.0)] + ([result(b, sim_b)] if sim_b else [])
        check = next(c for c in R.check_series(suite, results) if c.id == sr["id"])
        assert check.published_loss_pct == pytest.approx(100 * (1 - 9670 / 10475))
        assert check.status == status and check.gpus == [128, 512]
        if sim_b:
            assert check.simulated_loss_pct == pytest.approx(100 * (1 - sim_b / 10000))
    assert "scaling series" in R.format_series(R.check_series(suite, results))


def test_runs_simulate_and_convert(suite):
    ids = ["mpt-7b-h100x8", "zb-1.5b-zb1p-m32"]
    results = R.run_suite(suite, only=ids)
    assert [r.id for r in results] == ids
    for r in results:
        assert r.ok, r.message
        assert r.simulated > 0 and r.step_time_s > 0 and r.peak_memory_gib > 0 and r.fits in (True, False)
        assert r.error_pct == pytest.approx(100 * (r.simulated / r.published - 1))
    mpt, zb = results
    assert mpt.simulated == pytest.approx(48 * 2048 / mpt.step_time_s / 8)  # tokens/s/GPU
    assert zb.simulated == pytest.approx(192 / zb.step_time_s / 8)  # samples/s/GPU
    checks = {c.id: c.status for c in R.check_rankings(suite, results)}
    assert set(checks.values()) == {"SKIP"}  # no ranking has both of its runs here
    summary = R.summarize(results)
    assert summary["simulated"] == 2 and summary["max_abs_error_pct"] >= summary["median_abs_error_pct"]
    assert summary["memory_within"][1] == 1 and summary["memory_median_abs_error_pct"] == abs(zb.memory_error_pct)
    assert zb.published_memory_kind == "allocated" and mpt.memory_error_pct is None
    assert "mpt-7b-h100x8" in R.format_table(results)


def _rank(rank: int, allocated: float, reserved: float, runtime: float):
    from piper_sim.simulator import RankStats

    return RankStats(rank=rank, pp_rank=rank, represents=1, compute_s=1.0, comm_exposed_s=0.0, idle_s=0.0,
                     bubble_s=0.0, peak_memory_bytes=allocated, params_bytes=0.0, grads_bytes=0.0,
                     optimizer_bytes=0.0, activations_bytes=allocated, reserved_bytes=reserved, runtime_bytes=runtime)


def test_same_kind_memory_reads_the_sources_counter():
    """Each kind reads its own figure, max over ranks: here a different rank tops each kind."""
    ranks = [_rank(0, allocated=50e9, reserved=55e9, runtime=1e9), _rank(1, allocated=40e9, reserved=56e9, runtime=1e9),
             _rank(2, allocated=30e9, reserved=54e9, runtime=4e9)]
    assert R.same_kind_memory_bytes("allocated", ranks) == 50e9
    assert R.same_kind_memory_bytes("reserved", ranks) == 56e9
    assert R.same_kind_memory_bytes("nvidia-smi", ranks) == 58e9
    with pytest.raises(ValueError, match="max_active"):
        R.same_kind_memory_bytes("max_active", ranks)


def test_memory_error_is_of_the_published_kind(suite):
    """A real tiny entry (Zero Bubble 1.5B, PP 8): the simulated figure follows the entry's kind,
    and the error is simulated / published - 1 (published 30 GB = 27.9 GiB)."""
    e = copy.deepcopy(suite.entry("zb-1.5b-1f1b-m24"))
    got = {}
    for kind in R.MEMORY_KINDS:
        e["published_memory_kind"] = kind
        r = R.run_entry(e)
        assert r.ok, r.message
        assert r.memory_error_pct == pytest.approx(100 * (r.memory_same_kind_gib / r.published_memory_gib - 1))
        got[kind] = r
    assert r.published_memory_gib == pytest.approx(30e9 / 2**30)
    assert got["allocated"].memory_same_kind_gib == pytest.approx(got["allocated"].peak_memory_gib)
    assert got["nvidia-smi"].memory_same_kind_gib == pytest.approx(got["nvidia-smi"].device_memory_gib)
    assert got["allocated"].memory_same_kind_gib < got["reserved"].memory_same_kind_gib < got["nvidia-smi"].memory_same_kind_gib
    bare = copy.deepcopy(suite.entry("mpt-7b-a100x8"))  # no published memory: nothing to compare
    r = R.run_entry(bare)
    assert r.ok and r.memory_same_kind_gib is None and r.memory_error_pct is None


def test_memory_section_lists_errors_and_runs_that_do_not_fit():
    def res(rid, pub=None, kind=None, sim=None, verdict="fits", status="ok"):
        err = None if sim is None else 100 * (sim / pub - 1)
        return R.Result(id=rid, metric="tokens_per_s_per_gpu", published=1.0, precision="bf16", published_memory_gib=pub,
                        published_memory_kind=kind, memory_same_kind_gib=sim, memory_error_pct=err,
                        memory_verdict=verdict, status=status)

    results = [res("close", 80.0, "reserved", 72.0), res("far", 30.0, "allocated", 40.0, verdict="tight"),
               res("no-memory", verdict="oom"), res("broken", 50.0, "nvidia-smi", status="error")]
    text = R.format_memory_table(results)
    lines = {ln.split()[0]: ln.split() for ln in text.splitlines()[3:] if ln.split()[0] in {"close", "far", "broken"}}
    assert lines["close"][1:] == ["reserved", "80.0", "72.0", "-10.0%", "yes"]
    assert lines["far"][1:] == ["allocated", "30.0", "40.0", "+33.3%", "no"]
    assert lines["broken"][1:] == ["nvidia-smi", "50.0", "ERROR"]
    assert "no-memory" not in text.split("trained on")[0]  # no published memory: no row
    assert "median 21.7%, max 33.3%; 1 of 2 within 15%" in text
    assert text.splitlines()[-1] == "trained on its GPUs but does not fit in simulation: no-memory"
    s = R.memory_summary(results)
    assert s["memory_within"] == (1, 2) and s["trained_but_oom"] == ["no-memory"]
    assert s["memory_max_abs_error_pct"] == pytest.approx(100 / 3)


def test_gpu_hours_metric_is_inverse_throughput(suite):
    class Sim:
        tokens_per_s, world_size, step_time_s = 2048 * 1000.0, 2048, 1.0

    assert R.METRICS["gpu_hours_per_trillion_tokens"].value(Sim, None) == pytest.approx(1e12 / 1000 / 3600)
    assert not R.METRICS["gpu_hours_per_trillion_tokens"].higher_is_better


def test_a_failing_strategy_is_reported_not_raised(suite):
    e = copy.deepcopy(suite.entry("mpt-7b-h100x8"))
    e["strategy"]["directives"] = [{"op": "data_parallel", "degree": 3}]
    r = R.run_entry(e)
    assert r.status == "error" and "\n" not in r.message and r.message


def _entry(data: dict, eid: str) -> dict:
    return next(e for e in data["entries"] if e["id"] == eid)


def _write(tmp_path: Path, data) -> str:
    p = tmp_path / "suite.yaml"
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(p)


@pytest.mark.parametrize("breakage, expect", [
    (lambda d: d["entries"][0].pop("source"), "missing field(s) source"),
    (lambda d: d["entries"][1].update(id=d["entries"][0]["id"]), "duplicate id"),
    (lambda d: d["entries"][0].update(published="fast"), "published must be a positive number"),
    (lambda d: d["entries"][0].update(metric="tflops"), "unknown metric"),
    (lambda d: d["rankings"][0]["faster"].reverse(), "contradicts the published numbers"),
    (lambda d: d["rankings"][0]["faster"].append("nope"), "unknown entry id 'nope'"),
    (lambda d: d["models"]["mpt-7b"].update(hiden=1), "models.mpt-7b"),
    # an fp8 run names its recipe in the stack (which GEMMs run in FP8, what the casts move)
    (lambda d: _entry(d, "mb-llama3-8b-fsdp8-h100-fp8")["strategy"]["stack"].pop("fp8"),
     "precision fp8 with strategy.stack.fp8 'none'"),
    (lambda d: _entry(d, "mpt-7b-h100x8")["strategy"].update(stack={"fp8": "tensorwise"}),
     "precision bf16 with strategy.stack.fp8 'tensorwise'"),
    (lambda d: _entry(d, "mb-dsv3-b200x256-fp8")["strategy"]["stack"].update(fp8="fp4"), "fp8 must be one of"),
    (lambda d: d["entries"][0].update(published_memory_kind="max_active"),
     "published_memory_kind must be one of allocated, reserved, nvidia-smi (got 'max_active')"),
    (lambda d: d["entries"][0].pop("published_memory_kind"), "published_memory_kind must be one of"),
    (lambda d: d["entries"][0].pop("memory_source"), "memory_source must name"),
    (lambda d: d["entries"][2].update(published_memory_kind="reserved"), "describes a published memory"),
    # a scaling series changes only the GPU count: MPT-7B's 8-GPU row ran Triton attention
    (lambda d: d["series"][-1]["runs"].insert(0, "mpt-7b-h100x8"),
     "mpt-7b-h100x128 differs from mpt-7b-h100x8 in strategy.stack"),
    (lambda d: d["series"][-1]["runs"].reverse(), "growing GPU count"),
])
def test_malformed_suite_exits_2_with_one_line(tmp_path, capsys, breakage, expect):
    data = yaml.safe_load((SUITE_DIR / "suite.yaml").read_text())
    breakage(data)
    assert R.main(["--suite", _write(tmp_path, data)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expect in err, err


def test_unparsable_yaml_exits_2(tmp_path, capsys):
    assert R.main(["--suite", _write(tmp_path, "entries: [\n")]) == 2
    assert "malformed YAML" in capsys.readouterr().err


def test_report_exits_0_and_writes_csv(tmp_path, capsys, suite):
    out = tmp_path / "r.csv"
    assert R.main(["--only", "mpt-7b-a100x8", "--csv", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mpt-7b-a100x8" in text and "median" in text and "rankings:" in text
    assert "memory vs published" in text and "trained on its GPUs but does not fit in simulation: none" in text
    assert text.index("memory vs published") < text.index("rankings:")
    rows = out.read_text().splitlines()
    assert len(rows) == 2 and rows[0].startswith("id,metric,published")
    assert rows[0].endswith("published_memory_kind,memory_same_kind_gib,memory_error_pct")
    assert R.main(["--only", "no-such-run"]) == 2


def test_breakdown_splits_a_step_by_component(suite):
    """breakdown.py: the kernel-table split is positive, the fleet's spread adds the slowest of 8
    GPUs' share, and the overlap slowdown adds compute time while FSDP's gathers run, at most
    (1 - 1/slowdown) of the comm busy time."""
    from costmodel.hardware import GPU_OVERLAP_SLOWDOWN
    from costmodel.stragglers import slowest_factor

    spec = importlib.util.spec_from_file_location("published_breakdown", SUITE_DIR / "breakdown.py")
    bd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bd)
    ms = bd.breakdown(suite.entry("mpt-7b-h100x8"))
    assert ms["gemm"] > ms["attn"] > 0 and ms["mem"] > 0 and ms["launch"] > 0
    comm = sum(v for k, v in ms.items() if k.startswith("comm:"))
    assert ms["comm:ALL_GATHER"] > 0 and ms["comm:REDUCE_SCATTER"] > 0
    assert 0 < ms["slow"] <= (1 - 1 / GPU_OVERLAP_SLOWDOWN) * comm * (1 + 1e-9)
    standalone = sum(ms[k] for k in ("gemm", "attn", "mem", "launch", "other", "opt"))
    assert ms["straggle"] == pytest.approx(standalone * (slowest_factor(8) - 1))  # 8 H100s: 1.4%
    assert ms["step"] >= ms["gemm"] + ms["attn"] + ms["mem"] + ms["straggle"] + ms["slow"]
