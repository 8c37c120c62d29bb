"""The validation suites: the spread suite compiles, its names are unique, its predicted step
times are spread wider than the machine's noise, and its committed measurements cover it;
single-rank runs get one intra-op thread like every rank under torchrun."""

from __future__ import annotations

import os

import pytest

from piper_sim.api import compile
from piper_sim.cli.run import launch_env
from piper_sim.cli.validation import SPREAD_MIN_RATIO, slug, spread_suite
from piper_sim.simulator import simulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALIBRATIONS = [os.path.join(ROOT, "traces", "calibration", "cpu-2core.json"),
                os.path.join(ROOT, "traces", "validation_spread", "calibration.json")]


def test_spread_suite_names_unique_and_single_and_two_rank():
    suite = spread_suite()
    assert len(suite) >= 8
    assert len({s["name"] for s in suite}) == len(suite)
    assert len({slug(s["name"]) for s in suite}) == len(suite)  # file names do not collide
    assert {s["cluster"] for s in suite} == {"cpu:1", "cpu:2"}


@pytest.mark.parametrize("costmodel", CALIBRATIONS, ids=os.path.basename)
def test_spread_suite_predicted_neighbours_differ_by_more_than_noise(costmodel):
    times = sorted(simulate(compile(s), costmodel).step_time_s for s in spread_suite())
    ratios = [b / a for a, b in zip(times, times[1:])]
    assert min(ratios) >= SPREAD_MIN_RATIO, [f"{r:.2f}" for r in ratios]


def test_spread_suite_measurements_cover_the_suite():
    folder = os.path.join(ROOT, "traces", "validation_spread")
    for s in spread_suite():
        for kind in ("plan", "measured"):
            assert os.path.isfile(os.path.join(folder, f"{slug(s['name'])}.{kind}.json")), (s["name"], kind)


def test_single_rank_runs_get_one_thread_unless_told(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch_env()["OMP_NUM_THREADS"] == "1"
    assert "PIPER_VERBOSE" not in launch_env() and launch_env(verbose=True)["PIPER_VERBOSE"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert launch_env()["OMP_NUM_THREADS"] == "2"


def test_rounds_keep_each_strategys_fastest_round_and_its_trace(tmp_path):
    """A real (tiny, single-rank) executor run measured twice: the row keeps the faster round."""
    from piper_sim.cli.validation import _s, validate

    tiny = _s("tiny one rank", "gpt-tiny", "cpu:1", [], m=1, batch=2, seq=32)
    summary = validate([tiny], CALIBRATIONS[0], steps=2, warmup=1, out_dir=str(tmp_path), rounds=2)
    row = summary["rows"][0]
    assert summary["rounds"] == 2 and len(row["rounds_s"]) == 2
    assert row["measured_s"] == min(row["rounds_s"])
    assert sorted(p.name for p in tmp_path.glob("*.measured.json")) == ["tiny_one_rank.measured.json"]
