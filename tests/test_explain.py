"""piper_sim.explain: the terms of a step add up to the simulated step, agree with the
simulator's per-rank totals, name recompute and each stream's exposed communication; the
deciding terms of two plans carry the sign of their step difference; `piper-sim explain` and
`explore --explain` print them and draw the figure; bad input is one line, exit 2."""

from __future__ import annotations

import json
import math

import pytest

from piper_sim.api import compile
from piper_sim.cli.commands import main
from piper_sim.explain import (COMPUTE_WORDS, IDLE, P2P, RECOMPUTE, compare, coarse, plot_breakdowns, term_words)
from piper_sim.simulator import simulate


def strategy(model: str, cluster: str, batch: int, m: int, *directives: dict, seq: int = 32) -> dict:
    return {"model": model, "cluster": cluster, "global_batch": batch, "seq_len": seq, "microbatches": m,
            "directives": list(directives)}


PP = {"op": "pipeline", "degree": 2}
PLANS = {
    "1f1b": strategy("gpt-tiny", "cpu:2", 8, 4, PP, {"op": "schedule", "name": "1f1b"}),
    "interleaved": strategy("gpt-tiny", "cpu:2", 8, 4, {**PP, "stages_per_rank": 2},
                            {"op": "schedule", "name": "interleaved_1f1b"}),
    "dp_zero3": strategy("gpt-tiny", "h100:1x4", 8, 2, {"op": "data_parallel", "degree": 4, "zero": 3}),
    "tp_zb1p_selective": strategy("gpt-tiny", "h100:1x8", 16, 4, PP, {"op": "schedule", "name": "zb1p"},
                                  {"op": "data_parallel", "degree": 2, "zero": 1},
                                  {"op": "tensor_parallel", "degree": 2, "sequence_parallel": True},
                                  {"op": "recompute", "mode": "selective"}),
    "dualpipe_ep": strategy("moe-tiny", "h100:1x8", 16, 4, PP, {"op": "schedule", "name": "dualpipe"},
                            {"op": "expert_parallel", "degree": 2}, {"op": "data_parallel", "degree": 4, "zero": 1}),
    "cp": strategy("gpt-tiny", "h100:1x8", 8, 2, {"op": "context_parallel", "degree": 2},
                   {"op": "data_parallel", "degree": 4, "zero": 1}, seq=64),
    "moe_ep_full": strategy("moe-tiny", "h100:1x8", 8, 4, PP, {"op": "expert_parallel", "degree": 2},
                            {"op": "data_parallel", "degree": 2, "zero": 1}, {"op": "tensor_parallel", "degree": 2},
                            {"op": "recompute"}),
}
COMPUTE_TERMS = tuple(COMPUTE_WORDS)


@pytest.fixture(scope="module")
def results():
    return {name: simulate(compile(s)) for name, s in PLANS.items()}


def test_terms_add_up_to_the_step_and_match_the_simulator(results):
    for name, r in results.items():
        mean = r.explain(name)
        assert mean.step_time_s == r.step_time_s > 0
        assert math.isclose(mean.total_s, r.step_time_s, rel_tol=1e-9), name
        assert all(v >= -1e-12 * r.step_time_s for v in mean.terms.values()), (name, mean.terms)
        for s in r.rank_stats:
            one = r.explain(name, rank=s.rank)
            assert math.isclose(one.total_s, r.step_time_s, rel_tol=1e-9), (name, s.rank)
            # an independent check: compute time and exposed comm as the simulator sums them per rank
            # (no plan here overlaps two compute ops)
            compute = sum(one.get(t) for t in COMPUTE_TERMS)
            comm = sum(v for t, v in one.terms.items() if t.startswith("comm:"))
            assert compute == pytest.approx(s.compute_s, rel=1e-9), (name, s.rank)
            assert comm == pytest.approx(s.comm_exposed_s, rel=1e-9, abs=1e-15), (name, s.rank)
            assert one.get(IDLE) == pytest.approx(s.idle_s, rel=1e-6, abs=1e-12 * r.step_time_s), (name, s.rank)
        weights = sum(s.represents for s in r.rank_stats)
        assert sum(mean.get(t) for t in COMPUTE_TERMS) == pytest.approx(
            sum(s.compute_s * s.represents for s in r.rank_stats) / weights, rel=1e-9)


def test_terms_name_what_each_plan_spends_its_step_on(results):
    b = {name: r.explain(name) for name, r in results.items()}
    assert b["1f1b"].get(IDLE) > 0 and b["1f1b"].get(P2P) > 0 and b["1f1b"].get(RECOMPUTE) == 0
    assert b["interleaved"].get(IDLE) < b["1f1b"].get(IDLE)  # interleaving shrinks the bubble
    words = {name: {term_words(t) for t in x.terms} for name, x in b.items()}
    assert "exposed data-parallel communication" in words["dp_zero3"] and P2P not in b["dp_zero3"].terms
    assert {"exposed tensor-parallel communication", "backward-input compute",
            "backward-weight compute"} <= words["tp_zb1p_selective"]
    assert "exposed expert all-to-all communication" in words["moe_ep_full"] & words["dualpipe_ep"]
    assert "exposed context-parallel communication" in words["cp"]
    # full recompute re-runs each forward inside its backward (exact); selective is an estimate
    full, sel = b["moe_ep_full"], b["tp_zb1p_selective"]
    assert not full.recompute_estimated and 0.3 * full.get("F") < full.get(RECOMPUTE) < 1.5 * full.get("F")
    assert sel.recompute_estimated and 0 < sel.get(RECOMPUTE) < 0.5 * sel.get("F")
    text = str(full)
    assert "recompute (re-run forward)" in text and "tok/s/GPU" in text and "GiB" in text and " GB" not in text
    assert json.loads(json.dumps(full.to_json()))["terms"] == full.terms


def test_deciding_terms_explain_the_sign_of_the_step_difference(results, tmp_path):
    names = list(results)
    for x in names:
        for y in names:
            a, b = results[x].explain(x), results[y].explain(y)
            c = compare(a, b)
            diff = b.step_time_s - a.step_time_s
            assert sum(d for _, d in c.diffs) == pytest.approx(diff, rel=1e-9, abs=1e-15 * a.step_time_s)
            if x == y:
                assert not c.deciding and "same step time" in str(c)
                continue
            assert c.deciding and sum(d for _, d in c.deciding) * diff > 0, (x, y, c.deciding)
            assert set(dict(c.diffs)) <= set(coarse(a.terms)) | set(coarse(b.terms))
    fast, slow = sorted((results["1f1b"].explain("1f1b"), results["interleaved"].explain("interleaved")),
                        key=lambda z: z.step_time_s)
    line = str(compare(fast, slow))
    assert f"{slow.name} is " in line and "slower per step than" in line and "bubble/idle" in line
    fig = plot_breakdowns([fast, slow], str(tmp_path / "bars.png"))
    assert (tmp_path / "bars.png").stat().st_size > 10_000
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert sum(heights) == pytest.approx(fast.step_time_s + slow.step_time_s, rel=1e-9)


@pytest.fixture(scope="module")
def plan_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    paths = []
    for name in ("1f1b", "interleaved"):
        p = d / f"{name}.json"
        compile(PLANS[name]).save(str(p))
        paths.append(str(p))
    return paths


def test_cli_explain_prints_the_breakdown_the_deciding_terms_and_the_figure(plan_files, tmp_path, capsys):
    fig = tmp_path / "why.png"
    assert main(["explain", plan_files[0], "--against", plan_files[1], "--figure", str(fig)]) == 0
    out = capsys.readouterr().out
    assert out.count("where the step goes (mean over all GPUs)") == 2 and "why the ranking:" in out
    assert "bubble/idle" in out and "slower per step than" in out and fig.stat().st_size > 10_000
    assert main(["explain", plan_files[0], "--rank", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    b = d["breakdowns"][0]
    assert b["rank"] == 1 and math.isclose(sum(b["terms"].values()), b["step_time_s"], rel_tol=1e-9)


@pytest.mark.parametrize("argv,words", [
    (["explain", "/nonexistent/plan.json"], "/nonexistent/plan.json"),
    (["explain", "{plan}", "--rank", "7"], "--rank"),
    (["explain", "{plan}", "--figure", "/nonexistent/dir/x.png"], "--figure"),
    (["explain", "{bad}"], "not JSON"),
])
def test_cli_explain_bad_input_is_one_line_exit_2(plan_files, tmp_path, capsys, argv, words):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    argv = [a.format(plan=plan_files[0], bad=bad) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err


def test_explore_explain_compares_the_top_k_with_the_winner(tmp_path, capsys):
    fig = tmp_path / "top.png"
    assert main(["explore", "--model", "gpt-tiny", "--cluster", "h100:1x4", "--global-batch", "8", "--seq-len", "64",
                 "--zero", "1", "--no-recompute", "--tp", "1", "--schedules", "1f1b", "--workers", "1", "--quiet",
                 "--no-prune", "--explain", "3", "--explain-figure", str(fig)]) == 0
    out = capsys.readouterr().out
    head = out.splitlines()[0]
    assert "tok/s/GPU" in head and "idle" in head and "comm" in head and "mem GiB" in head and "bubble" not in head
    assert "pp1 - m" in out and "pp1 1f1b" not in out  # no pipeline: no schedule
    assert out.count("where the step goes") == 3 and out.count("slower per step than #1") == 2
    assert fig.stat().st_size > 10_000
