"""DeepSeek-V3's multi-token-prediction (MTP) modules (issue 26 part 4; arXiv 2412.19437 §2.2,
Megatron-Core ``MultiTokenPredictionLayer``): parameters and profiled costs equal their closed
forms, the module joins the head's stage (in a Megatron layout string as ``m``), it lengthens the
last stage's step, and the executor refuses it under CP in one line."""

from __future__ import annotations

import warnings

import pytest

from piper_sim.api import compile
from piper_sim.configs import get_config, unit_names, unit_param_count, unit_segments
from piper_sim.profiling import profile_model
from piper_sim.simulator import simulate
from piper_sim.sources import resolve_model
from piper_sim.strategy import StrategyError

pytestmark = pytest.mark.filterwarnings("ignore")

MOE_MTP = {"name": "moe-mtp", "n_layers": 4, "hidden": 64, "n_heads": 4, "n_kv_heads": 2, "ffn": 128, "vocab": 512,
           "max_seq": 128, "experts": 4, "top_k": 2, "expert_ffn": 64, "mtp_layers": 1}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the model files below


def _strategy(model: dict, pp: int = 2, layout: str | None = None) -> dict:
    import json

    path = f"{model['name']}-{model['mtp_layers']}.json"
    with open(path, "w") as f:
        json.dump(model, f)
    pipe = {"op": "pipeline", "degree": pp, **({"layout": layout} if layout else {})}
    return {"model": path, "cluster": f"cpu:{pp}", "global_batch": 4, "seq_len": 32, "microbatches": 4,
            "dtype": "fp32", "directives": [pipe, {"op": "schedule", "name": "1f1b"}]}


def test_deepseek_v3_mtp_parameters_are_the_closed_form():
    base, mtp = get_config("deepseek-v3"), get_config("deepseek-v3-mtp")
    h = mtp.hidden
    # enorm, hnorm, final norm (RMSNorm: h each), eh_proj 2h x h, and one MoE layer like layers.60
    assert unit_param_count(mtp, "mtp.0") == 3 * h + 2 * h * h + unit_param_count(base, "layers.60")
    assert mtp.param_count() == base.param_count() + unit_param_count(mtp, "mtp.0")
    assert 682e9 < mtp.param_count() < 684e9  # 671B + ~11.6B (HF's 685B counts the MTP's own embedding/head)
    from piper_sim.models import build_model

    assert sum(p.numel() for p in build_model(mtp).parameters()) == mtp.param_count()
    assert unit_names(mtp)[-2:] == ["mtp.0", "head"]
    assert unit_segments(mtp, "mtp.0") == ["mtp.0.pre", "mtp.0.experts", "mtp.0.loss"]


def test_mtp_segments_cost_a_layer_plus_projection_and_a_second_head():
    cfg = resolve_model(MOE_MTP)
    T, h = 2 * 32, cfg.hidden
    segs = {s.name: s for s in profile_model(cfg, 2, 32, "fp32")}
    last = f"layers.{cfg.n_layers - 1}"
    # the projection eh_proj: a [T, 2h] x [2h, h] GEMM forward (norms and the lookup count no flops)
    assert segs["mtp.0.pre"].fwd_flops == segs[f"{last}.pre"].fwd_flops + 2 * T * (2 * h) * h
    assert segs["mtp.0.experts"].fwd_flops == segs[f"{last}.experts"].fwd_flops
    assert segs["mtp.0.loss"].fwd_flops == segs["head"].fwd_flops  # final norm, the shared head, the loss
    assert segs["mtp.0.loss"].param_count == h  # its own final norm only: the head's weight is shared
    # ... which the module's other segments do not count again: together they are the unit
    assert sum(segs[f"mtp.0.{p}"].param_count for p in ("pre", "experts", "loss")) == unit_param_count(cfg, "mtp.0")
    assert segs["mtp.0.loss"].out_bytes == 2 * 32 * h * 4  # the main hidden states go on to the head


def test_mtp_sits_with_the_head_and_slows_the_last_stage():
    with_mtp = compile(_strategy(MOE_MTP, layout="Et*2|t*2mL"))
    assert with_mtp.header.stage_units[-1][-2:] == ["mtp.0", "head"]
    plain = compile(_strategy({**MOE_MTP, "mtp_layers": 0}, layout="Et*2|t*2L"))
    assert simulate(with_mtp).step_time_s > simulate(plain).step_time_s
    assert compile(_strategy(MOE_MTP)).header.stage_units[-1][-2:] == ["mtp.0", "head"]  # no layout: the same


def test_a_layout_must_place_every_mtp_module():
    with pytest.raises(StrategyError, match=r"places 0 MTP module\(s\) \('m'\) but model moe-mtp has mtp_layers = 1"):
        compile(_strategy(MOE_MTP, layout="Et*2|t*2L"))


def test_the_executor_runs_mtp_under_pp_and_cp():
    from executor.support import unrunnable

    assert unrunnable(compile(_strategy(MOE_MTP)), "p.json") == ""  # PP2 (tests/test_executor_mtp.py runs it)
    cp = _strategy(MOE_MTP, pp=2)  # cpu:2
    cp["directives"] = [{"op": "context_parallel", "degree": 2}]
    assert unrunnable(compile(cp), "p.json") == ""  # CP2 (tests/test_executor_mtp.py runs it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert unrunnable(compile(_strategy({**MOE_MTP, "mtp_layers": 0}))) == ""


@pytest.mark.parametrize("sp", [False, True])
def test_mtp_under_tensor_parallelism_compiles_with_its_own_head_collectives(sp):
    """The MTP module's loss segment (``mtp.0.loss``) is a head too: its vocabulary-parallel loss
    all-reduces are its own ops (``mtp.0.head.loss.*``), not a second ``head.loss.*`` (which made
    every MTP model under TP fail to compile); the plan simulates."""
    s = _strategy({**MOE_MTP, "name": "dense-mtp", "experts": 0, "top_k": 0})
    s["cluster"] = "cpu:4"
    s["directives"].append({"op": "tensor_parallel", "degree": 2, "sequence_parallel": sp})
    plan = compile(s)
    names = [i.name for i in plan.classes[-1].instructions() if i.name and "loss." in i.name and i.mb == 0]
    assert sorted(names) == sorted(f"{h}.loss.{x}" for h in ("head", "mtp.0.head") for x in ("max", "target", "sumexp"))
    # eh_proj as Megatron-Core runs it: column-parallel, its output gathered over the hidden dim
    act = 1 * 32 * 64 * 4  # micro-batch 1, seq 32, hidden 64, fp32
    eh = {(i.name, i.direction): i.bytes for i in plan.classes[-1].instructions()
          if i.name and i.name.startswith("mtp.0.eh.") and i.mb == 0}
    want = {("mtp.0.eh.gather", "F"): act}
    want.update({("mtp.0.eh.ag", "F"): 2 * act, ("mtp.0.eh.scatter.ag", "B"): act, ("mtp.0.eh.regather", "B"): 2 * act,
                 ("mtp.0.eh.rs", "B"): 2 * act} if sp else {("mtp.0.eh.ar", "B"): 2 * act})
    assert eh == want
    # its shifted tokens through the model's vocabulary-parallel embedding: reduced like the embedding's
    emb = {(i.name, i.direction, i.kind): i.bytes for i in plan.classes[-1].instructions()
           if i.name and i.name.startswith("mtp.0.embed.") and i.mb == 0}
    assert emb == ({("mtp.0.embed.rs", "F", "REDUCE_SCATTER"): act, ("mtp.0.embed.ag", "B", "ALL_GATHER"): act} if sp
                   else {("mtp.0.embed.ar", "F", "ALLREDUCE"): act})
    assert simulate(plan).step_time_s > 0
