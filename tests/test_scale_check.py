"""The executor's rank logic at 64 ranks over the fake process group (`executor.scale_check`):
every sampled family's groups, pairs and plan agree, and the check names a real mismatch."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch.distributed as dist

import executor.collectives
from executor.scale_check import FAMILIES, WORLD, Call, Family, check, record_ranks, recording, scale_check
from piper_sim.compiler import compile_strategy

pytestmark = pytest.mark.filterwarnings("ignore")

# a sample covering a split backward, interleaving, ZeRO-3, TP with and without SP, EP and multi-token
# prediction; the rest: slow
FAST = ("zbv-zero3", "1f1b-moe-ep4-tp2-zero3", "1f1b-moe-mtp-ep4-tp2-sp-zero1")  # `-m slow`: the other families


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES])
def test_family_at_64_ranks_issues_matching_collectives(name):
    plan = compile_strategy(FAMILIES[name].strategy(64)).plan
    r = scale_check(plan)
    assert r.ranks == 64 and r.calls > 64
    assert r.ok, r.mismatch


def _plan(bucket_mb: float | None = None):
    s = Family(pp=2, tp=2, zero=1, m=2).strategy(8)
    if bucket_mb:
        next(d for d in s["directives"] if d["op"] == "data_parallel")["bucket_mb"] = bucket_mb
    return compile_strategy(s).plan


@pytest.fixture(scope="module")
def logs():
    return record_ranks(_plan())


def test_recording_wraps_and_restores_the_functions_the_executor_calls():
    before = (dist.all_reduce, dist.isend, dist.new_group, executor.collectives.reduce_scatter,
              executor.collectives.all_gather)
    with recording():
        assert dist.all_reduce is not before[0] and dist.isend.__wrapped__ is before[1]
        assert executor.collectives.reduce_scatter.__wrapped__ is before[3]  # a module's alias, too
    assert (dist.all_reduce, dist.isend, dist.new_group, executor.collectives.reduce_scatter,
            executor.collectives.all_gather) == before


def test_logs_of_a_small_plan_agree(logs):
    assert check(logs) is None
    ops = {c.op for log in logs for c in log.calls}
    assert {"all_reduce", "reduce_scatter", "all_gather", "send", "recv"} <= ops
    assert all(log.groups == logs[0].groups for log in logs)


def _with(logs, rank, calls=None, **fields):
    out = list(logs)
    out[rank] = dataclasses.replace(logs[rank], calls=calls if calls is not None else logs[rank].calls, **fields)
    return out


def test_a_rank_running_another_plan_is_named():
    """Rank 5 runs the same layout with other gradient buckets: its data-parallel group disagrees."""
    other = record_ranks(_plan(bucket_mb=0.05))
    mixed = record_ranks(_plan())
    mixed[5] = other[5]
    msg = check(mixed)
    assert msg is not None and "rank 5" in msg and "differ at op" in msg and "reduce_scatter" in msg, msg


def test_a_different_size_or_order_on_a_group_is_named(logs):
    r = 3
    calls = list(logs[r].calls)
    k = next(i for i, c in enumerate(calls) if c.group != WORLD and c.op == "all_gather")
    bigger = calls[:k] + [dataclasses.replace(calls[k], numel=calls[k].numel + 1)] + calls[k + 1:]
    msg = check(_with(logs, r, bigger))
    assert msg and f"and rank {r} differ at op" in msg and f"all_gather {calls[k].numel + 1}" in msg, msg
    same_group = [i for i, c in enumerate(calls) if c.group == calls[k].group]
    i, j = same_group[0], next(x for x in same_group if calls[x].op != calls[same_group[0]].op)
    swapped = list(calls)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    assert "differ at op 0" in check(_with(logs, r, swapped))


def test_an_unmatched_send_or_receive_is_named(logs):
    r = next(log.rank for log in logs if any(c.op == "recv" for c in log.calls))
    calls = list(logs[r].calls)
    k = max(i for i, c in enumerate(calls) if c.op == "recv")  # its last receive, never posted
    n = sum(c.op == "recv" and c.peer == calls[k].peer for c in calls) - 1
    msg = check(_with(logs, r, calls[:k] + calls[k + 1:]))
    assert msg == (f"p2p {calls[k].peer} -> {r} on group #{WORLD}: send {n} of rank {calls[k].peer} is "
                   f"send {calls[k].numel} {calls[k].dtype} peer {r} tag {calls[k].tag} but receive {n} of "
                   f"rank {r} is nothing"), msg


def test_a_collective_the_plan_does_not_list_is_named(logs):
    r = 2
    g = next(g for g, want in logs[r].expected.items() if want)
    expected = {**logs[r].expected, g: logs[r].expected[g][1:]}
    msg = check(_with(logs, r, expected=expected))
    assert msg and msg.startswith(f"rank {r} group #{g}") and "the plan says" in msg, msg
    extra = [*logs[r].calls, Call("broadcast", WORLD, 4, (4,), "float32", 0)]
    msg = check(_with(logs, r, extra))
    assert msg and "broadcast 4 float32" in msg, msg


def test_groups_created_in_another_order_are_named(logs):
    groups = copy.copy(logs[6].groups)
    groups[0], groups[1] = groups[1], groups[0]
    msg = check(_with(logs, 6, groups=groups))
    assert msg and msg.startswith("group creation differs between rank 0 and rank 6 at new_group #0"), msg


def test_a_rank_that_raises_is_the_report(monkeypatch):
    from executor.runtime import Runtime

    real = Runtime.run_step

    def run_step(self, step, **kw):
        if self.rank == 1:
            raise ValueError("boom")
        return real(self, step, **kw)
    monkeypatch.setattr(Runtime, "run_step", run_step)
    r = scale_check(_plan())
    assert not r.ok and r.mismatch == "failed: rank 1: ValueError: boom"


def test_clipping_adds_its_norm_all_reduce_on_its_own_group():
    r = scale_check(_plan(), clip_grad_norm=1.0)
    assert r.ok, r.mismatch
    assert r.calls == scale_check(_plan()).calls + 8  # one all-reduce of the squared norm per rank


def test_a_send_of_other_bytes_than_the_plan_says_is_named(logs):
    r = next(log.rank for log in logs if log.expected_p2p)
    key, want = next(iter(sorted(logs[r].expected_p2p.items())))
    (tag, nbytes), *rest = want
    msg = check(_with(logs, r, expected_p2p={**logs[r].expected_p2p, key: sorted([(tag, nbytes * 2), *rest])}))
    assert msg == (f"rank {r}: {key[1]}s with peer {key[2]}: (tag, bytes) [({tag}, {nbytes})] issued beyond the "
                   f"plan's, [({tag}, {nbytes * 2})] of the plan's not issued"), msg


def test_a_split_backwards_regathers_go_after_the_bi_piece_whose_shards_they_gather():
    """zb1p under SP: the runtime issues a ``.regather`` at its plan position, after the BI piece
    it waits for and the collectives its modules performed (`module_order`), wherever the plan's
    list puts it among those."""
    plan = compile_strategy(Family("zb1p", pp=2, tp=2, sp=True, zero=1, m=2).strategy(4)).plan
    logs = record_ranks(plan)
    assert check(logs) is None, check(logs)
    tp = [i.id for i in plan.program(2).streams["tp"]]
    got = next(ids for ids in ([i for _, i in want] for want in logs[2].expected.values()) if set(ids) == set(tp))
    assert got != tp  # the plan lists some regather among the modules' collectives
    for k, op in enumerate(got):
        if op.endswith(".regather"):  # every module collective of its backward pass went before it
            mb = op.split(".")[3]
            assert not [x for x in got[k:] if f".{mb}." in x and ".B." in x and not x.endswith(".regather")], op


def test_moe_under_sp_exchanges_the_token_counts_before_the_rows():
    """The forward gather of the experts' tokens over TP is two all-gathers (`TPComm.gather_rows`,
    as Megatron-Core's dispatcher): the counts (int64), then the rows; the plan lists one op."""
    plan = compile_strategy(Family(pp=1, tp=2, sp=True, zero=1, m=1, model="moe-tiny").strategy(2)).plan
    logs = record_ranks(plan)
    assert check(logs) is None, check(logs)
    g, want = next((g, w) for g, w in logs[0].expected.items() if any(i.endswith(".moe.ag") for _, i in w))
    calls = [c for c in logs[0].calls if c.group == g]
    firsts = [k for k, (_, i) in enumerate(want) if i.startswith("TP.F.") and i.endswith(".moe.ag")]
    assert firsts and all(want[k + 1] == want[k] for k in firsts[::2])
    assert [calls[k].dtype for k in firsts[::2]] == ["int64"] * (len(firsts) // 2)
