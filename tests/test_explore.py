"""Explorer: the pruned search finds the exhaustive search's best; outputs a user can open."""

from __future__ import annotations

import csv
import json

import pytest

from piper_sim.axes import held_after
from piper_sim.explore import enumerate_candidates, explore, format_table, plot_pareto, write_csv


SMALL = [("llama3-8b", "h100:1x4", 16, 2048), ("qwen3-moe-1b", "h100:1x4", 16, 1024)]


@pytest.mark.parametrize("model,cluster,batch,seq",
                         [SMALL[0], pytest.param(*SMALL[1], marks=pytest.mark.slow)])  # MoE: ~28 s (CI budget)
def test_pruned_search_finds_the_exhaustive_best(model, cluster, batch, seq):
    kw = dict(zero_levels=(0, 1, 3), microbatch_factors=(2,), tp_degrees=(1, 2))
    full = explore(model, cluster, batch, seq, workers=1, prune=False, **kw)
    fast = explore(model, cluster, batch, seq, workers=1, prune=True, **kw)
    assert full.best is not None and fast.best is not None
    assert fast.best.step_time_s == pytest.approx(full.best.step_time_s)
    # every pruned strategy really could not have won (its exhaustive time is no better)
    exhaustive = {r.candidate: r for r in full.rows}
    for r in fast.rows:
        if r.status == "pruned":
            assert exhaustive[r.candidate].status != "ok" or \
                exhaustive[r.candidate].step_time_s >= full.best.step_time_s - 1e-12
        if r.status == "oom":
            assert exhaustive[r.candidate].status == "oom"
    assert fast.counts.get("pruned", 0) > 0


@pytest.mark.parametrize("model,cluster,batch,seq", SMALL)
def test_memory_screen_is_a_lower_bound_of_the_simulated_peak(model, cluster, batch, seq):
    """The screen's memory (model states + the activations the schedule holds, as the device
    would hold them) never exceeds what the simulator says the compiled plan needs: every
    schedule, ZeRO level, EP, TP, recompute."""
    from costmodel.hardware import parse_cluster
    from costmodel.model import get_costmodel
    from piper_sim.explore import Screener

    kw = dict(zero_levels=(0, 2, 3), microbatch_factors=(2,), tp_degrees=(1, 2))
    full = explore(model, cluster, batch, seq, workers=1, prune=False, **kw)
    screener = Screener(full.settings, get_costmodel("analytic", parse_cluster(cluster)))
    simulated = [r for r in full.rows if r.status in ("ok", "tight", "oom")]
    assert {r.candidate.schedule for r in simulated} >= {"1f1b", "zb1p", "dualpipe", "zbv"}
    tight = 0
    for r in simulated:
        mem, _, err = screener(r.candidate)
        assert not err and mem <= r.device_memory_bytes * (1 + 1e-12), r.candidate.short()
        tight += mem >= 0.5 * r.device_memory_bytes
    assert tight > len(simulated) // 2  # a bound worth having: most within 2x of the peak


@pytest.mark.parametrize("model,cluster,batch,seq", [SMALL[0], pytest.param(*SMALL[1], marks=pytest.mark.slow)])
def test_screen_and_compile_agree_on_every_candidates_activation_bytes(model, cluster, batch, seq):
    """The screen has no memory formula of its own: what each action of a stage leaves held
    (`parallel.memory.held_after`, summed over the stage's pieces) is the compiled plan's
    alloc - free of that action, for every candidate (schedules, split backward, ZeRO, TP/SP,
    recompute; under ZeRO-3 the sum of a split backward's BI and BW). Buffers that other ops
    take for a piece (ZeRO-3 parameter gathers, all-to-all receive buffers) are counted with
    the action they serve. MoE plans keep the forward combine's buffers from F to the
    backward, which the screen leaves out: there the screen's forward is at most the plan's,
    and the backward frees the same excess again."""
    from collections import defaultdict

    from costmodel.hardware import parse_cluster
    from costmodel.model import get_costmodel
    from piper_sim.compiler import compile_strategy
    from piper_sim.explore import Screener, _schedule

    kw = dict(zero_levels=(0, 3), microbatch_factors=(2,), tp_degrees=(1, 2))
    full = explore(model, cluster, batch, seq, workers=1, prune=False, **kw)
    s = full.settings
    screener = Screener(s, get_costmodel("analytic", parse_cluster(cluster)))
    checked = set()
    for r in full.rows:
        if r.status not in ("ok", "tight", "oom"):
            continue
        cand = r.candidate
        plan = compile_strategy(cand.strategy(s["model"], s["cluster"], s["global_batch"], s["seq_len"])).plan
        net: dict[tuple[int, str], float] = defaultdict(float)  # (stage, kind) -> bytes, over micro-batches
        mbs_of: dict[tuple[int, str], set] = defaultdict(set)  # the micro-batches run by that action
        ops = [i for cls in plan.classes for i in cls.instructions()]
        split = {(i.stage, i.mb) for i in ops if i.kind == "BI"}  # (stage, mb) whose backward is split
        for ins in ops:
            kind = ins.kind
            if kind == "ALL_GATHER" and ins.stage >= 0:  # a ZeRO-3 gather, for the piece it feeds
                kind = "F" if ins.direction == "F" else ("BI" if (ins.stage, ins.mb) in split else "B")
            elif kind == "REDUCE_SCATTER" and ins.stage >= 0:  # frees the backward's gathered parameters
                kind = "BI" if (ins.stage, ins.mb) in split else "B"
            elif kind == "ALL_TO_ALL":  # receive buffers, for the piece they feed
                kind = "F" if ins.direction == "F" else ("BI" if (ins.stage, ins.mb) in split else "B")
            if kind in ("F", "B", "BI", "BW"):
                if cand.zero == 3 and kind == "BW":  # ZeRO-3 moves bytes between BI and BW: their sum
                    kind = "BI"
                net[ins.stage, kind] += ins.alloc - ins.free
                if kind == ins.kind:
                    mbs_of[ins.stage, kind].add(ins.mb)
        mbs = s["global_batch"] // (cand.dp * cand.microbatches)
        spec = _schedule(cand.schedule, cand.pp, cand.microbatches, cand.v)
        beyond: dict[int, float] = defaultdict(float)  # stage -> what the plan holds beyond the screen
        for (stage, kind), got in net.items():
            kept, rerun = screener._stage_numbers(cand, mbs, spec.num_stages, stage)[:2]
            want = len(mbs_of[stage, kind]) * held_after(kind, kept, rerun)
            if cand.zero == 3 and kind == "BI":
                want += len(mbs_of[stage, kind]) * held_after("BW", kept, rerun)
            if cand.ep > 1:  # the forward combine's buffers, kept from F until the backward frees them
                assert (got - want >= -1) if kind == "F" else (got - want <= 1), (cand.short(), stage, kind)
                beyond[stage] += got - want
            else:
                assert got == pytest.approx(want, rel=1e-9, abs=1.0), (cand.short(), stage, kind)
        for stage, extra in beyond.items():
            assert extra == pytest.approx(0.0, abs=1e-9 * max(abs(v) for v in net.values())), (cand.short(), stage)
        checked.add((cand.schedule, cand.zero, cand.tp > 1, cand.recompute, cand.ep > 1))
    assert len(checked) >= 6


def test_enumeration_respects_schedule_constraints():
    cands = enumerate_candidates("gpt-tiny", "h100:1x8", 64, 128)
    for c in cands:
        assert 8 % c.pp == 0 and c.pp * c.dp * c.tp == 8 and c.sp == (c.tp > 1)
        if c.schedule == "dualpipe":
            assert c.pp % 2 == 0 and c.microbatches >= 2 * c.pp
        if c.schedule == "interleaved_1f1b":
            assert c.microbatches % c.pp == 0
    assert {c.schedule for c in cands} >= {"1f1b", "zbv", "dualpipev", "dualpipe"}
    assert {c.tp for c in cands} == {1, 2, 4}  # divisors of 8 GPUs per node that divide gpt-tiny's 4 heads


def test_outputs_table_csv_pareto(tmp_path):
    r = explore("llama3-8b", "h100:1x4", 16, 2048, workers=1, zero_levels=(1,), microbatch_factors=(2,),
                recompute=(False,), tp_degrees=(1,))
    table = format_table(r, top=3)
    assert "tokens/s" in table and "strategies:" in table
    write_csv(r, str(tmp_path / "t.csv"))
    rows = list(csv.DictReader(open(tmp_path / "t.csv")))
    assert len(rows) == len(r.rows) and rows[0]["status"] == "ok"
    plot_pareto(r, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000
    best = r.best_strategy()
    assert json.loads(json.dumps(best))["model"] == "llama3-8b"


def test_demo_writes_table_pictures_and_best_plan(tmp_path):
    """The README's main job, without the measured run (the executor tests cover that)."""
    from piper_sim.cli import main
    from piper_sim.plan import Plan

    assert main(["demo", "--no-run", "--quiet", "--workers", "2", "--out", str(tmp_path)]) == 0
    for name in ("strategies.csv", "pareto.png", "best_strategy.json", "best_timeline.png", "best_memory.png"):
        assert (tmp_path / name).stat().st_size > 0
    plan = Plan.load(str(tmp_path / "best_plan.json"))
    assert plan.meta["model"] == "qwen3-moe-9b" and plan.world_size == 32


@pytest.mark.slow
def test_tensor_parallel_wins_for_405b_on_1024_h100():
    """llama3-405b on 1,024 H100 at seq 8192 with Llama 3's batch per GPU (16M tokens on 8,192
    GPUs = 2,048 tokens per GPU: 256 sequences here): TP8 (with sequence parallelism) ranks first.
    No TP1 strategy can run this batch (fewer sequences than GPUs: 1F1B needs at least PP
    micro-batches per DP replica), TP4 can, with a bubble of one micro-batch per stage.
    The search is kept small (1F1B, ZeRO-1, full recompute: 405B does not fit without it)."""
    r = explore("llama3-405b", "h100:128x8", 256, 8192, workers=1, schedules=["1f1b"], zero_levels=(1,),
                recompute=(True,), microbatch_factors=(1, 2), max_microbatches=16)
    assert r.best is not None and r.best.candidate.tp == 8 and r.best.candidate.sp
    tp1 = [x for x in enumerate_candidates("llama3-405b", "h100:128x8", 256, 8192, tp_degrees=(1,),
                                           microbatch_factors=(1, 2, 4))]
    assert tp1 == [] and not any(x.candidate.tp == 1 and x.status == "ok" for x in r.rows)
    tp4 = [x for x in r.ok if x.candidate.tp == 4]
    assert tp4 and r.best.step_time_s < min(x.step_time_s for x in tp4)


def test_progress_reaches_its_total_with_pruned_candidates(tty_stderr):
    from piper_sim.cli.explore import progress_printer

    calls = []
    result = explore("gpt-tiny", "cpu:4", 8, 32, workers=1, schedules=["1f1b", "gpipe", "zb1p"],
                     progress=lambda *a: calls.append(a))
    assert result.counts.get("pruned", 0) > 0  # the case that used to stop short of the total
    for stage in ("screen", "simulate"):
        seen = [(i, n) for s, i, n in calls if s == stage]
        assert [i for i, _ in seen] == list(range(1, seen[-1][1] + 1)) and seen[-1][0] == seen[-1][1], stage
    tty_stderr.attach()
    show = progress_printer()
    for call in calls:
        show(*call)
    err = tty_stderr.read()  # the bars are drawn on a terminal only (tests/test_cli_habits.py: none in a log)
    total = [n for s, _, n in calls if s == "simulate"][-1]
    assert f"{total}/{total}" in err and "simulate" in err
