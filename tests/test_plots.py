"""Notebook-friendly pictures: ax=, a returned Figure, no backend switch, units, DualPipe
chunks and overlapped pairs, memory from zero in GB."""

from __future__ import annotations

import pathlib

import pytest

from piper_sim import trace
from piper_sim.api import compile
from piper_sim.simulator import simulate

ROOT = pathlib.Path(__file__).resolve().parents[1]
UNIT = "unit:F=1,BI=1,BW=1,comm=0"
CALIBRATION = str(ROOT / "traces" / "calibration" / "cpu-2core.json")


def _strategy(schedule: str, pp: int = 4, v: int = 1, m: int = 8, dp: int = 1) -> dict:
    d = [{"op": "pipeline", "degree": pp, "stages_per_rank": v}, {"op": "schedule", "name": schedule}]
    if dp > 1:
        d.append({"op": "data_parallel", "degree": dp, "zero": 1})
    return {"model": "gpt-tiny", "cluster": f"cpu:{pp * dp}", "global_batch": m * dp, "seq_len": 32,
            "microbatches": m, "directives": d}


@pytest.fixture(scope="module")
def runs():
    return {"dualpipev": simulate(compile(_strategy("dualpipev", v=2, m=8)), UNIT),
            "dualpipe": simulate(compile(_strategy("dualpipe", m=8)), UNIT),
            "calibrated": simulate(compile(_strategy("dualpipev", pp=2, v=2, m=4, dp=2)), CALIBRATION)}


def test_library_never_touches_the_backend_and_returns_figures(runs, tmp_path):
    import matplotlib
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    before = matplotlib.get_backend()
    r = runs["calibrated"]
    fig = r.plot_timeline()
    assert isinstance(fig, Figure) and not list(tmp_path.iterdir())  # no path: nothing written
    assert isinstance(r.plot_memory(), Figure)
    own = Figure(figsize=(8, 6))
    ax1, ax2 = own.subplots(2, 1)
    assert r.plot_timeline(ax=ax1) is own and r.plot_memory(ax=ax2) is own  # drawn into the caller's axes
    assert isinstance(ax1, Axes) and ax1.collections and ax2.lines
    path = tmp_path / "t.png"
    assert r.plot_timeline(str(path), title="t") is not None and path.read_bytes()[:4] == b"\x89PNG"
    assert matplotlib.get_backend() == before
    for f in list((ROOT / "piper_sim").rglob("*.py")) + list((ROOT / "executor").rglob("*.py")):
        assert "matplotlib.use(" not in f.read_text(), f  # only MPLBACKEND in the CLI's main
        assert "pyplot" not in f.read_text() or f.name == "trace.py", f


def test_time_axis_units(runs):
    unit = runs["dualpipev"].plot_timeline().axes[0]
    assert unit.get_xlabel() == "time (cost-model units)"
    assert unit.get_xlim()[1] == pytest.approx(runs["dualpipev"].step_time_s)
    cal = runs["calibrated"]
    ax = cal.plot_timeline().axes[0]
    assert ax.get_xlabel() == "time (ms)" and ax.get_xlim()[1] == pytest.approx(cal.step_time_s * 1e3)
    assert runs["dualpipev"].plot_memory().axes[-1].get_xlabel() == "time (cost-model units)"


def test_dualpipev_chunks_shaded_and_pairs_framed(runs):
    from matplotlib.colors import to_hex
    from matplotlib.patches import Rectangle

    r = runs["dualpipev"]
    ev = r.events
    comp = ev[ev["kind"].isin(["F", "B", "BI", "BW"])]
    chunks = dict(zip(zip(comp["rank"], comp["op_id"]), trace.chunk_of(comp)))
    for (rank, op), ch in chunks.items():
        stage = int(op.split(".")[1][1:])
        assert ch == (0 if stage == rank else 1)  # V: rank r holds stage r (down) and 2P-1-r (up)
    ax = r.plot_timeline().axes[0]
    faces = {to_hex(c) for coll in ax.collections for c in coll.get_facecolors()}
    assert trace.KIND_COLORS["F"] in faces and trace._shade(trace.KIND_COLORS["F"], 1) in faces
    frames = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_linewidth() >= 1.5]
    pairs = ev[ev["pair"] >= 0].groupby(["rank", "pair"]).ngroups
    assert pairs > 0 and len(frames) == pairs
    for (rank, slot), g in ev[ev["pair"] >= 0].groupby(["rank", "pair"]):
        assert set(g["kind"]) == {"F", "B"} and g["mb"].nunique() == 2  # one F and one B, two micro-batches
    labels = [t.get_text() for t in r.plot_timeline().legends[0].get_texts()]
    assert "second chunk (darker)" in labels and "overlapped F&B pair" in labels


def test_dualpipe_reverse_direction(runs):
    ev = runs["dualpipe"].events
    comp = ev[ev["kind"].isin(["F", "B", "BI", "BW"])]
    for (rank, mb), ch in zip(zip(comp["rank"], comp["mb"]), trace.chunk_of(comp)):
        assert ch == int(mb >= 4)  # micro-batches 4..7 enter at the last rank
    labels = [t.get_text() for t in runs["dualpipe"].plot_timeline().legends[0].get_texts()]
    assert "reverse direction (darker)" in labels


def test_memory_plot_zero_based_gb_with_dips(runs):
    r = runs["calibrated"]
    fig = r.plot_memory()
    axes = fig.axes
    assert len(axes) == len(r.shown_ranks())  # one panel per rank
    for ax, s in zip(axes, r.rank_stats):
        assert ax.get_ylim()[0] == 0 and "GB" in ax.get_ylabel()
        (line,) = ax.lines
        x, y = line.get_data()
        assert max(y) == pytest.approx(s.peak_memory_bytes / 1e9)  # GB, not GiB
        assert x[-1] == pytest.approx(r.step_time_s * 1e3)  # to the end of the step
        ups = [b > a for a, b in zip(y, y[1:]) if a != b]
        assert any(not u for u in ups[: len(ups) // 2 + 1])  # a dip before the peak plateau ends
