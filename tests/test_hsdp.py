"""Hybrid sharded data parallelism (HSDP, `piper_sim.parallel.hybrid`): ZeRO inside shard groups,
an all-reduce of each reduced shard across the replicas."""

from __future__ import annotations

import os

import pytest

from costmodel import UnitCostModel, get_costmodel, parse_cluster
from piper_sim.compiler import compile_strategy
from piper_sim.plan import Layout
from piper_sim.simulator import simulate
from piper_sim.strategy import StrategyError


def strategy(dp=4, zero=3, shard=2, pp=1, cluster="cpu:4", m=2, **dp_fields):
    directives = [{"op": "data_parallel", "degree": dp, "zero": zero, **dp_fields}]
    if shard:
        directives[0]["shard_degree"] = shard
    if pp > 1:
        directives.insert(0, {"op": "pipeline", "degree": pp})
    return {"model": "gpt-tiny", "cluster": cluster, "global_batch": 8, "seq_len": 32, "microbatches": m,
            "directives": directives}


def test_shard_and_replica_groups_split_the_data_parallel_ranks():
    layout = Layout(pp=2, dp=4, stage_ranks={0: [0], 1: [1]}, cp=2, dp_shard=2)
    r = layout.rank_at({"pp": 1, "dp": 3, "cp": 1})
    shard = layout.group_ranks("stage:1:shard", r)
    rep = layout.group_ranks("stage:1:rep", r)
    # shard group: dp ranks 2, 3 (the same dp // 2) over both cp ranks; replicas: dp 1 and 3, same cp
    assert shard == sorted(layout.rank_at({"pp": 1, "dp": d, "cp": k}) for d in (2, 3) for k in (0, 1))
    assert rep == sorted(layout.rank_at({"pp": 1, "dp": d, "cp": 1}) for d in (1, 3))
    assert set(shard) & set(rep) == {r}
    assert Layout.from_json(layout.to_json()) == layout
    assert "dp_shard" not in Layout(pp=1, dp=4, stage_ranks={0: [0]}).to_json()  # plain plans keep their hash


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_collectives_stay_in_the_shard_group_and_one_allreduce_per_bucket_crosses_replicas(zero):
    plan = compile_strategy(strategy(zero=zero)).plan
    dp_ops = [i for i in plan.classes[0].streams["dp"]]
    rs = [i for i in dp_ops if i.kind == "REDUCE_SCATTER"]
    ar = [i for i in dp_ops if i.kind == "ALLREDUCE"]
    assert rs and {i.group for i in dp_ops if i.kind in ("REDUCE_SCATTER", "ALL_GATHER")} == {"stage:0:shard"}
    assert {i.group for i in ar} == {"stage:0:rep"}
    buckets = {i.bucket for i in rs}
    assert sorted(i.bucket for i in ar) == sorted(buckets)  # one per bucket and step
    for a in ar:  # the reduced shard: the bucket's bytes over the shard group of 2
        assert a.bytes == pytest.approx(next(i.bytes for i in rs if i.bucket == a.bucket) / 2)
        assert a.id in next(i for i in plan.classes[0].streams["compute"] if i.kind == "OPT").deps or \
            any(a.id in i.deps for i in plan.classes[0].streams["compute"] if i.kind == "OPT")


def test_model_states_are_sharded_over_the_shard_group_only():
    """HSDP dp4 with shard groups of 2 holds what ZeRO over 2 ranks holds."""
    hsdp = compile_strategy(strategy(dp=4, zero=3, shard=2)).plan.classes[0].static_memory
    zero3_over_2 = compile_strategy({**strategy(dp=2, zero=3, shard=0), "cluster": "cpu:2"}).plan.classes[0]
    zero3_over_4 = compile_strategy(strategy(dp=4, zero=3, shard=0)).plan.classes[0].static_memory
    assert hsdp == pytest.approx(zero3_over_2.static_memory)
    assert hsdp["optimizer_bytes"] == pytest.approx(2 * zero3_over_4["optimizer_bytes"])


def test_step_is_the_closed_form_of_its_collectives_under_unit_costs():
    """ZeRO-1 HSDP, one micro-batch, one bucket: F, B, then the reduce-scatter in the shard group,
    the all-reduce across replicas, the optimizer step and the parameter all-gather, in series:
    F + B + 3 comm (plain ZeRO-1: F + B + 2 comm)."""
    cm = UnitCostModel(F=1, BI=1, BW=1, comm=0.5)
    one_bucket = {"bucket_mb": 1e6}
    hsdp = simulate(compile_strategy(strategy(zero=1, m=1, **one_bucket)).plan, cm, fold=False)
    plain = simulate(compile_strategy(strategy(zero=1, shard=0, m=1, **one_bucket)).plan, cm, fold=False)
    assert hsdp.step_time_s == pytest.approx(1 + 2 + 3 * 0.5)
    assert plain.step_time_s == pytest.approx(1 + 2 + 2 * 0.5)


def test_each_collective_is_priced_over_its_own_group():
    """On 2 nodes of 8 H100 with shard groups of a node: reduce-scatters and gathers cost what
    the collective model gives for the node's 8 ranks, the all-reduce what it gives for the 2
    replicas (one per node) of the shard's bytes."""
    cluster = "h100:2x8"
    plan = compile_strategy({**strategy(dp=16, zero=3, shard=8, cluster=cluster, m=1), "global_batch": 16}).plan
    cm = get_costmodel("analytic", parse_cluster(cluster))
    ev = simulate(plan, cm, fold=False).events
    ops = {i.id: i for i in plan.program(0).streams["dp"]}
    checked = set()
    for _, row in ev[(ev["rank"] == 0) & ev["op_id"].isin(list(ops))].iterrows():
        ins = ops[row["op_id"]]
        ranks = plan.layout.group_ranks(ins.group, 0) if not ins.group.startswith("ranks:") else \
            [int(x) for x in ins.group[6:].split(",")]
        want = cm.collective_time(ins.kind, ins.bytes, ranks)
        if ins.kind == "ALLREDUCE":
            assert ranks == [0, 8]
        else:
            assert ranks == list(range(8))
        assert row["end"] - row["start"] >= want * (1 - 1e-9)  # shared links only slow it
        checked.add(ins.kind)
    assert checked == {"ALLREDUCE", "REDUCE_SCATTER", "ALL_GATHER"}


def test_hsdp_with_a_pipeline_compiles_and_simulates():
    plan = compile_strategy({**strategy(dp=4, zero=3, shard=2, pp=2, cluster="cpu:8", m=2)}).plan
    assert plan.layout.dp_shard == 2
    assert {i.group for c in plan.classes for i in c.streams["dp"] if i.kind == "ALLREDUCE"} == \
        {"stage:0:rep", "stage:1:rep"}
    assert simulate(plan, "unit:comm=0.1").step_time_s > 0


@pytest.mark.parametrize("fields,message", [
    ({"shard_degree": 3}, "field 'shard_degree' 3 must divide the data-parallel degree 4"),
    ({"shard_degree": 2, "zero": 0}, "zero is 0"),
    ({"shard_degree": 1}, "shard_degree' 1 shards nothing"),
])
def test_bad_shard_degree_is_one_line_naming_the_field(fields, message):
    s = strategy(zero=fields.pop("zero", 3), shard=0)
    s["directives"][0].update(fields)
    with pytest.raises(StrategyError, match=message) as e:
        compile_strategy(s)
    assert "\n" not in str(e.value)


def test_hsdp_with_expert_parallelism_is_refused_by_name():
    s = {"model": "moe-tiny", "cluster": "cpu:4", "global_batch": 8, "seq_len": 32, "microbatches": 2,
         "directives": [{"op": "data_parallel", "degree": 4, "zero": 3, "shard_degree": 2},
                        {"op": "expert_parallel", "degree": 2}]}
    with pytest.raises(StrategyError, match="shard_degree.*expert_parallel"):
        compile_strategy(s)


def test_explore_enumerates_and_ranks_hsdp_candidates():
    from piper_sim.explore import enumerate_candidates, explore

    cands = enumerate_candidates("gpt-tiny", "h100:2x8", 32, 128, zero_levels=(3,), recompute=(False,),
                                 tp_degrees=[1], schedules=["1f1b"])
    hsdp = [c for c in cands if c.options]
    assert hsdp and all(c.options == (("data_parallel", "shard_degree", 8),) and c.dp == 16 for c in hsdp)
    result = explore("gpt-tiny", "h100:2x8", 32, 128, zero_levels=(3,), recompute=(False,), tp_degrees=[1],
                     schedules=["1f1b"], workers=1)
    ranked = [r for r in result.ok if r.candidate.options]
    assert ranked and all(r.step_time_s > 0 for r in ranked)
    assert "shard_degree=8" in ranked[0].candidate.short()


# ------------------------------------------------------------------ the executor runs it

def _hsdp_strategy(zero: int, pp: int = 1) -> dict:
    """HSDP 2x2 over 4 data-parallel ranks (shards of 2, 2 replicas), fp32, on gloo."""
    from test_executor import strategy as exec_strategy

    s = exec_strategy(pp=pp, dp=4, zero=zero, m=2, mbs=1)
    next(d for d in s["directives"] if d["op"] == "data_parallel")["shard_degree"] = 2
    return s


def test_executor_runs_hsdp_equal_to_the_reference(tmp_path):
    """torchrun on gloo: HSDP 2x2 (ZeRO-1, -2, -3) on 4 ranks, fp32, against the single-process
    reference (what ``--check`` enforces)."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_executor import GRAD_TOL, TOL, check_all

    rows = check_all(tmp_path, 4, {f"hsdp-z{z}": _hsdp_strategy(z) for z in (1, 2, 3)})
    assert set(rows) == {"hsdp-z1", "hsdp-z2", "hsdp-z3"}
    for name, row in rows.items():
        assert row["within_tolerance"] is True, (name, row)
        assert row["max_rel_param_diff"] <= TOL and row["max_rel_grad_diff"] <= GRAD_TOL, (name, row)


@pytest.mark.slow  # ~25 s: 8 ranks and a clipped run (the fast set keeps the 4-rank HSDP --check, CI budget)
def test_executor_runs_hsdp_with_a_pipeline_and_clipping_equal_to_the_reference(tmp_path):
    """PP2 x HSDP 2x2 (ZeRO-3) on 8 ranks, and --clip-grad-norm: the replicas' equal shards
    count once in the global norm."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_executor import GRAD_TOL, TOL, check_all, json_lines, save_plan, torchrun

    clipped = {save_plan(tmp_path, f"clip-z{z}", _hsdp_strategy(z)): z for z in (1, 3)}
    r = torchrun(4, [*clipped, "--steps", "2", "--check", "--json", "--clip-grad-norm", "0.05"])
    assert r.returncode == 0, r.stderr[-3000:]
    norms = {}
    for row in json_lines(r.stdout):
        if "grad_norm" in row:
            norms.setdefault(clipped[row["plan"]], []).append(row["grad_norm"])
        if "max_rel_param_diff" in row:
            assert row["within_tolerance"] is True and row["max_rel_grad_diff"] <= GRAD_TOL, row
    assert set(norms) == {1, 3} and all(n > 0.05 for v in norms.values() for n in v)
    assert abs(norms[1][0] - norms[3][0]) < 1e-4 * norms[1][0]  # one model, one first-step gradient
    row = check_all(tmp_path, 8, {"pp2-hsdp-z3": _hsdp_strategy(3, pp=2)})["pp2-hsdp-z3"]
    assert row["within_tolerance"] is True, row
    assert row["max_rel_param_diff"] <= TOL and row["max_rel_grad_diff"] <= GRAD_TOL, row


@pytest.mark.slow  # 30-55 s: the fast set keeps the HSDP --check run (CI budget)
def test_hsdp_save_and_resume_match_the_uninterrupted_run(tmp_path):
    """--save/--resume under HSDP 2x2 ZeRO-3: a shard's key names its place in the shard group
    (``shard{i}of{S}``), so the replicas' equal shards are written once and each replica loads
    it; 2 + 2 resumed steps give the 4 uninterrupted steps' losses."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_executor import assert_resume_matches_uninterrupted, save_plan, strategy as exec_strategy

    s = exec_strategy(dp=4, zero=3, m=2, mbs=1)
    next(d for d in s["directives"] if d["op"] == "data_parallel")["shard_degree"] = 2
    assert_resume_matches_uninterrupted(tmp_path, save_plan(tmp_path, "hsdp", s), 4)
