"""``shard_tensor`` on chosen segments (issue 12): selected layers/embedding/head are
Megatron-sharded, the others replicated over the TP group (whole parameters, no TP ops);
one-line errors; the executor's ``--check`` with half the layers sharded."""

from __future__ import annotations

import os
import sys

import pytest

from piper_sim.api import compile
from piper_sim.directives import expand, resolve
from piper_sim.models import get_config, tp_shard
from piper_sim.profiling import profile_model
from piper_sim.simulator import simulate
from piper_sim.strategy import StrategyError, parse_strategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_tensor_parallel import strategy  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def tiny(select: dict | None, tp: int = 2, sp: bool = False, m: int = 2, seq: int = 64) -> dict:
    d = [{"op": "pipeline", "degree": 1}, {"op": "schedule", "name": "1f1b"},
         {"op": "tensor_parallel", "degree": tp, "sequence_parallel": sp}]
    if select is not None:
        d.append({"op": "shard_tensor", "degree": tp, **select})
    return {"model": "gpt-tiny", "cluster": f"cpu:{tp}", "global_batch": m, "seq_len": seq, "microbatches": m,
            "directives": d}


def test_tp_ops_only_for_selected_layers_in_closed_form():
    """Per selected layer per micro-batch, 4 all-reduces of b·s·h (2 in F, 2 in B); none for
    the replicated layers; the replicated embedding has none, the sharded head its 4."""
    cfg = get_config("llama3-8b")
    m, s = 2, 1024
    selected = set(range(0, 16))
    plan = compile(strategy(tp=4, pp=2, m=m, gb=m, seq=s,
                            extra=[{"op": "shard_tensor", "degree": 4, "layers": "0-15", "embedding": False}]))
    ev = simulate(plan).events
    tp = ev[ev["stream"] == "tp"]
    act = s * cfg.hidden * 2
    for layer in range(cfg.n_layers):
        ops = tp[tp["op_id"].str.contains(rf"\.l{layer}\.")]
        want = 4 * m if layer in selected else 0
        assert len(ops) == want, layer
        assert set(ops["kind"]) <= {"ALLREDUCE"} and set(ops["bytes"]) <= {act}
    assert not tp["op_id"].str.contains("embed").any()
    assert len(tp[tp["op_id"].str.contains("head")]) == 4 * m
    assert plan.meta["tensor_parallel"] == {"degree": 4, "sequence_parallel": False, "layers": sorted(selected),
                                            "embedding": False, "head": True}


def test_states_of_unselected_segments_are_not_divided():
    """A rank holds 1/T of the selected segments' matrices and every unselected segment whole."""
    cfg, t = get_config("gpt-tiny"), 2
    whole = {x.name: x.param_count for x in profile_model(cfg, 1, 64)}
    shard = {x.name: x.param_count for x in profile_model(tp_shard(cfg, t), 1, 64)}
    assert all(shard[n] < whole[n] for n in whole)  # every segment has sharded matrices
    chosen = {"embed", "layers.0", "layers.1", "layers.2", "layers.3"}
    plan = compile(tiny({"layers": "0-3", "head": False}))
    per_rank = sum(shard[n] if n in chosen else whole[n] for n in whole)
    sm = plan.classes[0].static_memory
    assert sm == {"params_bytes": 2 * per_rank, "grads_bytes": 2 * per_rank, "optimizer_bytes": 12 * per_rank}
    full_tp, no_tp = compile(tiny(None)), compile({**tiny(None, tp=1), "directives": []})
    assert full_tp.classes[0].static_memory["params_bytes"] < sm["params_bytes"] < \
        no_tp.classes[0].static_memory["params_bytes"]
    # a replicated layer's compute is the whole layer's: more flops than a sharded one
    f = {i.id: i for i in plan.classes[0].instructions() if i.kind == "F"}
    assert f["F.s0.mb0.p5"].flops == pytest.approx(t * f["F.s0.mb0.p1"].flops, rel=0.05)


def test_selection_of_every_segment_is_the_plain_directive(capsys, tmp_path):
    everything = compile(tiny({"layers": "0-7", "embedding": True, "head": True}))
    plain = compile(tiny(None))
    ids = [[i.id for i in c.instructions()] for c in (everything.classes[0], plain.classes[0])]
    assert ids[0] == ids[1] and "layers" not in everything.meta["tensor_parallel"]
    low = expand(parse_strategy(tiny({"layers": [2, 0], "head": False}, sp=False)))
    setup = resolve(low)
    assert (setup.tp, setup.tp_layers, setup.tp_embed, setup.tp_head) == (2, (0, 2), True, False)
    assert [setup.tp_sharded(u) for u in ("embed", "layers.0", "layers.1", "head")] == [True, True, False, False]
    path = tmp_path / "p.json"
    compile(tiny({"layers": [0, 1, 2, 5], "head": False})).save(str(path))
    from piper_sim.cli import main

    assert main(["show", str(path)]) == 0
    assert "tp=2 sharded: embed, layers 0-2,5 (others replicated)" in capsys.readouterr().out


@pytest.mark.parametrize("select,sp,message", [
    ({"layers": [3, 8]}, False, "field 'layers' names layer(s) 8, but gpt-tiny has 8 layers (0..7)"),
    # a long range is named as runs, not listed index by index
    ({"layers": "0-99"}, False, "field 'layers' names layer(s) 8-99, but gpt-tiny has 8 layers (0..7)"),
    ({"layers": "0-3"}, True, "shard_tensor: field 'sequence_parallel' needs every segment sharded"),
    ({"layers": "3-1"}, False, "field 'layers' must be a list of layer indices or a range"),
    ({"layers": [0, -1]}, False, "field 'layers' entry must be"),
    ({"head": "no"}, False, "field 'head' must be true or false"),
    ({"layers": [], "embedding": False, "head": False}, False, "select no segment"),
    ({"degree": 4, "layers": [0]}, False, "shard_tensor: field 'degree' 4 differs from tensor_parallel's degree 2"),
], ids=["out-of-range", "out-of-range-runs", "sp", "range", "negative", "head-type", "empty", "degree"])
def test_bad_selections_are_one_line_errors_naming_the_field(select, sp, message):
    s = tiny(select, sp=sp)
    if "degree" in select:
        s["directives"][-1]["degree"] = select["degree"]
    with pytest.raises(StrategyError) as e:
        compile(s)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_selection_at_degree_1_is_checked_too():
    """``shard_tensor`` of degree 1 shards nothing, but a layer that does not exist is still an error."""
    s = tiny(None, tp=1)
    s["directives"] = [d for d in s["directives"] if d["op"] != "tensor_parallel"]
    s["directives"].append({"op": "shard_tensor", "degree": 1, "layers": [2, 30, 31]})
    with pytest.raises(StrategyError, match=r"field 'layers' names layer\(s\) 30-31, but gpt-tiny has 8 layers"):
        compile(s)
    s["directives"][-1]["layers"] = [2, 7]
    assert "tensor_parallel" not in compile(s).meta


def test_executor_half_the_layers_sharded_matches_the_reference(tmp_path):
    from test_executor_tp import assert_matches_reference, reference_losses, run_checks, tp_strategy

    configs = {"tp2-l0-3-head-whole": tp_strategy(extra=[{"op": "shard_tensor", "degree": 2, "layers": "0-3",
                                                          "head": False}]),
               "tp2-l4-7-embed-whole": tp_strategy(extra=[{"op": "shard_tensor", "degree": 2, "layers": [4, 5, 6, 7],
                                                           "embedding": False}])}
    res, _ = run_checks(tmp_path, 2, configs)
    assert_matches_reference(res, reference_losses(tmp_path, configs["tp2-l0-3-head-whole"]))


@pytest.mark.parametrize("s", [
    strategy("gpt-tiny", tp=2, pp=2, dp=2, zero=3, m=4, seq=64,
             extra=[{"op": "shard_tensor", "degree": 2, "layers": "2-5", "embedding": False}]),
    strategy("moe-tiny", tp=2, pp=2, dp=2, zero=1, m=4, seq=64,
             extra=[{"op": "expert_parallel", "degree": 2}, {"op": "shard_tensor", "degree": 2, "layers": [1, 3]}]),
], ids=["tp2-pp2-dp2-z3", "moe-tp2-ep2"])
def test_partial_plans_fold_exactly(s):
    from piper_sim.compiler import compile_strategy, compile_unfolded

    folded = compile_strategy(s).plan
    expanded, unfolded = folded.expand(), compile_unfolded(s)
    for a, b in zip(expanded, unfolded):
        for name in a.streams:
            assert [i.to_json() for i in a.streams[name]] == [i.to_json() for i in b.streams[name]]
    tp_layers = {i.name.split(".")[0] for c in folded.classes for i in c.instructions()
                 if i.stream == "tp" and i.name.startswith("l")}
    chosen = s["directives"][-1]["layers"]
    assert tp_layers == ({f"l{i}" for i in range(2, 6)} if chosen == "2-5" else {"l1", "l3"})
    assert simulate(folded).step_time_s == pytest.approx(simulate(folded, fold=False).step_time_s, rel=1e-9)
