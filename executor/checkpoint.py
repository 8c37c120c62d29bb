"""Checkpoints with torch.distributed.checkpoint (DCP), written atomically.

Every rank saves its flat parameters, its shard and its AdamW state under keys that name
the content, not the rank (``s0.flat``, ``s1.e.ep1.shard0of2.exp_avg``, ``s0.tp1of2.flat``),
so replicas of the same tensor (data- and context-parallel peers, hybrid-sharding replicas of
a shard, DualPipe's two copies of a stage) write it once. Resuming needs the same plan (its
hash), so the same layout: resharding onto another TP/DP layout is not supported (the flat
buffers are per shard, not per parameter).

``--save DIR`` keeps one folder per saved step, the newest ``keep`` of them::

    DIR/step-00000004/   DCP files + piper_meta.json (plan hash, step, world size, LR schedule)
    DIR/step-00000006/

A save writes into ``DIR/.step-N.tmp``; when every rank has written its files rank 0
writes ``piper_meta.json`` (the commit marker, last) and renames the folder to
``step-N`` (atomic), then removes the oldest folders (renamed to ``.trash-*`` first).
A process killed at any point of a save leaves the previous ``step-*`` folders intact,
and only complete ones have that name. ``--resume DIR`` takes the newest complete
folder (or DIR itself when it is a step folder) and checks the plan hash, the step and
the world size before loading (`find`, also run by ``piper-sim run`` before launching).
``PIPER_CKPT_KILL=rank:step:point`` SIGKILLs ``rank`` at ``point`` of the save of
``step`` (a test hook; points in `KILL_POINTS`). torch is imported inside the collective
functions only, so ``piper-sim run`` checks a checkpoint without it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal

from executor.lr import ADAMW
from piper_sim.files import atomic_write, fsync_dir
from piper_sim.plan import PlanError

META = "piper_meta.json"
STEP_DIR = re.compile(r"^step-(\d{8})$")
KILL_POINTS = ("start", "written", "marker", "renamed", "pruning")


def _state(rt) -> dict:
    sd = {}
    # a tensor-parallel rank's flat buffers hold its slices (and the replicated norms): one
    # key per TP rank; context-parallel peers hold the same parameters, like DP replicas
    tp = f".tp{rt.layout.tp_rank(rt.rank)}of{rt.layout.tp}" if rt.layout.tp > 1 else ""
    for fp in rt.flats.values():
        key = fp.key + tp
        if fp.sync == "shard":
            base, param = f"{key}.shard{fp.index}of{len(fp.group)}", fp.shard
            sd[base] = fp.shard.data
        else:
            base, param = f"{key}.flat", fp.flat
        if fp.materialised() and not fp.per_bucket:
            sd[f"{key}.flat"] = fp.flat.data
        state = fp.optimizer.state[param]
        sd[f"{base}.exp_avg"] = state["exp_avg"]
        sd[f"{base}.exp_avg_sq"] = state["exp_avg_sq"]
        sd[f"{base}.step"] = state["step"].view(1)
    return sd


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def _kill_point(step: int, point: str) -> None:
    import torch.distributed as dist

    spec = os.environ.get("PIPER_CKPT_KILL", "")
    if spec and spec == f"{dist.get_rank()}:{step}:{point}":
        os.kill(os.getpid(), signal.SIGKILL)


def check_kill_spec() -> None:
    """Refuse a malformed ``PIPER_CKPT_KILL`` before anything starts."""
    spec = os.environ.get("PIPER_CKPT_KILL", "")
    parts = spec.split(":")
    if spec and (len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in KILL_POINTS):
        raise PlanError(f"PIPER_CKPT_KILL={spec!r}: expected rank:step:point with point one of "
                        + ", ".join(KILL_POINTS))


def save(rt, root: str, step: int, keep: int = 2) -> str:
    """Collective: write the state after ``step`` steps to ``root/step-N``; keep the newest ``keep``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp  # slow to import: only when used

    final = step_dir(root, step)
    tmp = os.path.join(root, f".step-{step:08d}.tmp")
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of saves that were killed
            if name.startswith((".step-", ".trash-")):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    _kill_point(step, "start")
    dcp.save(_state(rt), checkpoint_id=tmp)
    _kill_point(step, "written")
    dist.barrier()  # every rank's files are on disk
    if dist.get_rank() == 0:
        with atomic_write(os.path.join(tmp, META)) as f:
            json.dump({"plan_hash": rt.plan.content_hash(), "step": step, "world_size": dist.get_world_size(),
                       "model": rt.header.model, "lr_schedule": schedule_dict(rt.lr_schedule)}, f)
        fsync_dir(tmp)
        _kill_point(step, "marker")
        if os.path.exists(final):  # saved this step before (a rerun): set the old one aside first
            os.rename(final, os.path.join(root, f".trash-{step:08d}"))
        os.rename(tmp, final)
        fsync_dir(root)
        _kill_point(step, "renamed")
        for old in complete_steps(root)[:-keep]:
            trash = os.path.join(root, f".trash-{old:08d}")
            os.rename(step_dir(root, old), trash)
            _kill_point(step, "pruning")
            shutil.rmtree(trash, ignore_errors=True)
    dist.barrier()
    return final


def complete_steps(root: str) -> list[int]:
    """Steps with a committed folder under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    steps = [int(m[1]) for m in map(STEP_DIR.match, os.listdir(root)) if m]
    return sorted(s for s in steps if os.path.isfile(os.path.join(step_dir(root, s), META)))


def schedule_dict(schedule) -> dict | None:
    """A learning-rate schedule (`executor.lr.LRSchedule`) as stored in ``piper_meta.json``,
    in one form per rate function: None for every step at the optimizer's own rate, no
    decay fields for a constant schedule."""
    if schedule is None:
        return None
    d = dataclasses.asdict(schedule)
    if d["decay"] == "constant":
        del d["decay_steps"], d["min_ratio"]
        if d["warmup_steps"] == 0 and d["lr"] == ADAMW["lr"]:
            return None
    return d


def _describe(schedule: dict | None) -> str:
    if schedule is None:
        return "none (the optimizer's own rate)"
    return ", ".join(f"{k}={v}" for k, v in schedule.items())


def find(path: str, plan_hash: str, world_size: int, lr_schedule: dict | None = None,
         override_lr_schedule: bool = False) -> tuple[str, int]:
    """The checkpoint folder to resume from (``path`` itself, or its newest complete
    step folder) and its step; raises PlanError naming what does not match. A run resumes
    under the learning-rate schedule it was saved with (``lr_schedule``: this run's, as
    `schedule_dict`) unless ``override_lr_schedule`` (as Megatron's
    ``--override-opt_param-scheduler``); checkpoints older than the stored schedule pass."""
    if os.path.isfile(os.path.join(path, META)):
        folder = path
    else:
        steps = complete_steps(path)
        if not steps:
            what = "does not exist" if not os.path.exists(path) else "holds no complete checkpoint"
            raise PlanError(f"--resume {path}: {what} (no step-N folder with {META})")
        folder = step_dir(path, steps[-1])
    try:
        with open(os.path.join(folder, META)) as f:
            marker = json.load(f)
    except (OSError, ValueError) as e:
        raise PlanError(f"--resume {folder}: unreadable {META} ({e})") from None
    if marker.get("plan_hash") != plan_hash:
        raise PlanError(f"--resume {folder} was saved by plan {marker.get('plan_hash')}, not by this plan "
                        f"{plan_hash}; resume with the plan that wrote it")
    if marker.get("world_size", world_size) != world_size:
        raise PlanError(f"--resume {folder} was saved by {marker['world_size']} ranks, not {world_size}")
    if "lr_schedule" in marker and marker["lr_schedule"] != lr_schedule and not override_lr_schedule:
        raise PlanError(f"--resume {folder} was saved under learning-rate schedule {_describe(marker['lr_schedule'])}; "
                        f"this run's is {_describe(lr_schedule)}: pass the same --lr/--warmup-steps/--lr-decay/"
                        f"--decay-steps/--min-lr-ratio, or --override-lr-schedule to continue under this run's")
    step = marker.get("step")
    m = STEP_DIR.match(os.path.basename(os.path.normpath(folder)))
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or (m and int(m[1]) != step):
        raise PlanError(f"--resume {folder}: {META} says step {step!r}, which does not match the folder")
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise PlanError(f"--resume {folder}: the DCP .metadata file is missing; the checkpoint is incomplete")
    return folder, step


def load(rt, path: str, override_lr_schedule: bool = False) -> int:
    """Collective: restore the state in place; returns the number of steps already done.
    Rank 0 picks and checks the folder, so every rank loads the same one or fails alike."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    found: list = [None]
    if dist.get_rank() == 0:
        try:
            found[0] = find(path, rt.plan.content_hash(), dist.get_world_size(), schedule_dict(rt.lr_schedule),
                            override_lr_schedule)
        except PlanError as e:
            found[0] = str(e)
    dist.broadcast_object_list(found, src=0)
    if isinstance(found[0], str):
        raise PlanError(found[0])
    folder, step = found[0]
    dcp.load(_state(rt), checkpoint_id=folder)
    return step
