"""Checkpoints: atomic step folders, verified on load, and a rank SIGKILLed at every point
of a save leaves a checkpoint that resumes to the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from executor import checkpoint
from piper_sim.plan import PlanError
from test_executor import ROOT, json_lines, save_plan, strategy, torchrun

pytestmark = pytest.mark.filterwarnings("ignore")


def _fake_checkpoint(root, folder_step: int, **meta) -> str:
    folder = checkpoint.step_dir(str(root), folder_step)
    os.makedirs(folder)
    open(os.path.join(folder, ".metadata"), "w").close()
    with open(os.path.join(folder, checkpoint.META), "w") as f:
        json.dump({"plan_hash": "abc", "step": folder_step, "world_size": 2, **meta}, f)
    return folder


def test_find_takes_the_newest_complete_folder_and_checks_it(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 4)
    os.makedirs(tmp_path / ".step-00000006.tmp")  # a killed save
    os.makedirs(tmp_path / "step-00000008")  # no marker: not complete
    assert checkpoint.complete_steps(str(tmp_path)) == [2, 4]
    assert checkpoint.find(str(tmp_path), "abc", 2) == (checkpoint.step_dir(str(tmp_path), 4), 4)
    assert checkpoint.find(checkpoint.step_dir(str(tmp_path), 2), "abc", 2)[1] == 2
    with pytest.raises(PlanError, match="saved by plan abc, not by this plan def"):
        checkpoint.find(str(tmp_path), "def", 2)
    with pytest.raises(PlanError, match="saved by 2 ranks, not 4"):
        checkpoint.find(str(tmp_path), "abc", 4)
    with pytest.raises(PlanError, match="holds no complete checkpoint"):
        checkpoint.find(str(tmp_path / "step-00000008"), "abc", 2)
    with pytest.raises(PlanError, match="does not exist"):
        checkpoint.find(str(tmp_path / "nowhere"), "abc", 2)
    wrong = tmp_path / "w"
    _fake_checkpoint(wrong, 3, step=5)
    with pytest.raises(PlanError, match="says step 5, which does not match the folder"):
        checkpoint.find(str(wrong), "abc", 2)


def test_run_refuses_a_mismatched_checkpoint_before_launching(tmp_path):
    plan = save_plan(tmp_path, "dp2", strategy(dp=2, m=2))
    _fake_checkpoint(tmp_path / "ck", 2)
    r = subprocess.run([sys.executable, "-m", "piper_sim.cli", "run", plan, "--resume", str(tmp_path / "ck")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "saved by plan abc, not by this plan" in r.stderr


def assert_resumes_bit_exact(tmp_path, s: dict, nproc: int) -> None:
    """4 steps uninterrupted vs 2 steps, --save, then --resume for 2 more: the same losses."""
    plan = save_plan(tmp_path, "plan", s)
    full = torchrun(nproc, [plan, "--steps", "4", "--json"], timeout=300)
    assert full.returncode == 0, full.stderr[-3000:]
    losses = [row["loss"] for row in json_lines(full.stdout)]
    ck = str(tmp_path / "ck")
    first = torchrun(nproc, [plan, "--steps", "2", "--save", ck, "--json"], timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = torchrun(nproc, [plan, "--steps", "2", "--resume", ck, "--json"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = json_lines(resumed.stdout)
    assert [r["step"] for r in rows] == [2, 3]
    assert [row["loss"] for row in json_lines(first.stdout)] + [r["loss"] for r in rows] == losses  # bit for bit


# (victim rank, point): rank 1 is not DCP's coordinator; only rank 0 commits and prunes
KILLS = [(1, "start"), (0, "written"), (0, "marker"), (0, "renamed"), (0, "pruning")]


@pytest.mark.slow
def test_kill_at_every_point_of_a_save_resumes_to_the_uninterrupted_losses(tmp_path):
    plan = save_plan(tmp_path, "dp2z1", strategy(dp=2, zero=1, m=2, mbs=2))
    full = torchrun(2, [plan, "--steps", "6", "--json"])
    assert full.returncode == 0, full.stderr[-3000:]
    losses = {row["step"]: row["loss"] for row in json_lines(full.stdout)}
    for victim, point in KILLS:
        ck = str(tmp_path / f"ck-{point}")
        killed = torchrun(2, [plan, "--steps", "4", "--save-every", "2", "--keep", "1", "--save", ck, "--json"],
                          env={"PIPER_CKPT_KILL": f"{victim}:4:{point}"}, timeout=200)
        assert killed.returncode != 0, (point, killed.stderr[-2000:])
        # the save of step 4 commits at the rename: before it the step-2 checkpoint stays
        expect = 4 if point in ("renamed", "pruning") else 2
        assert checkpoint.complete_steps(ck)[-1] == expect, (point, os.listdir(ck))
        resumed = torchrun(2, [plan, "--steps", "2", "--resume", ck, "--json"], timeout=200)
        assert resumed.returncode == 0, (point, resumed.stderr[-3000:])
        rows = json_lines(resumed.stdout)
        assert [r["step"] for r in rows] == [expect, expect + 1], point
        assert [r["loss"] for r in rows] == [losses[expect], losses[expect + 1]], point  # bit for bit


@pytest.mark.slow  # ~30 s (CI budget); the fast set keeps the save/resume bit-exact runs
def test_max_restarts_resumes_after_a_killed_rank_to_the_uninterrupted_losses(tmp_path):
    """PIPER_FAULT kills rank 1 in step 2; torchrun restarts both workers, which resume from
    the step-2 checkpoint and finish steps 2 and 3 with the losses of a run without the fault."""
    plan = save_plan(tmp_path, "pp2", strategy(pp=2, sched="1f1b", m=4))
    full = torchrun(2, [plan, "--steps", "4", "--json"])
    assert full.returncode == 0, full.stderr[-3000:]
    want = {row["step"]: row["loss"] for row in json_lines(full.stdout)}
    ck = str(tmp_path / "ck")
    r = subprocess.run([sys.executable, "-m", "piper_sim.cli", "run", plan, "--steps", "4", "--save", ck,
                        "--save-every", "1", "--max-restarts", "1", "--json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore",
                                                    "PIPER_FAULT": "1:2:F.s1.mb1:kill"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "restart 1: resuming at step 2" in r.stderr
    got: dict[int, float] = {}
    for row in json_lines(r.stdout):
        got[row["step"]] = row["loss"]  # the restarted attempt's value wins
    assert got == want
    assert checkpoint.complete_steps(ck) == [3, 4]
