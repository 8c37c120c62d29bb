"""torch.distributed.pipelining as an oracle: its pipeline_order built without a process group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from piper_sim.schedules import Action


# ----------------------------------------------------------------------------- torch oracle


def _torch_schedules():
    return pytest.importorskip("torch.distributed.pipelining.schedules")


def _fake_stage(index: int, num_stages: int, pp: int) -> SimpleNamespace:
    """Just enough of a PipelineStage for torch to build ``pipeline_order`` (no process group)."""
    return SimpleNamespace(stage_index=index, num_stages=num_stages, group_size=pp, group_rank=0,
                           submod=None, is_first=index == 0, is_last=index == num_stages - 1)


def _from_torch(action) -> tuple[Action, ...]:
    subs = action.sub_actions or (action,)  # OVERLAP_F_B -> a 2-action slot
    return tuple(Action(a.stage_index, a.computation_type.value, a.microbatch_index) for a in subs)


def torch_orders(cls, pp: int, m: int, v: int, single: bool = False) -> list[list[tuple]]:
    """torch's pipeline_order for every rank, idle slots and non-compute actions removed."""
    stages = [_fake_stage(i, pp * v, pp) for i in range(v)]
    order = (cls(stages[0], m) if single else cls(stages, m)).pipeline_order
    compute = {"F", "B", "I", "W", "OVERLAP_F_B"}
    return [[_from_torch(a) for a in order[r]
             if a is not None and a.computation_type.value in compute] for r in range(pp)]


