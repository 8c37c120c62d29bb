"""Tied embeddings with the embedding and the head on two pipeline stages (Megatron-Core's
embedding group): the plan's ``AR.embed`` between the first and the last stage, the last
stage's own copy of the matrix, and real gloo runs against the single-process reference."""

from __future__ import annotations

import json
import warnings

import pytest

from executor.support import TINY, unrunnable
from piper_sim.api import compile
from tests.test_executor import GRAD_TOL, TOL, json_lines, torchrun

pytestmark = pytest.mark.filterwarnings("ignore")

TIED = {**TINY, "name": "tiny-tied", "tie_embeddings": True}
EMBED_BYTES = TINY["vocab"] * TINY["hidden"] * 4  # fp32


def strategy(model: str, *directives: dict, world: int = 2, dp: int = 1, m: int = 4, sched: str = "1f1b",
             v: int = 1) -> dict:
    pipe = [{"op": "pipeline", "degree": 2, **({"stages_per_rank": v} if v > 1 else {})},
            {"op": "schedule", "name": sched}]
    return {"model": model, "cluster": f"cpu:{world}", "global_batch": dp * m * 2, "seq_len": 16,
            "microbatches": m, "dtype": "fp32", "directives": [*pipe, *directives]}


def DP2(zero: int, **kw) -> dict:
    return {"op": "data_parallel", "degree": 2, "zero": zero, **kw}


@pytest.fixture()
def tied(tmp_path):
    path = tmp_path / "tiny-tied.json"
    path.write_text(json.dumps(TIED))
    return str(path)


def plan_of(s: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile(s)


def ops(plan, pp_rank: int) -> dict:
    return {i.id: i for i in plan.classes[pp_rank].instructions()}


def test_plan_sums_the_two_copies_before_the_dp_sync_and_the_step(tied, tmp_path):
    plan = plan_of(strategy(tied, DP2(1), world=4, dp=2))
    for pp, stage in ((0, 0), (1, 1)):
        mine = ops(plan, pp)
        ar = mine["AR.embed"]
        assert ar.kind == "ALLREDUCE" and ar.tied and ar.stage == stage and ar.bytes == EMBED_BYTES
        assert plan.layout.group_ranks(ar.group, plan.classes[pp].ranks[0]) == [0, 2]  # dp 0 of pp 0 and 1
        assert "AR.embed" in mine[f"OPT.s{stage}"].deps
        assert {d for d in ar.deps} == {f"B.s{stage}.mb{m}" for m in range(4)}
        # the bucket holding the embedding (first stage: its first; last: the head's copy, its last)
        holder = f"RS.s{stage}.b{0 if stage == 0 else 2}"
        assert "AR.embed" in mine[holder].deps
        assert not any("AR.embed" in i.deps for k, i in mine.items() if k.startswith("RS") and k != holder)
    # the last stage holds (and steps) its own copy: a rank's states grow by the matrix's share
    untied = json.loads(json.dumps(TIED))
    untied.update(name="tiny-untied", tie_embeddings=False)
    (tmp_path / "u.json").write_text(json.dumps(untied))
    other = plan_of(strategy(str(tmp_path / "u.json"), DP2(1), world=4, dp=2))
    assert not any(i.tied for c in other.classes for i in c.instructions())
    assert plan.classes[1].static_memory == other.classes[1].static_memory  # the copy = an untied head
    assert plan.classes[0].static_memory == other.classes[0].static_memory


def test_one_rank_holding_both_stages_sums_them_locally(tied):
    plan = plan_of(strategy(tied, sched="zbv", v=2))
    mine = ops(plan, 0)
    ar = mine["AR.embed"]
    assert plan.layout.group_ranks(ar.group, 0) == [0]  # no transfer: the two copies are on rank 0
    assert "AR.embed" in mine["OPT.s0"].deps and "AR.embed" in mine["OPT.s3"].deps
    assert {d for d in ar.deps} == {f"BW.s{s}.mb{m}" for s in (0, 3) for m in range(4)}
    assert not any(i.tied for i in plan.classes[1].instructions())


def test_refusals_left(tied):
    cases = {
        "reduce-scatters every micro-batch": strategy(tied, DP2(2), world=4, dp=2),
        "ZeRO-3 reduce-scatters every micro-batch": strategy(tied, DP2(3), world=4, dp=2),
    }
    for why, s in cases.items():
        msg = unrunnable(plan_of(s))
        assert why in msg and "\n" not in msg, msg
    one_stage = {"model": tied, "cluster": "cpu:2", "global_batch": 4, "seq_len": 16, "microbatches": 2,
                 "dtype": "fp32", "directives": [DP2(3)]}
    assert "ZeRO-3 gathers the head's unit" in unrunnable(plan_of(one_stage))
    for s in (strategy(tied), strategy(tied, sched="zb1p"), strategy(tied, sched="zbv", v=2),
              strategy(tied, sched="dualpipe"), strategy(tied, DP2(1), world=4, dp=2),
              strategy(tied, DP2(3, reduce="per_step"), world=4, dp=2)):
        assert unrunnable(plan_of(s)) == ""


def check(tmp_path, nproc: int, configs: dict[str, dict], *extra: str) -> dict[str, dict]:
    paths = {}
    for name, s in configs.items():
        path = str(tmp_path / f"{name}.json")
        plan_of(s).save(path)
        paths[path] = name
    r = torchrun(nproc, [*paths, "--steps", "3", "--check", "--json", *extra])
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, dict] = {}
    for row in json_lines(r.stdout):
        out.setdefault(paths[row["plan"]], {}).update(row)
    assert set(out) == set(configs)
    for name, row in out.items():
        assert row["max_rel_param_diff"] <= TOL and row["max_rel_grad_diff"] <= GRAD_TOL, (name, row)
    return out


def test_pp2_1f1b_equals_the_reference(tied, tmp_path):
    check(tmp_path, 2, {"pp2-1f1b": strategy(tied)})


@pytest.mark.slow
def test_pp2_schedules_equal_the_reference(tied, tmp_path):
    """Two ranks (gpipe, interleaved, zb1p) and one rank holding both stages (zbv, dualpipev,
    dualpipe: its two copies summed in place)."""
    check(tmp_path, 2, {s: strategy(tied, sched=s, v=2 if s in ("interleaved_1f1b", "zbv", "dualpipev") else 1)
                        for s in ("gpipe", "interleaved_1f1b", "zb1p", "zbv", "dualpipev", "dualpipe")})


@pytest.mark.slow
def test_pp2_dp2_zero_tp_equal_the_reference(tied, tmp_path):
    configs = {"zero1": strategy(tied, DP2(1), world=4, dp=2),
               "zero0": strategy(tied, DP2(0), world=4, dp=2),
               "zero2-step": strategy(tied, DP2(2, reduce="per_step"), world=4, dp=2),
               "zero3-step": strategy(tied, DP2(3, reduce="per_step"), world=4, dp=2),
               "tp2-sp": strategy(tied, {"op": "tensor_parallel", "degree": 2, "sequence_parallel": True}, world=4)}
    check(tmp_path, 4, configs)


@pytest.mark.slow
def test_clip_counts_the_copy_once(tied, tmp_path):
    """The global gradient norm of PP2 (two copies) equals that of one stage (one matrix)."""
    one = {"model": tied, "cluster": "cpu:2", "global_batch": 8, "seq_len": 16, "microbatches": 4, "dtype": "fp32",
           "directives": [{"op": "data_parallel", "degree": 2, "zero": 0}]}
    configs = {"pp2": strategy(tied), "dp2": {**one, "microbatches": 2}}
    paths = {}
    for name, s in configs.items():
        path = str(tmp_path / f"{name}.json")
        plan_of(s).save(path)
        paths[path] = name
    r = torchrun(2, [*paths, "--steps", "2", "--check", "--json", "--clip-grad-norm", "0.05"])
    assert r.returncode == 0, r.stderr[-3000:]
    norms = {paths[row["plan"]]: row["grad_norm"] for row in json_lines(r.stdout) if row.get("step") == 0}
    assert abs(norms["pp2"] - norms["dp2"]) < 1e-5 * norms["dp2"], norms


@pytest.mark.slow
def test_save_and_resume_keep_both_copies(tied, tmp_path):
    """--save / --resume of PP2 x DP2 ZeRO-1: each stage saves its copy; the resumed run's
    losses equal an uninterrupted run's bit for bit."""
    from tests.test_checkpoint import assert_resumes_bit_exact

    assert_resumes_bit_exact(tmp_path, strategy(tied, DP2(1), world=4, dp=2), 4)
