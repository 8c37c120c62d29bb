"""Kineto-shaped traces (piper_sim.kineto): their shape, and HolisticTraceAnalysis on a
simulated and a measured (2-rank gloo run) trace directory; kernel-level traces against the
plan's operator profile, and HTA's temporal, kernel, idle-time, queue-length and critical-path
analyses on them. The HTA tests need the dev extra (``pip install -e ".[dev]"``:
HolisticTraceAnalysis, pandas < 3 for its critical path); they are skipped without it."""

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
        lead = data["otherData"]["device_offset_us"]  # the device starts after the host's first launches
        assert steps[0]["ts"] == 0 and steps[0]["dur"] == pytest.approx(result.step_time_s * 1e6 + lead, abs=1e-3)
        kernels = [e for e in ev if e.get("cat") == "kernel"]
        launches = {e["args"]["correlation"]: e for e in ev if e.get("name") == "cudaLaunchKernel"}
        assert kernels and all(k["args"]["correlation"] in launches for k in kernels)
        assert all(launches[k["args"]["correlation"]]["ts"] < k["ts"] for k in kernels)  # launched before it runs
        assert all(k["args"]["stream"] == k["tid"] > 0 for k in kernels)
        comm = [k for k in kernels if k["args"]["kind"] not in ("F", "B", "BI", "BW", "OPT")]
        names = {k["name"].split("(")[0] for k in comm}
        assert names == {"ncclDevKernel_SendRecv", "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL",
                         "ncclDevKernel_AllGather_RING_LL"}
        assert not any(k["name"].startswith(("F.", "B.")) for k in kernels)  # kernels, not plan ops
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
        for spans in by_thread.values():  # a stack of open slices: each next one nests or follows
            spans.sort(key=lambda s: (s[0], -s[1]))
            open_: list[float] = []
            for s, e in spans:
                while open_ and s >= open_[-1] - 1e-3:
                    open_.pop()
                assert not open_ or e <= open_[-1] + 1e-3
                open_.append(e)
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
    # every kernel is launched before it runs, on this host-bound tiny model too
    assert all(d["queue_length"].min() >= 0 for d in ta.get_queue_length_time_series(ranks=ranks).values())
    _sane(temporal, idle, overlap, result.step_time_s * 1e6, ranks)
    for s in result.per_rank.itertuples():  # HTA's compute time is ours, to its rounding (< 2 µs per kernel)
        row = temporal[temporal["rank"] == s.rank].iloc[0]
        ev = json.load(open(os.path.join(out, f"rank{s.rank}.pt.trace.json")))["traceEvents"]
        n = sum(e.get("cat") == "kernel" and e["args"]["kind"] in ("F", "B", "BI", "BW", "OPT") for e in ev)
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
    assert all(d["queue_length"].min() >= 0 for d in ta.get_queue_length_time_series(ranks=[0, 1]).values())
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


# --- kernel level ---------------------------------------------------------------------------

COMPUTE = ("F", "B", "BI", "BW", "OPT")


def _dense_strategy(layers: int | None = 4, seq: int = 2048, m: int = 4) -> dict:
    """Llama-3-8B (``layers`` of its 32) in PP2 1F1B x DP2 ZeRO-1 on one H100 node: a
    device-bound plan whose ops are real kernels (GEMMs, flash attention, norms...)."""
    model = "llama3-8b"
    if layers is not None:
        import dataclasses

        from piper_sim.sources import register_model, resolve_model

        model = f"llama3-8b-{layers}l"
        register_model(model, dataclasses.replace(resolve_model("llama3-8b"), n_layers=layers))
    return {"model": model, "cluster": "h100:1x4", "global_batch": 2 * m, "seq_len": seq, "microbatches": m,
            "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"},
                           {"op": "data_parallel", "degree": 2, "zero": 1}]}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    result = simulate(compile(_dense_strategy()))
    out = str(tmp_path_factory.mktemp("kineto") / "dense")
    return result, out, result.write_kineto(out)


def _profile_counts(result, rank: int):
    """Kernel name -> launches on ``rank``, from the plan's operator profile tables: each
    compute op that took time runs its table's rows, ``count`` calls each."""
    from collections import Counter

    from piper_sim.kineto_kernels import kernel_name

    plan, ev = result.plan, result.events
    ins = {i.id: i for lst in plan.program(rank).streams.values() for i in lst}
    want: Counter = Counter()
    for op in ev[(ev["rank"] == rank) & ev["kind"].isin(COMPUTE) & (ev["end"] > ev["start"])]["op_id"]:
        for cls, name, _, dtype, count, _, _ in plan.kernels.get(ins[op].kernels, ()):
            want[kernel_name(cls, name, dtype, "hopper")] += count
    return want


def test_kernel_level_trace_follows_the_operator_profile(dense, tmp_path):
    from collections import Counter

    from piper_sim.kineto import QUEUE_DEPTH

    result, out, paths = dense
    ev_all = result.events
    for path in paths:
        data = json.load(open(path))
        rank, lead = data["distributedInfo"]["rank"], data["otherData"]["device_offset_us"]
        ev = data["traceEvents"]
        kernels = [e for e in ev if e.get("cat") == "kernel"]
        compute = [k for k in kernels if k["args"]["kind"] in COMPUTE and k["args"]["kind"] != "OPT"]
        want = _profile_counts(result, rank)
        assert Counter(k["name"] for k in compute) == want and len(want) > 10
        assert any(n.startswith("sm90_xmma_gemm_bf16") for n in want)
        assert any("pytorch_flash::flash_fwd_kernel" in n for n in want)
        # the kernels of an op fill exactly its simulated [start, end]
        by_op = defaultdict(list)
        for k in kernels:
            by_op[k["args"]["op_id"]].append(k)
        sub = ev_all[(ev_all["rank"] == rank) & (ev_all["end"] > ev_all["start"])]
        for op, start, end in zip(sub["op_id"], sub["start"], sub["end"]):
            ks = sorted(by_op[op], key=lambda k: k["ts"])
            assert ks[0]["ts"] == pytest.approx(start * 1e6 + lead, abs=1e-3)
            assert ks[-1]["ts"] + ks[-1]["dur"] == pytest.approx(end * 1e6 + lead, abs=1e-3)
            assert all(a["ts"] + a["dur"] == pytest.approx(b["ts"], abs=2e-3) for a, b in zip(ks, ks[1:]))
        # host: cpu_op -> cudaLaunchKernel -> kernel, each launch inside its cpu op and before its kernel
        ops = {e["args"]["External id"]: e for e in ev if e.get("cat") == "cpu_op"}
        launch = {e["args"]["correlation"]: e for e in ev if e.get("name") == "cudaLaunchKernel"}
        assert {"aten::mm", "aten::_scaled_dot_product_flash_attention", "aten::rms_norm"} <= {
            e["name"] for e in ops.values()}
        for k in kernels:
            r = launch[k["args"]["correlation"]]
            op = ops[r["args"]["External id"]]
            assert op["ts"] <= r["ts"] and r["ts"] + r["dur"] <= op["ts"] + op["dur"] and r["ts"] + 1 <= k["ts"]
        mm = next(e for e in ops.values() if e["name"] == "aten::mm")
        assert len(mm["args"]["Input Dims"]) == 2 and mm["args"]["Input Dims"][0][1] == mm["args"]["Input Dims"][1][0]
        # the host runs ahead of the device, at most QUEUE_DEPTH launches ahead on a stream
        assert max(k["ts"] - launch[k["args"]["correlation"]]["ts"] for k in compute) > 1000
        for sid in {k["tid"] for k in kernels}:
            marks = sorted([(launch[k["args"]["correlation"]]["ts"], 1) for k in kernels if k["tid"] == sid]
                           + [(k["ts"], -1) for k in kernels if k["tid"] == sid])
            depth = 0
            for _, d in marks:
                depth += d
                assert 0 <= depth <= QUEUE_DEPTH
        # a cross-stream dependency: cudaEventRecord after the source's launch, cudaStreamWaitEvent
        # before the waiting op's, and the GPU's Stream Wait Event on the waiting stream
        records = {e["args"]["correlation"]: e for e in ev if e.get("name") == "cudaEventRecord"}
        waits = [e for e in ev if e.get("cat") == "cuda_sync"]
        assert waits and len(records) == len(waits)
        streams = {k["tid"] for k in kernels}
        for w in waits:
            a = w["args"]
            assert a["wait_on_cuda_event_record_corr_id"] in records and a["wait_on_stream"] in streams
            assert a["wait_on_stream"] != a["stream"] == w["tid"]
        names = {e["args"]["op_id"]: e["tid"] for e in kernels}
        assert any(w["tid"] == names["B.s0.mb0"] and a["wait_on_stream"] == names["RECV.B.s1.mb0"]
                   for w in waits for a in [w["args"]]) if rank == 0 else True
    # read back: plan ops, not kernels
    back = read_kineto_traces(out)
    cols = ["rank", "stream", "op_id", "kind", "stage", "mb", "peer"]
    assert back[cols].equals(ev_all[cols])
    assert (back["start"] - ev_all["start"]).abs().max() < 1e-8 and (back["end"] - ev_all["end"]).abs().max() < 1e-8
    assert (back["posted"] < back["start"]).all()  # the host began launching each op before it ran
    # kernels=False: one kernel per op, named by its op id
    ops_level = result.write_kineto(str(tmp_path / "ops"), kernels=False)
    ev0 = json.load(open(ops_level[0]))["traceEvents"]
    k0 = [e for e in ev0 if e.get("cat") == "kernel" and e["args"]["kind"] in ("F", "B")]
    n0 = ((ev_all["rank"] == 0) & ev_all["kind"].isin(["F", "B"]) & (ev_all["end"] > ev_all["start"])).sum()
    assert len(k0) == n0 and all(k["name"] == k["args"]["op_id"] for k in k0)


def _pandas_major() -> int:
    import pandas

    return int(pandas.__version__.split(".")[0])


def _hta_kernel_level(result, out: str, critical_ranks: list[int]) -> None:
    """HTA's temporal, kernel, idle-time, queue-length and critical-path analyses on a
    kernel-level trace directory, each checked against the simulation."""
    from piper_sim.kineto import QUEUE_DEPTH

    ta, temporal, idle, overlap = _hta(out)
    ranks = sorted(result.events["rank"].unique().tolist())
    step_us = result.step_time_s * 1e6
    _sane(temporal, idle, overlap, step_us, ranks)
    # kernel breakdown: every profile kernel, as many times as the profile's rows say
    _, per_kernel = ta.get_gpu_kernel_breakdown(visualize=False, num_kernels=10 ** 6, duration_ratio=1.0)
    for rank in ranks:
        rows = per_kernel[(per_kernel["rank"] == rank) & (per_kernel["kernel_type"] == "COMPUTATION")]
        rows = rows[~rows["name"].str.contains("multi_tensor_apply|Stream Wait Event")]  # the optimizer, syncs
        assert (rows["mean (us)"] > 0).all()
        got = {n: round(s / m) for n, s, m in zip(rows["name"], rows["sum (us)"], rows["mean (us)"])}
        assert got == dict(_profile_counts(result, rank))
    # idle time: compute waits on its dependencies (other), not on the host, which runs ahead
    for rank in ranks:
        assert (idle["idle_time"] >= 0).all()
        comp = idle[(idle["rank"] == rank) & (idle["stream"] == 7)].set_index("idle_category")["idle_time"]
        assert set(comp.index) <= {"host_wait", "kernel_wait", "other"}
        assert comp.get("host_wait", 0) < 0.05 * comp.sum()
    q = ta.get_queue_length_time_series(ranks=ranks)
    assert sorted(q) == ranks
    for d in q.values():
        assert d["queue_length"].min() >= 0 and d["queue_length"].max() <= QUEUE_DEPTH
    if _pandas_major() >= 3:
        pytest.skip("HolisticTraceAnalysis 0.5's critical path calls DataFrame.drop(axis=1, columns=...), which "
                    "pandas 3 refuses; the dev extra pins pandas < 3")
    for rank in critical_ranks:
        cp, ok = ta.critical_path_analysis(rank=rank, annotation="ProfilerStep", instance_id=0)
        assert ok
        nodes = [cp.node_list[n] for n in cp.critical_path_nodes]
        span = nodes[-1].ts - nodes[0].ts
        # the path ends with the rank's last kernel and runs through its last backward and the
        # optimizer step; the last stage's reaches back to its first receive (before it, the
        # peer worked: one rank's trace cannot show that)
        ev = result.events[result.events["rank"] == rank]
        lead = json.load(open(os.path.join(out, f"rank{rank}.pt.trace.json")))["otherData"]["device_offset_us"]
        start, end = ev["start"].min() * 1e6 + lead, ev["end"].max() * 1e6 + lead
        last_b = ev[ev["kind"].isin(["B", "BI"])]["start"].max() * 1e6 + lead
        assert nodes[-1].ts == pytest.approx(end, abs=1) and start - 1 <= nodes[0].ts <= last_b
        if ev["stage"].max() == result.plan.header.num_stages - 1:
            assert nodes[0].ts <= ev[ev["kind"] == "RECV"]["start"].min() * 1e6 + lead + 1
        assert span > 0.5 * (end - start)
        kinds = set(cp.get_critical_path_breakdown()["type"])
        assert {"critical_path_operator", "critical_path_sync_dependency"} <= kinds


def test_hta_analyses_a_kernel_level_trace(dense):
    result, out, _ = dense
    _hta_kernel_level(result, out, critical_ranks=[0, 2])


@pytest.mark.slow
def test_hta_analyses_a_full_llama3_8b_kernel_trace(tmp_path):
    """The whole model (16 layers a stage, ~600 kernels a forward), every rank's critical path."""
    result = simulate(compile(_dense_strategy(layers=None, seq=4096, m=8)))
    paths = result.write_kineto(str(tmp_path))
    assert all(os.path.getsize(p) < 40e6 for p in paths)
    _hta_kernel_level(result, str(tmp_path), critical_ranks=[0, 2])


def test_cli_kineto_ops_writes_one_kernel_per_op(sim, tmp_path, capsys):
    from piper_sim.cli import main

    result, _, _ = sim
    plan = str(tmp_path / "plan.json")
    result.plan.save(plan)
    assert main(["simulate", plan, "--kineto-ops"]) == 2
    assert "--kineto-ops needs --kineto DIR" in capsys.readouterr().err
    assert main(["simulate", plan, "--kineto", str(tmp_path / "k"), "--kineto-ops"]) == 0
    ev = json.load(open(tmp_path / "k" / "rank0.pt.trace.json"))["traceEvents"]
    compute = [e for e in ev if e.get("cat") == "kernel" and e["args"]["kind"] in COMPUTE]
    assert compute and all(k["name"] == k["args"]["op_id"] for k in compute)
    assert not any(e.get("cat") in ("cpu_op", "cuda_sync") for e in ev)


def test_kernel_names_follow_the_stack():
    """The profile rows name the stack's kernels (costmodel.stack); Kineto names them as its
    libraries do: cuDNN / FA3 attention, Inductor's fused norm under torch.compile, Apex's
    without, cuBLAS GEMMs by architecture."""
    from piper_sim.kineto_kernels import cpu_op_name, kernel_name

    assert kernel_name("attn_fwd", "cudnn", "bf16").startswith("cudnn_generated_fort_native_sdpa_sm90_flash_fprop")
    assert "FlashAttnBwdSm90" in kernel_name("attn_bwd", "flash3", "bf16")
    assert cpu_op_name("attn_bwd", "flash") == "aten::_scaled_dot_product_flash_attention_backward"
    assert kernel_name("mem", "rms_norm", "bf16", compiled=True).startswith("triton_red_fused_")
    assert kernel_name("mem", "rms_norm", "bf16").startswith("void cuApplyRMSNorm<c10::BFloat16")
    assert kernel_name("gemm", "mm", "bf16", "ampere").startswith("ampere_bf16_s16816gemm")
    assert kernel_name("gemm", "mm", "bf16", "blackwell").startswith("sm100_xmma_gemm_bf16bf16")
    assert "silu_kernel_cuda<c10::BFloat16>" in kernel_name("mem", "silu", "bf16")
