"""Interop with torch.distributed.pipelining / torchtitan: actions torch parses, torch's
schedule names, and the per-rank action CSV through torch's own ``_load_csv`` / ``_dump_csv``
(compute only and with comms)."""

from __future__ import annotations

import csv
import subprocess
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from piper_sim.api import compile
from piper_sim.configs import ZOO
from piper_sim.sources import register_model
from piper_sim.pipelining import compute_order
from piper_sim.pipelining import actions_with_comms, compute_actions, write_schedule_csv
from piper_sim.schedules import SCHEDULE_TABLE, SCHEDULES, TORCH_NAMES, canonical_schedule

S = pytest.importorskip("torch.distributed.pipelining.schedules")
ROOT = Path(__file__).resolve().parents[1]
V = {"interleaved_1f1b": 2, "combined_1f1b": 2, "zbv": 2, "dualpipev": 2}
MOE_8 = register_model("moe-tiny-8", replace(ZOO["moe-tiny"], n_layers=8)).name  # 4 ranks x 2 stages
TORCH_LOADABLE = [s for s in SCHEDULES if s != "dualpipe"]  # dualpipe: each stage on two ranks


def _strategy(sched: str, pp: int = 4, m: int = 8, dp: int = 1) -> dict:
    """A gpt-tiny pipeline; a MoE model with expert parallelism 2 (so DP >= 2) for a schedule
    that overlaps expert all-to-alls (combined_1f1b)."""
    moe = SCHEDULE_TABLE[sched].needs_ep if sched in SCHEDULE_TABLE else False
    dp = max(dp, 2) if moe else dp
    d = [{"op": "pipeline", "degree": pp, **({"stages_per_rank": V[sched]} if sched in V else {})},
         {"op": "schedule", "name": sched}]
    if dp > 1:
        d.append({"op": "data_parallel", "degree": dp, "zero": 1})
    if moe:
        d.append({"op": "expert_parallel", "degree": 2})
    return {"model": MOE_8 if moe else "gpt-tiny", "cluster": f"cpu:{pp * dp}", "global_batch": m * dp, "seq_len": 16,
            "microbatches": m, "directives": d}


def _runtime(pp: int, num_stages: int, m: int):
    """torch's CSV-driven schedule, with just enough of its stages (no process group)."""
    local = num_stages // pp
    stages = [SimpleNamespace(stage_index=i, num_stages=num_stages, group_size=pp, group_rank=0, submod=None,
                              is_first=i == 0, is_last=i == num_stages - 1) for i in range(local)]
    return S._PipelineScheduleRuntime(stages, m)


@pytest.mark.parametrize("sched", SCHEDULES)
def test_every_compute_order_action_parses_with_torch(sched):
    plan = compile(_strategy(sched))
    n = 0
    for r in range(4):
        for a in compute_order(plan, r).split():
            parsed = S._Action.from_str(a)
            assert str(parsed) == a  # round trip through torch's parser and repr
            n += 1
            if a.startswith("("):
                assert parsed.computation_type == S.OVERLAP_F_B and len(parsed.sub_actions) == 2
    assert n > 0


def test_torch_schedule_names_are_aliases():
    assert {canonical_schedule(t) for t in TORCH_NAMES.values()} == set(TORCH_NAMES)
    assert canonical_schedule("ScheduleInterleaved1F1B") == "interleaved_1f1b"
    assert canonical_schedule("zbvzerobubble") == "zbv"
    for ours, theirs in TORCH_NAMES.items():  # torch accepts the name too, for the same schedule
        S.get_schedule_class(theirs)
        a, b = compile(_strategy(ours)), compile(_strategy(theirs))
        assert a.meta["schedule"] == b.meta["schedule"] == ours
        ja, jb = a.to_json(), b.to_json()
        for j in (ja, jb):  # the plan records the strategy as written; everything else is identical
            j.pop("hash", None)
            j["meta"].pop("strategy")
        assert ja == jb
    with pytest.raises(ValueError, match=r"unknown name 'LoopedBFS'.*or torch's GPipe"):
        compile(_strategy("LoopedBFS"))


@pytest.mark.parametrize("sched", TORCH_LOADABLE)
@pytest.mark.parametrize("pp,m,dp", [(2, 4, 1), (4, 8, 2)])
def test_csv_round_trip_through_torch(sched, pp, m, dp, tmp_path):
    plan = compile(_strategy(sched, pp=pp, m=m, dp=dp))
    dp = plan.layout.dp  # 2 at least for a schedule that needs expert parallelism
    n_stages = plan.meta["num_stages"]

    # compute only: torch loads it, validates it, lowers it to comms, and dumps the same file
    path = tmp_path / "compute.csv"
    write_schedule_csv(plan, str(path))
    rt = _runtime(pp, n_stages, m)
    rt._load_csv(str(path))
    assert {r: [str(a) for a in acts] for r, acts in rt.pipeline_order.items()} == \
        {r: compute_actions(plan, r) for r in range(pp)}
    rt._dump_csv(str(tmp_path / "back.csv"), format="compute_only")
    assert (tmp_path / "back.csv").read_text() == path.read_text()
    lowered = rt.pipeline_order_with_comms  # torch's own placement of the transfers

    # with comms: the plan's transfers and gradient reductions, loaded as compute_comms
    path = tmp_path / "comms.csv"
    write_schedule_csv(plan, str(path), comms=True)
    rt = _runtime(pp, n_stages, m)
    rt._load_csv(str(path), format="compute_comms")
    ours = {r: actions_with_comms(plan, r) for r in range(pp)}
    assert {r: [str(a) for a in acts] for r, acts in rt.pipeline_order_with_comms.items()} == ours
    rt._dump_csv(str(tmp_path / "back.csv"), format="compute_comms")
    assert (tmp_path / "back.csv").read_text() == path.read_text()
    p2p = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
    for r in range(pp):  # the same transfers as torch's lowering, and REDUCE_GRAD iff data parallel
        theirs = sorted(str(a) for a in lowered[r] if a.computation_type.value in p2p)
        assert sorted(a for a in ours[r] if any(t in a for t in p2p)) == theirs
        assert sum("REDUCE_GRAD" in a for a in ours[r]) == (len(plan.classes[r].stages) if dp > 1 else 0)
    # each pair of ranks sends and receives in one order (NCCL matches point-to-point by order)
    stage_rank = {s: r for r in range(pp) for s in plan.classes[r].stages}
    sent, got = defaultdict(list), defaultdict(list)
    for r, acts in ours.items():
        for a in acts:
            x = S._Action.from_str(a)
            t = x.computation_type.value
            if t in ("SEND_F", "SEND_B"):
                peer = stage_rank[x.stage_index + (1 if t == "SEND_F" else -1)]
                sent[(r, peer)].append((t[-1], x.microbatch_index))
            elif t in ("RECV_F", "RECV_B"):
                peer = stage_rank[x.stage_index + (-1 if t == "RECV_F" else 1)]
                got[(peer, r)].append((t[-1], x.microbatch_index))
    assert sent == got and sent
    if not any("OVERLAP_F_B" in a for acts in ours.values() for a in acts):  # torch's dry run has no pairs
        S._simulate_comms_compute({r: [S._Action.from_str(a) for a in acts if "REDUCE_GRAD" not in a]
                                   for r, acts in ours.items()}, lambda s: stage_rank[s], n_stages)


def test_order_directive_takes_torch_actions():
    """A compute order copied from torch (or from `show --compute-order`) is a valid order."""
    plan = compile(_strategy("dualpipev", pp=2, m=4))
    low = _strategy("dualpipev", pp=2, m=4)
    low["directives"] += [{"op": "order", "pp_rank": r, "slots": compute_actions(plan, r)} for r in range(2)]
    assert [compute_order(compile(low), r) for r in range(2)] == [compute_order(plan, r) for r in range(2)]


def test_show_csv_command(tmp_path):
    plan_path = tmp_path / "plan.json"
    compile(_strategy("DualPipeV", pp=2, m=4)).save(str(plan_path))
    out = tmp_path / "schedule.csv"
    r = subprocess.run([sys.executable, "-m", "piper_sim", "show", str(plan_path), "--csv", str(out), "--comms",
                        "--compute-order"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = list(csv.reader(out.open()))
    assert len(rows) == 2 and "OVERLAP_F_B" in r.stdout and any("SEND_F" in a for a in rows[0])
    assert r.stdout.splitlines()[1].startswith("rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 ")
