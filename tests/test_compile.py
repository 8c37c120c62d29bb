"""Compiler: the strategy matrix, torch's orders, folding, memory, op ids, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from piper_sim.api import compile
from piper_sim.pipelining import compute_order
from piper_sim.compiler import compile_strategy, compile_unfolded
from piper_sim.plan import Plan, PlanError
from piper_sim.schedules import SCHEDULE_TABLE, SCHEDULES
from piper_sim.strategy import StrategyError
from piper_sim.validate import PlanValidationError, validate_plan
from torch_oracle import _torch_schedules

V = {"interleaved_1f1b": 2, "zbv": 2, "dualpipev": 2}


def strategy(model="gpt-tiny", pp=2, sched="1f1b", dp=1, zero=0, m=4, ep=0, v=None, seq=16, **extra):
    d = [{"op": "pipeline", "degree": pp, **({"stages_per_rank": v} if v else {})},
         {"op": "schedule", "name": sched}]
    if dp > 1 or zero:
        d.append({"op": "data_parallel", "degree": dp, "zero": zero})
    if ep:
        d.append({"op": "expert_parallel", "degree": ep})
    return {"model": model, "cluster": f"cpu:{pp * dp}", "global_batch": dp * m, "seq_len": seq,
            "microbatches": m, "directives": d, **extra}


@pytest.mark.parametrize("sched", [s for s in SCHEDULES if not SCHEDULE_TABLE[s].needs_ep])  # dense model
@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.filterwarnings("ignore:replicate")
def test_matrix_gpt_tiny_every_schedule_dp_zero(sched, dp):
    for zero in (0, 1, 2, 3):
        plan = compile(strategy(pp=4, sched=sched, dp=dp, zero=zero, m=8))
        assert plan.world_size == 4 * dp
        kinds = {i.kind for c in plan.classes for i in c.instructions()}
        if dp == 2:
            assert {0: "ALLREDUCE", 1: "REDUCE_SCATTER", 2: "REDUCE_SCATTER", 3: "REDUCE_SCATTER"}[zero] in kinds
            assert ("ALL_GATHER" in kinds) == (zero > 0)


@pytest.mark.parametrize("s", [
    strategy("moe-tiny", pp=1, sched="1f1b", dp=2, ep=2, m=2),
    strategy("moe-tiny", pp=2, sched="1f1b", dp=2, zero=1, ep=2, m=4),
    strategy("moe-tiny", pp=2, sched="dualpipev", dp=2, zero=1, ep=2, m=4),
    strategy("moe-tiny", pp=2, sched="combined_1f1b", dp=2, zero=1, ep=2, m=4),
], ids=["ep2", "pp2-1f1b-dp2-ep2", "pp2-dualpipev-dp2-ep2", "pp2-combined-dp2-ep2"])
def test_matrix_moe_tiny_expert_parallel(s):
    plan = compile(s)
    a2a = [i for c in plan.classes for i in c.instructions() if i.kind == "ALL_TO_ALL"]
    # every MoE layer: dispatch + combine in forward and in backward, per micro-batch
    assert len(a2a) == 4 * 4 * s["microbatches"]
    assert all(i.group == "ep" for i in a2a)
    assert plan.layout.ep == 2


def test_expert_parallel_alone_implies_dp_equals_ep():
    s = strategy("moe-tiny", pp=1, ep=2, m=2)
    s["cluster"], s["global_batch"] = "cpu:2", 4
    assert compile(s).layout.dp == 2


TORCH = [("interleaved_1f1b", "ScheduleInterleaved1F1B"), ("zbv", "ScheduleZBVZeroBubble"),
         ("dualpipev", "ScheduleDualPipeV")]


@pytest.mark.parametrize("name,cls_name", TORCH)
@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 8), (4, 12)])
def test_compute_order_equals_torch_pipeline_order(name, cls_name, pp, m):
    cls = getattr(_torch_schedules(), cls_name)
    plan = compile(strategy(pp=pp, sched=name, m=m, v=2))
    stages = [SimpleNamespace(stage_index=i, num_stages=2 * pp, group_size=pp, group_rank=0, submod=None,
                              is_first=i == 0, is_last=i == 2 * pp - 1) for i in range(2)]
    order = cls(stages, m).pipeline_order
    compute = {"F", "B", "I", "W", "OVERLAP_F_B"}
    for r in range(pp):  # torch's own repr of its actions, idle slots left out: (0F3;3B1)OVERLAP_F_B
        want = " ".join(str(a) for a in order[r] if a is not None and a.computation_type.value in compute)
        assert compute_order(plan, r) == want


def test_1f1b_and_gpipe_textbook_order():
    plan = compile(strategy(pp=4, sched="1f1b", m=8))
    assert compute_order(plan, 3) == " ".join(f"3F{i} 3B{i}" for i in range(8))
    assert compute_order(plan, 0).startswith("0F0 0F1 0F2 0F3 0B0 0F4 0B1")
    plan = compile(strategy(pp=2, sched="gpipe", m=4))
    assert compute_order(plan, 1) == "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3"


def test_dualpipe_two_copies_sum_gradients_and_double_params():
    plan = compile(strategy(pp=4, sched="dualpipe", m=8))
    assert plan.layout.stage_ranks == {0: [0, 3], 1: [1, 2], 2: [1, 2], 3: [0, 3]}
    ar = [i for i in plan.classes[0].instructions() if i.kind == "ALLREDUCE"]
    assert ar and {i.group for i in ar} == {"stage:0", "stage:3"}
    assert plan.program(0).streams["dp"][0].group.startswith("ranks:0,3")
    # rank 0 holds two stages: twice the params of a 1f1b rank
    one = compile(strategy(pp=4, sched="1f1b", m=8)).classes[1].static_memory["params_bytes"]
    two = plan.classes[1].static_memory["params_bytes"]
    assert two == pytest.approx(2 * one)


@pytest.mark.filterwarnings("ignore:replicate")
@pytest.mark.parametrize("s", [
    strategy(pp=2, sched="1f1b", dp=4, zero=3, m=4),
    strategy(pp=4, sched="dualpipe", dp=2, zero=1, m=8),
    strategy(pp=2, sched="zbv", dp=2, zero=2, m=4),
    strategy("moe-tiny", pp=2, sched="dualpipev", dp=4, zero=1, ep=2, m=4),
], ids=["pp2-dp4-z3", "dualpipe-dp2", "zbv-dp2-z2", "moe-dualpipev-dp4-ep2"])
def test_folded_plan_expands_to_the_unfolded_compile(s):
    folded = compile_strategy(s).plan
    unfolded = compile_unfolded(s)
    expanded = folded.expand()
    assert len(expanded) == len(unfolded) == folded.world_size
    for a, b in zip(expanded, unfolded):
        assert a.rank == b.rank and a.streams.keys() == b.streams.keys()
        for name in a.streams:
            assert [i.to_json() for i in a.streams[name]] == [i.to_json() for i in b.streams[name]]
        assert a.static_memory == b.static_memory


def test_zero_model_state_bytes_per_rank():
    psi = None
    for zero, expect in [(0, lambda p, n: 16 * p), (1, lambda p, n: 4 * p + 12 * p / n),
                         (2, lambda p, n: 2 * p + 14 * p / n), (3, lambda p, n: 16 * p / n)]:
        plan = compile(strategy(pp=1, sched="1f1b", dp=4, zero=zero, m=1))
        from piper_sim.models import get_config
        psi = get_config("gpt-tiny").param_count()
        mem = plan.classes[0].static_memory
        assert sum(mem.values()) == pytest.approx(expect(psi, 4))


def test_op_ids_are_stable_and_readable():
    plan = compile(strategy(pp=2, sched="zb1p", dp=2, zero=1, m=4))
    ids = {i.id for i in plan.classes[0].instructions()}
    assert {"F.s0.mb0", "BI.s0.mb3", "BW.s0.mb3", "SEND.F.s0.mb1", "RECV.B.s1.mb2", "RS.s0.b0",
            "AG.s0.b0", "OPT.s0"} <= ids
    again = compile(strategy(pp=2, sched="zb1p", dp=2, zero=1, m=4))
    assert again.content_hash() == plan.content_hash()


@pytest.mark.parametrize("zero", [2, 3])
def test_zero23_reduce_scatter_every_microbatch(zero):
    """ZeRO-2/3 reduce-scatter every bucket once per micro-batch, right after that
    micro-batch's backward (FSDP's default); the optimizer waits for all of them; the
    unsharded gradients live from one micro-batch's backward to its reduce-scatter.
    ``reduce: per_step`` keeps one reduce-scatter per bucket after the last backward."""
    def ops_of(plan, pp=0):
        return {i.id: i for i in plan.classes[pp].instructions()}

    per_mb = ops_of(compile(strategy(pp=2, sched="zb1p", dp=2, zero=zero, m=4)))
    rs = sorted(k for k, i in per_mb.items() if i.kind == "REDUCE_SCATTER")
    buckets = sorted({k.rsplit(".", 1)[1] for k in rs})
    assert rs == sorted(f"RS.s0.mb{m}.{b}" for m in range(4) for b in buckets)
    for m in range(4):
        for b in buckets:
            ins = per_mb[f"RS.s0.mb{m}.{b}"]
            assert ins.mb == m and ins.deps == [f"BW.s0.mb{m}"] and ins.free > 0
    assert {k for k in rs} <= set(per_mb["OPT.s0"].deps)
    # the unsharded gradients are taken by each micro-batch's weight pass, given back by its reduce-scatters
    assert per_mb["BW.s0.mb1"].alloc == pytest.approx(sum(per_mb[f"RS.s0.mb1.{b}"].free for b in buckets))
    s = strategy(pp=2, sched="zb1p", dp=2, zero=zero, m=4)
    s["directives"][-1]["reduce"] = "per_step"
    per_step = ops_of(compile(s))
    assert sorted(k for k, i in per_step.items() if i.kind == "REDUCE_SCATTER") == \
        sorted(f"RS.s0.{b}" for b in buckets)
    assert per_step["RS.s0.b0"].deps == [f"BW.s0.mb{m}" for m in range(4)]
    # DualPipe's two copies of a stage pair their reduce-scatters by the i-th backward here
    dual = compile(strategy(pp=2, sched="dualpipe", dp=2, zero=zero, m=4))
    for c in dual.classes:
        ids = {i.id for i in c.instructions() if i.kind == "REDUCE_SCATTER"}
        assert {"RS.s0.i0.b0", "RS.s0.i1.b0", "RS.s1.i1.b0"} <= ids and not any(".mb" in k for k in ids)
    validate_plan(dual)


def test_reduce_field_errors():
    for zero, reduce, msg in [(1, "per_microbatch", "needs zero 2 or 3"), (3, "sometimes", "must be 'per_microbatch'")]:
        s = strategy(pp=1, dp=2, zero=zero)
        s["directives"][-1]["reduce"] = reduce
        with pytest.raises(StrategyError, match="reduce") as e:
            compile(s)
        assert msg in str(e.value)
    s = strategy(pp=1, dp=2, zero=1)
    s["directives"][-1]["reduce"] = "per_step"  # what ZeRO-0/1 do anyway
    a, b = compile(s), compile(strategy(pp=1, dp=2, zero=1))
    assert a.classes[0].streams == b.classes[0].streams


def test_every_dependency_and_peer_is_consistent_after_json_round_trip(tmp_path):
    plan = compile(strategy("moe-tiny", pp=2, sched="1f1b", dp=2, zero=3, ep=2, m=4))
    path = tmp_path / "plan.json"
    plan.save(str(path))
    back = Plan.load(str(path))
    assert back.content_hash() == plan.content_hash()
    validate_plan(back)


def test_hand_edited_plan_is_refused_and_deadlock_is_named(tmp_path):
    plan = compile(strategy(pp=2, sched="1f1b", m=4))
    d = plan.to_json()
    # swap rank 1's first forward and first backward: B.s1.mb0 before its F
    c1 = d["classes"][1]["streams"]["compute"]
    c1[0], c1[1] = c1[1], c1[0]
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="hash"):
        Plan.load(str(path))
    edited = Plan.load(str(path), check_hash=False)
    with pytest.raises(PlanValidationError, match="deadlock"):
        validate_plan(edited)


def _cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "piper_sim.cli", *args], capture_output=True, text=True)


def _write(tmp_path, data, name="s.json"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(p)


BAD = [
    ({**strategy(), "directives": [{"op": "pipelin", "degree": 2}]}, "unknown op 'pipelin'"),
    ({**strategy(), "directives": [{"op": "pipeline", "degre": 2}]}, "unknown field(s) degre"),
    ("{\"model\": ", "malformed JSON"),
    (strategy(pp=16, sched="1f1b", m=16), "16 stages but model gpt-tiny has only 8 layers"),
    (strategy(pp=3, sched="dualpipe", m=6), "dualpipe"),
    (strategy(pp=4, sched="dualpipe", m=6), "dualpipe"),
    (strategy(pp=4, sched="interleaved_1f1b", m=6, v=2), "multiple of the pipeline degree"),
    ({**strategy("moe-tiny", pp=1, dp=3, ep=3, m=1)}, "does not divide the 4 experts"),
    ({**strategy(pp=2, m=4), "cluster": "cpu:8"}, "needs PP×DP = 2×1 = 2 ranks but cluster cpu:8 has 8"),
    ({**strategy(pp=2, m=4), "model": "gpt-huge"}, "unknown model"),
]


@pytest.mark.parametrize("data,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_one_line_exit_2(tmp_path, capsys, data, message):
    from piper_sim.cli import main

    assert main(["compile", _write(tmp_path, data), "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_bad_input_exit_status_from_the_real_command(tmp_path):
    r = _cli("compile", _write(tmp_path, strategy(pp=4, sched="dualpipe", m=6)))
    assert r.returncode == 2
    assert r.stderr.startswith("piper-sim: error: directive schedule: dualpipe") and "Traceback" not in r.stderr


def test_bad_order_directives(tmp_path):
    s = strategy(pp=2, m=2)
    s["directives"].append({"op": "order", "pp_rank": 1, "slots": ["1F0", "1B0", "1F1"]})
    with pytest.raises(StrategyError, match="stage 1 micro-batch 1"):
        compile(s)
    s["directives"][-1]["slots"] = ["1F0", "1B0", "1F1", "1B1", "1B1"]
    with pytest.raises(StrategyError, match="appears twice"):
        compile(s)
    # rank 0 runs its backwards before rank 1 can produce them, and rank 1 waits: deadlock
    s["directives"][-1]["slots"] = ["1B0", "1F0", "1F1", "1B1"]
    with pytest.raises((StrategyError, PlanValidationError), match="deadlock|wait"):
        compile(s)


def test_zero_on_dp1_warns_not_fails(tmp_path):
    r = _cli("compile", _write(tmp_path, strategy(pp=2, zero=1, m=4)), "-o", str(tmp_path / "p.json"))
    assert r.returncode == 0
    assert "warning: replicate: zero=1 on data-parallel degree 1" in r.stderr


def test_cli_compile_show_models(tmp_path):
    out = str(tmp_path / "p.json")
    assert _cli("compile", _write(tmp_path, strategy(pp=2, sched="dualpipev", m=4)), "-o", out).returncode == 0
    r = _cli("show", out, "--compute-order")
    assert r.returncode == 0
    assert r.stdout.splitlines()[0].startswith("rank 0: 0F0 0F1")
    assert "(" in r.stdout  # dualpipev has overlapped pairs
    r = _cli("show", out)
    assert "compute" in r.stdout and "SEND.F.s0.mb0" in r.stdout
    r = _cli("models")
    assert "deepseek-v3" in r.stdout and "llama3-405b" in r.stdout


def test_bucket_mb_fills_buckets_from_the_models_end():
    """DDP / Megatron-LM order: full buckets from the last layers, the rest in the first
    layers' bucket (reduced last, gathered first); a remainder of a few bytes (a cut at
    byte precision) joins its neighbour instead of costing a collective of its own."""
    from piper_sim.parallel.data import MIN_BUCKET_BYTES, _buckets

    mib = 2**20
    assert _buckets(2.5 * mib, 1, n_units=4) == [0.5 * mib, mib, mib]
    assert _buckets(2 * mib + 8, 1, n_units=4) == [mib + 8, mib]
    assert _buckets(2 * mib + MIN_BUCKET_BYTES, 1, n_units=4) == [MIN_BUCKET_BYTES, mib, mib]
    assert _buckets(3.0, None, n_units=3) == [1.0, 1.0, 1.0]
