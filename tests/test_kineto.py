"""Kineto-shaped traces (piper_sim.kineto): their shape, and HolisticTraceAnalysis on a
simulated and a measured (2-rank gloo run) trace directory. The HTA tests need the dev extra
(``pip install -e ".[dev]"``: HolisticTraceAnalysis); they are skipped without it."""

from __future__ import annotations

import glob
import json
import os
import sys
from collections import defaultdict

import pytest

from piper_sim.api import compile
from piper_sim.kineto import read_kineto_traces
from piper_sim.simulator import simulate

sys.path.insert(0, os.path.dirname(__file__))
from test_executor import save_plan, strategy, torchrun  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

# dualpipe with DP ZeRO-1 and EP on two H100 nodes: SendRecv, all-to-all, reduce-scatter and
# all-gather kernels, overlapped F&B pairs; folded, so one file per rank class
MOE = {"model": "moe-tiny", "cluster": "h100:2x8", "global_batch": 32, "seq_len": 64, "microbatches": 4,
       "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "dualpipe"},
                      {"op": "data_parallel", "degree": 8, "zero": 1}, {"op": "expert_parallel", "degree": 4}]}


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    result = simulate(compile(MOE))
    out = str(tmp_path_factory.mktemp("kineto") / "sim")
    return result, out, result.write_kineto(out)


def test_kineto_shape_and_round_trip(sim):
    result, out, paths = sim
    ranks = sorted(result.events["rank"].unique().tolist())
    assert [os.path.basename(p) for p in paths] == [f"rank{r}.pt.trace.json" for r in ranks]
    for path, rank in zip(paths, ranks):
        text = open(path).read()
        assert f'"rank": {rank}' in text.split("traceEvents")[0]  # HTA's regex finds the rank first
        data = json.loads(text)
        assert data["schemaVersion"] == 1
        assert data["distributedInfo"] == {"backend": "nccl", "rank": rank, "world_size": 16}
        ev = data["traceEvents"]
        steps = [e for e in ev if e["name"].startswith("ProfilerStep#")]
        assert len(steps) == 1 and steps[0]["name"] == "ProfilerStep#0"
        assert steps[0]["dur"] == pytest.approx(result.step_time_s * 1e6, abs=1e-3)
        kernels = [e for e in ev if e.get("cat") == "kernel"]
        launches = {e["args"]["correlation"] for e in ev if e.get("name") == "cudaLaunchKernel"}
        assert kernels and all(k["args"]["correlation"] in launches for k in kernels)
        assert all(k["args"]["stream"] == k["tid"] > 0 for k in kernels)
        comm = [k for k in kernels if k["args"]["kind"] not in ("F", "B", "BI", "BW", "OPT")]
        names = {k["name"].split("(")[0] for k in comm}
        assert names == {"ncclDevKernel_SendRecv", "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL",
                         "ncclDevKernel_AllGather_RING_LL"}
        assert all(k["name"] == k["args"]["op_id"] for k in kernels if k not in comm)
        assert {"Collective name", "In msg nelems", "dtype"} <= set(comm[0]["args"])
        # memory: Kineto's [memory] events and a Perfetto counter in GB, both never below zero
        mem = [e for e in ev if e["name"] == "[memory]"]
        counter = [e for e in ev if e["ph"] == "C"]
        assert mem and counter and min(e["args"]["allocated"] for e in counter) >= 0
        assert max(e["args"]["Total Allocated"] for e in mem) == pytest.approx(
            result.rank_stats[ranks.index(rank)].peak_memory_bytes, rel=1e-6)
        by_thread = defaultdict(list)  # Perfetto: slices on one thread nest or are disjoint
        for e in ev:
            if e["ph"] == "X":
                assert e["dur"] >= 0
                by_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
        for spans in by_thread.values():
            spans.sort()
            for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
                assert s1 >= e0 - 1e-3 or e1 <= e0 + 1e-3
    back = read_kineto_traces(out)
    cols = ["rank", "stream", "op_id", "kind", "stage", "mb", "peer"]
    assert back[cols].equals(result.events[cols])
    assert (back["start"] - result.events["start"]).abs().max() < 1e-8
    assert (back["end"] - result.events["end"]).abs().max() < 1e-8


def _hta(trace_dir: str):
    hta = pytest.importorskip("hta.trace_analysis")
    ta = hta.TraceAnalysis(trace_dir=trace_dir)
    temporal = ta.get_temporal_breakdown(visualize=False)
    idle, _ = ta.get_idle_time_breakdown(ranks=ta.t.get_ranks(), visualize=False)
    overlap = ta.get_comm_comp_overlap(visualize=False)
    return ta, temporal, idle, overlap


def _sane(temporal, idle, overlap, step_us: float, ranks: list[int]) -> None:
    assert sorted(temporal["rank"]) == sorted(overlap["rank"]) == ranks
    for _, row in temporal.iterrows():
        assert 0 < row["kernel_time(us)"] <= step_us + 1
        assert 0 <= row["idle_time(us)"] < row["kernel_time(us)"]
        assert 0 < row["compute_time(us)"] <= row["kernel_time(us)"]
        assert row["non_compute_time(us)"] > 0  # comm kernels were recognised as NCCL's
        assert row["idle_time(us)"] + row["compute_time(us)"] + row["non_compute_time(us)"] == pytest.approx(
            row["kernel_time(us)"], abs=1)
    assert overlap["comp_comm_overlap_pctg"].between(0, 100).all()
    assert (idle["idle_time"] >= 0).all() and (idle["idle_time"] < step_us).all()
    assert set(idle["rank"]) == set(ranks)


def test_hta_reads_a_simulated_trace(sim):
    result, out, _ = sim
    ta, temporal, idle, overlap = _hta(out)
    ranks = sorted(result.events["rank"].unique().tolist())
    assert ta.t.get_ranks() == ranks and ta.get_profiler_steps() == [0]
    _sane(temporal, idle, overlap, result.step_time_s * 1e6, ranks)
    ev = result.events
    for s in result.per_rank.itertuples():  # HTA's compute time is ours, to its rounding (< 2 µs per kernel)
        row = temporal[temporal["rank"] == s.rank].iloc[0]
        n = ((ev["rank"] == s.rank) & ev["kind"].isin(["F", "B", "BI", "BW", "OPT"])).sum()
        assert row["compute_time(us)"] == pytest.approx(s.compute_s * 1e6, abs=float(2 * n + 1))


def test_hta_reads_a_measured_trace_and_profile_names_ops(tmp_path):
    pytest.importorskip("hta.trace_analysis")
    plan = save_plan(tmp_path, "pp2", strategy(pp=2, sched="1f1b", m=4))
    kineto, prof = tmp_path / "kineto", tmp_path / "prof"
    r = torchrun(2, [plan, "--steps", "2", "--json", "--kineto", str(kineto), "--profile", str(prof)])
    assert r.returncode == 0, r.stderr[-3000:]
    measured = read_kineto_traces(str(kineto))
    ta, temporal, idle, overlap = _hta(str(kineto))
    assert ta.t.get_ranks() == [0, 1] and ta.get_profiler_steps() == [1]  # the last step
    _sane(temporal, idle, overlap, measured["end"].max() * 1e6, [0, 1])
    # run --profile: torch.profiler traces with ProfilerStep#N and one record_function per plan op
    from piper_sim.plan import Plan

    p = Plan.load(plan)
    for rank in (0, 1):
        (path,) = glob.glob(str(prof / f"rank{rank}.json"))
        data = json.load(open(path))
        assert data["distributedInfo"]["rank"] == rank
        names = [e["name"] for e in data["traceEvents"] if e.get("cat") == "user_annotation"]
        assert {"ProfilerStep#0", "ProfilerStep#1"} <= set(names)
        ops = [i.id for lst in p.program(rank).streams.values() for i in lst]
        assert all(names.count(op) == 2 for op in ops)  # once per step


def test_ops_in_flight_together_get_their_own_lanes(tmp_path):
    """The executor keeps async comms of one plan stream in flight together; Perfetto and HTA
    need each thread / CUDA stream's slices disjoint, so overlapping ones go to extra lanes."""
    from piper_sim import trace

    rows = [(0, "compute", "F.s0.mb0", "F", 0, 0, 0.0, 1e-3, 0.0, 1.0, -1),
            (0, "send.pp1", "SEND.F.s0.mb0", "SEND", 0, 0, 1e-3, 4e-3, 8.0, 0.0, 1),
            (0, "send.pp1", "SEND.F.s0.mb1", "SEND", 0, 1, 2e-3, 3e-3, 8.0, 0.0, 1),  # inside the first
            (0, "send.pp1", "SEND.F.s0.mb2", "SEND", 0, 2, 5e-3, 6e-3, 8.0, 0.0, 1)]
    df = trace.events_to_dataframe(rows)
    assert trace.lanes(df) == [0, 0, 1, 0]
    from piper_sim.kineto import kineto_trace

    ev = kineto_trace(df, 0, world_size=2)["traceEvents"]
    sends = [e for e in ev if e.get("cat") == "kernel" and e["args"]["kind"] == "SEND"]
    assert len({e["tid"] for e in sends}) == 2 and all(e["name"].startswith("ncclDevKernel_SendRecv") for e in sends)
    path = tmp_path / "t.json"
    trace.write_chrome_trace(df, str(path))
    names = [e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"] if e.get("name") == "thread_name"]
    assert names == ["compute", "send.pp1", "send.pp1 #2"]
    assert trace.read_chrome_trace(str(path))[["stream", "op_id"]].equals(df[["stream", "op_id"]])
