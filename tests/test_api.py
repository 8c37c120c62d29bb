"""The Python and command-line surface: top-level lazy API, DataFrames (with the JSON path
kept), logging levels, --version, help on every option, ``python -m piper_sim``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"model": "gpt-tiny", "cluster": "cpu:4", "global_batch": 8, "seq_len": 32, "microbatches": 4,
        "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"},
                       {"op": "data_parallel", "degree": 2, "zero": 1}]}


def _py(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": ROOT}).stdout.strip()


def test_top_level_api_is_lazy_and_callable():
    heavy = ("torch", "pandas", "simpy", "matplotlib", "piper_sim.api", "piper_sim.explore")
    out = _py(f"import sys, piper_sim; print(sorted(m for m in {heavy!r} if m in sys.modules))")
    assert out == "[]"
    import piper_sim
    from piper_sim.api import compile as api_compile
    from piper_sim.simulator import simulate

    assert piper_sim.compile is api_compile and piper_sim.simulate is simulate
    import piper_sim.explore as explore_module  # the module and the top-level name are one object

    assert piper_sim.explore is explore_module and callable(piper_sim.explore)
    assert {"compile", "simulate", "explore"} <= set(dir(piper_sim))
    with pytest.raises(AttributeError):
        piper_sim.nothing  # noqa: B018


def test_results_are_dataframes_and_json_still_works(tmp_path, monkeypatch):
    import pandas as pd

    import piper_sim

    res = piper_sim.simulate(piper_sim.compile(TINY), "unit:F=1,BI=1,BW=1,comm=0", fold=False)
    df = res.per_rank
    assert isinstance(df, pd.DataFrame) and len(df) == 4 == len(res.rank_stats)
    assert list(df["rank"]) == [s.rank for s in res.rank_stats]
    assert {"compute_s", "comm_exposed_s", "idle_s", "bubble_s", "peak_memory_bytes", "represents"} <= set(df)
    assert df["bubble_s"].mean() / res.step_time_s == pytest.approx(res.bubble_fraction)
    d = json.loads(json.dumps(res.to_json()))  # the JSON path
    assert [r["compute_s"] for r in d["per_rank"]] == df["compute_s"].tolist()
    assert isinstance(res.events, pd.DataFrame) and isinstance(res.memory, pd.DataFrame)

    result = piper_sim.explore("gpt-tiny", "cpu:4", 8, 32, workers=1, schedules=["1f1b", "gpipe"],
                               zero_levels=(1,), microbatch_factors=(2,), recompute=(False,))
    table = result.table
    assert isinstance(table, pd.DataFrame) and len(table) == len(result.rows)
    assert table["strategy"].iloc[0] == result.best.candidate.short() and table["status"].iloc[0] == "ok"
    assert {"pp", "schedule", "microbatches", "dp", "zero", "tokens_per_s", "reason"} <= set(table)

    # validation: the measured side stubbed with the simulated trace (a real run is in test_executor)
    from piper_sim.cli import validation

    def fake_measure(plan_path, steps, warmup, trace, timeout_s=900):
        sim = piper_sim.simulate(plan_path, "unit:F=1,BI=1,BW=1,comm=0")
        sim.write_trace(trace)
        return sim.step_time_s * 1.1, []

    monkeypatch.setattr(validation, "measure", fake_measure)
    summary = validation.validate([TINY], "unit:F=1,BI=1,BW=1,comm=0", out_dir=str(tmp_path))
    assert isinstance(summary["table"], pd.DataFrame) and summary["table"]["error_pct"].iloc[0] == pytest.approx(
        100 * (1 / 1.1 - 1))
    on_disk = json.load(open(tmp_path / "validation.json"))
    assert "table" not in on_disk and on_disk["rows"][0]["name"] == summary["table"]["name"].iloc[0]


def test_every_cli_option_has_help():
    from piper_sim.cli import build_parser

    missing = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(sp, path + [name])
            elif not isinstance(a, argparse._HelpAction) and not a.help:
                missing.append((" ".join(path), a.option_strings or a.dest))

    walk(build_parser(), ["piper-sim"])
    assert not missing


@pytest.fixture
def restore_logging():
    import logging

    names = ("piper_sim", "costmodel", "executor")
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).handlers), logging.getLogger(n).propagate)
             for n in names}
    yield
    for n, (level, handlers, propagate) in saved.items():
        logger = logging.getLogger(n)
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.propagate = propagate


def test_version_module_entry_point_and_log_levels(tmp_path, capsys, restore_logging):
    from piper_sim import __version__
    from piper_sim.cli import main

    out = subprocess.run([sys.executable, "-m", "piper_sim", "--version"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0 and out.stdout.strip() == f"piper-sim {__version__}"
    # ZeRO on a data-parallel degree of 1 warns; -qq silences warnings, -v adds debug lines
    s = dict(TINY, directives=[{"op": "pipeline", "degree": 4}, {"op": "data_parallel", "degree": 1, "zero": 1}])
    path = tmp_path / "s.json"
    path.write_text(json.dumps(s))
    plan = str(tmp_path / "p.json")

    def cli(*argv: str) -> subprocess.CompletedProcess:  # a subprocess: pytest records warnings in-process
        return subprocess.run([sys.executable, "-m", "piper_sim", *argv], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": ROOT})

    out = cli("compile", str(path), "-o", plan)
    assert out.returncode == 0 and "piper-sim: warning: replicate: zero=1" in out.stderr
    out = cli("-qq", "compile", str(path), "-o", plan)
    assert out.returncode == 0 and "warning" not in out.stderr
    assert main(["-v", "simulate", plan, "--costmodel", "unit:F=1"]) == 0
    err = capsys.readouterr().err
    assert "piper-sim: debug: simulated" in err
    assert main(["simulate", plan, "--costmodel", "unit:F=1"]) == 0
    cap = capsys.readouterr()
    assert "debug" not in cap.err and "step 21 units" in cap.out
    assert main(["-qq", "compile", str(tmp_path / "missing.json")]) == 2  # errors are always shown
    assert "piper-sim: error:" in capsys.readouterr().err


def test_readme_notebook_api(tmp_path, monkeypatch):
    """The README's notebook snippet runs on the README's strategy and gives a DataFrame and a Figure."""
    import re

    import pandas as pd
    from matplotlib.figure import Figure

    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("## In a notebook", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 6
    strategy = re.search(r"## A strategy\s*```json\n(.*?)```", text, re.S).group(1)
    (tmp_path / "strategy.json").write_text(strategy)
    monkeypatch.chdir(tmp_path)
    env: dict = {}
    exec(code, env)  # noqa: S102 - the README's own code
    assert isinstance(env["res"].per_rank, pd.DataFrame) and len(env["res"].per_rank) > 0
    assert isinstance(env["fig"], Figure)
