"""Pipeline layouts as real runs write them (issue 26 part 3): stages without transformer layers
(an embedding-only first stage, a head-and-loss-only last stage) given as ``layers_per_stage``
zeros or as Megatron's ``--pipeline-model-parallel-layout`` string (``piper_sim.layouts``), for
1F1B, interleaved 1F1B with one layer per chunk, ZB1P and ZB-V, compiled, simulated and run by
the executor against the single-process reference."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from piper_sim.api import compile
from piper_sim.layouts import layout_layers
from piper_sim.profiling import profile_model
from piper_sim.configs import get_config
from piper_sim.strategy import StrategyError

pytestmark = pytest.mark.filterwarnings("ignore")


def strategy(pp: int, sched: str, lps: list[int] | None = None, layout: str | None = None, m: int = 8,
             v: int | None = None, dtype: str = "bf16", seq: int = 32, extra: tuple = ()) -> dict:
    pipe: dict = {"op": "pipeline", "degree": pp}
    if v:
        pipe["stages_per_rank"] = v
    if lps is not None:
        pipe["layers_per_stage"] = lps
    if layout is not None:
        pipe["layout"] = layout
    return {"model": "gpt-tiny", "cluster": f"cpu:{pp}", "global_batch": m, "seq_len": seq, "microbatches": m,
            "dtype": dtype, "directives": [pipe, {"op": "schedule", "name": sched}, *extra]}


def layers(n: range) -> list[str]:
    return [f"layers.{i}" for i in n]


# ------------------------------------------------------------------------------ the layout string


def test_layout_strings_read_as_megatron_parses_them():
    assert layout_layers("E|t*4|t*4|L", "w") == [0, 4, 4, 0]
    assert layout_layers("Et*3|(tt|)*29,m|L".replace("m", "t"), "w") == [3] + [2] * 29 + [1, 0]
    assert layout_layers("E|(t|)*22,L", "w") == [0] + [1] * 22 + [0]  # the Zero Bubble paper's 1F1B-I
    assert layout_layers("Ett|tt L", "w") == [2, 2]  # spaces, like commas, are cosmetic


@pytest.mark.parametrize("layout, says", [
    ("t*4|t*4|L", "must start with the embedding E"),
    ("E|t*4|t*4", "must end with the loss L"),
    ("E|t*4|L|t*4", "must end with the loss L"),
    ("EE|t*8|L", "must start with the embedding E, once"),
    ("E||t*8|L", "stage(s) [1] hold nothing"),
    ("Et*4|t*4mL", "places 1 MTP module(s) ('m') but model gpt-tiny has mtp_layers = 0"),
    ("Et*4m|t*4L", "MTP modules ('m') must sit in the last stage"),
    ("Et*4|tmt*3L", "MTP modules ('m') must sit in the last stage"),
    ("E|x*8|L", "letter(s) 'x'"),
    ("E|t*99999999|L", "unrolls to more than"),
])
def test_bad_layouts_are_refused_in_one_line(layout, says):
    with pytest.raises(StrategyError, match=r"field 'layout'") as e:
        compile(strategy(2, "1f1b", layout=layout))
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("pipe, says", [
    ({"layout": "E|t*4|t*4|L"}, "has 4 stages, not a multiple of the degree 3"),
    ({"layout": "E|t*2|t*2|t*2|t*2|L", "stages_per_rank": 1}, "6 stages = 3 × 2, but stages_per_rank is 1"),
    ({"layout": "E|t*8|L", "layers_per_stage": [0, 8, 0]}, "both give the layers per stage"),
    ({"layers_per_stage": [0, 4, 0, 4], "degree": 4}, "leaves stage(s) [2] with nothing"),
    ({"layers_per_stage": [0, 4, 3]}, "summing to the 8 layers"),
    ({"layers_per_stage": [0, -1, 9]}, "list of layer counts (0 or more)"),
])
def test_bad_layer_counts_are_refused_in_one_line(pipe, says):
    s = strategy(pipe.get("degree", 3), "1f1b")
    s["directives"][0].update(pipe)
    with pytest.raises(StrategyError) as e:
        compile(s)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_cli_refuses_a_bad_layout_with_exit_2(tmp_path):
    import json

    path = tmp_path / "s.json"
    path.write_text(json.dumps(strategy(3, "1f1b", layout="E|t*8")))
    r = subprocess.run([sys.executable, "-m", "piper_sim", "compile", str(path), "-o", str(tmp_path / "p.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "field 'layout'" in r.stderr and "must end with the loss L" in r.stderr


# ------------------------------------------------------------------------- compile and simulate


@pytest.mark.parametrize("name, s, units", [
    ("1f1b", strategy(4, "1f1b", [0, 4, 4, 0]), [["embed"], layers(range(4)), layers(range(4, 8)), ["head"]]),
    ("1f1b-layout", strategy(3, "1f1b", layout="E|t*8|L"), [["embed"], layers(range(8)), ["head"]]),
    ("zb1p", strategy(4, "zb1p", layout="E|t*4|t*4|L"), [["embed"], layers(range(4)), layers(range(4, 8)), ["head"]]),
    # one layer per chunk, the embedding and the head on chunks of their own (PP5 x 2 chunks)
    ("interleaved", strategy(5, "interleaved_1f1b", layout="E|(t|)*8,L", m=10),
     [["embed"], *[[f"layers.{i}"] for i in range(8)], ["head"]]),
    ("zbv", strategy(2, "zbv", [0, 4, 4, 0]), [["embed"], layers(range(4)), layers(range(4, 8)), ["head"]]),
])
def test_empty_first_and_last_stages_compile_and_simulate(name, s, units):
    from piper_sim.simulator import simulate

    plan = compile(s)
    assert plan.meta["stage_units"] == units
    r = simulate(plan)
    assert r.step_time_s > 0 and len(r.rank_stats) == s["directives"][0]["degree"]
    sends = {i.stage for c in plan.classes for i in c.instructions() if i.kind == "SEND"}
    assert sends == set(range(len(units)))  # every stage sends (forward or backward) as any stage


def test_stage_compute_and_memory_follow_the_layout():
    """An embedding-only stage computes the embedding's flops and nothing else, a head-only stage
    the head's (and loss's); its parameters are those units' alone."""
    from piper_sim.simulator import simulate

    s = strategy(4, "1f1b", [0, 4, 4, 0], m=4)
    plan = compile(s)
    segs = {x.unit: x for x in profile_model(get_config("gpt-tiny"), 1, 32, "bf16")}
    flops = {st: {} for st in range(4)}
    for c in plan.classes:
        for i in c.instructions():
            if i.kind in ("F", "B") and i.mb == 0:
                flops[i.stage][i.kind] = flops[i.stage].get(i.kind, 0) + i.flops
    assert flops[0]["F"] == segs["embed"].fwd_flops
    assert flops[0]["B"] == segs["embed"].bwd_input_flops + segs["embed"].bwd_weight_flops
    assert flops[3]["F"] == segs["head"].fwd_flops
    assert flops[3]["B"] == segs["head"].bwd_input_flops + segs["head"].bwd_weight_flops
    layer_f = sum(x.fwd_flops for x in profile_model(get_config("gpt-tiny"), 1, 32, "bf16")
                  if x.unit in layers(range(4)))
    assert flops[1]["F"] == layer_f
    stats = {x.pp_rank: x for x in simulate(plan).rank_stats}
    cfg = get_config("gpt-tiny")
    assert stats[0].params_bytes == pytest.approx(cfg.vocab * cfg.hidden * 2, rel=0.01)  # the table alone, bf16
    assert stats[0].compute_s < stats[1].compute_s / 4 and stats[3].compute_s < stats[1].compute_s
    even = {x.pp_rank: x for x in simulate(compile(strategy(4, "1f1b", [2, 2, 2, 2], m=4))).rank_stats}
    assert stats[1].activations_bytes > even[1].activations_bytes  # 4 layers' activations where 2 were


def test_existing_layouts_keep_their_plans():
    """``layout`` is only an other spelling: the same counts give the same stages and costs."""
    a = compile(strategy(4, "1f1b", [2, 2, 2, 2]))
    b = compile(strategy(4, "1f1b", layout="Ett|tt|tt|ttL"))
    assert a.meta["stage_units"] == b.meta["stage_units"]
    assert [i.to_json() for c in a.classes for i in c.instructions()] == \
        [i.to_json() for c in b.classes for i in c.instructions()]


# ------------------------------------------------------------------------------------ executor


def test_executor_check_with_embedding_only_and_head_only_stages(tmp_path):
    """torchrun, 4 gloo processes: PP4 1F1B and ZB1P with an embedding-only first and head-only
    last stage, interleaved 1F1B with one layer per chunk and ZB-V, each equal to the
    single-process reference (fp32: parameters within --check's tolerance, first-step
    gradients within 1e-5 relative)."""
    from tests.test_executor import GRAD_TOL, TOL, json_lines, torchrun

    configs = {
        "pp4-1f1b": strategy(4, "1f1b", [0, 4, 4, 0], dtype="fp32", seq=16),
        "pp4-zb1p": strategy(4, "zb1p", layout="E|t*4|t*4|L", dtype="fp32", seq=16),
        "pp4-interleaved": strategy(4, "interleaved_1f1b", layout="E|t|t|t|t|t|t*3|L", dtype="fp32", seq=16),
        "pp4-zbv": strategy(4, "zbv", [0, 1, 1, 2, 2, 1, 1, 0], dtype="fp32", seq=16),
    }
    paths = {}
    for name, s in configs.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = str(tmp_path / f"{name}.json")
            compile(s).save(path)
        paths[path] = name
    r = torchrun(4, [*paths, "--steps", "2", "--check", "--json"])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {paths[row["plan"]]: row for row in json_lines(r.stdout) if "max_rel_grad_diff" in row}
    assert set(rows) == set(configs)
    for name, row in rows.items():
        assert row["max_rel_grad_diff"] <= GRAD_TOL and row["max_rel_param_diff"] <= TOL, (name, row)
        assert row["within_tolerance"] is True and row["dtype"] == "fp32", (name, row)


def test_job_export_refuses_a_layout_in_one_line():
    from piper_sim.interop.common import InteropError, job_from_strategy

    with pytest.raises(InteropError, match=r"field 'layout' is not exported") as e:
        job_from_strategy(strategy(3, "1f1b", layout="E|t*8|L"))
    assert "\n" not in str(e.value)
