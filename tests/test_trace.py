"""Tests for piper_sim.trace: event schema, Chrome trace shape, pictures."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from piper_sim import trace
from piper_sim.api import compile
from piper_sim.simulator import simulate

UNIT = "unit:F=1,BI=1,BW=1,comm=0"


@pytest.fixture(scope="module")
def results():
    """A unit-time dualpipe run (zero-length comm) and an analytic run with expert
    all-to-alls inside overlapped F&B pairs, DP collectives and p2p across nodes."""
    dualpipe = compile({"model": "gpt-tiny", "cluster": "cpu:4", "global_batch": 8, "seq_len": 32, "microbatches": 8,
                        "directives": [{"op": "pipeline", "degree": 4}, {"op": "schedule", "name": "dualpipe"}]})
    moe = compile({"model": "moe-tiny", "cluster": "h100:2x8", "global_batch": 32, "seq_len": 64, "microbatches": 4,
                   "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "dualpipe"},
                                  {"op": "data_parallel", "degree": 8, "zero": 1},
                                  {"op": "expert_parallel", "degree": 4}]})
    return {"unit-dualpipe": simulate(dualpipe, UNIT), "analytic-moe": simulate(moe, fold=False)}


@pytest.mark.parametrize("name", ["unit-dualpipe", "analytic-moe"])
def test_chrome_trace_shape(results, name, tmp_path):
    result = results[name]
    path = tmp_path / "trace.json"
    trace.write_chrome_trace(result.events, str(path))
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    ranks = set(result.events["rank"])
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in ranks}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(threads.values()) == set(result.events["stream"])

    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == len(result.events)
    by_thread = defaultdict(list)
    for e in slices:
        assert e["dur"] >= 0 and e["ts"] >= 0 and (e["pid"], e["tid"]) in threads
        by_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():  # Perfetto needs nested or disjoint slices per thread
        spans.sort()
        for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
            assert s1 >= e0 - 1e-3 or e1 <= e0 + 1e-3, f"partial overlap {s0, e0} / {s1, e1}"

    starts = [e for e in events if e["ph"] == "s"]
    ends = [e for e in events if e["ph"] == "f"]
    n_send = sum(1 for e in slices if e["args"]["kind"] == "SEND")
    assert n_send == sum(1 for e in slices if e["args"]["kind"] == "RECV") == len(starts) == len(ends) > 0
    assert sorted(e["id"] for e in starts) == sorted(e["id"] for e in ends) == list(range(len(starts)))
    assert all(e["bp"] == "e" for e in ends)

    def enclosing(flow, kind):
        return [e for e in slices if e["pid"] == flow["pid"] and e["tid"] == flow["tid"]
                and e["args"]["kind"] == kind and e["ts"] <= flow["ts"] <= e["ts"] + e["dur"]]

    for s in starts:
        assert enclosing(s, "SEND")
    for f in ends:
        assert enclosing(f, "RECV")


def test_events_to_dataframe_schema():
    rows = [(0, "compute", "F.s0.mb0", "F", 0, 0, 0.0, 1.0, 10.0, 5.0, -1),
            (0, "send", "SEND.F.s0.mb0", "SEND", 0, 0, 1.0, 1.5, 10.0, 0.0, 1)]
    df = trace.events_to_dataframe(rows)
    assert tuple(df.columns) == trace.EVENT_COLUMNS
    as_dicts = trace.events_to_dataframe([dict(zip(trace.EVENT_COLUMNS, r)) for r in rows])
    assert as_dicts.equals(df)
    with pytest.raises(ValueError, match="lack columns"):
        trace.events_to_dataframe([{"rank": 0}])


def test_pictures(results, tmp_path):
    for name, result in results.items():
        for kind, draw in (("timeline", result.plot_timeline), ("memory", result.plot_memory)):
            path = tmp_path / f"{name}-{kind}.png"
            draw(str(path), title=name)
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_module_stays_light():
    import subprocess
    import sys

    code = ("import sys, piper_sim, piper_sim.plan; "
            "print(sorted(m for m in ('simpy', 'pandas', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_exposed_comm_counts_comm_not_under_compute():
    """Rank 0: an all-reduce 2..5 partly under a backward 0..3, a gather 4..6 overlapping
    it (counted once) and an optimizer 5.5..7: exposed 3..5.5. Rank 1 computes only;
    rank 2 only communicates (two overlapping p2p ops: 1..1.5)."""
    rows = [(0, "B", 0.0, 3.0), (0, "ALLREDUCE", 2.0, 5.0), (0, "ALL_GATHER", 4.0, 6.0), (0, "OPT", 5.5, 7.0),
            (1, "F", 0.0, 1.0), (2, "SEND", 1.0, 1.25), (2, "RECV", 1.0, 1.5)]
    got = trace.exposed_comm(rows)
    assert got == pytest.approx({0: 2.5, 1: 0.0, 2: 0.5})
    assert trace.union_intervals([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]


def test_simulator_exposed_comm_is_the_trace_definition(results):
    """The simulator's per-rank exposed time is `trace.exposed_comm` of its own events."""
    r = results["analytic-moe"]
    ev = r.events
    want = trace.exposed_comm(zip(ev["rank"], ev["kind"], ev["start"], ev["end"]))
    assert {s.rank: s.comm_exposed_s for s in r.rank_stats} == pytest.approx(want)
    assert max(want.values()) > 0


def test_ep_timeline_groups_comm_and_aggregates_all_to_alls(results):
    """Expert parallelism + DualPipe + ZeRO: per rank one compute row, one comm row (send/recv
    and DP collectives, coloured by kind) and one thin all-to-all row whose bursts join."""
    from matplotlib.colors import to_hex

    r = results["analytic-moe"]
    ev = r.events
    fig = r.plot_timeline(ranks=[0, 8])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "comm", "all-to-all",
                                                            "rank 8", "comm", "all-to-all"]
    for rank in (0, 8):
        sub = ev[ev["rank"] == rank]
        a2a = sub[sub["kind"] == "ALL_TO_ALL"]
        (row,) = [c for c in ax.collections if c.get_gid() == f"rank {rank}/all-to-all"]
        spans = [p.vertices[:, 0] for p in row.get_paths()]
        spans = [(min(x), max(x)) for x in spans]
        assert 0 < len(spans) < len(a2a)  # aggregated...
        scale = 1e3  # ms
        for s, e in zip(a2a["start"] * scale, a2a["end"] * scale):  # ...and none dropped
            assert any(lo - 1e-9 <= s and e <= hi + 1e-9 for lo, hi in spans)
        comm = [c for c in ax.collections if c.get_gid() == f"rank {rank}/comm"]  # one per kind
        faces = {to_hex(c.get_facecolors()[0]) for c in comm}
        kinds = set(sub["kind"]) - {"F", "B", "BI", "BW", "OPT", "ALL_TO_ALL"}
        assert faces == {trace.KIND_COLORS[k] for k in kinds} and len(faces) >= 3  # send/recv, RS, AG
        assert sum(len(c.get_paths()) for c in comm) == sub["kind"].isin(kinds).sum()
    legend = {t.get_text() for t in fig.legends[0].get_texts()}
    assert {"send/recv", "reduce-scatter", "all-gather", "all-to-all"} <= legend


def test_mark_lanes_and_aggregation():
    # three overlapping comm ops take three lanes; one after them reuses the first
    assert trace.mark_lanes([0.0, 0.1, 0.2, 5.0], [1.0, 1.0, 1.0, 6.0], min_w=0.05) == [0, 1, 2, 0]
    # zero-length ops still get a width; marks closer than half of it take another lane
    assert trace.mark_lanes([0.0, 0.01], [0.0, 0.01], min_w=0.1) == [0, 1]
    # send/recv above the collectives, each group in its own lanes
    assert trace.comm_lanes(["ALL_GATHER", "SEND", "REDUCE_SCATTER", "RECV"], [0.0, 0.0, 0.5, 3.0],
                            [1.0, 1.0, 1.5, 4.0], min_w=0.05) == [1, 0, 2, 0]
    spans = trace.aggregate_marks([0.0, 0.3, 2.0], [0.2, 0.4, 2.0], min_w=0.1, join=0.15)
    assert spans == [(0.0, 0.4, 2), (2.0, 2.1, 1)]
