"""The executor's learning-rate schedule (--lr, --warmup-steps, --lr-decay, --decay-steps,
--min-lr-ratio): its values, and training under it against the reference under the same one."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from executor.lr import LRSchedule
from test_executor import ROOT, json_lines, save_plan, strategy, torchrun


def test_warmup_then_cosine_or_linear_decay_to_the_floor():
    cos = LRSchedule(lr=1.0, warmup_steps=4, decay="cosine", decay_steps=14, min_ratio=0.1)
    assert [cos(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cos(4) == 1.0 and cos(9) == pytest.approx(0.1 + 0.9 * 0.5) and cos(14) == pytest.approx(0.1)
    assert cos(100) == pytest.approx(0.1)  # held at the floor
    lin = LRSchedule(lr=2.0, decay="linear", decay_steps=10, min_ratio=0.0)
    assert [lin(s) for s in (0, 5, 10)] == pytest.approx([2.0, 1.0, 0.0])
    assert LRSchedule(lr=3e-4)(123) == 3e-4
    assert all(a >= b for a, b in zip([cos(s) for s in range(4, 20)], [cos(s) for s in range(5, 21)]))
    assert math.isclose(LRSchedule(warmup_steps=2)(1), LRSchedule().lr)


def test_scheduled_training_matches_the_reference_under_the_same_schedule(tmp_path):
    paths = [save_plan(tmp_path, "z1", strategy(dp=2, zero=1, m=2, mbs=2)),
             save_plan(tmp_path, "pp2", strategy(pp=2, sched="zb1p", m=4, mbs=2))]
    sched = ["--lr", "3e-3", "--warmup-steps", "1", "--lr-decay", "cosine", "--decay-steps", "3"]
    r = torchrun(2, [*paths, "--steps", "3", "--check", "--json", *sched])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json_lines(r.stdout)
    checks = [x for x in rows if "max_rel_param_diff" in x]
    assert len(checks) == 2 and all(x["within_tolerance"] for x in checks), checks
    plain = torchrun(2, [paths[0], "--steps", "3", "--json"])
    assert plain.returncode == 0, plain.stderr[-3000:]
    scheduled = [x["loss"] for x in rows if "loss" in x and x["plan"] == paths[0]]
    constant = [x["loss"] for x in json_lines(plain.stdout) if "loss" in x]
    assert scheduled[0] == pytest.approx(constant[0]) and scheduled[2] != pytest.approx(constant[2], rel=1e-6)


def test_a_decay_without_its_end_is_a_one_line_error(tmp_path):
    path = save_plan(tmp_path, "dp2", strategy(dp=2, m=2))
    r = subprocess.run([sys.executable, "-m", "piper_sim", "run", path, "--steps", "1", "--lr-decay", "cosine",
                        "--warmup-steps", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith(
        "--lr-decay cosine needs --decay-steps after --warmup-steps (2); got --decay-steps 0")


@pytest.mark.slow
def test_resume_keeps_the_schedule_it_was_saved_under(tmp_path):
    """A checkpoint stores its learning-rate schedule: resuming under the same options gives
    the uninterrupted run's losses bit for bit; other options are a one-line error before
    any worker starts, unless --override-lr-schedule."""
    plan = save_plan(tmp_path, "dp2z1", strategy(dp=2, zero=1, m=2, mbs=2))
    sched = ["--lr", "3e-3", "--warmup-steps", "1", "--lr-decay", "cosine", "--decay-steps", "4"]
    full = torchrun(2, [plan, "--steps", "4", "--json", *sched])
    assert full.returncode == 0, full.stderr[-3000:]
    losses = [row["loss"] for row in json_lines(full.stdout) if "loss" in row]
    ck = str(tmp_path / "ck")
    first = torchrun(2, [plan, "--steps", "2", "--save", ck, "--json", *sched])
    assert first.returncode == 0, first.stderr[-3000:]
    other = subprocess.run([sys.executable, "-m", "piper_sim", "run", plan, "--steps", "2", "--resume", ck,
                            "--lr", "2e-3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert other.returncode == 2
    last = other.stderr.strip().splitlines()[-1]
    assert "was saved under learning-rate schedule lr=0.003, warmup_steps=1, decay=cosine" in last
    assert "this run's is lr=0.002, warmup_steps=0, decay=constant" in last and "--override-lr-schedule" in last
    resumed = torchrun(2, [plan, "--steps", "2", "--resume", ck, "--json", *sched])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [row["loss"] for row in json_lines(resumed.stdout) if "loss" in row] == losses[2:]  # bit for bit
    # through `piper-sim run`, which checks before torchrun and hands the flag to the workers
    overridden = subprocess.run([sys.executable, "-m", "piper_sim", "run", plan, "--steps", "2", "--resume", ck,
                                 "--json", "--lr", "2e-3", "--override-lr-schedule"], cwd=ROOT, capture_output=True,
                                text=True, timeout=300)
    assert overridden.returncode == 0, overridden.stderr[-3000:]
    other_losses = [row["loss"] for row in json_lines(overridden.stdout) if "loss" in row]
    assert other_losses[0] == losses[2] and other_losses[1] != losses[3]  # step 3 trained under the new rate


def test_equal_schedules_are_stored_alike_and_old_checkpoints_resume(tmp_path):
    import json
    import os

    from executor import checkpoint

    assert checkpoint.schedule_dict(None) is None
    assert checkpoint.schedule_dict(LRSchedule(lr=1e-3)) is None  # --lr at the default rate = no flags
    assert checkpoint.schedule_dict(LRSchedule(lr=2e-3, decay_steps=9, min_ratio=0.5)) == \
        checkpoint.schedule_dict(LRSchedule(lr=2e-3))  # decay fields of a constant schedule do not count
    folder = tmp_path / "step-00000002"
    folder.mkdir()
    (folder / ".metadata").write_text("")
    (folder / checkpoint.META).write_text(json.dumps({"plan_hash": "h", "step": 2, "world_size": 2}))
    assert checkpoint.find(str(tmp_path), "h", 2, {"lr": 0.003})[1] == 2  # saved before schedules were stored
    meta = json.loads((folder / checkpoint.META).read_text())
    (folder / checkpoint.META).write_text(json.dumps({**meta, "lr_schedule": None}))
    with pytest.raises(Exception, match="learning-rate schedule none"):
        checkpoint.find(str(tmp_path), "h", 2, {"lr": 0.003})
    assert checkpoint.find(os.fspath(tmp_path), "h", 2, {"lr": 0.003}, override_lr_schedule=True)[1] == 2
