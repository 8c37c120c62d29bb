"""`piper-sim compare PLAN --trace DIR` (piper_sim.measured, piper_sim.trace_compare): real
torch.profiler traces mapped onto plan ops and reported against the simulation. Traces of a
plain PyTorch CPU training loop (annotated with record_function(op_id), and un-annotated: the
fallback by order; slow: a 2-process gloo data-parallel loop), of the executor (one 2-rank gloo
run: --profile and --kineto), simulated Kineto-shaped traces, and a public trace from
HolisticTraceAnalysis's test data (tests/data/public_traces, MIT)."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

import piper_sim
from piper_sim.cli.commands import main
from piper_sim.measured import comm_kind, read_rank_traces
from piper_sim.trace_compare import compare_traces

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "data"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from user_models import residual_mlp  # noqa: E402

PUBLIC = os.path.join(ROOT, "tests", "data", "public_traces", "hta_mi250_minitoy_train")
M, MBS, SEQ = 2, 2, 8  # the shapes tests/test_user_model.py profiles (a warm cache in the suite)
LOOP = {"model": f"py:{os.path.join(ROOT, 'tests', 'data', 'user_models.py')}:residual_mlp", "cluster": "cpu:1",
        "global_batch": M * MBS, "seq_len": SEQ, "microbatches": M, "dtype": "fp32", "directives": []}
PLAN_OPS = ["F.s0.mb0", "B.s0.mb0", "F.s0.mb1", "B.s0.mb1", "OPT.s0"]  # the plan's order (asserted below)

pytestmark = pytest.mark.filterwarnings("ignore")


def train_loop(path: str, annotate: bool, steps: int = 3, scopes: bool = False) -> None:
    """A plain PyTorch training loop (not the executor): the residual MLP, M micro-batches of
    gradient accumulation, AdamW, profiled on CPU. With ``annotate`` every plan op is a
    record_function(op_id) range (the convention) and a profiler schedule makes ProfilerStep
    ranges; without, nothing marks the ops or the steps (the fallback by order), or with
    ``scopes`` only ranges that name no op (``## forward ##``, ``## backward ##``...)."""
    torch.manual_seed(0)
    um = residual_mlp()
    model, loss_fn = um.module, um.loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [um.example_batch(MBS, SEQ, "cpu", torch.float32, k) for k in range(M)]
    names = {"F": "## forward ##", "B": "## backward ##", "O": "## optimizer ##"}
    rf = record_function if annotate else (lambda name: record_function(names[name[0]]) if scopes
                                           else contextlib.nullcontext())
    # annotated: a schedule, the trace written when its active steps end (as tensorboard_trace_handler does)
    sched = schedule(wait=0, warmup=1, active=steps - 1) if annotate else None
    ready = (lambda p: p.export_chrome_trace(path)) if annotate else None
    with profile(activities=[ProfilerActivity.CPU], schedule=sched, on_trace_ready=ready) as prof:
        for _ in range(steps):
            for k, (x, y) in enumerate(batches):
                with rf(f"F.s0.mb{k}"):
                    loss = loss_fn(model(x), y) / M
                with rf(f"B.s0.mb{k}"):
                    loss.backward()
            with rf("OPT.s0"):
                opt.step()
                opt.zero_grad()
            prof.step()
    if not annotate:
        prof.export_chrome_trace(path)


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    base = tmp_path_factory.mktemp("loop")
    plan = piper_sim.compile(LOOP)
    plan_path = str(base / "loop.plan.json")
    plan.save(plan_path)
    for name, annotate, scopes in (("annotated", True, False), ("plain", False, False), ("scoped", False, True)):
        os.makedirs(base / name)
        train_loop(str(base / name / "rank0.pt.trace.json"), annotate, steps=2 if scopes else 3, scopes=scopes)
    return plan, plan_path, base


def test_plain_loop_annotated_maps_every_op_and_reports_errors(loop, capsys):
    plan, plan_path, base = loop
    assert [i.id for i in plan.program(0).streams["compute"]] == PLAN_OPS
    c = compare_traces(plan, str(base / "annotated"))
    (m,) = c.mappings
    assert m.mapping == "annotation" and m.step in (1, 2) and len(m.ops) == 5
    ops = c.ops.set_index("op_id")
    assert list(c.ops["op_id"]) == PLAN_OPS and (ops["mapping"] == "annotation").all()
    assert (ops["measured_s"] > 0).all() and (ops["simulated_s"] > 0).all()
    assert ops["error_pct"].notna().all() and ops["ratio"].notna().all()
    # measured = the record_function range of that op in the chosen ProfilerStep, read here independently
    data = json.load(open(base / "annotated" / "rank0.pt.trace.json"))
    ua = [e for e in data["traceEvents"] if e.get("cat") == "user_annotation"]
    (stp,) = [e for e in ua if e["name"] == f"ProfilerStep#{m.step}"]
    for op in PLAN_OPS:
        (e,) = [e for e in ua if e["name"] == op and stp["ts"] <= e["ts"] <= stp["ts"] + stp["dur"]]
        assert ops.loc[op, "measured_s"] == pytest.approx(e["dur"] / 1e6, rel=1e-6, abs=1e-9)
    cat = c.categories.set_index("category")
    assert cat.loc["forward", "measured_s"] == pytest.approx(ops.loc[["F.s0.mb0", "F.s0.mb1"], "measured_s"].sum())
    assert cat.loc["backward", "ops_matched"] == 2 and cat.loc["optimizer", "ops_planned"] == 1
    # CPU only, no comm: the step is the ops plus the idle between them
    assert cat.loc["exposed comm", "measured_s"] == 0
    assert cat.loc["step", "measured_s"] == pytest.approx(ops["measured_s"].sum() + cat.loc["idle", "measured_s"])
    assert c.gaps and c.gaps[0].startswith("rank 0 ")
    # the command line: text, --csv and --json written
    out_csv, out_json = base / "ops.csv", base / "report.json"
    assert main(["compare", plan_path, "--trace", str(base / "annotated"), "--csv", str(out_csv),
                 "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "rank 0: mapped by annotation, 5 of 5 plan ops in ProfilerStep#" in text and "biggest gaps:" in text
    rep = json.load(open(out_json))
    assert rep["matched_ops"] == 5 and [r["op_id"] for r in rep["ops"]] == PLAN_OPS
    assert open(out_csv).readline().startswith("rank,op_id,kind,category,mapping,measured_s,simulated_s")


def test_plain_loop_without_annotations_maps_by_order(loop):
    plan, _, base = loop
    c = compare_traces(plan, str(base / "plain"))
    (m,) = c.mappings
    # no ProfilerStep ranges: the trace is cut after each Optimizer.step; the last of the 3 steps wins a tie
    assert m.mapping == "order" and m.step is None and (m.window, m.windows) == (2, 3)
    assert "step 3 of 3" in m.describe_step() and not m.unmatched_phases
    ops = c.ops.set_index("op_id")
    assert (ops["mapping"] == "order").all() and (ops["measured_s"] > 0).all()
    starts = [ops.loc[op, "measured_start_s"] for op in PLAN_OPS]
    assert starts == sorted(starts)  # F0 B0 F1 B1 OPT, in the loop's order
    assert ops.loc["B.s0.mb0", "trace_name"].startswith("autograd::engine::evaluate_function")
    assert ops.loc["OPT.s0", "trace_name"] == "Optimizer.step#AdamW.step"
    # the annotated and plain loops ran the same work: backward phases are the bulk of both
    assert ops.loc[["B.s0.mb0", "B.s0.mb1"], "measured_s"].sum() > 0


def test_scope_ranges_around_phases_are_looked_into(loop):
    """``## backward ##`` around loss.backward() holds autograd's ranges: backward, not forward;
    ``## optimizer ##`` holds Optimizer.step."""
    plan, _, base = loop
    c = compare_traces(plan, str(base / "scoped"))
    (m,) = c.mappings
    assert m.mapping == "order" and len(m.ops) == 5 and not m.unmatched_phases
    ops = c.ops.set_index("op_id")
    assert ops.loc["F.s0.mb0", "trace_name"] == "## forward ##"
    assert ops.loc["B.s0.mb1", "trace_name"].startswith("autograd::engine::evaluate_function")
    assert ops.loc["OPT.s0", "trace_name"] == "Optimizer.step#AdamW.step"
    starts = [ops.loc[op, "measured_start_s"] for op in PLAN_OPS]
    assert starts == sorted(starts)


def test_executor_traces_profile_and_kineto(tmp_path):
    """One 2-rank gloo run of a pp2 1F1B plan with --profile (real torch.profiler traces, a
    record_function per plan op) and --kineto (the executor's events in Kineto's shape)."""
    from test_executor import save_plan, strategy, torchrun

    from piper_sim.kineto import read_kineto_traces

    plan = save_plan(tmp_path, "pp2", strategy(pp=2, sched="1f1b", m=2))
    prof, kin = tmp_path / "prof", tmp_path / "kineto"
    r = torchrun(2, [plan, "--steps", "2", "--profile", str(prof), "--kineto", str(kin)])
    assert r.returncode == 0, r.stderr[-3000:]
    from piper_sim.plan import Plan

    p = Plan.load(plan)
    n_ops = {r_: sum(len(v) for v in p.program(r_).streams.values()) for r_ in (0, 1)}
    for d in (prof, kin):
        c = compare_traces(plan, str(d))
        assert [m.mapping for m in c.mappings] == ["annotation", "annotation"]
        assert [m.step for m in c.mappings] == [1, 1]  # both steps hold every op: the later one
        assert [len(m.ops) for m in c.mappings] == [n_ops[0], n_ops[1]] and c.ops["measured_s"].notna().all()
        comp = c.ops[c.ops["kind"].isin(["F", "B", "OPT"])]
        assert (comp["measured_s"] > 0).all() and comp["error_pct"].notna().all()
        cats = set(c.categories["category"])
        assert {"forward", "backward", "optimizer", "comm send", "comm recv", "exposed comm", "idle"} <= cats
    # the Kineto-shaped traces carry the executor's own op times: compare measures exactly those
    events = read_kineto_traces(str(kin)).set_index(["rank", "op_id"])
    for row in c.ops.itertuples(index=False):
        ev = events.loc[(row.rank, row.op_id)]
        assert row.measured_s == pytest.approx(ev["end"] - ev["start"], abs=2e-9)


def test_public_trace_from_another_project(capsys, tmp_path):
    """HolisticTraceAnalysis's MI250 toy training trace: GPU kernels on their own device, backward on
    autograd's thread, no distributedInfo (rank 0 by order), two ProfilerStep ranges."""
    (t,) = read_rank_traces(PUBLIC)
    assert t.rank == 0 and t.rank_from == "order" and len(t.device) > 10
    plan = piper_sim.compile({"model": "gpt-tiny", "cluster": "cpu:1", "global_batch": 1, "seq_len": 16,
                              "microbatches": 1, "dtype": "fp32", "directives": []})
    c = compare_traces(plan, PUBLIC)
    (m,) = c.mappings
    assert m.mapping == "order" and m.step == 1 and len(m.ops) == 3  # ProfilerStep#2 is only the profiler's stop
    ops = c.ops.set_index("op_id")
    assert ops["device_s"].notna().all()  # the measured times are the ops' kernels, found by correlation id
    assert ops.loc["OPT.s0", "trace_name"] == "Optimizer.step#SGD.step"
    cat = c.categories.set_index("category")
    compute = cat.loc[["forward", "backward", "optimizer"], "measured_s"]
    assert (compute > 0).all() and compute.sum() <= cat.loc["step", "measured_s"]
    assert cat.loc["step", "measured_s"] == pytest.approx(9288.291e-6, rel=1e-6)  # ProfilerStep#1's range
    # a plan with two micro-batches: the trace's one forward/backward maps to the first, the rest is reported
    plan_path = str(tmp_path / "m2.plan.json")
    piper_sim.compile({"model": "gpt-tiny", "cluster": "cpu:1", "global_batch": 2, "seq_len": 16,
                       "microbatches": 2, "dtype": "fp32", "directives": []}).save(plan_path)
    assert main(["compare", plan_path, "--trace", PUBLIC]) == 0
    out = capsys.readouterr().out
    assert "rank 0: mapped by order, 3 of 5 plan ops in ProfilerStep#1" in out
    assert "2 plan ops not found in the traces" in out


def test_torch_pipelining_ranges_map_onto_plan_ops(loop, tmp_path):
    """torch.distributed.pipelining's own ranges (a single-stage GPipe: ``Forward k`` /
    ``Backward k``; the multi-stage schedules' ``PP:<action>``) are plan ops; the optimizer,
    which it leaves unannotated, is torch's Optimizer.step range."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from piper_sim.measured import op_id_of

    plan, _, _ = loop
    um = residual_mlp()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        sched = ScheduleGPipe(PipelineStage(um.module, 0, 1, torch.device("cpu")), n_microbatches=M, loss_fn=um.loss)
        x, y = um.example_batch(M * MBS, SEQ, "cpu", torch.float32, 0)
        opt = torch.optim.AdamW(um.module.parameters())
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                sched.step(x, target=y)
                opt.step()
                opt.zero_grad()
    finally:
        dist.destroy_process_group()
    os.makedirs(tmp_path / "pp")
    prof.export_chrome_trace(str(tmp_path / "pp" / "rank0.pt.trace.json"))
    c = compare_traces(plan, str(tmp_path / "pp"))
    assert c.mappings[0].mapping == "annotation" and len(c.mappings[0].ops) == 5
    ops = c.ops.set_index("op_id")
    assert ops.loc["F.s0.mb1", "trace_name"] == "Forward 1" and ops.loc["B.s0.mb0", "trace_name"] == "Backward 0"
    assert ops.loc["OPT.s0", "mapping"] == "order" and (ops["measured_s"] > 0).all()
    # GPipe runs both forwards first: the measured order is the schedule's, not the plan's 1F1B
    assert ops.loc["F.s0.mb1", "measured_start_s"] < ops.loc["B.s0.mb0", "measured_start_s"]
    assert [op_id_of(n) for n in ("PP:1F3", "PP:0I2", "PP:0W2", "PP:1RECV_F0", "PP:0RECV_B1", "PP:1SEND_B1")] == \
        ["F.s1.mb3", "BI.s0.mb2", "BW.s0.mb2", "RECV.F.s0.mb0", "RECV.B.s1.mb1", "SEND.B.s1.mb1"]
    assert op_id_of("Forward 3") is None and op_id_of("Forward 3", [2]) == "F.s2.mb3"


def _dp_worker(rank: int, out: str, init: str) -> None:
    """A plain PyTorch data-parallel loop (no DDP, no executor): two micro-batches, then one
    gloo all-reduce per unit's gradients from the model's end (the plan's buckets), AdamW;
    profiled on CPU without annotations."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    um = residual_mlp()
    model = um.module
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    units = [model.stem, *model.blocks, model.head]
    batches = [um.example_batch(MBS, SEQ, "cpu", torch.float32, M * rank + k) for k in range(M)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            for x, y in batches:
                (um.loss(model(x), y) / M).backward()
            for u in reversed(units):
                flat = torch.cat([p.grad.flatten() for p in u.parameters()])
                dist.all_reduce(flat)
                torch.nn.utils.vector_to_parameters(flat / 2, [p.grad for p in u.parameters()])
            opt.step()
            opt.zero_grad()
    prof.export_chrome_trace(os.path.join(out, f"rank{rank}.pt.trace.json"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_plain_data_parallel_loop_maps_allreduces_by_order(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "dp"
    out.mkdir()
    mp.spawn(_dp_worker, args=(str(out), f"file://{tmp_path}/store"), nprocs=2)
    plan = piper_sim.compile({**LOOP, "cluster": "cpu:2", "global_batch": 2 * M * MBS,
                              "directives": [{"op": "data_parallel", "degree": 2, "zero": 0}]})
    c = compare_traces(plan, str(out))
    assert [(t.rank, t.rank_from) for t in read_rank_traces(str(out))] == [(0, "distributedInfo"),
                                                                          (1, "distributedInfo")]
    assert [(m.mapping, len(m.ops), m.planned) for m in c.mappings] == [("order", 11, 11)] * 2
    ar = c.ops[c.ops["kind"] == "ALLREDUCE"]
    assert len(ar) == 12 and (ar["trace_name"] == "gloo:all_reduce").all() and (ar["measured_s"] > 0).all()
    # the six buckets in the plan's order (from the model's end), each after the last backward
    for rank, sub in c.ops.groupby("rank"):
        last_b = sub.loc[sub["op_id"] == "B.s0.mb1", "measured_start_s"].item()
        starts = sub.loc[sub["kind"] == "ALLREDUCE", "measured_start_s"].tolist()
        assert starts == sorted(starts) and starts[0] > last_b
    assert c.categories.set_index("category").loc["comm allreduce", "ops_matched"] == 12


@pytest.mark.parametrize("case,needle", [
    ("missing", "no such file or folder"),
    ("empty", "no trace files"),
    ("unreadable", "not a readable JSON trace"),
    ("gz-unreadable", "not a readable JSON trace"),
    ("world", "the traces are of a 4-rank run (distributedInfo.world_size) but the plan has 1 rank"),
    ("same-rank", "are both rank 0"),
    ("step", "--step 9: rank 0's trace has no ProfilerStep#9"),
    ("no-ops", "no plan op found in the traces; name each op with torch.profiler.record_function(op_id)"),
    ("nested", "only in subfolders (iteration_10, iteration_20); give one of them"),
])
def test_bad_traces_are_one_line_errors(tmp_path, capsys, case, needle):
    plan_path = str(tmp_path / "p.json")
    piper_sim.compile({"model": "gpt-tiny", "cluster": "cpu:1", "global_batch": 1, "seq_len": 16,
                       "microbatches": 1, "dtype": "fp32", "directives": []}).save(plan_path)
    d = tmp_path / "tr"
    d.mkdir()
    extra: list[str] = []
    if case == "missing":
        d = tmp_path / "nope"
    elif case == "unreadable":
        (d / "rank0.pt.trace.json").write_text('{"traceEvents": [')
    elif case == "gz-unreadable":
        (d / "rank0.pt.trace.json.gz").write_bytes(b"not gzip")
    elif case == "world":
        (d / "rank0.json").write_text(json.dumps({"distributedInfo": {"rank": 0, "world_size": 4},
                                                  "traceEvents": []}))
    elif case == "same-rank":
        for f in ("a.json", "b.json.gz"):
            body = json.dumps({"distributedInfo": {"rank": 0}, "traceEvents": []}).encode()
            (d / f).write_bytes(gzip.compress(body) if f.endswith(".gz") else body)
    elif case == "nested":  # torchtitan writes iteration_N/rank{R}_trace.json
        for it in (10, 20):
            (d / f"iteration_{it}").mkdir()
            (d / f"iteration_{it}" / "rank0_trace.json").write_text(json.dumps({"traceEvents": []}))
    elif case == "no-ops":
        (d / "rank0.json").write_text(json.dumps({"traceEvents": []}))
    elif case == "step":
        (d / "rank0.json").write_text(json.dumps({"traceEvents": []}))
        extra = ["--step", "9"]
    assert main(["compare", plan_path, "--trace", str(d), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and err.startswith("piper-sim: error: ")


def test_comm_names_as_torch_records_them():
    assert comm_kind("nccl:all_reduce") == "ALLREDUCE" and comm_kind("gloo:all_reduce") == "ALLREDUCE"
    assert comm_kind("gloo:send") == "SEND" and comm_kind("nccl:recv") == "RECV"
    assert comm_kind("c10d::_allgather_base_") == "ALL_GATHER"
    assert comm_kind("record_param_comms", {"Collective name": "reduce_scatter_tensor_coalesced"}) == "REDUCE_SCATTER"
    assert comm_kind("ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)") == "SEND"
    assert comm_kind("nccl:all_to_all") == "ALL_TO_ALL"
    assert comm_kind("aten::add_") is None and comm_kind("F.s0.mb0") is None


def test_simulated_kineto_traces_compare_to_themselves(tmp_path):
    """A simulation written as Kineto-shaped traces (every rank: comm kernels named as NCCL's) and
    read back as the measured run: every op, exposed comm and idle match the simulation, and rank 1
    is compared with its rank class's simulated replica (the comparison's simulation is folded)."""
    plan = piper_sim.compile({"model": "gpt-tiny", "cluster": "h100:1x2", "global_batch": 4, "seq_len": 64,
                              "microbatches": 2, "directives": [{"op": "data_parallel", "degree": 2, "zero": 1}]})
    sim = piper_sim.simulate(plan, fold=False)
    sim.write_kineto(str(tmp_path / "k"))
    c = compare_traces(plan, str(tmp_path / "k"))
    assert [m.mapping for m in c.mappings] == ["annotation", "annotation"]
    assert list(c.ranks["simulated_as"]) == [0, 0]  # dp replicas: one class, simulated once
    assert c.ops["measured_s"].notna().all()
    timed = c.ops[c.ops["simulated_s"] > 0]
    assert {"comm reduce_scatter", "comm all_gather"} <= set(timed["category"])
    # the traces keep µs with ns decimals
    assert timed["measured_s"].to_numpy() == pytest.approx(timed["simulated_s"].to_numpy(), abs=2e-9)
    # the host's ProfilerStep starts DEVICE_LEAD_US before the first kernel (a real host leads
    # its GPU): the measured step, and its idle, are that much longer
    from piper_sim.kineto import DEVICE_LEAD_US

    lead = {"step_s": DEVICE_LEAD_US * 1e-6, "idle_s": DEVICE_LEAD_US * 1e-6}
    for col in ("step_s", "compute_s", "exposed_comm_s", "idle_s"):
        want = c.ranks[f"simulated_{col}"].to_numpy() + lead.get(col, 0.0)
        assert c.ranks[f"measured_{col}"].to_numpy() == pytest.approx(want, abs=1e-7), col
