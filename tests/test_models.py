import time

import pytest
import torch

from piper_sim.models import (
    ZOO,
    Block,
    ModelConfig,
    Transformer,
    build_model,
    build_units,
    get_config,
    run_units,
    unit_names,
    unit_param_count,
    unit_segments,
)

# A tiny DeepSeek-like config: MLA, one leading dense layer, a shared expert.
MLA_TINY = ModelConfig(
    "mla-tiny", n_layers=3, hidden=64, n_heads=4, n_kv_heads=4, ffn=128, vocab=256, max_seq=64,
    n_experts=4, top_k=2, n_shared=1, expert_ffn=32, first_dense=1, attention="mla",
    q_lora_rank=32, kv_lora_rank=16, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16,
)


def test_get_config_unknown():
    assert get_config("gpt-tiny") is ZOO["gpt-tiny"]
    with pytest.raises(ValueError, match=r"unknown model 'nope'; choose one of: .*gpt-tiny"):
        get_config("nope")


@pytest.mark.parametrize("name", [n for n in ZOO if n != "deepseek-v3"] + ["mla-tiny"])
def test_param_count_matches_meta_build(name):
    cfg = MLA_TINY if name == "mla-tiny" else get_config(name)
    model = build_model(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == cfg.param_count()


def test_full_size_models_build_on_meta():
    for name in ["llama3-405b", "deepseek-v3"]:
        cfg = get_config(name)
        t0 = time.perf_counter()
        model = build_model(cfg, device="meta", dtype=torch.bfloat16)
        assert time.perf_counter() - t0 < 60  # sanity bound, not a speed assertion
        assert sum(p.numel() for p in model.parameters()) == cfg.param_count()
        assert next(model.parameters()).dtype == torch.bfloat16


def test_published_sizes():
    # Llama 3: 8.03B / 70.6B / 405.9B.
    for name, n in [("llama3-8b", 8.03e9), ("llama3-70b", 70.6e9), ("llama3-405b", 405.9e9)]:
        assert get_config(name).param_count() == pytest.approx(n, rel=0.01)
        assert not get_config(name).is_moe
    # DeepSeek-V3 (without MTP): 671B total, 37B active.
    ds = get_config("deepseek-v3")
    assert ds.is_moe
    assert ds.param_count() == pytest.approx(671e9, rel=0.02)
    assert ds.active_param_count() == pytest.approx(37e9, rel=0.05)
    assert get_config("gpt-tiny").active_param_count() == get_config("gpt-tiny").param_count()


def test_refuses_big_models_on_real_devices():
    with pytest.raises(ValueError, match="meta"):
        build_model(get_config("llama3-8b"), device="cpu")
    with pytest.raises(ValueError, match="meta"):
        build_units(get_config("llama3-70b"), unit_names(get_config("llama3-70b"))[:20], device="cpu")


def test_units_and_segments():
    assert unit_names(get_config("gpt-tiny")) == ["embed", *(f"layers.{i}" for i in range(8)), "head"]
    assert unit_segments(get_config("gpt-tiny"), "layers.3") == ["layers.3"]
    assert unit_segments(get_config("moe-tiny"), "layers.0") == ["layers.0.pre", "layers.0.experts"]
    ds = get_config("deepseek-v3")
    assert unit_segments(ds, "layers.2") == ["layers.2"]
    assert unit_segments(ds, "layers.3") == ["layers.3.pre", "layers.3.experts"]
    assert unit_segments(ds, "head") == ["head"]
    with pytest.raises(ValueError):
        unit_segments(ds, "layers.61")
    assert sum(unit_param_count(ds, n) for n in unit_names(ds)) == ds.param_count()


@pytest.mark.parametrize("name", ["gpt-tiny", "moe-tiny", "mla-tiny"])
def test_any_split_gives_the_same_weights_and_outputs(name):
    cfg = MLA_TINY if name == "mla-tiny" else get_config(name)
    model = build_model(cfg, device="cpu", seed=7)
    names = unit_names(cfg)
    cut = len(names) // 2 + 1
    stages = [build_units(cfg, names[:2], seed=7), build_units(cfg, names[2:cut], seed=7),
              build_units(cfg, names[cut:], seed=7)]
    merged = {k: v for s in stages for k, v in s.state_dict().items()}
    ref = model.state_dict()
    assert merged.keys() == ref.keys()
    assert all(torch.equal(merged[k], ref[k]) for k in ref)

    tokens = torch.randint(0, cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    x = tokens
    for s in stages:
        x = run_units(s, s.unit_names(), x)
    assert torch.equal(x, model(tokens))

    other = build_model(cfg, device="cpu", seed=8)
    assert not torch.equal(other.embed.weight, model.embed.weight)


def test_init_and_loss():
    cfg = get_config("gpt-tiny")
    model = build_model(cfg, device="cpu")
    assert torch.equal(model.norm.weight, torch.ones(cfg.hidden)) and model.norm is model.head.norm
    assert model.layers[0].attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.embed.weight.mean().abs().item() < 0.002
    tokens = torch.randint(0, cfg.vocab, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, cfg.vocab)
    loss = model.loss(logits, tokens)
    assert loss.item() == pytest.approx(torch.log(torch.tensor(cfg.vocab)).item(), rel=0.05)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    half = build_model(cfg, device="cpu", dtype=torch.bfloat16)
    assert torch.equal(half.embed.weight, model.embed.weight.to(torch.bfloat16))


@pytest.mark.parametrize("cfg", [get_config("moe-tiny"), MLA_TINY], ids=["moe-tiny", "mla-tiny"])
def test_moe_layer_matches_per_token_reference(cfg):
    torch.manual_seed(0)
    block = build_units(cfg, [f"layers.{cfg.first_dense}"], seed=1)[f"layers.{cfg.first_dense}"]
    moe = block.moe
    x = torch.randn(10, cfg.hidden)
    weights, ids = moe.route(x)
    assert weights.shape == ids.shape == (10, cfg.top_k)
    torch.testing.assert_close(weights.sum(-1), torch.ones(10))

    expected = torch.stack([
        sum(w * moe.experts[int(e)](t) for w, e in zip(wt, et)) for t, wt, et in zip(x, weights, ids)
    ])
    if moe.shared is not None:
        expected = expected + moe.shared(x)
    torch.testing.assert_close(moe(x), expected)

    # The pieces an executor uses compose to the block's forward.
    xs = torch.randn(2, 5, cfg.hidden)
    resid, h, w, i, shared = block.forward_pre(xs)
    torch.testing.assert_close(Block.forward_post(resid, moe.routed(h, w, i), shared), block(xs))
    tokens, order, counts = moe.permute(h, i)
    assert sum(counts) == 10 * cfg.top_k and tokens.shape == (10 * cfg.top_k, cfg.hidden)


def test_meta_forward_and_backward_shapes():
    for cfg in [get_config("moe-tiny"), MLA_TINY]:
        block = build_model(cfg, device="meta", dtype=torch.bfloat16).layers[cfg.first_dense]
        x = torch.empty(2, 16, cfg.hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
        resid, h, w, ids, shared = block.forward_pre(x)
        assert resid.shape == x.shape and h.shape == (32, cfg.hidden) and ids.shape == (32, cfg.top_k)
        out = block.attn(x)
        (g,) = torch.autograd.grad(out, x, torch.ones_like(out))
        assert out.shape == g.shape == x.shape and out.is_meta
    model = build_model(get_config("gpt-tiny"), device="meta")
    assert model(torch.zeros(2, 8, dtype=torch.long, device="meta")).shape == (2, 8, 512)
    assert isinstance(model, Transformer)
