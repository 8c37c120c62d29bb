"""Seams inside the library: typed instruction fields (no op-id parsing), one schedule
registry, one table per fact, the named-axis mesh."""

from __future__ import annotations

import ast
import itertools
import json
import os

import pytest

from piper_sim.api import compile
from piper_sim.compiler import compile_unfolded
from piper_sim.ir import op_id
from piper_sim.plan import (COMPUTE_KINDS, PLAN_VERSION, Instruction, Layout, Plan, PlanError, _upgrade_v1,
                            missing_fields)
from piper_sim.schedules import SCHEDULE_TABLE, SCHEDULES, build_schedule, canonical_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def strategy(model="gpt-tiny", pp=2, sched="1f1b", dp=1, zero=0, m=4, ep=0, tp=0, sp=False, rec=None, **extra):
    d = [{"op": "pipeline", "degree": pp}, {"op": "schedule", "name": sched}]
    if dp > 1 or zero:
        d.append({"op": "data_parallel", "degree": dp, "zero": zero, **extra})
    if ep:
        d.append({"op": "expert_parallel", "degree": ep})
    if tp:
        d.append({"op": "tensor_parallel", "degree": tp, "sequence_parallel": sp})
    if rec:
        d.append({"op": "recompute", "mode": rec})
    return {"model": model, "cluster": f"cpu:{pp * dp * max(tp, 1)}", "global_batch": dp * m, "seq_len": 16,
            "microbatches": m, "directives": d}


MATRIX = {
    "pp4-1f1b": strategy(pp=4, m=8),
    "gpipe-dp2-z0": strategy(sched="gpipe", dp=2),
    "zb1p-dp2-z1": strategy(pp=4, sched="zb1p", dp=2, zero=1, m=8),
    "interleaved-z2": strategy(sched="interleaved_1f1b", dp=2, zero=2),
    "dualpipe-z2": strategy(sched="dualpipe", dp=2, zero=2),  # RS numbered per copy (round)
    "dualpipev-z3": strategy(sched="dualpipev", dp=2, zero=3),
    "zbv-z3-per-step": strategy(sched="zbv", dp=2, zero=3, reduce="per_step"),
    "moe-dp4-ep2-z1": strategy("moe-tiny", pp=1, dp=4, ep=2, zero=1, m=2),  # expert buckets
    "moe-dp4-ep2-z3": strategy("moe-tiny", pp=1, dp=4, ep=2, zero=3, m=2),
    "moe-dualpipev-ep2": strategy("moe-tiny", sched="dualpipev", dp=2, ep=2, zero=1),
    "tp2-sp-full-recompute": strategy(sched="zb1p", tp=2, sp=True, dp=2, zero=1, rec="full"),
    "moe-tp2-ep2": strategy("moe-tiny", pp=1, dp=2, ep=2, tp=2, m=2),
}


# ----------------------------------------------------------------------------- instructions

def _check_instructions(instructions: list[Instruction]) -> set[str]:
    seen = set()
    for ins in instructions:
        assert missing_fields(ins) == [], (ins.id, missing_fields(ins))
        assert op_id(ins) == ins.id, (op_id(ins), ins.id)  # the id is a function of the fields
        seen.add(ins.kind + (".zero3" if ins.kind == "ALL_GATHER" and ins.bucket >= 0 and ins.direction else "")
                 + (".experts" if ins.experts else "") + (".tp" if ins.name else ""))
    return seen


@pytest.mark.filterwarnings("ignore")
def test_every_instruction_has_its_kinds_fields_and_its_id_is_formed_from_them():
    seen = set()
    for name, s in MATRIX.items():
        plan = compile(s)
        seen |= _check_instructions([i for c in plan.classes for i in c.instructions()])
        # and through JSON: the fields survive a round trip
        again = Plan.from_json(json.loads(plan.dumps()))
        assert again.content_hash() == plan.content_hash()
    # the matrix reaches every family of instruction
    assert {"F", "B", "BI", "BW", "OPT", "SEND", "RECV", "ALLREDUCE", "REDUCE_SCATTER", "ALL_GATHER",
            "ALL_GATHER.zero3", "ALL_TO_ALL", "REDUCE_SCATTER.experts", "ALL_GATHER.zero3.experts",
            "ALLREDUCE.tp", "ALL_GATHER.tp", "REDUCE_SCATTER.tp"} <= seen


@pytest.mark.filterwarnings("ignore")
def test_unfolded_compile_has_the_same_fields():
    for name in ("dualpipe-z2", "moe-dp4-ep2-z3"):
        programs = compile_unfolded(MATRIX[name])
        _check_instructions([i for p in programs for lst in p.streams.values() for i in lst])


def test_a_missing_field_is_named():
    ins = Instruction(id="AR.s0.b0", kind="ALLREDUCE", stream="dp", stage=0, group="stage:0")
    assert missing_fields(ins) == ["bucket or name"]
    a2a = Instruction(id="x", kind="ALL_TO_ALL", stream="ep", stage=0, mb=1, group="ep", a2a="dispatch")
    assert missing_fields(a2a) == ["direction", "block"]


def test_version_1_plans_are_upgraded_on_load():
    path = os.path.join(ROOT, "traces", "validation", "pp2_dualpipev.plan.json")
    with open(path) as f:
        d = json.load(f)
    assert d["version"] == 1 and PLAN_VERSION == 2
    plan = Plan.from_json(d)  # the hash is checked on the file as written
    _check_instructions([i for c in plan.classes for i in c.instructions()])
    # each upgrade rule reads back the fields `op_id` formed
    for ins in [Instruction("", "ALL_GATHER", "dp", stage=1, mb=3, bucket=2, experts=True, direction="B", round=1),
                Instruction("", "REDUCE_SCATTER", "dp", stage=0, mb=2, bucket=0, round=-1),
                Instruction("", "REDUCE_SCATTER", "dp", stage=0, mb=2, bucket=4, round=3),
                Instruction("", "ALL_TO_ALL", "ep", stage=0, mb=1, block=2, direction="B", a2a="dispatch"),
                Instruction("", "ALLREDUCE", "tp", stage=0, mb=1, direction="R", name="l3.attn.ar")]:
        ins.id = op_id(ins)
        assert Instruction.from_json(_upgrade_v1(_v1(ins))) == ins
    with pytest.raises(PlanError, match="version 7 is not supported"):
        Plan.from_json({**d, "version": 7})


def _v1(ins: Instruction) -> dict:
    """The instruction as a version 1 plan held it (no typed fields)."""
    d = ins.to_json()
    return {k: v for k, v in d.items() if k not in ("direction", "bucket", "experts", "block", "round", "name")}


def _uses_of_op_ids(path: str) -> list[str]:
    """Places in a source file that take an op id (``.id``, ``.match``, ``["op_id"]``) apart:
    string methods, indexing, or the ``re`` module."""
    tree = ast.parse(open(path).read())
    out = []

    def is_op_id(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr in ("id", "match", "op_id")) or \
            (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "op_id")

    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            out += [f"line {node.lineno}: imports re" for n in names if n == "re"]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_op_id(node.func.value):
            out.append(f"line {node.lineno}: .{node.func.attr}() on an op id")
        elif isinstance(node, ast.Subscript) and is_op_id(node.value):
            out.append(f"line {node.lineno}: indexes an op id")
    return out


@pytest.mark.parametrize("path", ["executor/runtime.py", "executor/stage.py", "executor/collectives.py",
                                  "executor/worker.py", "executor/parallel/data.py", "executor/parallel/tensor.py",
                                  "executor/parallel/context.py", "executor/parallel/expert.py",
                                  "piper_sim/simulator.py", "piper_sim/pipelining.py"])
def test_back_ends_never_parse_op_ids(path):
    assert _uses_of_op_ids(os.path.join(ROOT, path)) == []


def test_the_op_id_detector_finds_parsing():
    src = "import re\nm = ins.id.split('.')\nx = ins.match[0]\ny = r['op_id'].startswith('A')\n"
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "piper_seams_probe.py")
    with open(path, "w") as f:
        f.write(src)
    assert len(_uses_of_op_ids(path)) == 4


# ----------------------------------------------------------------------------- schedules

@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_registry_entry_builds_what_it_says(name):
    e = SCHEDULE_TABLE[name]
    pp, m = 2, 8
    spec = build_schedule(name, pp, m, stages_per_rank=e.stages_per_rank)
    assert spec.placement == e.placement
    copies = {len(r) for r in spec.stage_ranks.values()}
    assert copies == {e.copies}
    assert spec.num_stages == pp * e.stages_per_rank
    if e.torch_name:
        assert canonical_schedule("Schedule" + e.torch_name) == name
    if e.demo_as:
        assert SCHEDULE_TABLE[e.demo_as].copies == 1


def test_explorer_and_demo_read_the_registry():
    from piper_sim.cli.demo import small_strategy
    from piper_sim.explore import Candidate

    for name, e in SCHEDULE_TABLE.items():
        assert Candidate(pp=2, schedule=name, microbatches=8, dp=1, zero=0).v == e.stages_per_rank
        small = small_strategy(Candidate(pp=2, schedule=name, microbatches=8, dp=1, zero=0))
        sched = next(d["name"] for d in small["directives"] if d["op"] == "schedule")
        assert sched == (e.demo_as or ("interleaved_1f1b" if e.needs_ep else name))  # no EP in this winner
        compile(small)  # the demo's small plan compiles for every winner


@pytest.mark.parametrize("winner, kinds", [
    (dict(pp=1, schedule="1f1b", dp=8, zero=3), {"dp": 2}),
    (dict(pp=1, schedule="1f1b", dp=4, zero=1, tp=2, sp=True), {"dp": 2, "tp": 2}),
    (dict(pp=1, schedule="1f1b", dp=8, zero=1, ep=8), {"dp": 2, "ep": 2}),
    (dict(pp=4, schedule="zb1p", dp=8, zero=1, ep=4), {"pp": 2, "dp": 2, "ep": 2}),
    (dict(pp=2, schedule="interleaved_1f1b", dp=1, zero=0, cp=2), {"pp": 2, "cp": 2}),
])
def test_the_demo_runs_a_plan_of_the_winners_kinds(winner, kinds):
    """DP-only -> DP, TP -> TP, EP -> EP, PP + EP -> both...; and the executor runs it."""
    from piper_sim.cli.demo import _unrunnable, small_strategy
    from piper_sim.explore import Candidate

    small = small_strategy(Candidate(microbatches=8, **winner))
    plan = compile(small)
    lay = plan.layout
    assert {k: v for k, v in dict(pp=lay.pp, dp=lay.dp, ep=lay.ep, tp=lay.tp, cp=lay.cp).items() if v > 1} == kinds
    if "pp" in kinds:
        assert plan.header.schedule == winner["schedule"]
    assert plan.header.zero == (winner["zero"] if "dp" in kinds else 0)
    assert _unrunnable(small) == ""


# ----------------------------------------------------------------------------- tables

def test_one_table_per_fact_agrees_across_layers():
    import torch

    from costmodel import model as cm_model
    from costmodel.dtypes import DTYPES, dtype_name, torch_dtype
    from piper_sim import trace

    assert cm_model.COMPUTE_KINDS == COMPUTE_KINDS  # costmodel may not import the plan: checked here
    assert trace.COMPUTE_KINDS is COMPUTE_KINDS
    for name, d in DTYPES.items():
        assert torch_dtype(name).itemsize == d.bytes
        assert dtype_name(torch_dtype(name)) == name
    assert dtype_name(torch.int64) == "int64"


# ----------------------------------------------------------------------------- mesh

def test_mesh_axes_keep_the_rank_numbering():
    for pp, dp, tp, ep in itertools.product([1, 2, 3], [1, 2, 4], [1, 2], [1, 2]):
        if dp % ep:
            continue
        lay = Layout(pp=pp, dp=dp, ep=ep, tp=tp, stage_ranks={s: [s % pp] for s in range(pp)})
        assert list(lay.axes) == ["pp", "dp", "cp", "tp"]
        for p, d, t in itertools.product(range(pp), range(dp), range(tp)):
            r = (p * dp + d) * tp + t  # the formula of plan format 1
            assert lay.rank_at({"pp": p, "dp": d, "tp": t}) == r == lay.rank(p, d, t)
            assert lay.coords_of(r) == {"pp": p, "dp": d, "cp": 0, "tp": t}
            assert lay.group_ranks("tp", r) == list(range(r - t, r - t + tp))
            assert lay.group_ranks("dp", r) == [(p * dp + x) * tp + t for x in range(dp)]
            assert lay.group_ranks("pp", r) == [(x * dp + d) * tp + t for x in range(pp)]
            base = d // ep * ep
            assert lay.group_ranks("ep", r) == [(p * dp + x) * tp + t for x in range(base, base + ep)]
        assert lay.class_ranks(pp - 1) == list(range((pp - 1) * dp * tp, pp * dp * tp))


def test_groups_are_the_ranks_their_definition_names():
    """Every symbolic group (`Layout.group_ranks`, computed with the rank formula) against its
    definition in coordinates, over layouts with CP, HSDP shards and two stage copies (dualpipe)."""
    for pp, dp, cp, tp, ep, shard in itertools.product([1, 3], [2, 4], [1, 2], [1, 2], [1, 2], [0, 2]):
        lay = Layout(pp=pp, dp=dp, ep=ep, tp=tp, cp=cp, dp_shard=shard,
                     stage_ranks={s: sorted({s, pp - 1 - s}) for s in range(pp)})
        for r in range(lay.world_size):
            c = lay.coords_of(r)
            for axis in ("pp", "dp", "cp", "tp"):
                assert lay.group_ranks(axis, r) == [lay.rank_at({**c, axis: i}) for i in range(lay.axes[axis])]
            assert lay.group_ranks("ep", r) == [lay.rank_at({**c, "dp": d})
                                                for d in range(c["dp"] // ep * ep, c["dp"] // ep * ep + ep)]
            for s in range(pp):
                def stage(keep):
                    return sorted(lay.rank_at({**c, "pp": p, "dp": d, "cp": k}) for p in lay.stage_ranks[s]
                                  for d in range(dp) if keep(d) for k in range(cp))
                assert lay.group_ranks(f"stage:{s}", r) == stage(lambda d: True)
                assert lay.group_ranks(f"stage:{s}:edp", r) == stage(lambda d: d % ep == c["dp"] % ep)
                if shard:
                    assert lay.group_ranks(f"stage:{s}:shard", r) == stage(lambda d: d // shard == c["dp"] // shard)
                    assert lay.group_ranks(f"stage:{s}:rep", r) == sorted(
                        lay.rank_at({**c, "dp": d}) for d in range(dp) if d % shard == c["dp"] % shard)


def test_plan_files_are_packed_and_read_back_to_the_same_content(tmp_path):
    """The file form (version 3) holds version 2's content in less space: the same hash,
    the same instructions; version 2 JSON still loads; a row with too few values is refused."""
    plan = compile(strategy(pp=2, dp=2, zero=1, tp=2, sp=True))
    packed, plain = json.loads(plan.dumps()), plan.to_json()
    assert packed["version"] == 3 and plain["version"] == PLAN_VERSION
    assert packed["hash"] == plain["hash"] == plan.content_hash()
    assert len(plan.dumps()) < 0.75 * len(json.dumps(plain, separators=(",", ":")))
    for d in (packed, plain):
        again = Plan.from_json(d)
        assert again.content_hash() == plan.content_hash()
        assert [[i.to_json() for i in c.instructions()] for c in again.classes] == \
               [[i.to_json() for i in c.instructions()] for c in plan.classes]
    path = tmp_path / "p.json"
    plan.save(str(path))
    assert Plan.load(str(path)).content_hash() == plan.content_hash()
    packed["classes"][0]["streams"]["compute"][0].pop()
    with pytest.raises(PlanError, match="malformed plan file.*stream 'compute'"):
        Plan.from_json(packed)
