"""Tests for piper_sim.schedules: shapes, constraints, validation, and equality with torch."""

from __future__ import annotations

import pytest

from piper_sim.schedules import (
    SCHEDULES,
    Action,
    ScheduleError,
    ScheduleSpec,
    build_schedule,
    validate_orders,
)

PPS = (1, 2, 4, 8)
MS = (1, 2, 3, 4, 6, 8, 12, 16, 32)


from torch_oracle import torch_orders, _torch_schedules  # noqa: E402


MULTI = [
    ("interleaved_1f1b", "ScheduleInterleaved1F1B", 2),
    ("interleaved_1f1b", "ScheduleInterleaved1F1B", 3),
    ("zb1p", "ScheduleInterleavedZeroBubble", 1),
    ("zb1p", "ScheduleInterleavedZeroBubble", 2),
    ("zb1p", "ScheduleInterleavedZeroBubble", 4),
    ("zbv", "ScheduleZBVZeroBubble", 2),
    ("dualpipev", "ScheduleDualPipeV", 2),
]


@pytest.mark.parametrize("name,cls_name,v", MULTI, ids=[f"{n}-v{v}" for n, _, v in MULTI])
def test_multi_stage_orders_equal_torch(name, cls_name, v):
    cls = getattr(_torch_schedules(), cls_name)
    compared = 0
    for pp in (1, 2, 3, 4, 8):
        for m in range(1, 25):
            try:
                spec = build_schedule(name, pp, m, v)
            except ScheduleError:
                continue
            try:
                expected = torch_orders(cls, pp, m, v)
            except ValueError:
                # torch's zero bubble also demands m % max(1, m // pp) == 0 for v=1,
                # where the order does not depend on it; we accept those m.
                assert name == "zb1p" and v == 1
                continue
            assert spec.orders == expected, f"{name} pp={pp} m={m} v={v}"
            compared += 1
    assert compared >= 20


def test_gpipe_equals_torch():
    S = _torch_schedules()
    for pp in PPS:
        for m in MS:
            expected = torch_orders(S.ScheduleGPipe, pp, m, 1, single=True)
            assert build_schedule("gpipe", pp, m).orders == expected


def test_1f1b_equals_torch():
    """Equal to torch's Schedule1F1B, except a known torch off-by-one on the last rank."""
    S = _torch_schedules()
    for pp in PPS:
        for m in (mm for mm in MS if mm >= pp):
            ours = build_schedule("1f1b", pp, m).orders
            theirs = torch_orders(S.Schedule1F1B, pp, m, 1, single=True)
            assert ours[:-1] == theirs[:-1]
            # torch 2.13 numbers the last rank's forwards 1..m instead of 0..m-1
            torch_bug = any(s[0].kind == "F" and s[0].mb == m for s in theirs[-1])
            assert ours[-1] == theirs[-1] or torch_bug


def test_torch_1f1b_rejects_m_below_pp_like_us():
    S = _torch_schedules()
    with pytest.raises(ValueError):
        torch_orders(S.Schedule1F1B, 4, 2, 1, single=True)
    with pytest.raises(ScheduleError, match="1f1b needs microbatches >= pp"):
        build_schedule("1f1b", 4, 2)


# ----------------------------------------------------------------------------- shapes


def test_action_and_slot_notation():
    spec = build_schedule("dualpipev", 2, 4)
    assert str(Action(0, "F", 3)) == "0F3"
    assert spec.format_order(0).split()[0] == "0F0"
    assert "(0F3;3B1)" in spec.format_order(0)
    assert str(spec).splitlines()[0] == "dualpipev pp=2 stages=4 m=4"


@pytest.mark.parametrize("pp", PPS)
def test_1f1b_warmup_steady_cooldown(pp):
    m = 2 * pp
    spec = build_schedule("1f1b", pp, m)
    for r, order in enumerate(spec.orders):
        kinds = "".join(s[0].kind for s in order)
        w = pp - 1 - r
        assert kinds == "F" * w + "FB" * (m - w) + "B" * w
        assert [s[0].mb for s in order if s[0].kind == "F"] == list(range(m))


def test_gpipe_all_forwards_first():
    spec = build_schedule("gpipe", 4, 6)
    for order in spec.orders:
        assert "".join(s[0].kind for s in order) == "F" * 6 + "B" * 6


def test_interleaved_loop_placement_and_warmup():
    pp, v, m = 4, 2, 8
    spec = build_schedule("interleaved_1f1b", pp, m, v)
    assert spec.num_stages == 8 and spec.stage_ranks[5] == [1]
    for r, order in enumerate(spec.orders):
        warmup = next(i for i, s in enumerate(order) if s[0].kind == "B")
        assert warmup == (v - 1) * pp + 2 * (pp - 1 - r) + 1  # warmup Fs plus the first steady F
        assert spec.stages_of(r) == [r, r + pp]


def test_zb1p_v1_is_zb_h1():
    """Warmup pp-1-r F, steady F I (+ W of the oldest I once the steady index reaches r)."""
    pp, m = 4, 8
    spec = build_schedule("zb1p", pp, m)
    for r, order in enumerate(spec.orders):
        kinds = "".join(s[0].kind for s in order)
        w = pp - 1 - r
        steady = "".join("FI" + ("W" if j >= r else "") for j in range(m - w))
        cool = "".join("I" + ("W" if j >= r else "") for j in range(m - w, m))
        assert kinds == "F" * w + steady + cool + "W" * min(r, m)


def test_v_placement():
    spec = build_schedule("zbv", 4, 8)
    assert spec.stage_ranks == {0: [0], 1: [1], 2: [2], 3: [3], 4: [3], 5: [2], 6: [1], 7: [0]}
    assert spec.placement == "v" and spec.stages_of(0) == [0, 7]


def test_dualpipe_placement_and_rank_of():
    spec = build_schedule("dualpipe", 4, 8)
    assert spec.num_stages == 4 and spec.stage_ranks[1] == [1, 2]
    assert spec.rank_of(0, 0) == 0 and spec.rank_of(0, 4) == 3
    assert spec.rank_of(3, 3) == 3 and spec.rank_of(3, 7) == 0
    # the up-direction micro-batches enter at the last rank
    assert spec.orders[3][0] == (Action(0, "F", 4),)
    with pytest.raises(ScheduleError):
        spec.rank_of(4, 0)


@pytest.mark.parametrize("pp,m,counts", [
    (4, 8, [16, 15, 15, 16]),
    (8, 16, [34, 32, 30, 29, 29, 30, 32, 34]),
])
def test_dualpipe_slot_counts(pp, m, counts):
    spec = build_schedule("dualpipe", pp, m)
    assert [len(o) for o in spec.orders] == counts
    # bubble-free at unit time: the makespan equals the busiest rank's slot count
    assert validate_orders(spec) == max(counts)
    # ranks r and pp-1-r mirror each other
    for r in range(pp):
        assert [len(s) for s in spec.orders[r]] == [len(s) for s in spec.orders[pp - 1 - r]]


def test_dualpipe_middle_ranks_start_step4_unoverlapped():
    spec = build_schedule("dualpipe", 4, 8)
    for r in (1, 2):
        first_pair = next(i for i, s in enumerate(spec.orders[r]) if len(s) == 2)
        assert [s[0].kind for s in spec.orders[r][first_pair - 2:first_pair]] == ["F", "B"]


@pytest.mark.parametrize("name,v,makespan", [
    ("gpipe", 1, lambda p, m: 2 * (m + p - 1)),
    ("1f1b", 1, lambda p, m: 2 * (m + p - 1)),
    ("interleaved_1f1b", 2, lambda p, m: 2 * 2 * m + 2 * (p - 1)),
    ("zb1p", 1, lambda p, m: 3 * m + p - 1),
    ("zbv", 2, lambda p, m: 6 * m + p - 1),
])
def test_unit_time_makespan(name, v, makespan):
    """Bubble sizes with every action taking one step (for the V/zb ones, m >= 2pp)."""
    for pp in PPS:
        for m in (2 * pp, 4 * pp):
            assert validate_orders(build_schedule(name, pp, m, v)) == makespan(pp, m), (pp, m)


# ----------------------------------------------------------------------------- grid


GRID = [(name, v) for name in SCHEDULES for v in ((2, 3) if name == "interleaved_1f1b" else
                                                   (1, 2) if name == "zb1p" else (None,))]


@pytest.mark.parametrize("name,v", GRID, ids=[f"{n}-{v}" for n, v in GRID])
def test_every_schedule_validates_over_grid(name, v):
    built = 0
    for pp in PPS:
        for m in MS:
            try:
                spec = build_schedule(name, pp, m, v)
            except ScheduleError:
                continue
            assert isinstance(spec, ScheduleSpec)
            steps = validate_orders(spec)
            assert steps >= max(len(o) for o in spec.orders)
            built += 1
    assert built >= 8


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("args,kwargs,message", [
    (("interleaved_1f1b", 4, 6), {}, r"interleaved_1f1b needs microbatches to be a multiple of the "
                                     r"pipeline degree \(got m=6, pp=4\); use 4 or 8"),
    (("zb1p", 4, 6, 2), {}, r"multiple of the pipeline degree \(got m=6, pp=4\)"),
    (("nope", 4, 8), {}, r"unknown schedule 'nope'; choose one of gpipe, 1f1b"),
    (("1f1b", 0, 8), {}, r"1f1b needs pp to be an integer >= 1 \(got pp=0\)"),
    (("gpipe", 2, 0), {}, r"gpipe needs microbatches to be an integer >= 1 \(got m=0\)"),
    (("gpipe", 2, 4, 2), {}, r"single-stage schedule: stages_per_rank must be 1"),
    (("interleaved_1f1b", 2, 4, 1), {}, r"needs stages_per_rank >= 2 \(got 1\)"),
    (("zbv", 2, 4, 3), {}, r"exactly 2 stages per rank: stages_per_rank must be 2 \(got 3\)"),
    (("dualpipe", 4, 8, 3), {}, r"must be 1 \(stages/pp\) or 2 \(copies per rank\) \(got 3\)"),
    (("dualpipev", 4, 6), {}, r"dualpipev needs microbatches >= number of stages 2\*pp"),
    (("dualpipe", 3, 12), {}, r"dualpipe needs an even pipeline degree \(got pp=3\)"),
    (("dualpipe", 4, 6), {}, r"even number of microbatches >= 2\*pp \(got m=6, pp=4\); use 8"),
    (("dualpipe", 4, 9), {}, r"use 10"),
    (("zbv", 4, 8), {"placement": "loop"}, r"zbv uses 'v' placement \(got placement='loop'\)"),
])
def test_errors(args, kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        build_schedule(*args, **kwargs)


def test_schedule_error_is_value_error_and_defaults():
    assert issubclass(ScheduleError, ValueError)
    assert build_schedule("zbv", 2, 4).num_stages == 4  # stages_per_rank defaults to 2
    assert build_schedule("interleaved_1f1b", 2, 4).num_stages == 4
    assert build_schedule("zb1p", 2, 4).num_stages == 2
    assert build_schedule("dualpipe", 2, 4, 1).orders == build_schedule("dualpipe", 2, 4, 2).orders
    assert build_schedule("1F1B", 2, 4, placement="loop").name == "1f1b"


def _spec(orders: list[str], name: str = "custom", m: int = 2) -> ScheduleSpec:
    def parse(tok: str) -> tuple[Action, ...]:
        return tuple(Action(int(t[0]), t[1], int(t[2:])) for t in tok.strip("()").split(";"))
    pp = len(orders)
    return ScheduleSpec(name, pp, pp, m, {s: [s] for s in range(pp)},
                        [[parse(t) for t in o.split()] for o in orders])


def test_validate_detects_deadlock():
    spec = _spec(["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"])
    blocked = r"rank 0 at 0B0 \(needs 1I/B0\); rank 1 at 1F1 \(needs 0F1\)"
    with pytest.raises(ScheduleError, match=r"deadlock after 1 steps; blocked heads: " + blocked):
        validate_orders(spec)


@pytest.mark.parametrize("orders,message", [
    (["0F0 0F1 0B0", "1F0 1B0 1F1 1B1"], r"stage 0 mb 1 has passes F"),
    (["0F0 0F1 0B0 0B1 0B1", "1F0 1B0 1F1 1B1"], r"0B1 appears twice"),
    (["0F0 0F1 0B0 0B1 1F0", "1B0 1F1 1B1"], r"1F0 is on rank 0 but stage 1 mb 0 belongs to rank"),
    (["0F0 0F1 0B0 0B1", "1B0 1F0 1F1 1B1"], r"1B0 is not after 1F0"),
    (["0F0 0F1 0I0 0W1 0I1 0W0", "1F0 1B0 1F1 1B1"], r"0W1 is not after 0I1"),
    (["0F0 0F1 0I0 0B1", "1F0 1B0 1F1 1B1"], r"stage 0 mb 0 has passes FI"),
])
def test_validate_detects_malformed(orders, message):
    with pytest.raises(ScheduleError, match=message):
        validate_orders(_spec(orders))


def test_validate_accepts_overlapped_pairs():
    assert validate_orders(_spec(["0F0 0F1 0B0 0B1", "1F0 (1F1;1B0) 1B1"])) == 5
