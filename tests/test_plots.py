"""Notebook-friendly pictures: ax=, a returned Figure, no backend switch, units, DualPipe
chunks and overlapped pairs, memory from zero in GiB, no event too short to see, labelled
Pareto fronts, short reprs with HTML summaries."""

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


def test_memory_plot_zero_based_gib_with_dips(runs):
    r = runs["calibrated"]
    fig = r.plot_memory()
    axes = fig.axes
    assert len(axes) == len(r.shown_ranks())  # one panel per rank
    for ax, s in zip(axes, r.rank_stats):
        assert ax.get_ylim()[0] == 0 and "GiB" in ax.get_ylabel()
        line = ax.lines[0]  # the step (then the peak's dotted line)
        x, y = line.get_data()
        assert max(y) == pytest.approx(s.peak_memory_bytes / 2**30)  # GiB, as torch reports memory
        assert x[-1] == pytest.approx(r.step_time_s * 1e3)  # to the end of the step
        ups = [b > a for a, b in zip(y, y[1:]) if a != b]
        assert any(not u for u in ups[: len(ups) // 2 + 1])  # a dip before the peak plateau ends


@pytest.fixture(scope="module")
def llama_pp2():
    """The issue's llama3-8b PP2 1F1B step (8 micro-batches), at a short sequence to stay cheap."""
    return simulate(compile({"model": "llama3-8b", "cluster": "h100:1x2", "global_batch": 8, "seq_len": 1024,
                             "microbatches": 8,
                             "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"}]}))


def _marks(ax, gid_prefix: str) -> list:
    """The drawn block outlines (one path per mark) of the collections whose gid starts so."""
    return [p for c in ax.collections if (c.get_gid() or "").startswith(gid_prefix) for p in c.get_paths()]


def test_every_llama3_8b_pp2_event_is_a_visible_mark(llama_pp2, tmp_path):
    """The issue's case: rank 0's 16 send/recv (92 µs each in a ~1 s step) drew as ~5 marks."""
    import numpy as np
    from matplotlib.colors import to_rgb
    from matplotlib.image import imread

    r = llama_pp2
    ev = r.events
    path = tmp_path / "t.png"
    dpi = 130
    fig = r.plot_timeline(str(path), dpi=dpi)
    ax = fig.axes[0]
    to_px = ax.transData.transform
    for rank in (0, 1):
        sub = ev[ev["rank"] == rank]
        marks = _marks(ax, f"rank {rank}/")
        assert len(marks) == len(sub)  # each event its own mark
        widths = [np.ptp(to_px(p.vertices)[:, 0]) * dpi / fig.dpi for p in marks]
        assert min(widths) >= trace.MIN_MARK_PX - 1e-6
        assert len(_marks(ax, f"rank {rank}/comm")) == sub["kind"].isin(["SEND", "RECV"]).sum() == 16
    # ...and in the PNG: the red send/recv runs along the middle of rank 0's comm row
    img = imread(str(path))[:, :, :3]
    y = ax.get_yticks()[list(t.get_text() for t in ax.get_yticklabels()).index("comm")]
    row = int(round(img.shape[0] - to_px((0, y))[1] * dpi / fig.dpi))
    red = np.all(np.abs(img[row] - np.array(to_rgb(trace.KIND_COLORS["SEND"]))) < 0.08, axis=1)
    runs = int(red[0]) + int(np.sum(red[1:] & ~red[:-1]))
    assert runs == 16


def test_memory_over_time_in_gib_with_its_peak(llama_pp2):
    r = llama_pp2
    fig = r.plot_memory()
    gib = 2**30
    for ax, s in zip(fig.axes, r.rank_stats):
        assert "GiB" in ax.get_ylabel() and ax.get_ylim()[0] == 0
        step = ax.lines[0]
        x, y = step.get_data()
        assert max(y) == pytest.approx(s.peak_memory_bytes / gib)  # GiB, torch's unit
        assert y[0] == pytest.approx((s.params_bytes + s.grads_bytes + s.optimizer_bytes) / gib)  # static base
        assert len(x) == len(set(r.memory[r.memory["rank"] == s.rank]["time"])) + 2  # every change, 0 and t_end
        assert any(t.get_text() == f"peak {s.peak_memory_bytes / gib:.1f} GiB" for t in ax.texts)
    for ax, s in zip(r.plot_memory(states=False).axes, r.rank_stats):  # the activations alone
        assert max(ax.lines[0].get_data()[1]) == pytest.approx(s.activations_bytes / gib)


def test_pareto_front_points_labelled_without_overlap():
    from piper_sim.explore import explore, pareto_front, plot_pareto

    r = explore("llama3-8b", "h100:1x4", 16, 2048, workers=1, zero_levels=(1,), microbatch_factors=(2,),
                recompute=(False,), tp_degrees=(1,))
    front = pareto_front(r.ok)
    assert len(front) >= 3
    ax = plot_pareto(r).axes[0]
    texts = [t for t in ax.texts if t.get_text()]
    assert sorted(t.get_text() for t in texts) == sorted(f.candidate.short() for f in front)
    boxes = [t.get_window_extent() for t in texts]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert any(t.get_text().startswith("best: ") for t in ax.get_legend().get_texts())


def test_plan_and_result_reprs_are_short_with_an_html_summary():
    plan = compile({"model": "llama3-8b", "cluster": "h100:8x8", "global_batch": 128, "seq_len": 4096,
                    "microbatches": 8,
                    "directives": [{"op": "pipeline", "degree": 4}, {"op": "schedule", "name": "1f1b"},
                                   {"op": "data_parallel", "degree": 16, "zero": 1}]})
    text = repr(plan)
    assert plan.world_size == 64 and len(text) < 2000 and "\n" not in text
    for fact in ("llama3-8b", "world 64", "schedule 1f1b", "pp4 dp16", "zero 1", "micro-batches 8"):
        assert fact in text, fact
    ops = sum(len(lst) for c in plan.classes for lst in c.streams.values())
    assert f"instructions {ops:,}" in text
    html = plan._repr_html_()
    assert html.startswith("<table") and "llama3-8b" in html and "pp4 dp16" in html and len(html) < 4000
    r = simulate(plan)
    text = repr(r)
    assert len(text) < 2000 and "\n" not in text
    assert f"tokens/s {r.tokens_per_s:,.0f}" in text and f"MFU {r.mfu:.1%}" in text
    assert f"memory {r.memory_verdict} (" in text and r.memory_verdict in ("fits", "tight", "oom")
    html = r._repr_html_()
    assert "<table" in html and f"{r.tokens_per_s:,.0f}" in html and r.memory_verdict in html
