"""Checkpoints per parameter: a run saved under one layout resumes under another (pipeline
cut, TP, DP/ZeRO stage, EP, a tied embedding's copy) to the losses of the uninterrupted run,
and a checkpoint of another model is refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from executor import checkpoint
from piper_sim.plan import PlanError
from test_executor import ROOT, json_lines, save_plan, strategy, torchrun
from test_executor_tp import tp_strategy
from test_tied_embeddings import DP2, TIED
from test_tied_embeddings import strategy as pp2_strategy

pytestmark = pytest.mark.filterwarnings("ignore")

LOSS_TOL = 1e-6  # fp32: only the summation order differs between layouts (1 ulp of a loss near 6 is 4.8e-7)


def _losses(out: str) -> list[float]:
    return [row["loss"] for row in json_lines(out) if "loss" in row]


def assert_resumes_onto(tmp_path, saved: dict, n_saved: int, resumed: dict, n_resumed: int,
                        same_layout_too: bool = False) -> None:
    """4 steps under ``saved`` with a checkpoint after step 2; steps 2 and 3 again under
    ``resumed`` from that checkpoint: the same losses to LOSS_TOL (``same_layout_too``: and
    under ``saved`` again, bit for bit)."""
    assert saved["global_batch"] == resumed["global_batch"]
    ck = str(tmp_path / "ck")
    full = torchrun(n_saved, [save_plan(tmp_path, "saved", saved), "--steps", "4", "--save", ck,
                              "--save-every", "2", "--json"], timeout=300)
    assert full.returncode == 0, full.stderr[-3000:]
    want = _losses(full.stdout)
    with open(os.path.join(checkpoint.step_dir(ck, 2), checkpoint.META)) as f:
        assert json.load(f)["format"] == checkpoint.FORMAT
    again = torchrun(n_resumed, [save_plan(tmp_path, "resumed", resumed), "--steps", "2", "--resume",
                                 checkpoint.step_dir(ck, 2), "--json"], timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = [r for r in json_lines(again.stdout) if "loss" in r]
    assert [r["step"] for r in rows] == [2, 3]
    got = [r["loss"] for r in rows]
    assert max(abs(a - b) for a, b in zip(got, want[2:])) <= LOSS_TOL, (got, want)
    if same_layout_too:
        again = torchrun(n_saved, [str(tmp_path / "saved.json"), "--steps", "2", "--resume",
                                   checkpoint.step_dir(ck, 2), "--json"], timeout=300)
        assert again.returncode == 0, again.stderr[-3000:]
        assert _losses(again.stdout) == want[2:]  # bit for bit


def _same_batch(s: dict, like: dict) -> dict:
    return {**s, "global_batch": like["global_batch"]}


def test_tp2_sp_resumes_onto_dp2_zero3(tmp_path):
    """TP slices (DTensors) saved, read back as ZeRO-3 shards of whole parameters, and by the
    same layout bit for bit (the fast set's save/resume check; the slow set has one per layout)."""
    saved = tp_strategy(sp=True, m=2)
    assert_resumes_onto(tmp_path, saved, 2, _same_batch(strategy(dp=2, zero=3, m=1), saved), 2, same_layout_too=True)


LAYOUTS = {
    # TP slices and ZeRO-1 shards of them onto ZeRO-3 shards of whole parameters
    "tp2-dp2-zero1->dp4-zero3": (tp_strategy(dp=2, zero=1, m=2), 4, strategy(dp=4, zero=3, m=1), 4),
    # a pipeline of TP+SP slices onto two ZeRO-2 replicas of the whole model (another world size)
    "pp2-tp2-sp->dp2-zero2": (tp_strategy(sp=True, pp=2, m=4), 4, strategy(dp=2, zero=2, m=2), 2),
    # and back: whole parameters onto a pipeline of TP slices
    "dp2-zero2->pp2-tp2": (strategy(dp=2, zero=2, m=2), 2, tp_strategy(pp=2, m=4), 4),
    # expert-parallel shards (the experts' own flat group) onto a pipeline without EP
    "moe-ep2-dp2->pp2": (strategy("moe-tiny", dp=2, ep=2, m=2, mbs=2), 2,
                         strategy("moe-tiny", pp=2, m=4, mbs=1), 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_resume_onto_another_layout(case, tmp_path):
    saved, n_saved, resumed, n_resumed = LAYOUTS[case]
    assert_resumes_onto(tmp_path, saved, n_saved, _same_batch(resumed, saved), n_resumed)


@pytest.mark.slow
def test_tied_embedding_copy_resumes_onto_one_stage_and_back(tmp_path):
    """The last stage's copy of a tied embedding is stored as ``embed.weight``: a PP2 run
    resumes on one stage (no copy), and a one-stage run on PP2 (the copy loaded from it)."""
    path = tmp_path / "tiny-tied.json"
    path.write_text(json.dumps(TIED))
    pp2 = pp2_strategy(str(path), DP2(1), world=4, dp=2)
    one = {**pp2, "cluster": "cpu:2", "directives": [DP2(0)]}
    for name, (saved, n_saved, resumed, n_resumed) in {"a": (pp2, 4, one, 2), "b": (one, 2, pp2, 4)}.items():
        os.makedirs(tmp_path / name)
        assert_resumes_onto(tmp_path / name, saved, n_saved, resumed, n_resumed)


@pytest.mark.slow
def test_resume_refuses_other_shapes_under_the_same_model_name(tmp_path):
    """A model file edited under the same name: every rank fails alike, naming the parameter."""
    (tmp_path / "a.json").write_text(json.dumps(TIED))
    (tmp_path / "b.json").write_text(json.dumps({**TIED, "ffn": 2 * TIED["ffn"]}))
    one = {"cluster": "cpu:2", "global_batch": 8, "seq_len": 16, "microbatches": 2, "dtype": "fp32",
           "directives": [DP2(1)]}
    ck = str(tmp_path / "ck")
    r = torchrun(2, [save_plan(tmp_path, "a", {**one, "model": str(tmp_path / "a.json")}), "--steps", "1", "--save", ck])
    assert r.returncode == 0, r.stderr[-3000:]
    r = torchrun(2, [save_plan(tmp_path, "b", {**one, "model": str(tmp_path / "b.json")}), "--steps", "1", "--resume", ck])
    assert r.returncode != 0
    assert "parameter layers.0.mlp.w1.weight is [128, 64] there and [256, 64] in this plan" in r.stderr, r.stderr[-3000:]


def _marker(root, **meta) -> str:
    folder = checkpoint.step_dir(str(root), 2)
    os.makedirs(folder)
    open(os.path.join(folder, ".metadata"), "w").close()
    with open(os.path.join(folder, checkpoint.META), "w") as f:
        json.dump({"format": checkpoint.FORMAT, "plan_hash": "abc", "step": 2, "world_size": 4,
                   "model": "gpt-tiny", **meta}, f)
    return folder


def test_find_takes_a_per_parameter_checkpoint_from_any_plan_of_the_model(tmp_path):
    folder = _marker(tmp_path)
    assert checkpoint.find(str(tmp_path), "def", 2, model="gpt-tiny") == (folder, 2)
    with pytest.raises(PlanError, match="holds model gpt-tiny, this plan trains moe-tiny"):
        checkpoint.find(str(tmp_path), "def", 2, model="moe-tiny")


def test_run_refuses_a_checkpoint_of_another_model_before_launching(tmp_path):
    _marker(tmp_path / "ck")
    plan = save_plan(tmp_path, "moe", strategy("moe-tiny", dp=2, m=2))
    r = subprocess.run([sys.executable, "-m", "piper_sim.cli", "run", plan, "--resume", str(tmp_path / "ck")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "holds model gpt-tiny, this plan trains moe-tiny" in r.stderr


@pytest.mark.slow
def test_user_module_tp2_sp_resumes_onto_pp2(tmp_path):
    """A user nn.Module's sharding annotations (`piper_sim.user_tp`): its TP slices saved as
    DTensors, read back whole by a two-stage pipeline."""
    from test_user_tp import tp_strategy as user_tp_strategy

    saved = user_tp_strategy(sp=True, m=2)
    resumed = {**saved, "cluster": "cpu:2",
               "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"}]}
    assert_resumes_onto(tmp_path, saved, 2, resumed, 2)
