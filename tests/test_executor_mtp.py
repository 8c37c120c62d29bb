"""DeepSeek-V3's multi-token-prediction modules in the executor (arXiv 2412.19437 §2.2,
Megatron-Core ``MultiTokenPredictionLayer``): the MTP losses are part of the training loss of
both the single-process reference and the staged executor; under PP the last stage holds a
copy of the embedding whose gradient the plan's ``AR.embed`` sums with the first stage's.
Real gloo runs against the reference (``--check``)."""

from __future__ import annotations

import json

import pytest
import torch

from executor.parallel.context import cp_positions
from executor.support import MLA, MOE, TINY, unrunnable
from piper_sim.configs import config_from_dict
from piper_sim.models import build_model, lm_loss, mtp_loss
from tests.test_tied_embeddings import check, ops, plan_of

pytestmark = pytest.mark.filterwarnings("ignore")

MTP = {**TINY, "name": "tiny-mtp", "mtp_layers": 1, "mtp_loss_scale": 0.3}
MOE_MTP = {**MOE, "name": "moe-mtp", "mtp_layers": 1}
MOE_MTP2 = {**MOE, "name": "moe-mtp2", "mtp_layers": 2}
MLA_MTP2 = {**MLA, "name": "mla-mtp2", "mtp_layers": 2}
PIPE = [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"}]
DP2 = {"op": "data_parallel", "degree": 2, "zero": 1}
EP2 = {"op": "expert_parallel", "degree": 2}


def strategy(model: str, *directives: dict, world: int = 2, m: int = 4, batch: int = 8) -> dict:
    return {"model": model, "cluster": f"cpu:{world}", "global_batch": batch, "seq_len": 16, "microbatches": m,
            "dtype": "fp32", "directives": list(directives)}


@pytest.fixture()
def files(tmp_path) -> dict[str, str]:
    out = {}
    for spec in (MTP, MOE_MTP, MOE_MTP2, MLA_MTP2):
        path = tmp_path / f"{spec['name']}.json"
        path.write_text(json.dumps(spec))
        out[spec["name"]] = str(path)
    return out


def test_reference_loss_adds_the_scaled_mtp_loss():
    """Module 0 predicts the token two ahead from the main hidden states and the embedding of
    the next token; its masked mean cross entropy, times lambda / D, joins the main loss."""
    cfg = config_from_dict(MTP)
    model = build_model(cfg, device="cpu")
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(cfg.vocab, (2, 17), generator=g)
    tokens, targets = seq[:, :-1], seq[:, 1:]
    x = model.embed(tokens)
    for layer in model.layers:
        x = layer(x)
    main = lm_loss(model.head(x), targets)
    y = model.mtp[0](x[:, :-1], model.embed(tokens[:, 1:]))  # position i: the token at i + 1 embedded
    logits = torch.nn.functional.linear(y, model.head.out.weight)
    want = main + 0.3 * lm_loss(logits, seq[:, 2:])  # ... predicting the one at i + 2
    got = model.training_loss(tokens, targets)
    assert torch.allclose(got, want, rtol=1e-6), (got, want)
    assert got > main  # the MTP loss is there


def test_pp2_plan_shares_the_embedding_with_the_last_stage(files):
    plan = plan_of(strategy(files["tiny-mtp"], *PIPE))
    embed_bytes = TINY["vocab"] * TINY["hidden"] * 4
    for pp, stage in ((0, 0), (1, 1)):
        ar = ops(plan, pp)["AR.embed"]
        assert ar.tied and ar.stage == stage and ar.bytes == embed_bytes
        assert "AR.embed" in ops(plan, pp)[f"OPT.s{stage}"].deps
    one = plan_of(strategy(files["tiny-mtp"], world=1, m=2))
    assert not any(i.tied for c in one.classes for i in c.instructions())  # one stage: nothing to sum


def TP2(sp: bool) -> dict:
    return {"op": "tensor_parallel", "degree": 2, "sequence_parallel": sp}


def CP2(style: str = "allgather") -> dict:
    return {"op": "context_parallel", "degree": 2, "style": style}


def test_refusals_left(files):
    some = strategy(files["tiny-mtp"], {"op": "shard_tensor", "degree": 2, "layers": [0]})
    msg = unrunnable(plan_of(some))
    assert "multi-token-prediction" in msg and "shard_tensor selection of layers" in msg and "\n" not in msg, msg
    assert unrunnable(plan_of(strategy(files["tiny-mtp"], TP2(True)))) == ""
    assert unrunnable(plan_of(strategy(files["tiny-mtp"], CP2("ring")))) == ""
    zero3 = strategy(files["tiny-mtp"], {"op": "data_parallel", "degree": 2, "zero": 3}, m=2, batch=4)
    assert "shares its embedding with its multi-token-prediction modules" in unrunnable(plan_of(zero3))
    for s in (strategy(files["tiny-mtp"], *PIPE), strategy(files["tiny-mtp"], DP2, m=2, batch=4)):
        assert unrunnable(plan_of(s)) == ""


def test_pp1_dp2_and_pp2_1f1b_equal_the_reference(files, tmp_path):
    """With clipping by the global norm: the last stage's own (untied) output layer counts in
    it, its embedding copy (mtp_embed) does not (it counted neither before: 1.7e-3 param diff)."""
    check(tmp_path, 2, {"dp2": strategy(files["tiny-mtp"], DP2, m=2, batch=8),
                        "pp2-1f1b": strategy(files["tiny-mtp"], *PIPE)}, "--clip-grad-norm", "0.05")


def test_moe_ep2_equals_the_reference(files, tmp_path):
    """Two MTP modules whose layers are MoE, their experts behind their own all-to-alls (one
    stage, DP2 x EP2): the main hidden states and module 0's output travel past them to the
    head's piece, which alone writes the shared output layer's gradient (the plan syncs its
    bucket after that piece). On the last of two stages: the slow test below."""
    check(tmp_path, 2, {"ep2": strategy(files["moe-mtp2"], DP2, EP2, m=2, batch=8)})


def test_tensor_parallel_equals_the_reference(files, tmp_path):
    """TP2 with and without SP, and with full recompute (the module re-run whole, its embedding,
    eh_proj and layer collectives in the plan's order): the module embeds its tokens with the
    vocabulary-parallel embedding (``mtp.0.embed.*``), ``eh_proj`` is column-parallel with its
    output gathered over the hidden dim, its loss goes through the vocabulary-parallel head
    in the head's piece, before the main loss (``mtp.0.head.*``)."""
    check(tmp_path, 2, {"tp2": strategy(files["tiny-mtp"], TP2(False), m=2, batch=4),
                        "tp2-sp": strategy(files["tiny-mtp"], TP2(True), m=2, batch=4),
                        "tp2-sp-full": strategy(files["tiny-mtp"], TP2(True), {"op": "recompute"}, m=2, batch=4)})


@pytest.mark.slow
def test_tensor_parallel_with_pipeline_experts_and_data_parallel_equal_the_reference(files, tmp_path):
    """Four ranks: PP2 x TP2 + SP (the last stage's embedding copy sharded by vocabulary rows
    and summed with the first stage's shard), with a split backward (zb1p: the MTP embedding's
    output-gradient all-gather is BW's, after it) and full recompute, MoE MTP layers under
    TP2 x EP2 x DP2 and TP2 + SP."""
    zb1p = [PIPE[0], {"op": "schedule", "name": "zb1p"}]
    check(tmp_path, 4, {"pp2-tp2-sp": strategy(files["tiny-mtp"], TP2(True), *PIPE, world=4),
                        "zb1p-tp2-sp-full": strategy(files["tiny-mtp"], TP2(True), *zb1p, {"op": "recompute"}, world=4),
                        "moe-tp2-ep2-dp2": strategy(files["moe-mtp"], TP2(False), DP2, EP2, world=4, m=2, batch=8),
                        "moe-tp2-sp-pp2": strategy(files["moe-mtp"], TP2(True), *PIPE, world=4)})


def test_context_parallel_equals_the_reference(files, tmp_path):
    """CP2, all-gather and ring (with full recompute): the MTP module's layer attends over the cp
    group with the plan's ``mtp.0.kv.ag`` / ``mtp.0.dkv.rs`` (Megatron-Core builds its
    attention with the cp group); every rank reads the whole micro-batch, so the shifted tokens
    and targets at its positions need no roll, and each rank's MTP loss is its positions' share
    of the whole sequence's masked mean (the masked tail lies on rank 0 only)."""
    plan = plan_of(strategy(files["tiny-mtp"], CP2(), m=2, batch=4))
    mtp_ops = [(i.direction, i.kind) for i in plan.classes[0].instructions() if i.mb == 0 and i.name.startswith("mtp.")]
    assert mtp_ops == [("F", "ALL_GATHER"), ("B", "ALL_GATHER"), ("B", "REDUCE_SCATTER")], mtp_ops
    cfg = config_from_dict(MTP)
    logits, targets = torch.randn(2, 16, cfg.vocab, dtype=torch.float64), torch.randint(cfg.vocab, (2, 16))
    for d in (0, 1):  # the ranks' shares, averaged over the group, are the whole loss
        shares = [mtp_loss(logits[:, pos], targets, d, cfg, positions=pos) for pos in
                  (cp_positions(16, 2, r) for r in range(2))]
        assert torch.allclose(sum(shares) / 2, mtp_loss(logits, targets, d, cfg)), d
    check(tmp_path, 2, {"cp2": strategy(files["tiny-mtp"], CP2(), m=2, batch=4),
                        "cp2-ring-full": strategy(files["tiny-mtp"], CP2("ring"), {"op": "recompute"}, m=2, batch=4)})


@pytest.mark.slow
def test_context_parallel_mla_moe_and_selective_recompute_equal_the_reference(files, tmp_path):
    """Two ranks: two MLA MTP modules over a ring, two MoE ones (all-gather), selective recompute."""
    check(tmp_path, 2, {"mla-ring": strategy(files["mla-mtp2"], CP2("ring"), m=2, batch=4),
                        "moe": strategy(files["moe-mtp2"], CP2(), m=2, batch=4),
                        "selective": strategy(files["tiny-mtp"], CP2(), {"op": "recompute", "mode": "selective"},
                                              m=2, batch=4)})


@pytest.mark.slow
def test_context_parallel_with_pipeline_data_tensor_and_expert_parallel_equal_the_reference(files, tmp_path):
    """Four ranks: CP2 with PP2 (1f1b; zb1p over a ring with full recompute: the embedding copy's
    AR.embed on the last stage), DP2 ZeRO-1, TP2 (+ SP; the vocabulary-parallel MTP loss at the
    rank's positions), MoE MTP layers under DP2 x EP2, and CP4 over a ring."""
    zb1p = [PIPE[0], {"op": "schedule", "name": "zb1p"}, {"op": "recompute"}]
    check(tmp_path, 4, {"pp2": strategy(files["tiny-mtp"], CP2(), *PIPE, world=4),
                        "zb1p-ring-full": strategy(files["tiny-mtp"], CP2("ring"), *zb1p, world=4),
                        "dp2": strategy(files["tiny-mtp"], CP2(), DP2, world=4, m=2, batch=8),
                        "tp2-sp": strategy(files["tiny-mtp"], CP2(), TP2(True), world=4, m=2, batch=4),
                        "tp2-ring": strategy(files["tiny-mtp"], CP2("ring"), TP2(False), world=4, m=2, batch=4),
                        "moe-dp2-ep2": strategy(files["moe-mtp2"], CP2(), DP2, EP2, world=4, m=2, batch=8),
                        "cp4-ring": strategy(files["tiny-mtp"], {"op": "context_parallel", "degree": 4,
                                                                 "style": "ring"}, world=4, m=2, batch=4)})


@pytest.mark.slow
def test_pp2_dp2_ep2_zero1_equal_the_reference(files, tmp_path):
    """Four ranks: the embedding's copy summed over the embedding group, then over DP; the MoE
    MTP layer's pieces carry the main hidden states past its all-to-alls to the head."""
    zero3 = {"op": "data_parallel", "degree": 2, "zero": 3, "reduce": "per_step"}
    check(tmp_path, 4, {"pp2-dp2": strategy(files["tiny-mtp"], *PIPE, DP2, world=4, batch=16),
                        "pp2-zero3": strategy(files["tiny-mtp"], *PIPE, zero3, world=4, batch=16),
                        "pp2-ep2": strategy(files["moe-mtp"], *PIPE, DP2, EP2, world=4, batch=16)})


@pytest.mark.slow
def test_pp2_schedules_equal_the_reference(files, tmp_path):
    """A split backward (zb1p), one rank holding both stages (zbv: the copies summed in place),
    full recompute."""
    v2 = {"op": "pipeline", "degree": 2, "stages_per_rank": 2}
    check(tmp_path, 2, {"zb1p": strategy(files["tiny-mtp"], PIPE[0], {"op": "schedule", "name": "zb1p"}),
                        "zbv": strategy(files["tiny-mtp"], v2, {"op": "schedule", "name": "zbv"}),
                        "recompute": strategy(files["tiny-mtp"], *PIPE, {"op": "recompute"})})


@pytest.mark.slow
def test_save_and_resume_keep_the_embedding_copy(files, tmp_path):
    """--save / --resume of PP2 x DP2 ZeRO-1: the last stage saves its copy (mtp_embed); the
    resumed run's losses equal an uninterrupted run's bit for bit."""
    from tests.test_checkpoint import assert_resumes_bit_exact

    assert_resumes_bit_exact(tmp_path, strategy(files["tiny-mtp"], *PIPE, DP2, world=4, batch=16), 4)
