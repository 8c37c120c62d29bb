"""The finer recompute policies (`piper_sim.recompute`: torchtitan's op-SAC and every N-th
block, Megatron's selective ``modules``) under tensor (+ sequence) and context parallelism:
the checkpoints that hold a TP / CP collective re-run it inside the backward, and the plan
lists each re-run as an ``R`` op (`piper_sim.recompute.reruns_forward_collective`); under
torchrun (gloo) the runs equal the single-process reference (fp32, gradients within 1e-5)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_executor_cp import cp_strategy  # noqa: E402
from test_executor_tp import DSV3_TINY, _model, assert_matches_reference, reference_losses, run_checks, \
    tp_strategy  # noqa: E402

from piper_sim.api import compile  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def _rc(**kw) -> list[dict]:
    return [{"op": "recompute", **kw}]


def _reruns(s: dict, stream: str) -> list[str]:
    """The ``R`` ops of a plan's ``stream`` (rank 0, micro-batch 0), by name."""
    plan = compile(s)
    ops = [i for c in plan.classes for i in c.instructions() if i.stream == stream and i.direction == "R"]
    return sorted({i.name for i in ops if i.mb == 0})


def test_plans_list_what_each_policy_re_runs():
    """Megatron's ``mlp`` re-runs the MLP's row-parallel collective (SP: its all-gather and
    reduce-scatter), ``layernorm`` none; op-SAC every collective of every layer (not the head's:
    torchtitan wraps blocks only); every-2 those of the odd layers; CP ring: the K/V ring of the
    recomputed layers."""
    tp = tp_strategy(m=2)
    L = 8  # gpt-tiny
    assert _reruns({**tp, "directives": tp["directives"] + _rc(mode="selective", modules=["layernorm"])}, "tp") == []
    assert _reruns({**tp, "directives": tp["directives"] + _rc(mode="selective", modules=["layernorm", "mlp"])},
                   "tp") == sorted(f"l{i}.mlp.ar" for i in range(L))
    sp = tp_strategy(sp=True, m=2)
    assert _reruns({**sp, "directives": sp["directives"] + _rc(mode="selective", modules=["mlp"])}, "tp") == \
        sorted(f"l{i}.mlp.{x}" for i in range(L) for x in ("ag", "rs"))
    assert _reruns({**tp, "directives": tp["directives"] + _rc(mode="op")}, "tp") == \
        sorted(f"l{i}.{b}.ar" for i in range(L) for b in ("attn", "mlp"))
    full = _reruns({**tp, "directives": tp["directives"] + _rc()}, "tp")
    assert "head.loss.max" in full and len(full) == 2 * L + 3
    ring = cp_strategy(style="ring")
    assert _reruns({**ring, "directives": ring["directives"] + _rc(mode="every", every=2)}, "cp") == \
        sorted(f"l{i}.kv.ag" for i in range(1, L, 2))
    assert _reruns({**ring, "directives": ring["directives"] + _rc(mode="op")}, "cp") == \
        sorted(f"l{i}.kv.ag" for i in range(L))


def test_tp2_finer_policies_match_the_reference(tmp_path):
    """TP2 and TP2 + SP with Megatron's [layernorm, mlp] and with op-SAC; CP2 (allgather and
    ring) with op-SAC and every 2nd block: `run --check` equals the reference (one launch each)."""
    configs = {
        "tp2-modules": tp_strategy(extra=_rc(mode="selective", modules=["layernorm", "mlp"])),
        "tp2-sp-modules": tp_strategy(sp=True, extra=_rc(mode="selective", modules=["layernorm", "mlp"])),
        "tp2-op": tp_strategy(extra=_rc(mode="op")),
        "tp2-sp-op": tp_strategy(sp=True, extra=_rc(mode="op")),
    }
    res, _ = run_checks(tmp_path, 2, configs)
    assert_matches_reference(res, reference_losses(tmp_path, tp_strategy()))
    # the TP2 test's ordering: the TP2 modules' plan re-runs each MLP's all-reduce before its backward's
    names = [(i.direction, i.name) for c in compile(configs["tp2-modules"]).classes for i in c.instructions()
             if i.stream == "tp" and i.mb == 0 and i.name.startswith("l7.")]
    assert names == [("F", "l7.attn.ar"), ("F", "l7.mlp.ar"), ("R", "l7.mlp.ar"), ("B", "l7.mlp.ar"),
                     ("B", "l7.attn.ar")]


def test_cp2_finer_policies_match_the_reference(tmp_path):
    """CP2, all-gather (the recomputed layers keep their re-run gather for the backward) and
    ring (the recomputed layers' ``CP.R`` ring first), under op-SAC and every 2nd block."""
    configs = {
        "cp2-op": cp_strategy(extra=_rc(mode="op")),
        "cp2-every2": cp_strategy(extra=_rc(mode="every", every=2)),
        "cp2-ring-op": cp_strategy(style="ring", extra=_rc(mode="op")),
        "cp2-ring-every2": cp_strategy(style="ring", extra=_rc(mode="every", every=2)),
    }
    res, _ = run_checks(tmp_path, 2, configs)
    assert_matches_reference(res, reference_losses(tmp_path, cp_strategy()))


@pytest.mark.slow
def test_moe_and_mla_under_tp_and_ep_with_finer_policies(tmp_path):
    """TP2 x EP2 x DP2: a DeepSeek-V3-shaped model with every Megatron module that applies
    (the shared expert's checkpoint re-runs ``l1.shared.ar``), moe-tiny under op-SAC (the
    experts' own checkpoint re-runs their ``moe.ar``)."""
    ep = {"op": "expert_parallel", "degree": 2}
    mods = ["core_attn", "layernorm", "mlp", "moe_act", "shared_experts", "mla_up_proj"]
    dsv3 = {**tp_strategy(dp=2, extra=[ep, *_rc(mode="selective", modules=mods)]),
            "model": _model(tmp_path, DSV3_TINY)}
    moe = tp_strategy(model="moe-tiny", dp=2, extra=[ep, *_rc(mode="op")])
    assert "l1.shared.ar" in _reruns(dsv3, "tp") and "l0.mlp.ar" in _reruns(dsv3, "tp")
    res, _ = run_checks(tmp_path, 4, {"dsv3": dsv3, "moe-op": moe})
    assert_matches_reference({"moe-op": res.pop("moe-op")}, reference_losses(tmp_path, moe))
    assert_matches_reference(res, reference_losses(tmp_path, dsv3))


def test_split_backward_runs_the_finer_policies_equal_to_the_reference(tmp_path):
    """ZB1P, ZBV and DualPipeV (BI/BW split) with op-SAC, every 2nd block, Megatron's uniform
    chunks of 2 layers and its mlp / moe modules (moe-tiny): each checkpoint re-runs once, in
    BI, and BW reads what it kept (torch's checkpoint would re-run it again, and refuses a
    second backward of an op-SAC region)."""
    from test_executor import GRAD_TOL, TOL, check_all, strategy

    configs = {}
    for name, rc in {"zb1p-op": {"mode": "op"}, "zb1p-uniform2": {"method": "uniform", "num_layers": 2},
                     "zbv-op": {"mode": "op"}, "dualpipev-every2": {"mode": "every", "every": 2},
                     "zb1p-mlp": {"mode": "selective", "modules": ["core_attn", "mlp"]}}.items():
        s = strategy(pp=2, sched=name.split("-")[0], m=4)  # every-N, block: in process below too
        configs[name] = {**s, "directives": s["directives"] + _rc(**rc)}
    s = strategy("moe-tiny", pp=2, sched="zb1p", m=4)
    configs["zb1p-moe"] = {**s, "directives": s["directives"] + _rc(mode="selective", modules=["moe"])}
    out = check_all(tmp_path, 2, configs)
    assert set(out) == set(configs)
    for name, row in out.items():
        assert row["within_tolerance"] is True and row["max_rel_param_diff"] <= TOL, (name, row)
        assert row["max_rel_grad_diff"] <= GRAD_TOL, (name, row)


def _split_reruns(policy, keep: bool):
    """(matmuls a gpt-tiny stage's BI + BW run, the parameter gradients) under ``policy``."""
    import torch
    from mm_count import CountMM

    from executor.stage import Stage, backward_input, backward_weight
    from piper_sim.models import get_config

    cfg = get_config("gpt-tiny")
    units = [f"layers.{i}" for i in range(cfg.n_layers)] + ["head"]  # the last of two stages: input x
    stage = Stage(cfg, 1, 2, units, [units], 1, 0, torch.device("cpu"), torch.float32, seed=0)
    stage.keep_recompute = keep
    stage.set_recompute(policy)
    g = torch.Generator().manual_seed(0)
    x, targets = torch.randn(2, 32, cfg.hidden, generator=g), torch.randint(0, cfg.vocab, (2, 32), generator=g)
    for p in stage.units.parameters():
        p.grad = torch.zeros_like(p)
    rec = stage.forward_piece(0, {"x": x}, {}, targets, 1.0)
    with CountMM() as count:
        backward_input(rec, {"loss": None})
        backward_weight(rec)
    return count.n, [p.grad.clone() for p in rec.params]


def test_a_split_backward_re_runs_each_checkpoint_once():
    """Counted at the dispatcher: BI + BW under op-SAC and every-2 re-run exactly the matmuls one
    plain backward re-runs (each checkpoint once), with plain autograd's gradients; torch's own
    checkpoint cannot give an op-SAC region its second pass."""
    from piper_sim.recompute import Recompute

    base, grads = _split_reruns(Recompute("none"), keep=True)
    L = 8  # gpt-tiny
    full, _ = _split_reruns(Recompute("full"), keep=True)
    per_block = (full - base - 1) // L  # the head's one matmul
    assert per_block >= 4 and full - base == L * per_block + 1
    for policy, reruns in {Recompute("op"): L * (per_block // 2), Recompute("every", every=2): L // 2 * per_block,
                           Recompute("full", method="block", num_layers=3): 3 * per_block,
                           Recompute("selective", modules=("mlp",)): L * 3}.items():  # w1, w3, w2
        n, g = _split_reruns(policy, keep=True)
        assert n - base == reruns, policy
        assert all(a.equal(b) for a, b in zip(g, grads)), policy
    with pytest.raises(RuntimeError, match="backward an extra time|only allowed to backward once"):
        _split_reruns(Recompute("op"), keep=False)
    n, _ = _split_reruns(Recompute("selective", modules=("mlp",)), keep=False)
    assert n - base > L * 3  # torch's checkpoint: BW re-runs the MLPs again


@pytest.mark.slow
def test_split_backward_with_tp_or_cp_and_op_sac(tmp_path):
    """PP2 ZB1P x TP2 and x CP2 (ring) under op-SAC: BI re-runs each block's collectives once
    (the plan's R ops), BW re-runs none."""
    tp = tp_strategy(pp=2, sched="zb1p", m=4, extra=_rc(mode="op"))
    cp = cp_strategy(style="ring", pp=2, sched="zb1p", m=4, extra=_rc(mode="op"))
    res, _ = run_checks(tmp_path, 4, {"tp": tp, "cp": cp})
    assert_matches_reference({"cp": res.pop("cp")}, reference_losses(tmp_path, cp))
    assert_matches_reference(res, reference_losses(tmp_path, tp))
