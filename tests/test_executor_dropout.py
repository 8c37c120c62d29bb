"""Executor: dropout (hidden dropout 0.1 before each residual add) under pipeline, data, tensor
(+ sequence) and context parallelism against the single-process reference (torchrun, gloo on
CPU, 2 steps): every rank draws the reference's masks (`piper_sim.models.DropoutStream`)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_executor import strategy  # noqa: E402
from test_executor_cp import cp_strategy  # noqa: E402
from test_executor_tp import assert_matches_reference, reference_losses, run_checks, tp_strategy  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

DROP = {"name": "drop", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256,
        "dropout": 0.1}


def model_file(tmp_path, **extra) -> str:
    path = tmp_path / "drop.json"
    path.write_text(json.dumps({**DROP, **extra}))
    return str(path)


def test_a_ranks_mask_is_its_slice_of_the_full_mask():
    from piper_sim.models import DropoutStream, dropout_mask

    full = dropout_mask(DropoutStream(0, 3, range(4), 32), 1, 0, 0.1, torch.Size([4, 32, 8]), torch.device("cpu"),
                        torch.float32)
    assert 0.05 < (full == 0).float().mean().item() < 0.15  # p = 0.1 of 1024 elements
    assert torch.equal(full.unique(), torch.tensor([0.0, 1 / 0.9]))
    pos = torch.tensor([4, 5, 6, 7, 24, 25, 26, 27])  # a CP rank's two chunks, under SP one TP rank's half
    part = dropout_mask(DropoutStream(0, 3, range(2, 4), 32, pos), 1, 0, 0.1, torch.Size([2, 8, 8]),
                        torch.device("cpu"), torch.float32)
    assert torch.equal(part, full[2:4][:, pos])
    other = dropout_mask(DropoutStream(0, 3, range(4), 32), 1, 1, 0.1, torch.Size([4, 32, 8]), torch.device("cpu"),
                         torch.float32)
    assert not torch.equal(other, full)  # another site: another mask
    with pytest.raises(RuntimeError, match=r"dropout: a \[2, 16, 8\] input does not match"):
        dropout_mask(DropoutStream(0, 3, range(2), 32, pos), 1, 0, 0.1, torch.Size([2, 16, 8]), torch.device("cpu"),
                     torch.float32)


def test_tp_sp_and_pipeline_with_dropout_match_the_reference(tmp_path):
    m = model_file(tmp_path)
    configs = {"tp2": tp_strategy(model=m), "tp2-sp": tp_strategy(model=m, sp=True),
               # full recomputation draws the same masks again in backward
               "tp2-sp-full": tp_strategy(model=m, sp=True, extra=[{"op": "recompute"}]),
               "pp2": strategy(m, pp=2, m=2),
               # stage 0 runs F0 F1 B0 B1: each recomputing backward draws its own micro-batch's masks
               "pp2-full": {**strategy(m, pp=2, m=2), "directives": [*strategy(m, pp=2, m=2)["directives"],
                                                                      {"op": "recompute"}]}}
    res, _ = run_checks(tmp_path, 2, configs)
    ref = reference_losses(tmp_path, configs["tp2"])
    no_dropout = reference_losses(tmp_path, tp_strategy(model=model_file(tmp_path, dropout=0.0)))
    assert abs(ref[0] - no_dropout[0]) > 1e-4  # the masks change the loss: matching it is not trivial
    assert_matches_reference(res, ref)


@pytest.mark.slow  # the fast set keeps the mask-slicing unit test and the TP/SP/PP run
def test_cp_allgather_and_ring_with_dropout_match_the_reference(tmp_path):
    m = model_file(tmp_path)
    configs = {"cp2": cp_strategy(model=m), "cp2-ring": cp_strategy(model=m, style="ring"),
               "cp2-ring-full": cp_strategy(model=m, style="ring", extra=[{"op": "recompute"}])}
    res, _ = run_checks(tmp_path, 2, configs)
    assert_matches_reference(res, reference_losses(tmp_path, configs["cp2"]))


@pytest.mark.slow
def test_cp2_by_tp2_sp_with_dropout_matches_the_reference(tmp_path):
    """Under CP x SP a rank's dropout sees its TP rank's half of its CP chunks."""
    m = model_file(tmp_path)
    configs = {"cp2-tp2-sp": cp_strategy(model=m, tp=2, sp=True)}
    res, _ = run_checks(tmp_path, 4, configs)
    assert_matches_reference(res, reference_losses(tmp_path, configs["cp2-tp2-sp"]))
