"""A plan file is what its own strategy compiles to (`piper_sim.origin`): mutated plans of every
parallelism family are refused unless the mutation touched cost estimates only, by the one
check `simulate`, `run` and each worker make (`piper_sim.validate.load_valid_plan`)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import subprocess
import sys

import pytest

from piper_sim.api import compile
from piper_sim.origin import COST_FIELDS
from piper_sim.plan import COLLECTIVE_KINDS, COMPUTE_KINDS, Instruction, Plan, _hash
from piper_sim.validate import PlanValidationError, check_plan_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}


def _strategy(model: str = "gpt-tiny", pp: int = 1, sched: str = "1f1b", dp: int = 1, zero: int = 0, tp: int = 1,
              cp: int = 1, ep: int = 1, v: int | None = None, m: int = 2) -> dict:
    d: list[dict] = [{"op": "pipeline", "degree": pp, **({"stages_per_rank": v} if v else {})},
                     {"op": "schedule", "name": sched}]
    if dp > 1 or zero:
        d.append({"op": "data_parallel", "degree": dp, "zero": zero})
    if tp > 1:
        d.append({"op": "tensor_parallel", "degree": tp, "sequence_parallel": True})
    if cp > 1:
        d.append({"op": "context_parallel", "degree": cp})
    if ep > 1:
        d.append({"op": "expert_parallel", "degree": ep})
    return {"model": model, "cluster": f"cpu:{pp * dp * tp * cp}", "global_batch": dp * m, "seq_len": 16,
            "microbatches": m, "directives": d}


FAMILIES = {
    "pp2-1f1b": _strategy(pp=2, m=4),
    "pp2-zbv": _strategy(pp=2, sched="zbv", v=2, m=4),
    **{f"dp2-zero{z}": _strategy(dp=2, zero=z) for z in (0, 1, 2, 3)},
    "tp2-sp": _strategy(tp=2),
    "cp2": _strategy(cp=2),
    "ep2-dp2": _strategy("moe-tiny", dp=2, ep=2),
}


def _copy(plan: Plan) -> Plan:
    return Plan(layout=copy.deepcopy(plan.layout), classes=copy.deepcopy(plan.classes),
                meta=copy.deepcopy(plan.meta), kernels=dict(plan.kernels))


def _ops(plan: Plan) -> list[tuple[int, str, int, Instruction]]:
    return [(ci, s, i, ins) for ci, c in enumerate(plan.classes) for s, lst in c.streams.items()
            for i, ins in enumerate(lst)]


PER_KIND = 1  # ops sampled per kind and plan (each mutated every way): about 650 mutations


def _mutations(plan: Plan, rng: random.Random, per_kind: int = PER_KIND) -> list[tuple[str, bool, Plan]]:
    """(what, accepted?, mutated plan): a sample of ops of each kind, each mutated every way."""
    by_kind: dict[str, list] = {}
    for loc in _ops(plan):
        by_kind.setdefault(loc[3].kind, []).append(loc)
    picked = [loc for locs in by_kind.values() for loc in rng.sample(locs, min(per_kind, len(locs)))]
    out = []

    def mutate(what: str, accepted: bool, edit) -> None:
        new = _copy(plan)
        edit(new)
        out.append((what, accepted, new))

    for ci, stream, i, ins in picked:
        name = f"{ins.id}@{ci}"

        def op(p: Plan, ci=ci, stream=stream, i=i) -> Instruction:
            return p.classes[ci].streams[stream][i]

        mutate(f"drop {name}", False, lambda p, ci=ci, s=stream, i=i: p.classes[ci].streams[s].pop(i))
        mutate(f"duplicate {name}", False, lambda p, ci=ci, s=stream, i=i: p.classes[ci].streams[s].insert(
            i + 1, dataclasses.replace(copy.deepcopy(p.classes[ci].streams[s][i]),
                                       id=p.classes[ci].streams[s][i].id + ".copy")))
        mutate(f"1,000 copies of {name}", False, lambda p, ci=ci, s=stream, i=i: p.classes[ci].streams[s].extend(
            dataclasses.replace(p.classes[ci].streams[s][i], id=f"x{k}") for k in range(1000)))
        if i + 1 < len(plan.classes[ci].streams[stream]):
            def swap(p, ci=ci, s=stream, i=i):
                lst = p.classes[ci].streams[s]
                lst[i], lst[i + 1] = lst[i + 1], lst[i]
            mutate(f"swap {name} with the next op", False, swap)
        mutate(f"move {name} to another stream", False, lambda p, ci=ci, s=stream, i=i: (
            p.classes[ci].streams.setdefault("other", []).append(p.classes[ci].streams[s].pop(i))))
        mutate(f"self-dependency of {name}", False, lambda p, op=op: op(p).deps.append(op(p).id))
        if ins.deps:
            mutate(f"drop a dependency of {name}", False, lambda p, op=op: op(p).deps.pop())
        mutate(f"flops of {name} x3", True, lambda p, op=op: setattr(op(p), "flops", op(p).flops * 3 + 1))
        mutate(f"memory of {name} x2", True, lambda p, op=op: (setattr(op(p), "alloc", op(p).alloc * 2),
                                                                setattr(op(p), "free", op(p).free * 2)))
        mutate(f"flops of {name} NaN", False, lambda p, op=op: setattr(op(p), "flops", math.nan))
        mutate(f"bytes of {name} negative", False, lambda p, op=op: setattr(op(p), "bytes", -1.0))
        if ins.kind in COMPUTE_KINDS:
            mutate(f"HBM bytes of {name} x2", True, lambda p, op=op: setattr(op(p), "bytes", op(p).bytes * 2 + 1))
            mutate(f"stage of {name} + 1", False, lambda p, op=op: setattr(op(p), "stage", op(p).stage + 1))
            mutate(f"micro-batch of {name} + 1", False, lambda p, op=op: setattr(op(p), "mb", op(p).mb + 1))
        else:
            mutate(f"payload of {name} x2", False, lambda p, op=op: setattr(op(p), "bytes", op(p).bytes * 2 + 1))
        if ins.kind in COLLECTIVE_KINDS:
            mutate(f"regroup {name} to pp", False, lambda p, op=op: setattr(op(p), "group", "pp"))
            mutate(f"kind of {name} changed", False, lambda p, op=op: setattr(
                op(p), "kind", "ALL_GATHER" if op(p).kind != "ALL_GATHER" else "ALLREDUCE"))
    meta_edits = {"model": lambda v: "nope", "dtype": lambda v: "fp16" if v != "fp16" else "bf16",
                  "seq_len": lambda v: v * 2, "micro_batch_size": lambda v: v + 1, "microbatches": lambda v: v + 1,
                  "zero": lambda v: (v + 1) % 4, "stage_parts": lambda v: [[["embed"]]], "seed": lambda v: v + 1}
    for key, new in meta_edits.items():
        mutate(f"meta.{key} edited", False, lambda p, k=key, new=new: p.meta.__setitem__(k, new(p.meta[k])))
    mutate("meta.strategy global batch doubled", False, lambda p: p.meta["strategy"].__setitem__(
        "global_batch", p.meta["strategy"]["global_batch"] * 2))
    mutate("meta.model_flops_per_step x2", True, lambda p: p.meta.__setitem__(
        "model_flops_per_step", p.meta["model_flops_per_step"] * 2))
    return out


def test_cost_fields_are_estimates_only():
    """The fields a mutation may change and stay accepted are those only the simulator reads."""
    assert COST_FIELDS <= {f for f in Instruction.__dataclass_fields__}
    assert not COST_FIELDS & {"kind", "group", "bytes", "peer", "deps", "bucket", "stage", "mb", "needed_by"}


def test_mutated_plans_are_refused_unless_only_costs_changed():
    """About 650 mutations over PP, split backward, DP ZeRO 0-3, TP+SP, CP and EP plans (at least 300): each
    refused (one line) exactly when it changes what runs, accepted when it changes costs only."""
    rng = random.Random(0)
    total, refused = 0, 0
    wrong = []
    for family, strategy in FAMILIES.items():
        plan = compile(strategy)
        check_plan_file(plan)  # the plan as compiled is accepted
        for what, accepted, mutated in _mutations(plan, rng):
            total += 1
            try:
                check_plan_file(mutated)
                got = True
            except PlanValidationError as e:
                got, refused = False, refused + 1
                assert "\n" not in str(e), str(e)
            if got != accepted:
                wrong.append(f"{family}: {what}: {'accepted' if got else 'refused'}")
    assert not wrong, wrong[:10]
    assert total >= 300 and refused >= 250, (total, refused)


def _tamper(plan: Plan, edit, path) -> str:
    d = json.loads(json.dumps(plan.to_json()))
    edit(d)
    d["hash"] = _hash({k: d[k] for k in ("kernels", "layout", "meta", "classes") if k in d})
    with open(path, "w") as f:
        json.dump(d, f)
    return str(path)


def _drop_all(kind: str):
    def edit(d: dict) -> None:
        for c in d["classes"]:
            for s in c["streams"]:
                c["streams"][s] = [i for i in c["streams"][s] if i["kind"] != kind]
    return edit


def _drop_opt(d: dict) -> None:
    d["classes"][0]["streams"]["compute"] = [i for i in d["classes"][0]["streams"]["compute"] if i["kind"] != "OPT"]


TAMPERED = {  # the plans that trained wrong with exit 0, in both back ends
    "zero0-no-allreduce": ("dp2-zero0", _drop_all("ALLREDUCE"), "lacks AR"),
    "no-optimizer-step": ("dp2-zero1", _drop_opt, "lacks OPT"),
    "ep-dispatch-dropped-everywhere": ("ep2-dp2", _drop_all("ALL_TO_ALL"), "lacks A2A"),
}


@pytest.mark.parametrize("name", list(TAMPERED))
def test_simulate_run_and_the_worker_refuse_a_tampered_plan(tmp_path, name):
    """The same one line, exit 2, from all three entry points, before any process group."""
    family, edit, needle = TAMPERED[name]
    path = _tamper(compile(FAMILIES[family]), edit, tmp_path / "plan.json")
    worker_env = {**ENV, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": "1"}
    commands = {"simulate": ([sys.executable, "-m", "piper_sim.cli", "simulate", path], ENV),
                "run": ([sys.executable, "-m", "piper_sim.cli", "run", path], ENV),
                "worker": ([sys.executable, "-m", "executor", path], worker_env)}
    lines = {}
    for entry, (cmd, env) in commands.items():
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (entry, r.returncode, r.stderr[-2000:])
        assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, (entry, r.stderr[-2000:])
        lines[entry] = r.stderr.strip().split("invalid plan: ")[-1]
    assert len(set(lines.values())) == 1, lines


def _losses(path: str) -> list[float]:
    r = subprocess.run([sys.executable, "-m", "piper_sim.cli", "run", path, "--steps", "2", "--json",
                        "--no-hash-check"], env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line)["loss"] for line in r.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_a_plan_with_edited_costs_trains_as_the_original(tmp_path):
    """What the check accepts trains the same: a ZeRO-1 plan with every compute op's flops and
    HBM bytes edited (a what-if for the simulator) gives the original's losses, bit for bit."""
    plan = compile(FAMILIES["dp2-zero1"])
    original = str(tmp_path / "plan.json")
    plan.save(original)

    def slower(d: dict) -> None:
        for c in d["classes"]:
            for lst in c["streams"].values():
                for i in lst:
                    if i["kind"] in COMPUTE_KINDS:
                        i["flops"] = i.get("flops", 0) * 5 + 1
                        i["bytes"] = i.get("bytes", 0) * 2 + 1
    edited = _tamper(plan, slower, tmp_path / "edited.json")
    assert _losses(edited) == _losses(original)
