"""Checkpoints with torch.distributed.checkpoint (DCP).

Every rank saves its flat parameters, its shard and its AdamW state under keys that name
the content, not the rank (``s0.flat``, ``s1.e.ep1.shard0of2.exp_avg``), so replicas of
the same tensor (data-parallel peers, DualPipe's two copies of a stage) write it once.
Resuming needs the same plan (its hash is kept next to the checkpoint).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from piper_sim.plan import PlanError

META = "piper_meta.json"


def _state(rt) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for fp in rt.flats.values():
        if fp.sync == "shard":
            base, param = f"{fp.key}.shard{fp.index}of{len(fp.group)}", fp.shard
            sd[base] = fp.shard.data
        else:
            base, param = f"{fp.key}.flat", fp.flat
        if fp.materialised() and not fp.per_bucket:
            sd[f"{fp.key}.flat"] = fp.flat.data
        state = fp.optimizer.state[param]
        sd[f"{base}.exp_avg"] = state["exp_avg"]
        sd[f"{base}.exp_avg_sq"] = state["exp_avg_sq"]
        sd[f"{base}.step"] = state["step"].view(1)
    return sd


def save(rt, path: str, step: int) -> None:
    """Collective: write the state after ``step`` steps."""
    import torch.distributed.checkpoint as dcp  # slow to import: only when used

    os.makedirs(path, exist_ok=True)
    dcp.save(_state(rt), checkpoint_id=path)
    if dist.get_rank() == 0:
        with open(os.path.join(path, META), "w") as f:
            json.dump({"plan_hash": rt.plan.content_hash(), "step": step, "model": rt.plan.meta["model"]}, f)
    dist.barrier()


def load(rt, path: str) -> int:
    """Collective: restore the state in place; returns the number of steps already done."""
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        raise PlanError(f"{path}: not a piper-sim checkpoint (no {META})")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta["plan_hash"] != rt.plan.content_hash():
        raise PlanError(f"{path} was saved by plan {meta['plan_hash']}, not by this plan "
                        f"{rt.plan.content_hash()}; resume with the plan that wrote it")
    import torch.distributed.checkpoint as dcp

    dcp.load(_state(rt), checkpoint_id=path)
    return int(meta["step"])
