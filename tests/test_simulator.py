"""Tests for piper_sim.simulator: published bubble/memory formulas, ZeRO model states,
collective costs, link sharing, deadlocks, folding, results and the CLI."""

from __future__ import annotations

import json
import os
import math

import pytest

from costmodel import UnitCostModel, get_costmodel, parse_cluster
from costmodel.calibration import check_calibration
from costmodel.model import AnalyticCostModel
from piper_sim.api import compile
from piper_sim.models import get_config
from piper_sim.plan import Instruction, Layout, Plan, RankClass
from piper_sim.simulator import SimulationDeadlock, SimulationError, fold_is_exact, simulate

UNIT = "unit:F=1,BI=1,BW=1,comm=0"
F, BI, BW = 1.0, 1.0, 1.0
B = BI + BW  # full backward
FB = F + B  # an overlapped F&B pair with comm=0 and no expert pieces


def tiny(schedule: str, pp: int, m: int, **pipe) -> Plan:
    return compile({"model": "gpt-tiny", "cluster": f"cpu:{pp}", "global_batch": m, "seq_len": 32,
                    "microbatches": m, "directives": [{"op": "pipeline", "degree": pp, **pipe},
                                                      {"op": "schedule", "name": schedule}]})


def hand_plan(streams: list[dict[str, list[Instruction]]], dp: int = 1, cluster: str = "h100:1x8",
              static: dict | None = None) -> Plan:
    """One class per entry of `streams` (pipeline ranks), `dp` replicas each."""
    pp = len(streams)
    layout = Layout(pp=pp, dp=dp, stage_ranks={s: [s] for s in range(pp)})
    classes = [RankClass(pp_rank=r, ranks=[layout.rank(r, d) for d in range(dp)], streams=st,
                         static_memory=dict(static or {}), stages=[r]) for r, st in enumerate(streams)]
    return Plan(layout=layout, classes=classes, meta={"cluster": cluster})


def check_data_dependencies(plan: Plan, events) -> None:
    """Every compute op starts after what it needs from other stages (independent of
    the plan's own deps): F after the previous stage's F, B/BI after its F and the next
    stage's B/BI, BW after its BI."""
    first = events[events["kind"].isin(["F", "B", "BI", "BW"])]
    start = first.groupby(["kind", "stage", "mb"])["start"].min().to_dict()
    end = first.groupby(["kind", "stage", "mb"])["end"].max().to_dict()
    last = plan.meta["num_stages"] - 1

    def grad_end(s, mb):
        return end.get(("B", s, mb), end.get(("BI", s, mb)))

    for (kind, s, mb), t in start.items():
        needs = []
        if kind == "F" and s > 0:
            needs.append(end[("F", s - 1, mb)])
        if kind in ("B", "BI"):
            needs.append(end[("F", s, mb)])
            if s < last:
                needs.append(grad_end(s + 1, mb))
        if kind == "BW":
            needs.append(end[("BI", s, mb)])
        for need in needs:
            assert t >= need - 1e-12, f"{kind}.s{s}.mb{mb} starts at {t} before its input at {need}"


def bubbles(result) -> list[float]:
    return [s.bubble_s for s in result.rank_stats]


# ----------------------------------------------------------------------------- bubbles


@pytest.mark.parametrize("pp,m", [(4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_1f1b_and_gpipe_bubble(schedule, pp, m):
    plan = tiny(schedule, pp, m)
    r = simulate(plan, UNIT)
    assert bubbles(r) == pytest.approx([(pp - 1) * (F + B)] * pp)
    assert r.step_time_s == pytest.approx(m * (F + B) + (pp - 1) * (F + B))
    check_data_dependencies(plan, r.events)


@pytest.mark.parametrize("pp,m", [(4, 8), (4, 16), (8, 16)])
def test_zb1p_bubble(pp, m):
    plan = tiny("zb1p", pp, m)
    r = simulate(plan, UNIT)
    assert bubbles(r) == pytest.approx([(pp - 1) * (F + B - 2 * BW)] * pp)
    check_data_dependencies(plan, r.events)


@pytest.mark.parametrize("pp,v,m", [(4, 2, 8), (4, 2, 16), (2, 4, 8)])
def test_interleaved_bubble_fraction(pp, v, m):
    plan = tiny("interleaved_1f1b", pp, m, stages_per_rank=v)
    r = simulate(plan, UNIT)
    for s in r.rank_stats:
        assert s.compute_s == pytest.approx(v * m * (F + B))
        assert s.bubble_s / s.compute_s == pytest.approx((pp - 1) / (v * m))
    check_data_dependencies(plan, r.events)


DUALPIPE_CASES = [("dualpipe", 4, 8), ("dualpipe", 4, 16), ("dualpipe", 8, 16),
                  ("dualpipev", 2, 4), ("dualpipev", 2, 8), ("dualpipev", 4, 8)]


def dualpipe_bubble(schedule: str, pp: int) -> float:
    stages = pp if schedule == "dualpipe" else 2 * pp  # PP counted in stages (DualPipe README)
    return (stages / 2 - 1) * (FB + B - 3 * BW)


# DualPipe sends both outputs of an overlapped pair when the pair ends (the compiler's order pass)
@pytest.mark.parametrize("schedule,pp,m", DUALPIPE_CASES)
def test_dualpipe_bubble_compiled(schedule, pp, m):
    r = simulate(tiny(schedule, pp, m), UNIT)
    assert bubbles(r) == pytest.approx([dualpipe_bubble(schedule, pp)] * pp)


# ----------------------------------------------------------------------------- memory


def in_flight(plan: Plan, result) -> dict[int, float]:
    """Peak activations per rank in micro-batches of its own stages (alloc / the stage's F alloc)."""
    unit = {i.stage: i.alloc for c in plan.classes for i in c.streams["compute"] if i.kind == "F"}
    out = {}
    for rank, g in result.events.groupby("rank"):
        ops = {i.id: i for i in plan.class_of(rank).streams["compute"]}
        deltas = []
        for op, s, e in zip(g["op_id"], g["start"], g["end"]):
            ins = ops.get(op)
            if ins is not None and ins.alloc:
                deltas.append((s, 1, ins.alloc / unit[ins.stage]))
            if ins is not None and ins.free:
                deltas.append((e, 0, -ins.free / unit[ins.stage]))
        cur = peak = 0.0
        for _, _, d in sorted(deltas):
            cur += d
            peak = max(peak, cur)
        out[int(rank)] = peak
    return out


@pytest.mark.parametrize("pp", [4, 8])
def test_activation_memory_1f1b_and_dualpipe(pp):
    m = 2 * pp
    p1, pd = tiny("1f1b", pp, m), tiny("dualpipe", pp, m)
    r1, rd = simulate(p1, UNIT), simulate(pd, UNIT)
    assert max(in_flight(p1, r1).values()) == pytest.approx(pp)
    assert max(in_flight(pd, rd).values()) == pytest.approx(pp + 1)
    # the engine's own peak: rank 0 of 1f1b holds pp forward activations of stage 0
    f0 = next(i.alloc for i in p1.classes[0].streams["compute"] if i.kind == "F")
    assert r1.rank_stats[0].activations_bytes == pytest.approx(pp * f0)
    # DualPipe holds every stage twice
    assert sum(s.params_bytes for s in rd.rank_stats) == pytest.approx(2 * sum(s.params_bytes for s in r1.rank_stats))


def test_activation_memory_dualpipev():
    pp = 4  # PP = 8 stages
    plan = tiny("dualpipev", pp, 2 * pp)
    assert max(in_flight(plan, simulate(plan, UNIT)).values()) == pytest.approx(2 * pp + 1)


@pytest.mark.parametrize("zero,per_param", [(0, lambda n: 16), (1, lambda n: 4 + 12 / n),
                                            (2, lambda n: 2 + 14 / n), (3, lambda n: 16 / n)])
def test_zero_model_states(zero, per_param):
    n = 4
    plan = compile({"model": "gpt-tiny", "cluster": f"cpu:{n}", "global_batch": 8, "seq_len": 32,
                    "microbatches": 2, "directives": [{"op": "data_parallel", "degree": n, "zero": zero}]})
    psi = get_config("gpt-tiny").param_count()
    r = simulate(plan, UNIT)
    for s in r.rank_stats:
        states = s.params_bytes + s.grads_bytes + s.optimizer_bytes
        assert states == pytest.approx(per_param(n) * psi)
        assert s.peak_memory_bytes == pytest.approx(states + s.activations_bytes)


# ----------------------------------------------------------------------------- comm costs


@pytest.mark.parametrize("kind,steps,factor", [("ALLREDUCE", 2, 2), ("REDUCE_SCATTER", 1, 1), ("ALL_GATHER", 1, 1)])
@pytest.mark.parametrize("fold", [True, False])
def test_lone_collective_follows_ring_formula(kind, steps, factor, fold):
    n, size = 8, 2.0**30
    plan = hand_plan([{"dp": [Instruction(id="C", kind=kind, stream="dp", bytes=size, group="stage:0")]}], dp=n)
    cluster = parse_cluster("h100:1x8")
    cm = get_costmodel("analytic", cluster)
    r = simulate(plan, cm, fold=fold)
    gpu = cluster.gpu
    ring = factor * (n - 1) / n * size / gpu.nvlink_bw + steps * (n - 1) * gpu.intra_alpha_s
    assert (r.events["end"] - r.events["start"]).tolist() == pytest.approx([ring] * (1 if fold else n))
    assert r.step_time_s == pytest.approx(cm.collective_time(kind, size, list(range(n))))


def test_concurrent_sends_share_a_link():
    size = 2.0**28
    sends = {"send.a": [Instruction(id="SEND.a", kind="SEND", stream="send.a", bytes=size, peer=1, match="a")],
             "send.b": [Instruction(id="SEND.b", kind="SEND", stream="send.b", bytes=size, peer=2, match="b")]}
    recv = [{"recv": [Instruction(id=f"RECV.{x}", kind="RECV", stream="recv", bytes=size, peer=0, match=x)]}
            for x in "ab"]
    cluster = parse_cluster("h100:1x8")
    cm = get_costmodel("analytic", cluster)
    both = simulate(hand_plan([sends, *recv]), cm)
    # both leave rank 0 over its one NVLink port: each gets half of it
    assert both.step_time_s == pytest.approx(2 * size / cluster.gpu.nvlink_bw)
    alone = simulate(hand_plan([{"send.a": sends["send.a"]}, recv[0], {}]), cm)
    assert alone.step_time_s == pytest.approx(cm.p2p_time(size, 0, 1))


def test_compute_slows_down_while_comm_runs():
    plan = hand_plan([{"compute": [Instruction(id="F.s0.mb0", kind="F", stream="compute", stage=0, mb=0)],
                       "dp": [Instruction(id="AR", kind="ALLREDUCE", stream="dp", bytes=1.0, group="stage:0")]}],
                     dp=2, cluster="cpu:2")
    r = simulate(plan, UnitCostModel(F=4, comm=2, slowdown=2))
    ev = r.events.set_index("op_id")
    assert ev.loc["AR", "end"] == pytest.approx(2)
    assert ev.loc["F.s0.mb0", "end"] == pytest.approx(5)  # 2 s at half speed, then 3 s


def test_comm_slows_down_while_its_rank_computes():
    """commslowdown=2: an all-reduce of 2 s posted with a 1 s forward runs at half speed for
    1 s (on either member: rank 1 computes only), then at full speed: it ends at 2.5 s."""
    plan = hand_plan([{"compute": [Instruction(id="F.s0.mb0", kind="F", stream="compute", stage=0, mb=0)],
                       "dp": [Instruction(id="AR", kind="ALLREDUCE", stream="dp", bytes=1.0, group="stage:0")]}],
                     dp=2, cluster="cpu:2")
    ev = simulate(plan, "unit:F=1,comm=2,commslowdown=2", fold=False).events
    assert ev[ev["op_id"] == "AR"]["end"].tolist() == pytest.approx([2.5, 2.5])
    assert ev[ev["op_id"] == "F.s0.mb0"]["end"].tolist() == pytest.approx([1, 1])
    alone = simulate(plan, "unit:F=1,comm=2", fold=False).events
    assert alone[alone["op_id"] == "AR"]["end"].tolist() == pytest.approx([2, 2])


def test_partial_dependency_follows_the_work_done_not_the_clock():
    """A bucket sync waiting for half of a 4 s forward that runs at half speed for its first
    2 s (an all-reduce overlaps it): half the work is done at 3 s, not at 2 s."""
    plan = hand_plan([{"compute": [Instruction(id="F.s0.mb0", kind="F", stream="compute", stage=0, mb=0)],
                       "dp": [Instruction(id="AR0", kind="ALLREDUCE", stream="dp", bytes=1.0, group="stage:0")],
                       "dp.b": [Instruction(id="AR1", kind="ALLREDUCE", stream="dp.b", bytes=1.0, group="stage:0",
                                            deps=["F.s0.mb0"], dep_progress=0.5)]}], dp=2, cluster="cpu:2")
    ev = simulate(plan, UnitCostModel(F=4, comm=2, slowdown=2)).events.set_index("op_id")
    assert ev.loc["AR1", "posted"] == pytest.approx(3)
    # 1 unit of work in 2 s at half speed, 1 in 1 s, 1 in 2 s at half speed again (AR1), 1 in 1 s
    assert ev.loc["F.s0.mb0", "end"] == pytest.approx(6)


def test_expert_pieces_share_their_stage_time_by_flops():
    plan = compile({"model": "moe-tiny", "cluster": "cpu:4", "global_batch": 8, "seq_len": 32, "microbatches": 2,
                    "directives": [{"op": "expert_parallel", "degree": 4}]})
    r = simulate(plan, UNIT)
    ev = r.events[r.events["rank"] == 0]
    per_op = (ev["end"] - ev["start"]).groupby([ev["kind"], ev["mb"]]).sum()
    assert per_op[("F", 0)] == pytest.approx(F) and per_op[("B", 0)] == pytest.approx(B)
    assert (ev["kind"] == "F").sum() > 2  # the forward really is cut into pieces


# ----------------------------------------------------------------------------- deadlocks


def test_deadlock_between_two_ranks_is_reported():
    def rank(me, peer):
        return {"p2p": [Instruction(id=f"SEND.{me}", kind="SEND", stream="p2p", peer=peer, match=me),
                        Instruction(id=f"RECV.{peer}", kind="RECV", stream="p2p", peer=peer, match=peer)]}
    plan = hand_plan([rank("a", 1), rank("b", 0)], cluster="cpu:2")
    with pytest.raises(SimulationDeadlock) as e:
        simulate(plan, UNIT)
    msg = str(e.value)
    assert "\n" not in msg
    assert "rank 0 SEND.a waits for RECV.a on rank 1" in msg and "rank 1 SEND.b waits for RECV.b on rank 0" in msg


def test_deadlock_in_hand_edited_plan():
    d = tiny("1f1b", 2, 4).to_json()
    for ins in d["classes"][0]["streams"]["compute"]:
        if ins["id"] == "F.s0.mb0":  # the first forward now waits for a gradient that needs it
            ins["deps"] = ins.get("deps", []) + ["RECV.B.s1.mb0"]
    plan = Plan.from_json(json.loads(json.dumps(d)), check_hash=False)
    with pytest.raises(SimulationDeadlock, match=r"rank 0 F\.s0\.mb0 waits for RECV\.B\.s1\.mb0"):
        simulate(plan, UNIT)


def test_collective_missing_a_member_is_a_deadlock():
    plan = hand_plan([{"dp": [Instruction(id="AR.s0.b0", kind="ALLREDUCE", stream="dp", bytes=8.0, group="stage:0")]},
                      {"compute": [Instruction(id="F.s0.mb0", kind="F", stream="compute")]}], cluster="cpu:2")
    plan.layout.stage_ranks = {0: [0, 1], 1: [1]}  # stage 0 has a copy on pipeline rank 1, which never syncs it
    with pytest.raises(SimulationDeadlock, match="rank 0 AR.s0.b0 waits for ranks 1 to reach it"):
        simulate(plan, UNIT)


def test_unknown_dependency_is_an_error():
    plan = hand_plan([{"compute": [Instruction(id="F", kind="F", stream="compute", deps=["nope"])]}], cluster="cpu:1")
    with pytest.raises(SimulationError, match="depends on nope"):
        simulate(plan, UNIT)


# ----------------------------------------------------------------------------- folding


def assert_same_results(folded, unfolded, dp: int) -> None:
    assert folded.folded and not unfolded.folded
    assert folded.step_time_s == pytest.approx(unfolded.step_time_s, rel=1e-9)
    assert folded.bubble_fraction == pytest.approx(unfolded.bubble_fraction, rel=1e-9)
    rows = {s.rank: s for s in unfolded.rank_stats}
    assert len(rows) == sum(s.represents for s in folded.rank_stats)
    for s in folded.rank_stats:
        for d in range(dp):
            u = rows[s.rank + d]
            for f in ("compute_s", "comm_exposed_s", "idle_s", "peak_memory_bytes", "activations_bytes",
                      "params_bytes", "optimizer_bytes"):
                assert getattr(s, f) == pytest.approx(getattr(u, f), rel=1e-9, abs=1e-12), (s.rank, d, f)
    ev_u = unfolded.events[unfolded.events["rank"].isin([s.rank for s in folded.rank_stats])]
    cols = ["rank", "op_id", "start", "end"]
    a = folded.events[cols].sort_values(cols[:2]).reset_index(drop=True)
    b = ev_u[cols].sort_values(cols[:2]).reset_index(drop=True)
    assert a[cols[:2]].equals(b[cols[:2]])
    assert a["end"].tolist() == pytest.approx(b["end"].tolist(), rel=1e-9)


def test_fold_equals_unfold_on_64_gpus():
    plan = compile({"model": "llama3-8b", "cluster": "h100:8x8", "global_batch": 128, "seq_len": 4096,
                    "microbatches": 8,
                    "directives": [{"op": "pipeline", "degree": 4}, {"op": "schedule", "name": "1f1b"},
                                   {"op": "data_parallel", "degree": 16, "zero": 1}]})
    folded, unfolded = simulate(plan), simulate(plan, fold=False)
    assert folded.num_events * 16 == unfolded.num_events
    assert_same_results(folded, unfolded, 16)
    assert 0 < folded.mfu < 1 and folded.rank_stats[0].comm_exposed_s > 0


def test_fold_equals_unfold_with_experts_and_dualpipe():
    plan = compile({"model": "moe-tiny", "cluster": "h100:2x8", "global_batch": 32, "seq_len": 64, "microbatches": 4,
                    "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "dualpipe"},
                                   {"op": "data_parallel", "degree": 8, "zero": 1},
                                   {"op": "expert_parallel", "degree": 4}]})
    assert_same_results(simulate(plan), simulate(plan, fold=False), 8)


def test_fold_falls_back_when_replicas_differ():
    # 3 nodes of 4 GPUs, PP4 x DP3: replica 0 of pipeline ranks 0 and 1 share node 0, replica 1 does not
    plan = compile({"model": "llama3-8b", "cluster": "h100:3x4", "global_batch": 12, "seq_len": 1024,
                    "microbatches": 4,
                    "directives": [{"op": "pipeline", "degree": 4}, {"op": "data_parallel", "degree": 3}]})
    exact, why = fold_is_exact(plan, parse_cluster("h100:3x4"))
    assert not exact and "p2p" in why
    r = simulate(plan)
    assert not r.folded and len(r.rank_stats) == 12
    assert r.step_time_s == simulate(plan, fold=False).step_time_s


# ----------------------------------------------------------------------------- results / CLI


def test_result_fields_and_json():
    plan = tiny("1f1b", 4, 8)
    r = simulate(plan)  # analytic on cpu:4
    d = json.loads(json.dumps(r.to_json()))
    for key in ("step_time_s", "tokens_per_s", "mfu", "bubble_fraction", "per_rank", "num_events", "sim_wall_s"):
        assert key in d
    assert set(d["per_rank"][0]) >= {"rank", "compute_s", "comm_exposed_s", "idle_s", "peak_memory_bytes",
                                      "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes"}
    assert r.tokens_per_s == pytest.approx(plan.meta["tokens_per_step"] / r.step_time_s)
    peak = parse_cluster("cpu:4").gpu.peak("bf16")
    assert r.mfu == pytest.approx(plan.meta["model_flops_per_step"] / (r.step_time_s * 4 * peak))
    assert r.num_events == len(r.events) == sum(len(lst) for c in plan.classes for lst in c.streams.values())
    for s in r.rank_stats:
        assert s.compute_s + s.comm_exposed_s + s.idle_s == pytest.approx(r.step_time_s)
    assert list(r.events.columns[:11]) == ["rank", "stream", "op_id", "kind", "stage", "mb", "start", "end",
                                           "bytes", "flops", "peer"]


def test_cli_simulate(tmp_path, capsys):
    from piper_sim.cli import main

    path = tmp_path / "plan.json"
    tiny("zb1p", 4, 8).save(str(path))
    out = {k: str(tmp_path / f"{k}") for k in ("trace.json", "timeline.png", "memory.png")}
    assert main(["simulate", str(path), "--costmodel", UNIT, "--json", "--trace", out["trace.json"],
                 "--timeline", out["timeline.png"], "--memory", out["memory.png"]]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["step_time_s"] == pytest.approx(8 * 3 + 3)
    for p in out.values():
        assert (tmp_path / p).stat().st_size > 0
    assert main(["simulate", str(path), "--costmodel", "unit:F=x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("piper-sim: error:") and err.count("\n") == 1
    assert main(["simulate", str(path)]) == 0 and "step" in capsys.readouterr().out
    assert math.isfinite(d["mfu"])


def test_cpu_ranks_share_cores():
    """Two ranks computing at once on one core take twice as long (processor sharing)."""
    from costmodel.model import UnitCostModel
    from piper_sim.api import compile as compile_plan

    plan = compile_plan({"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 2, "seq_len": 16,
                         "microbatches": 1, "directives": [{"op": "data_parallel", "degree": 2}]})
    cm = UnitCostModel.parse("unit:F=1,BI=1,BW=1,comm=0")
    alone = simulate(plan, cm).step_time_s
    cm.compute_slots = 1
    shared = simulate(plan, cm, fold=False).step_time_s
    cm.compute_slots = 2
    enough = simulate(plan, cm, fold=False).step_time_s
    assert alone == pytest.approx(3.0)
    assert shared == pytest.approx(2 * alone)
    assert enough == pytest.approx(alone)


@pytest.mark.parametrize("zero,reduce", [(2, "per_microbatch"), (3, "per_microbatch"), (2, "per_step"),
                                         (3, "per_step"), (1, None)])
def test_dp_traffic_per_step_is_the_zero_formula_with_microbatches(zero, reduce):
    """Simulated bytes per rank and step of each DP collective kind = `dp_collectives`:
    ZeRO-2/3 reduce-scatter the sharded gradients once per micro-batch (m × Ψ·2 bytes),
    ZeRO-3 gathers for every forward and backward, ZeRO-1 syncs once per step."""
    from costmodel.memory import dp_collectives

    m, dp = 4, 4
    d = {"op": "data_parallel", "degree": dp, "zero": zero, **({"reduce": reduce} if reduce else {})}
    r = simulate(compile({"model": "gpt-tiny", "cluster": f"cpu:{dp}", "global_batch": dp * m, "seq_len": 32,
                          "microbatches": m, "directives": [d]}), "analytic")
    psi = get_config("gpt-tiny").param_count()
    want: dict[str, float] = {}
    for kind, nbytes in dp_collectives(psi, dp, zero, microbatches=m, reduce=reduce or "per_step"):
        want[kind] = want.get(kind, 0.0) + nbytes
    ev = r.events
    for rank in sorted(set(ev["rank"])):  # the simulated ranks (DP replicas fold into one)
        got = ev[(ev["rank"] == rank) & ev["kind"].isin(list(want))].groupby("kind")["bytes"].sum().to_dict()
        assert got == pytest.approx(want)
    n_rs = (1 if zero < 2 or reduce == "per_step" else m)
    assert want["REDUCE_SCATTER"] == pytest.approx(n_rs * psi * 2)


# ----------------------------------------------------------------------------- host posting


def _post_plan(dep_progress: float = 1.0) -> Plan:
    """Two compute ops and two all-reduces on each of 2 ranks: AR1 becomes ready when AR0
    ends (dep_progress 1) or half-way through the first compute op (dep_progress 0.5)."""
    compute = [Instruction(id="B.s0.mb0", kind="B", stream="compute", stage=0, mb=0),
               Instruction(id="F.s0.mb1", kind="F", stream="compute", stage=0, mb=1)]
    ar1_deps = ["AR0"] if dep_progress == 1.0 else ["B.s0.mb0"]
    dp = [Instruction(id="AR0", kind="ALLREDUCE", stream="dp", bytes=1.0, group="stage:0"),
          Instruction(id="AR1", kind="ALLREDUCE", stream="dp", bytes=1.0, group="stage:0", deps=ar1_deps,
                      dep_progress=dep_progress)]
    return hand_plan([{"compute": compute, "dp": dp}], dp=2, cluster="cpu:2")


def test_host_bound_rank_posts_comm_between_compute_ops():
    """host=1 (a CPU rank: compute runs on the thread that posts): AR0 is posted first (0.5 s),
    then B runs; AR1, ready at 1.5 s, waits for B's end (2.5 s) and is posted before F."""
    ev = simulate(_post_plan(), "unit:B=2,F=2,comm=1,post=0.5,host=1", fold=False).events
    ev = ev[ev["rank"] == 0].set_index("op_id")
    assert (ev.loc["AR0", "start"], ev.loc["AR0", "end"]) == pytest.approx((0, 1.5))
    assert (ev.loc["B.s0.mb0", "start"], ev.loc["B.s0.mb0", "end"]) == pytest.approx((0.5, 2.5))
    assert (ev.loc["AR1", "posted"], ev.loc["AR1", "start"], ev.loc["AR1", "end"]) == pytest.approx((2.5, 2.5, 4))
    assert (ev.loc["F.s0.mb1", "start"], ev.loc["F.s0.mb1", "end"]) == pytest.approx((3, 5))
    # an accelerator's host only posts: comm starts while compute runs, compute never waits
    ev = simulate(_post_plan(), "unit:B=2,F=2,comm=1,post=0.5", fold=False).events
    ev = ev[ev["rank"] == 0].set_index("op_id")
    assert ev.loc["B.s0.mb0", "start"] == 0 and ev.loc["F.s0.mb1", "end"] == pytest.approx(4)
    assert (ev.loc["AR1", "posted"], ev.loc["AR1", "end"]) == pytest.approx((1.5, 3))
    # without posting cost nor host the times are the plain unit ones
    ev = simulate(_post_plan(), "unit:B=2,F=2,comm=1", fold=False).events.set_index("op_id")
    assert ev.loc["AR1", "end"].tolist() == pytest.approx([2, 2])


def test_post_from_inside_a_backward_stalls_it():
    """A gradient bucket the plan lets start half-way through B is posted from inside it, as
    the executor's hook does: B loses the 0.5 s of posting, the transfer starts after it."""
    ev = simulate(_post_plan(dep_progress=0.5), "unit:B=2,F=2,comm=1,post=0.5,host=1", fold=False).events
    ev = ev[ev["rank"] == 0].set_index("op_id")
    assert ev.loc["B.s0.mb0", "start"] == pytest.approx(0.5)  # after AR0's post
    assert (ev.loc["AR1", "posted"], ev.loc["AR1", "end"]) == pytest.approx((1.5, 3))
    assert ev.loc["B.s0.mb0", "end"] == pytest.approx(3)  # 2 s of work + 0.5 s posting AR1
    assert ev.loc["F.s0.mb1", "start"] == pytest.approx(3)


def test_calibrated_post_time_and_host_bound():
    post = {"ALL_GATHER": {"alpha_s": 1e-4, "bw_Bps": 1e9}, "SEND": {"alpha_s": 2e-5, "bw_Bps": 4e9}}
    cpu = AnalyticCostModel(parse_cluster("cpu:2"), {"post": post})
    assert cpu.host_bound and cpu.post_time("ALL_GATHER", 1e6) == pytest.approx(1.1e-3)
    assert cpu.post_time("SEND", 4e6) == pytest.approx(1.02e-3) and cpu.post_time("ALLREDUCE", 1e6) == 0
    gpu = AnalyticCostModel(parse_cluster("h100:1x8"))
    assert not gpu.host_bound and gpu.post_time("ALL_GATHER", 1e6) == 0
    with pytest.raises(ValueError, match="post"):
        check_calibration({"kind": "calibration", "post": {"BROADCAST": post["SEND"]}})
    with pytest.raises(ValueError, match="host 0 or 1"):
        get_costmodel("unit:host=2")


def test_comm_is_posted_when_ready_even_while_its_stream_moves_data():
    """AR1 is ready when B ends (1.1 s, with AR0's post from inside it) while AR0 still moves
    data: it is posted then, before F (the executor posts every ready op), and its transfer
    follows AR0's."""
    compute = [Instruction(id="B.s0.mb0", kind="B", stream="compute", stage=0, mb=0),
               Instruction(id="F.s0.mb1", kind="F", stream="compute", stage=0, mb=1)]
    dp = [Instruction(id="AR0", kind="ALLREDUCE", stream="dp", bytes=1.0, group="stage:0", deps=["B.s0.mb0"],
                      dep_progress=0.5),
          Instruction(id="AR1", kind="ALLREDUCE", stream="dp", bytes=1.0, group="stage:0", deps=["B.s0.mb0"])]
    plan = hand_plan([{"compute": compute, "dp": dp}], dp=2, cluster="cpu:2")
    ev = simulate(plan, "unit:B=1,F=5,comm=1,post=0.1,host=1", fold=False).events
    ev = ev[ev["rank"] == 0].set_index("op_id")
    assert ev.loc["AR0", "end"] == pytest.approx(1.6)
    assert (ev.loc["AR1", "posted"], ev.loc["AR1", "end"]) == pytest.approx((1.1, 2.6))
    assert (ev.loc["F.s0.mb1", "start"], ev.loc["F.s0.mb1", "end"]) == pytest.approx((1.2, 6.2))


class _GatherSlow(UnitCostModel):
    def collective_time(self, kind, nbytes, ranks):
        return 1.0 if kind == "ALL_GATHER" else 0.5


def test_compute_waiting_at_a_gate_resumes_after_the_posts_made_meanwhile():
    """F0 waits at its first gather (done at 1.3 s); AG1, ready at 1.1 s, is posted from inside
    F0 (1.1-1.4 s): F0 runs on at 1.4 s, not 1.3 s."""
    compute = [Instruction(id="F.s0.mb0", kind="F", stream="compute", stage=0, mb=0)]
    ag = lambda name, stream, at, deps=(): Instruction(  # noqa: E731
        id=name, kind="ALL_GATHER", stream=stream, bytes=1.0, group="stage:0", deps=list(deps),
        needed_by="F.s0.mb0", needed_at=at)
    streams = {"compute": compute, "g0": [ag("AG0", "g0", 0.0)],
               "other": [Instruction(id="X", kind="ALLREDUCE", stream="other", bytes=1.0, group="stage:0")],
               "g1": [ag("AG1", "g1", 1.0, ["X"])]}
    plan = hand_plan([streams], dp=2, cluster="cpu:2")
    ev = simulate(plan, _GatherSlow(F=2, post=0.3, host=1), fold=False).events
    ev = ev[ev["rank"] == 0].set_index("op_id")
    assert [ev.loc[k, "posted"] for k in ("AG0", "X", "AG1")] == pytest.approx([0, 0.3, 1.1])
    assert (ev.loc["F.s0.mb0", "start"], ev.loc["F.s0.mb0", "end"]) == pytest.approx((0.6, 3.4))


def test_a_gate_behind_an_op_that_needs_the_host_is_a_deadlock_named_plainly():
    """F1 holds the host waiting for AG, which its stream lists after X, which is ready (after
    Y) while F1 runs and needs the host (the executor would hang the same way): the error
    names the host and its holder."""
    compute = [Instruction(id="F.s0.mb0", kind="F", stream="compute", stage=0, mb=0),
               Instruction(id="F.s0.mb1", kind="F", stream="compute", stage=0, mb=1)]
    other = [Instruction(id="Y", kind="ALLREDUCE", stream="other", bytes=1.0, group="stage:0", deps=["F.s0.mb0"])]
    dp = [Instruction(id="X", kind="ALLREDUCE", stream="dp", bytes=1.0, group="stage:0", deps=["Y"]),
          Instruction(id="AG", kind="ALL_GATHER", stream="dp", bytes=1.0, group="stage:0", needed_by="F.s0.mb1",
                      needed_at=0.5)]
    plan = hand_plan([{"compute": compute, "other": other, "dp": dp}], dp=2, cluster="cpu:2")
    with pytest.raises(SimulationDeadlock, match="X waits for the rank's host .*held by F.s0.mb1, which waits "
                                                 "part-way for AG"):
        simulate(plan, "unit:F=1,comm=0.2,host=1")


POST = {"ALLREDUCE": {"alpha_s": 4.55e-05, "bw_Bps": 8.96e11}, "REDUCE_SCATTER": {"alpha_s": 9.47e-05, "bw_Bps": 5.16e10},
        "ALL_GATHER": {"alpha_s": 1.22e-04, "bw_Bps": 2.18e10}, "ALL_TO_ALL": {"alpha_s": 0.0, "bw_Bps": 2.07e11},
        "SEND": {"alpha_s": 2.32e-05, "bw_Bps": 1.01e12}, "RECV": {"alpha_s": 0.0, "bw_Bps": 3.5e11}}


@pytest.mark.parametrize("pp", [2, 4])
def test_host_grants_do_not_depend_on_wake_up_order(pp):
    """DualPipe with ring context parallelism on the committed CPU calibration plus posting
    times (a 2-core VM's): two transfers of a rank end at one instant and the next ops of both
    streams ask for the host. Granted in the executor's order, folded equals unfolded (they
    differed by up to 4e-3 when simpy's wake-up order decided)."""
    from costmodel.calibration import load_calibration

    cal = load_calibration(os.path.join(os.path.dirname(__file__), "..", "traces", "calibration", "cpu-2core.json"))
    overrides = {k: v for k, v in cal.items() if k not in ("kind", "device", "meta")}
    cm = AnalyticCostModel(parse_cluster(f"cpu:{2 * pp}"), {**overrides, "post": POST, "compute_slots": 2})
    plan = compile({"model": "gpt-tiny", "cluster": f"cpu:{2 * pp}", "global_batch": 10, "seq_len": 8,
                    "microbatches": 10, "directives": [{"op": "pipeline", "degree": pp},
                                                       {"op": "schedule", "name": "dualpipe"},
                                                       {"op": "context_parallel", "degree": 2, "style": "ring"}]})
    folded, unfolded = simulate(plan, cm), simulate(plan, cm, fold=False)
    assert folded.folded and folded.step_time_s == pytest.approx(unfolded.step_time_s, rel=1e-12)


def test_an_fp32_plan_is_priced_and_measured_in_fp32():
    """One dtype knob (the plan's): an fp32 plan's MFU is against the fp32 peak, and its GEMMs
    are priced in fp32 (slower than the same plan in bf16)."""
    from costmodel.hardware import H100

    def run(dtype):
        s = {"model": "gpt-small", "cluster": "h100:1x8", "global_batch": 8, "seq_len": 256, "microbatches": 1,
             "dtype": dtype, "directives": [{"op": "data_parallel", "degree": 8}]}
        plan = compile(s)
        return plan, simulate(plan)

    plan, r32 = run("fp32")
    _, r16 = run("bf16")
    flops = plan.header.model_flops_per_step
    assert r32.mfu == pytest.approx(flops / (r32.step_time_s * 8 * H100.peak("fp32")))
    assert r32.step_time_s > 2 * r16.step_time_s


def test_folded_links_are_the_simulated_ranks_ports_of_every_members_links():
    """The folded simulator derives a collective's links from the ports every member uses
    (`CostModel.collective_ports`), mapped to the simulated ranks: the same set, in the same
    order, as mapping each member's `links_used` link to its class's representative."""
    from costmodel.collectives import links_used
    from piper_sim.simulator import _Engine

    plan = compile({"model": "gpt-small", "cluster": "h100:4x8", "global_batch": 64, "seq_len": 512,
                             "microbatches": 4, "directives": [
                                 {"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"},
                                 {"op": "data_parallel", "degree": 8, "zero": 1},
                                 {"op": "tensor_parallel", "degree": 2}]})
    cm = get_costmodel("analytic", parse_cluster("h100:4x8"))
    eng = _Engine(plan, cm, folded=True)
    checked = 0
    ranks_of = {gid: ranks for ranks, gid in eng._gids.items()}  # a collective's links are keyed by its group id
    for (kind, key), got in eng._group_links.items():
        if kind in ("SEND", "RECV"):
            continue
        group = ranks_of[key]
        want = tuple(dict.fromkeys(eng._link_rep(link) for link in links_used(kind, group, cm.cluster)))
        assert got == want, (kind, group)
        checked += 1
    assert checked >= 3


def test_gradient_buckets_of_a_pieced_backward_overlap_the_rest_of_it():
    """Under TP the backward is cut per unit (pieces): a gradient bucket's reduce-scatter waits for
    the piece that completes it, not for every piece of the last micro-batch, so the buckets of
    the later layers go out while the first layers' backward still runs (Megatron's
    --overlap-grad-reduce); the first bucket (the embedding's) still waits for the end."""
    plan = compile({"model": "gpt-tiny", "cluster": "cpu:4", "global_batch": 8, "seq_len": 32, "microbatches": 4,
                    "directives": [{"op": "data_parallel", "degree": 2, "zero": 1, "bucket_mb": 0.05},
                                   {"op": "tensor_parallel", "degree": 2}]})
    ev = simulate(plan, UNIT).events
    ev = ev[ev["rank"] == 0]
    last_backward_end = ev[ev["kind"] == "B"]["end"].max()
    rs = ev[ev["kind"] == "REDUCE_SCATTER"]
    rs = rs[rs["stream"] != "tp"]
    assert len(rs) > 2
    assert rs["start"].min() < last_backward_end  # overlapped with the backward
    assert rs["start"].max() >= last_backward_end - 1e-9  # bucket 0 waits for the embedding's gradient


def test_gradient_buckets_of_a_split_backward_wait_for_its_weight_gradients():
    """A split backward (BI pieces, then one BW per stage and micro-batch) makes the weight
    gradients in BW: every bucket's gradient sync waits for the last micro-batch's BW, whatever
    piece its first byte lies in (a sync on the BI piece alone would reduce unfinished gradients:
    the executor's --check catches it, tests/test_executor_cp.py)."""
    from piper_sim.compiler import build_dag
    from piper_sim.strategy import parse_strategy

    st = {"model": "gpt-tiny", "cluster": "cpu:8", "global_batch": 8, "seq_len": 32, "microbatches": 4,
          "directives": [{"op": "pipeline", "degree": 2, "stages_per_rank": 2}, {"op": "schedule", "name": "zbv"},
                         {"op": "data_parallel", "degree": 2, "zero": 1, "bucket_mb": 0.05},
                         {"op": "tensor_parallel", "degree": 2}]}
    dag, _, _ = build_dag(parse_strategy(st), folded=True)
    syncs = [n for n in dag.g.nodes if dag.ins(n).kind == "REDUCE_SCATTER" and dag.ins(n).group != "tp"]
    assert len(syncs) > 2
    for n in syncs:
        bw = [p for p in dag.g.predecessors(n) if dag.ins(p).kind == "BW"]
        last = max(dag.ins(x).mb for x in dag.g.nodes if dag.ins(x).kind == "BW" and x[0] == n[0]
                   and dag.ins(x).stage == dag.ins(n).stage)
        assert any(dag.ins(p).mb == last for p in bw), dag.ins(n)
