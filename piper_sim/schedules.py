"""Pipeline schedule library: the per-rank compute order of every supported schedule.

A schedule is a list of compute *slots* per pipeline rank, in execution order, with no
idle slots (the simulator and executor insert waits from dependencies). A slot holds one
`Action` or an overlapped pair (DualPipe's F&B). Actions use the notation of
``torch.distributed.pipelining``: ``{stage}{kind}{mb}``, e.g. ``0F3``, ``5I2``, and a pair
prints as ``(0F3;7B2)``. Kinds: F forward, B full backward, I backward-input,
W backward-weight.

Placements (which pipeline rank holds which model stage):

- ``loop``: stage s on rank s % pp (gpipe, 1f1b, zb1p, interleaved_1f1b, combined_1f1b).
- ``v``: 2 stages per rank, rank r holds r and 2pp-1-r (zbv, dualpipev).
- ``mirror``: dualpipe; pp stages, rank r holds copies of stages r and pp-1-r.
  Micro-batches 0..m/2-1 enter at rank 0 and use the copy of stage s on rank s;
  m/2..m-1 enter at rank pp-1 and use the copy on rank pp-1-s.

Orders of interleaved_1f1b, zb1p, zbv and dualpipev equal the ``pipeline_order`` of
torch's ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and
ScheduleDualPipeV with idle slots removed; dualpipe follows deepseek-ai/DualPipe's 8 steps.
See ``shared/reference/schedules.md`` §1-3 for the rules.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

__all__ = [
    "Action",
    "SCHEDULES",
    "ScheduleError",
    "ScheduleSpec",
    "Slot",
    "SCHEDULE_TABLE",
    "ScheduleEntry",
    "build_schedule",
    "canonical_schedule",
    "default_schedule",
    "format_slot",
    "stages_per_rank",
    "validate_orders",
]

KINDS = ("F", "B", "I", "W")


class ScheduleError(ValueError):
    """An impossible schedule request or a malformed order (one line: what, got, fix)."""


@dataclass(frozen=True)
class Action:
    """One compute action: ``kind`` of micro-batch ``mb`` on model stage ``stage``."""

    stage: int
    kind: str  # "F", "B" (full backward), "I" (backward-input), "W" (backward-weight)
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


Slot = tuple[Action, ...]  # 1 action, or 2 = an overlapped pair (F first, then B)


def format_slot(slot: Slot) -> str:
    """``0F3`` for a single action, ``(0F3;1B2)`` for an overlapped pair."""
    if len(slot) == 1:
        return str(slot[0])
    return "(" + ";".join(str(a) for a in slot) + ")"


@dataclass
class ScheduleSpec:
    """A built schedule: stage placement plus one compute order per pipeline rank."""

    name: str
    pp: int  # pipeline ranks
    num_stages: int  # model stages
    microbatches: int
    stage_ranks: dict[int, list[int]]  # stage -> ranks holding a copy (2 only for dualpipe)
    orders: list[list[Slot]]  # per rank, compute slots in execution order
    placement: str = "loop"

    def rank_of(self, stage: int, mb: int) -> int:
        """The pipeline rank whose copy of ``stage`` runs micro-batch ``mb``."""
        if stage not in self.stage_ranks:
            raise ScheduleError(
                f"{self.name}: stage {stage} does not exist (stages are 0..{self.num_stages - 1})"
            )
        if not 0 <= mb < self.microbatches:
            raise ScheduleError(
                f"{self.name}: micro-batch {mb} does not exist (0..{self.microbatches - 1})"
            )
        ranks = self.stage_ranks[stage]
        if len(ranks) == 1:
            return ranks[0]
        return ranks[0] if mb < self.microbatches // 2 else ranks[1]

    def stages_of(self, rank: int) -> list[int]:
        """Model stages that ``rank`` holds (ascending)."""
        return sorted(s for s, ranks in self.stage_ranks.items() if rank in ranks)

    def format_order(self, rank: int) -> str:
        """Space-separated order of one rank, e.g. ``0F0 0F1 (0F2;7B0) 7W0``."""
        return " ".join(format_slot(slot) for slot in self.orders[rank])

    def __str__(self) -> str:
        head = f"{self.name} pp={self.pp} stages={self.num_stages} m={self.microbatches}"
        return "\n".join([head] + [f"rank {r}: {self.format_order(r)}" for r in range(self.pp)])


# ----------------------------------------------------------------------------- orders


def _gpipe(pp: int, m: int) -> list[list[Slot]]:
    """All forwards, then all backwards, in micro-batch order."""
    return [
        [(Action(r, "F", i),) for i in range(m)] + [(Action(r, "B", i),) for i in range(m)]
        for r in range(pp)
    ]


def _one_f_one_b(pp: int, m: int) -> list[list[Slot]]:
    """Textbook 1F1B: min(pp-1-r, m) warmup F, steady [F, B], cooldown B."""
    orders = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        order: list[Slot] = [(Action(r, "F", i),) for i in range(warmup)]
        for i in range(m - warmup):
            order += [(Action(r, "F", warmup + i),), (Action(r, "B", i),)]
        order += [(Action(r, "B", i),) for i in range(m - warmup, m)]
        orders.append(order)
    return orders


def _interleaved(pp: int, m: int, v: int, zero_bubble: bool, combined: bool = False) -> list[list[Slot]]:
    """Interleaved 1F1B (loop placement), or ZB1P when ``zero_bubble``, or with ``combined``
    Megatron-Core's combined 1F1B.

    Forwards go round-robin over local stages in groups of q micro-batches (q = m /
    rounds, rounds = max(1, m // pp)); backwards visit local stages in reverse.
    1F1B warms up with (v-1)q + 2(pp-1-r) forwards and runs full backwards. ZB1P warms up
    with (v-1)q + (pp-1-r), runs backward-input I, and once the backward index reaches r
    follows each I with the W of the oldest pending I; leftover Ws go last.
    Combined 1F1B (Megatron-Core ``overlap_moe_expert_parallel_comm``) warms up with one
    forward more (pipeline_parallel/schedules.py get_pp_rank_microbatches, "one extra
    micro-batch forward step before the 1f1b stages") and runs each steady-state forward and
    backward as one overlapped pair (pipeline_parallel/combined_1f1b.py), so one micro-batch's
    all-to-alls run while the other computes.
    """
    rounds = max(1, m // pp)
    q = m // rounds
    total = v * m
    orders = []
    for r in range(pp):
        warmup = min((v - 1) * q + (1 if zero_bubble else 2) * (pp - 1 - r) + int(combined), total)
        f_next = [0] * v  # next micro-batch per local stage, forward
        b_next = [0] * v
        pending_w: deque[Action] = deque()
        order: list[Slot] = []

        def forward(k: int) -> None:
            local = (k // q) % v
            order.append((Action(local * pp + r, "F", f_next[local]),))
            f_next[local] += 1

        def backward(j: int) -> None:
            local = v - 1 - (j // q) % v
            act = Action(local * pp + r, "I" if zero_bubble else "B", b_next[local])
            b_next[local] += 1
            order.append((act,))
            if zero_bubble:
                pending_w.append(Action(act.stage, "W", act.mb))
                if j >= r:
                    order.append((pending_w.popleft(),))

        for k in range(warmup):
            forward(k)
        for j in range(total - warmup):
            forward(warmup + j)
            backward(j)
            if combined:  # the two slots just appended run as one overlapped F&B pair
                order[-2:] = [order[-2] + order[-1]]
        for j in range(total - warmup, total):
            backward(j)
        order += [(w,) for w in pending_w]
        orders.append(order)
    return orders


def _zbv(pp: int, m: int) -> list[list[Slot]]:
    """ZB-V (torch ScheduleZBVZeroBubble): V placement, chunk 0 = stage r, chunk 1 = 2pp-1-r.

    Runs with n = max(2pp-1, m) micro-batches and drops the actions of micro-batches >= m.
    """
    n = max(2 * pp - 1, m)
    orders = []
    for r in range(pp):
        c = (r, 2 * pp - 1 - r)
        nf, ni, nw = [0, 0], [0, 0], [0, 0]
        order: list[Slot] = []

        def emit(ops: str) -> None:
            """Append ops written as chunk+kind, e.g. "1F 1I 1W"."""
            for op in ops.split():
                chunk, kind = int(op[0]), op[1]
                counter = {"F": nf, "I": ni, "W": nw}[kind]
                order.append((Action(c[chunk], kind, counter[chunk]),))
                counter[chunk] += 1

        for _ in range(2 * (pp - r) - 1):  # warmup
            emit("0F")
        for _ in range(r):
            emit("1F 0F")
        for _ in range(pp - r):
            emit("1F 1I 1W")
        while nf[1] < nf[0] or nf[0] < n:  # steady
            emit(("0F " if nf[0] < n else "") + "0I 0W 1F 1I 1W")
        for _ in range(r):  # cooldown
            emit("0I 1I")
        for _ in range(pp - r):
            emit("0I 0W")
        emit("1W " * (ni[1] - nw[1]) + "0W " * (ni[0] - nw[0]))
        orders.append([s for s in order if s[0].mb < m])
    return orders


def _dualpipe_rank(n: int, h: int, m_half: int, stage: tuple[int, int],
                   mb_base: tuple[int, int]) -> list[Slot]:
    """The 8-step DualPipe order of one rank, in terms of its two local phases.

    n = ranks per half (DualPipeV: pp), h = half rank, m_half = micro-batches per phase.
    Phase k runs model stage ``stage[k]`` on micro-batches ``mb_base[k] + 0, 1, ...``.
    Ws are deferred through a FIFO of Is (like DualPipe's WeightGradStore).
    """
    nf, nb = [0, 0], [0, 0]
    pending_w: deque[Action] = deque()
    order: list[Slot] = []

    def fwd(k: int) -> Action:
        nf[k] += 1
        return Action(stage[k], "F", mb_base[k] + nf[k] - 1)

    def bwd(k: int, kind: str = "B") -> Action:
        nb[k] += 1
        a = Action(stage[k], kind, mb_base[k] + nb[k] - 1)
        if kind == "I":
            pending_w.append(Action(a.stage, "W", a.mb))
        return a

    def weight() -> None:
        if pending_w:
            order.append((pending_w.popleft(),))

    middle = h == n - 1
    for _ in range(2 * (n - h - 1)):  # 1: F0
        order.append((fwd(0),))
    for _ in range(h + 1):  # 2: F0 F1
        order += [(fwd(0),), (fwd(1),)]
    for _ in range(n - h - 1):  # 3: I1 W F1
        order.append((bwd(1, "I"),))
        weight()
        order.append((fwd(1),))
    for i in range(m_half - 2 * n + h + 1):  # 4: (F0;B1) (F1;B0)
        if i == 0 and middle:  # not overlapped, to shrink the bubble
            order += [(fwd(0),), (bwd(1),)]
        else:
            order.append((fwd(0), bwd(1)))
        order.append((fwd(1), bwd(0)))
    for _ in range(n - h - 1):  # 5: B1 (F1;B0)
        order += [(bwd(1),), (fwd(1), bwd(0))]
    zb = False
    for i in range(h + 1):  # 6: B1 B0, switching to I halfway
        if i == (h + 1) // 2 and h % 2 == 1:
            zb = True
        order.append((bwd(1, "I" if zb else "B"),))
        if i == (h + 1) // 2 and h % 2 == 0:
            zb = True
        order.append((bwd(0, "I" if zb else "B"),))
    for _ in range(n - h - 1):  # 7: W I0
        weight()
        order.append((bwd(0, "I"),))
    for _ in range(h + 1):  # 8: W
        weight()
    return order


def _dualpipev(pp: int, m: int) -> list[list[Slot]]:
    return [_dualpipe_rank(pp, r, m, (r, 2 * pp - 1 - r), (0, 0)) for r in range(pp)]


def _dualpipe(pp: int, m: int) -> list[list[Slot]]:
    n, half = pp // 2, m // 2
    orders = []
    for r in range(pp):
        # direction 0 (enters at rank 0) uses stage r here, direction 1 stage pp-1-r;
        # the second half of the ranks see direction 1 as their phase 0.
        d0 = int(r >= n)
        stage_of = (r, pp - 1 - r)
        orders.append(_dualpipe_rank(
            n, min(r, pp - 1 - r), half,
            (stage_of[d0], stage_of[1 - d0]), (d0 * half, (1 - d0) * half),
        ))
    return orders


# ----------------------------------------------------------------------------- build


def _fail(name: str, msg: str) -> ScheduleError:
    return ScheduleError(f"{name} {msg}")


def _multiples_hint(m: int, k: int) -> str:
    lo = (m // k) * k
    return f"use {lo} or {lo + k}" if lo >= k else f"use {k}"


def _check_single(name: str, pp: int, m: int, spr: int | None) -> int:
    if spr not in (None, 1):
        raise _fail(name, f"is a single-stage schedule: stages_per_rank must be 1 (got {spr}); "
                          "use interleaved_1f1b or zb1p for more stages per rank")
    if name == "1f1b" and m < pp:
        raise _fail(name, f"needs microbatches >= pp like torch's Schedule1F1B (got m={m}, "
                          f"pp={pp}); use m >= {pp} or gpipe")
    return 1


def _check_interleaved(name: str, pp: int, m: int, spr: int | None) -> int:
    spr = SCHEDULE_TABLE[name].stages_per_rank if spr is None else spr
    low = SCHEDULE_TABLE[name].stages_per_rank
    if not isinstance(spr, int) or spr < low:
        raise _fail(name, f"needs stages_per_rank >= {low} (got {spr})")
    if spr > 1 and m % pp:
        raise _fail(name, "needs microbatches to be a multiple of the pipeline degree "
                          f"(got m={m}, pp={pp}); {_multiples_hint(m, pp)}")
    return spr


def _check_combined(name: str, pp: int, m: int, spr: int | None) -> int:
    # Megatron-Core TransformerConfig: "If enabling EP A2A overlap,
    # virtual_pipeline_model_parallel_size must be specified when pipeline_model_parallel_size > 1"
    if pp > 1 and spr == 1:
        raise _fail(name, "needs virtual stages when pp > 1, as Megatron-Core's EP all-to-all overlap does: "
                          "stages_per_rank must be >= 2 (got 1); use 2, or schedule interleaved_1f1b/1f1b")
    return _check_interleaved(name, pp, m, spr) if pp > 1 else 1


def _check_v(name: str, pp: int, m: int, spr: int | None) -> int:
    if spr not in (None, 2):
        raise _fail(name, f"uses V placement with exactly 2 stages per rank: stages_per_rank "
                          f"must be 2 (got {spr}); pass 2 or leave it unset")
    if name == "dualpipev" and m < 2 * pp:
        raise _fail(name, f"needs microbatches >= number of stages 2*pp like torch's "
                          f"ScheduleDualPipeV (got m={m}, pp={pp}); use {2 * pp}")
    return 2


def _check_mirror(name: str, pp: int, m: int, spr: int | None) -> int:
    if spr not in (None, 1, 2):
        raise _fail(name, f"has pp stages and holds copies of stages r and pp-1-r on rank r: "
                          "stages_per_rank must be 1 (stages/pp) or 2 (copies per rank) "
                          f"(got {spr})")
    if pp % 2:
        fix = f"use {pp - 1} or {pp + 1}" if pp > 1 else "use 2"
        raise _fail(name, f"needs an even pipeline degree (got pp={pp}); {fix}")
    if m % 2 or m < 2 * pp:
        good = max(2 * pp, m + m % 2)
        raise _fail(name, "needs an even number of microbatches >= 2*pp "
                          f"(got m={m}, pp={pp}); use {good}")
    return 2


@dataclass(frozen=True)
class ScheduleEntry:
    """Everything the library knows about one schedule (`SCHEDULE_TABLE`).

    name:            our name.
    torch_name:      torch.distributed.pipelining's class name without ``Schedule`` ("" when
                     torch has none with the same order); accepted wherever a schedule is named.
    placement:       ``loop``, ``v`` or ``mirror`` (module docstring).
    stages_per_rank: the pipeline directive's default (model stages = pp × this).
    copies:          copies of each model stage (dualpipe: 2, one per direction).
    check:           (name, pp, m, requested stages per rank) -> stages a rank holds, or
                     ScheduleError saying what is impossible and how to fix it.
    build:           (pp, m, stages a rank holds) -> compute slots per rank.
    explore_min_mb:  the explorer tries micro-batch counts >= this × pp only (1: any).
    demo_as:         the schedule a two-rank CPU demo of this one runs ("" itself).
    needs_ep:        it overlaps expert-parallel all-to-alls (combined_1f1b): plans without
                     expert parallelism, or with full recompute, are refused.
    """

    name: str
    torch_name: str
    placement: str
    stages_per_rank: int
    check: Callable[[str, int, int, int | None], int]
    build: Callable[[int, int, int], list[list[Slot]]]
    copies: int = 1
    explore_min_mb: int = 1
    demo_as: str = ""
    needs_ep: bool = False


SCHEDULE_TABLE: dict[str, ScheduleEntry] = {e.name: e for e in (
    ScheduleEntry("gpipe", "GPipe", "loop", 1, _check_single, lambda pp, m, v: _gpipe(pp, m), explore_min_mb=2),
    ScheduleEntry("1f1b", "1F1B", "loop", 1, _check_single, lambda pp, m, v: _one_f_one_b(pp, m)),
    ScheduleEntry("interleaved_1f1b", "Interleaved1F1B", "loop", 2, _check_interleaved,
                  lambda pp, m, v: _interleaved(pp, m, v, zero_bubble=False)),
    ScheduleEntry("combined_1f1b", "", "loop", 2, _check_combined,
                  lambda pp, m, v: _interleaved(pp, m, v, zero_bubble=False, combined=True), needs_ep=True),
    ScheduleEntry("zb1p", "InterleavedZeroBubble", "loop", 1, _check_interleaved,
                  lambda pp, m, v: _interleaved(pp, m, v, zero_bubble=True), explore_min_mb=2),
    ScheduleEntry("zbv", "ZBVZeroBubble", "v", 2, _check_v, lambda pp, m, v: _zbv(pp, m), explore_min_mb=2),
    ScheduleEntry("dualpipe", "", "mirror", 1, _check_mirror, lambda pp, m, v: _dualpipe(pp, m), copies=2,
                  explore_min_mb=2, demo_as="dualpipev"),
    ScheduleEntry("dualpipev", "DualPipeV", "v", 2, _check_v, lambda pp, m, v: _dualpipev(pp, m),
                  explore_min_mb=2),
)}
SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_TABLE)
# torch.distributed.pipelining's names (``get_schedule_class``) of the schedules whose orders
# equal ours; accepted, case-insensitively and with or without "Schedule", wherever a
# schedule is named.
TORCH_NAMES = {e.name: e.torch_name for e in SCHEDULE_TABLE.values() if e.torch_name}
_ALIASES = {torch.lower(): ours for ours, torch in TORCH_NAMES.items()}
PLACEMENTS = {e.name: e.placement for e in SCHEDULE_TABLE.values()}


def canonical_schedule(name: str) -> str:
    """Our name of a schedule named ours or torch's way: ``"ZBVZeroBubble"`` -> ``"zbv"``,
    ``"ScheduleInterleaved1F1B"`` -> ``"interleaved_1f1b"``. Unknown names come back lowered."""
    key = name.strip().lower() if isinstance(name, str) else name
    if not isinstance(key, str):
        return key
    if key.startswith("schedule") and key[len("schedule"):] in _ALIASES:
        key = key[len("schedule"):]
    return _ALIASES.get(key, key)


def default_schedule(stages_per_rank: int | None) -> str:
    """The schedule of a pipeline that names none: interleaved 1F1B for several stages per
    rank, else 1F1B."""
    return "interleaved_1f1b" if stages_per_rank and stages_per_rank > 1 else "1f1b"


def known_names() -> str:
    """For error messages: ours, then torch's aliases."""
    return ", ".join(SCHEDULES) + " (or torch's " + ", ".join(TORCH_NAMES.values()) + ")"


def guess(name: object) -> str:
    """`` (did you mean 'zb1p'?)`` for a mistyped schedule name ('' when nothing is close)."""
    from costmodel.names import did_you_mean

    close = did_you_mean(name, [*SCHEDULES, *TORCH_NAMES.values()])
    return f" (did you mean {close!r}?)" if close else ""


def _check(name: str, pp: int, m: int, spr: int | None) -> int:
    """Validate a request; return the stages per rank to use."""
    if name not in SCHEDULE_TABLE:
        raise ScheduleError(f"unknown schedule {name!r}{guess(name)}; choose one of {known_names()}")
    if not isinstance(pp, int) or pp < 1:
        raise _fail(name, f"needs pp to be an integer >= 1 (got pp={pp!r})")
    if not isinstance(m, int) or m < 1:
        raise _fail(name, f"needs microbatches to be an integer >= 1 (got m={m!r})")
    return SCHEDULE_TABLE[name].check(name, pp, m, spr)


def stages_per_rank(name: str, pp: int, microbatches: int, requested: int | None = None) -> int:
    """The stages each pipeline rank holds under schedule ``name`` (ScheduleError if impossible)."""
    return _check(name, pp, microbatches, requested)


def build_schedule(name: str, pp: int, microbatches: int, stages_per_rank: int | None = None,
                   placement: str | None = None) -> ScheduleSpec:
    """Build the per-rank compute orders of schedule ``name``.

    ``stages_per_rank`` defaults to what the schedule needs (1 for gpipe/1f1b/zb1p, 2 for
    the others; dualpipe, with pp stages in two copies, accepts 1 or 2). ``placement``
    may name the schedule's placement (``loop``, ``v`` or ``mirror``) but cannot change
    it. Raises ScheduleError on impossible requests.
    """
    name = canonical_schedule(name)
    v = _check(name, pp, microbatches, stages_per_rank)
    m = microbatches
    style = SCHEDULE_TABLE[name].placement
    # with one stage per rank, loop and V placement coincide
    if placement is not None and placement != style and not (v == 1 and placement == "v"):
        raise _fail(name, f"uses {style!r} placement (got placement={placement!r}); "
                          f"pass placement={style!r} or leave it unset")
    if style == "mirror":
        stage_ranks = {s: [s, pp - 1 - s] for s in range(pp)}
    elif style == "v":
        stage_ranks = {s: [s if s < pp else 2 * pp - 1 - s] for s in range(2 * pp)}
    else:
        stage_ranks = {s: [s % pp] for s in range(v * pp)}
    return ScheduleSpec(name, pp, len(stage_ranks), m, stage_ranks, SCHEDULE_TABLE[name].build(pp, m, v), style)


# ----------------------------------------------------------------------------- validate


def _deps(a: Action, last_stage: int) -> list[tuple[int, str, int]]:
    """What must finish before ``a`` may start (keys as recorded by validate_orders)."""
    if a.kind == "F":
        return [(a.stage - 1, "F", a.mb)] if a.stage > 0 else []
    if a.kind == "W":
        return [(a.stage, "I", a.mb)]
    deps = [(a.stage, "F", a.mb)]
    if a.stage < last_stage:
        deps.append((a.stage + 1, "G", a.mb))  # G = input gradient (from I or B)
    return deps


def validate_orders(spec: ScheduleSpec) -> int:
    """Check ``spec.orders`` and return its unit-time makespan.

    Checks that every (stage, mb) has exactly one F and either one B or one I and one W,
    each on ``spec.rank_of(stage, mb)``; that F precedes its backward and I precedes W; and
    that a unit-time execution (each slot takes one step once its dependencies finished in
    earlier steps) completes. Raises ScheduleError naming the problem or the blocked heads.
    """
    where = f"{spec.name} pp={spec.pp} m={spec.microbatches}"
    if len(spec.orders) != spec.pp:
        raise ScheduleError(f"{where}: {len(spec.orders)} rank orders for pp={spec.pp}")
    pos: dict[tuple[int, str, int], tuple[int, int]] = {}  # (stage, kind, mb) -> (rank, slot)
    for rank, order in enumerate(spec.orders):
        for i, slot in enumerate(order):
            if len(slot) not in (1, 2):
                raise ScheduleError(f"{where}: rank {rank} slot {i} holds {len(slot)} actions")
            for a in slot:
                if a.kind not in KINDS:
                    raise ScheduleError(f"{where}: rank {rank} has unknown kind in {a}")
                key = (a.stage, a.kind, a.mb)
                if key in pos:
                    raise ScheduleError(
                        f"{where}: {a} appears twice (ranks {pos[key][0]} and {rank})")
                if spec.rank_of(a.stage, a.mb) != rank:
                    raise ScheduleError(
                        f"{where}: {a} is on rank {rank} but stage {a.stage} mb {a.mb} "
                        f"belongs to rank {spec.rank_of(a.stage, a.mb)}")
                pos[key] = (rank, i)
    for s in range(spec.num_stages):
        for mb in range(spec.microbatches):
            have = {k for k in KINDS if (s, k, mb) in pos}
            if have not in ({"F", "B"}, {"F", "I", "W"}):
                raise ScheduleError(
                    f"{where}: stage {s} mb {mb} has passes {''.join(sorted(have)) or 'none'}; "
                    "need F and B, or F, I and W")
            back = "B" if "B" in have else "I"
            if pos[(s, back, mb)][1] <= pos[(s, "F", mb)][1]:
                raise ScheduleError(f"{where}: {s}{back}{mb} is not after {s}F{mb}")
            if back == "I" and pos[(s, "W", mb)][1] <= pos[(s, "I", mb)][1]:
                raise ScheduleError(f"{where}: {s}W{mb} is not after {s}I{mb}")

    last = spec.num_stages - 1
    done: set[tuple[int, str, int]] = set()
    heads = [0] * spec.pp
    steps = 0
    while any(h < len(o) for h, o in zip(heads, spec.orders)):
        ready = [r for r in range(spec.pp) if heads[r] < len(spec.orders[r]) and all(
            d in done for a in spec.orders[r][heads[r]] for d in _deps(a, last))]
        if not ready:
            blocked = "; ".join(
                f"rank {r} at {format_slot(spec.orders[r][heads[r]])} (needs "
                + ", ".join(f"{s}{'I/B' if k == 'G' else k}{mb}" for a in spec.orders[r][heads[r]]
                            for s, k, mb in _deps(a, last) if (s, k, mb) not in done) + ")"
                for r in range(spec.pp) if heads[r] < len(spec.orders[r]))
            raise ScheduleError(f"{where}: deadlock after {steps} steps; blocked heads: {blocked}")
        for r in ready:
            for a in spec.orders[r][heads[r]]:
                done.add((a.stage, a.kind, a.mb))
                if a.kind in ("I", "B"):
                    done.add((a.stage, "G", a.mb))
            heads[r] += 1
        steps += 1
    return steps
