"""Checkpoints with torch.distributed.checkpoint (DCP), written atomically, resumable onto
another layout.

A checkpoint stores every parameter of the model and its two AdamW moments *per parameter*,
under the parameter's name in the whole model (``model.layers.3.attn.wq.weight``,
``optim.layers.3.attn.wq.weight.exp_avg``, ``optim.step``): data-parallel (ZeRO) shards are
all-gathered over their group first, and a tensor-parallel slice is a DTensor sharded over
the TP group, so DCP records where each piece lies in the whole tensor. Replicas (data- and
context-parallel peers, hybrid-sharding replicas, DualPipe's two copies of a stage, a tied
embedding's copy on the last stage, stored as ``embed.weight``) write a piece once. Loading
asks DCP for this rank's pieces of each parameter under *its* layout, so a run resumes onto
another pipeline cut, TP, DP, ZeRO stage or expert layout of the same model (the parameter
names and whole shapes must match: checked, one line naming the parameter). Saving holds
one flat group's whole parameters and moments at a time (three times its parameters);
loading holds this rank's (three times its parameters) until they are in place.
Checkpoints written before this format (one key per shard, no ``format`` in the marker)
still resume with the plan that wrote them.

``--save DIR`` keeps one folder per saved step, the newest ``keep`` of them::

    DIR/step-00000004/   DCP files + piper_meta.json (format, step, model, parameter shapes, LR schedule)
    DIR/step-00000006/

A save writes into ``DIR/.step-N.tmp``; when every rank has written its files rank 0
writes ``piper_meta.json`` (the commit marker, last) and renames the folder to
``step-N`` (atomic), then removes the oldest folders (renamed to ``.trash-*`` first).
A process killed at any point of a save leaves the previous ``step-*`` folders intact,
and only complete ones have that name. ``--resume DIR`` takes the newest complete
folder (or DIR itself when it is a step folder) and checks the model and the step
before loading (`find`, also run by ``piper-sim run`` before launching).
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
FORMAT = "per-parameter"  # the marker's ``format``; absent: one key per shard (resumes with the same plan only)
MOMENTS = ("exp_avg", "exp_avg_sq")
STEP_DIR = re.compile(r"^step-(\d{8})$")
KILL_POINTS = ("start", "written", "marker", "renamed", "pruning")


def _legacy_state(rt) -> dict:
    """The state under the keys of checkpoints written before `FORMAT` (one per shard)."""
    sd = {}
    # a tensor-parallel rank's flat buffers hold its slices (and the replicated norms): one
    # key per TP rank; context-parallel peers hold the same parameters, like DP replicas
    tp = f".tp{rt.layout.tp_rank(rt.rank)}of{rt.layout.tp}" if rt.layout.tp > 1 else ""
    for fp in rt.flats.values():
        key = fp.key + tp
        if fp.sync == "shard":
            base = f"{key}.shard{fp.index}of{len(fp.group)}"
            sd[base] = fp.shard.data
        else:
            base = f"{key}.flat"
        if fp.materialised() and not fp.per_bucket:
            sd[f"{key}.flat"] = fp.flat.data
        state = fp.adam_state
        sd[f"{base}.exp_avg"] = state["exp_avg"]
        sd[f"{base}.exp_avg_sq"] = state["exp_avg_sq"]
        sd[f"{base}.step"] = state["step"].view(1)
    return sd


def _as_placed(rt, name: str, local):
    """``local`` as DCP should store it: a DTensor where an axis splits parameter ``name``."""
    for axis in rt.axes:
        placed = axis.distributed(name, local)
        if placed is not None:
            return placed
    return local


def _saved_name(rt, name: str) -> str:
    for axis in rt.axes:
        name = axis.saved_name(name)
    return name


def _per_parameter(rt, buffers) -> tuple[dict, list[tuple]]:
    """The state dict of ``buffers`` (flat key -> {"model" | moment: tensor in the full flat
    layout}) per parameter, and the (kept, other) local views of a name this rank holds twice
    (the state dict takes the first; a load copies it into the other)."""
    sd: dict = {}
    twice: list[tuple] = []
    for key, fp in sorted(rt.flats.items()):
        for what, buf in buffers[key].items():
            for name, local in fp.named_views(buf).items():
                saved = _saved_name(rt, name)
                k = f"model.{saved}" if what == "model" else f"optim.{saved}.{what}"
                if k in sd:
                    twice.append((sd[k], local))
                else:
                    sd[k] = _as_placed(rt, name, local)
    return sd, twice


def _shapes(sd: dict) -> dict[str, list[int]]:
    """Parameter name -> its whole shape (a DTensor's global one)."""
    return {k.removeprefix("model."): list(t.shape) for k, t in sd.items() if k.startswith("model.")}


def _saved_state(rt) -> dict:
    """Collective over each flat group: this rank's parameters and AdamW moments per
    parameter, ZeRO shards all-gathered (the full flat layout) and TP slices as DTensors."""
    import torch

    from executor.reference import full_flat, full_parameters

    buffers, steps = {}, set()
    for key, fp in sorted(rt.flats.items()):
        state = fp.adam_state
        buffers[key] = {"model": full_parameters(fp, rt.comms),
                        **{m: full_flat(fp, state[m], rt.comms) for m in MOMENTS}}
        steps.add(float(state["step"]))
    if len(steps) > 1:
        raise RuntimeError(f"rank {rt.rank}: its optimizers took different numbers of steps {sorted(steps)}")
    sd, _ = _per_parameter(rt, buffers)
    sd["optim.step"] = torch.tensor([steps.pop() if steps else 0.0], dtype=torch.float64)
    return sd


def _load_per_parameter(rt, folder: str, marker: dict) -> None:
    """Collective: fill this rank's flat parameters, shards and AdamW state from a
    per-parameter checkpoint written under any layout of the same model."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    buffers = {}
    for key, fp in rt.flats.items():
        state = fp.adam_state
        like = fp.params[0]
        buffers[key] = {"model": torch.zeros(fp.total_len, dtype=like.dtype, device=like.device),
                        **{m: torch.zeros(fp.total_len, dtype=state[m].dtype, device=state[m].device)
                           for m in MOMENTS}}
    sd, twice = _per_parameter(rt, buffers)
    mine, saved = _shapes(sd), marker.get("params", {})
    missing = next((f"parameter {n} (shape {s}) is not in it" for n, s in sorted(mine.items()) if n not in saved), None)
    differs = next((f"parameter {n} is {saved[n]} there and {s} in this plan" for n, s in sorted(mine.items())
                    if n in saved and saved[n] != s), None)
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, missing or differs)
    problem = next((p for p in problems if p), None)
    if problem:
        raise PlanError(f"--resume {folder}: {problem}; resume with a plan of the model that wrote it "
                        f"({marker.get('model')})")
    sd["optim.step"] = torch.zeros(1, dtype=torch.float64)
    dcp.load(sd, checkpoint_id=folder)
    for kept, other in twice:
        other.copy_(kept.to_local() if hasattr(kept, "to_local") else kept)
    step = float(sd["optim.step"][0])
    for key, fp in rt.flats.items():
        loaded = buffers[key]
        if not fp.per_bucket:
            fp.flat.data.copy_(loaded["model"])
        if fp.shard is not None:
            fp.shard.data.copy_(fp.own_pieces(loaded["model"]))
        state = fp.adam_state
        for m in MOMENTS:
            state[m].copy_(loaded[m] if fp.shard is None else fp.own_pieces(loaded[m]))
        state["step"].fill_(step)


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
    state = _saved_state(rt)
    dcp.save(state, checkpoint_id=tmp)
    _kill_point(step, "written")
    shapes: list = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, _shapes(state))  # also: every rank's files are on disk
    if dist.get_rank() == 0:
        with atomic_write(os.path.join(tmp, META)) as f:
            json.dump({"format": FORMAT, "plan_hash": rt.plan.content_hash(), "step": step,
                       "world_size": dist.get_world_size(), "model": rt.header.model,
                       "params": dict(sorted({n: s for part in shapes for n, s in part.items()}.items())),
                       "lr_schedule": schedule_dict(rt.lr_schedule)}, f)
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
         override_lr_schedule: bool = False, model=None) -> tuple[str, int]:
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
    if marker.get("format") == FORMAT:  # per parameter: any layout of the same model resumes
        if model is not None and marker.get("model") != json.loads(json.dumps(model)):
            raise PlanError(f"--resume {folder} holds model {marker.get('model')}, this plan trains {model}; "
                            f"resume with a plan of that model")
    else:  # one key per shard: only the plan that wrote it
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
            folder, step = find(path, rt.plan.content_hash(), dist.get_world_size(), schedule_dict(rt.lr_schedule),
                                override_lr_schedule, rt.header.model)
            with open(os.path.join(folder, META)) as f:
                found[0] = (folder, step, json.load(f))
        except PlanError as e:
            found[0] = str(e)
    dist.broadcast_object_list(found, src=0)
    if isinstance(found[0], str):
        raise PlanError(found[0])
    folder, step, marker = found[0]
    if marker.get("format") == FORMAT:
        _load_per_parameter(rt, folder, marker)
    else:
        dcp.load(_legacy_state(rt), checkpoint_id=folder)
    return step
