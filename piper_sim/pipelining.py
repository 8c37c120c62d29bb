"""A plan's pipeline order in torch.distributed.pipelining's action notation, and the
per-rank action CSV that torch's ``_load_csv`` and torchtitan's
``--parallelism.pipeline_parallel_schedule_csv`` load.

Actions (torch's ``_Action.__repr__`` / ``_Action.from_str``): ``{stage}{type}{mb}`` with type
F (forward), B (full backward), I (backward-input), W (backward-weight), an overlapped pair
as ``(0F3;3B1)OVERLAP_F_B``, and, in the compute+comms form, ``{stage}SEND_F{mb}``,
``{stage}RECV_F{mb}``, ``{stage}SEND_B{mb}``, ``{stage}RECV_B{mb}`` (a RECV names the
receiving stage, a SEND the sending one) and ``{stage}REDUCE_GRAD``.

- `compute_actions(plan, pp_rank)`: the rank's compute slots; `compute_order` joins them into
  the lines of ``piper-sim show --compute-order`` (they equal torch's ``pipeline_order`` for interleaved
  1F1B, interleaved zero-bubble, ZB-V and DualPipeV).
- `actions_with_comms(plan, pp_rank)`: the same with the plan's point-to-point transfers and
  gradient reductions placed in one list: each RECV right before the first compute that
  needs it (earlier RECVs of the same peer stream first, so each peer pair sends and
  receives in the plan's order, as NCCL matches them), each SEND right after the compute
  it depends on, in its stream's order, and ``REDUCE_GRAD`` after a stage's last backward
  when the plan reduces its gradients across data-parallel ranks.
- `write_schedule_csv(plan, path, comms=False)`: one row per pipeline rank. Load it with
  ``schedule._load_csv(path)`` (``format="compute_comms"`` for ``comms=True``), e.g. in a
  ``_PipelineScheduleRuntime``. DualPipe places every stage on two ranks, which torch's
  schedules cannot express: its CSV is written but torch refuses it.

Imports nothing heavy (no torch).
"""

from __future__ import annotations

import csv
from typing import TYPE_CHECKING

from piper_sim.files import atomic_write
from piper_sim.plan import WEIGHT_GRAD_KINDS

if TYPE_CHECKING:  # pragma: no cover
    from piper_sim.plan import Instruction, Plan

__all__ = ["TYPE_LETTER", "compute_actions", "actions_with_comms", "write_schedule_csv", "schedule_csv_rows"]

TYPE_LETTER = {"F": "F", "B": "B", "BI": "I", "BW": "W"}  # plan kind -> torch computation type


def _slots(plan: "Plan", pp_rank: int) -> list[tuple[list[str], list["Instruction"]]]:
    """The rank's compute slots in order: (actions, instructions) with the actions as torch
    strings (an op split into pieces is one action)."""
    slots: dict[int, tuple[list[str], list[Instruction]]] = {}
    for ins in plan.classes[pp_rank].streams.get("compute", []):
        if ins.kind not in TYPE_LETTER or ins.slot < 0:
            continue
        acts, inss = slots.setdefault(ins.slot, ([], []))
        action = f"{ins.stage}{TYPE_LETTER[ins.kind]}{ins.mb}"
        if action not in acts:
            acts.append(action)
        inss.append(ins)
    return [slots[k] for k in sorted(slots)]


def _slot_str(acts: list[str]) -> str:
    return acts[0] if len(acts) == 1 else "(" + ";".join(acts) + ")OVERLAP_F_B"


def compute_actions(plan: "Plan", pp_rank: int) -> list[str]:
    """The rank's compute actions, one per slot, e.g. ``['0F0', '0F1', '(0F3;3B1)OVERLAP_F_B']``."""
    return [_slot_str(acts) for acts, _ in _slots(plan, pp_rank)]


def actions_with_comms(plan: "Plan", pp_rank: int) -> list[str]:
    """The rank's compute actions with its sends, receives and gradient reductions (see the
    module doc)."""
    cls = plan.classes[pp_rank]
    compute = {i.id: i for i in cls.streams.get("compute", [])}
    p2p = [lst for lst in cls.streams.values() if lst and all(i.kind in ("SEND", "RECV") for i in lst)]
    where = {i.id: (k, n) for k, lst in enumerate(p2p) for n, i in enumerate(lst)}
    ptr = [0] * len(p2p)
    # ops that are neither compute nor transfers (an expert all-to-all between a piece and its
    # send, or between a received gradient and the backward) pass dependencies through
    between = {i.id: i for lst in cls.streams.values() for i in lst if i.id not in compute and i.id not in where}
    memo: dict[str, tuple[frozenset[str], frozenset[str]]] = {}

    def waits_for(ins: Instruction) -> tuple[frozenset[str], frozenset[str]]:
        """(compute ops, transfers) ``ins`` waits for, directly or through ops in ``between``."""
        if ins.id not in memo:
            ops, xfers = set(), set()
            for d in ins.deps:
                if d in compute:
                    ops.add(d)
                elif d in where:
                    xfers.add(d)
                elif d in between:
                    o, x = waits_for(between[d])
                    ops |= o
                    xfers |= x
            memo[ins.id] = (frozenset(ops), frozenset(xfers))
        return memo[ins.id]

    consumer: dict[str, Instruction] = {}  # RECV id -> the first compute op that needs it
    for ins in cls.streams.get("compute", []):
        for d in sorted(waits_for(ins)[1], key=lambda d: where[d]):
            consumer.setdefault(d, ins)
    # stages whose gradients the plan reduces across data-parallel ranks
    reduced = {i.stage for lst in cls.streams.values() for i in lst
               if i.kind in ("ALLREDUCE", "REDUCE_SCATTER") and i.stage >= 0}
    slots = _slots(plan, pp_rank)
    backward_total: dict[int, int] = {}  # B/W actions per stage: REDUCE_GRAD follows the last
    for _, inss in slots:
        for key in {(i.stage, i.kind, i.mb) for i in inss if i.kind in WEIGHT_GRAD_KINDS}:
            backward_total[key[0]] = backward_total.get(key[0], 0) + 1
    backward_seen: dict[int, int] = {}
    done: set[str] = set()
    out: list[str] = []

    def recv_name(ins: Instruction) -> str:
        c = consumer.get(ins.id)
        if c is None:  # nothing computes on it here; name it from the sender's stage
            return f"{ins.stage}RECV_F{ins.mb}"
        return f"{c.stage}RECV_{'F' if c.kind == 'F' else 'B'}{ins.mb}"

    def send_name(ins: Instruction) -> str:
        src = [compute[d] for d in waits_for(ins)[0] if compute[d].stage == ins.stage and compute[d].mb == ins.mb]
        forward = any(s.kind == "F" for s in src) if src else ins.direction == "F"
        return f"{ins.stage}SEND_{'F' if forward else 'B'}{ins.mb}"

    def emit_until(k: int, n: int) -> None:
        while ptr[k] <= n:
            ins = p2p[k][ptr[k]]
            out.append(recv_name(ins) if ins.kind == "RECV" else send_name(ins))
            ptr[k] += 1

    def ready(ins: Instruction) -> bool:
        return waits_for(ins)[0] <= done

    for acts, inss in slots:
        for ins in inss:  # the receives this slot computes on, with the earlier ones of their streams
            for d in sorted(waits_for(ins)[1], key=lambda d: where[d]):
                if p2p[where[d][0]][where[d][1]].kind == "RECV":
                    emit_until(*where[d])
        out.append(_slot_str(acts))
        done.update(i.id for i in inss)
        for k, lst in enumerate(p2p):  # sends whose data is now computed, in stream order
            while ptr[k] < len(lst) and lst[ptr[k]].kind == "SEND" and ready(lst[ptr[k]]):
                emit_until(k, ptr[k])
        for key in sorted({(i.stage, i.kind, i.mb) for i in inss if i.kind in WEIGHT_GRAD_KINDS}):
            backward_seen[key[0]] = backward_seen.get(key[0], 0) + 1
            if key[0] in reduced and backward_seen[key[0]] == backward_total[key[0]]:
                out.append(f"{key[0]}REDUCE_GRAD")
    for k, lst in enumerate(p2p):  # nothing should be left; keep the plan's order if it is
        if ptr[k] < len(lst):
            emit_until(k, len(lst) - 1)
    return out


def schedule_csv_rows(plan: "Plan", comms: bool = False) -> list[list[str]]:
    """One list of action strings per pipeline rank."""
    fn = actions_with_comms if comms else compute_actions
    return [fn(plan, r) for r in range(len(plan.classes))]


def write_schedule_csv(plan: "Plan", path: str, comms: bool = False) -> None:
    """Write the per-rank action CSV (one row per pipeline rank) that torch's ``_load_csv``
    reads; ``comms``: the compute+comms form (``_load_csv(path, format="compute_comms")``)."""
    with atomic_write(path, newline="") as f:  # a killed process never leaves half a file
        writer = csv.writer(f)
        for row in schedule_csv_rows(plan, comms):
            writer.writerow(row)


def compute_order(plan: "Plan", pp_rank: int) -> str:
    """A rank's compute actions in torch.distributed.pipelining notation, overlapped pairs as
    ``(0F3;3B1)OVERLAP_F_B`` (every action parses with torch's ``_Action.from_str``)."""
    return " ".join(compute_actions(plan, pp_rank))
