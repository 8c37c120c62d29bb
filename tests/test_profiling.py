import time

import pytest
import torch

from piper_sim.models import Linear, ModelConfig, get_config, unit_names, unit_segments
from piper_sim.profiling import SegmentCost, measure, profile_kind, profile_model


def _dense_expected(cfg: ModelConfig, B: int, s: int) -> tuple[int, int]:
    """(linear flops, attention flops) of one dense block forward."""
    T, h, hd = B * s, cfg.hidden, cfg.head_dim
    proj = h * cfg.n_heads * hd * 2 + 2 * h * cfg.n_kv_heads * hd  # wq, wo, wk, wv
    linear = 2 * T * (proj + 3 * h * cfg.ffn)  # + SwiGLU (3 matrices)
    attn = 4 * B * s * s * cfg.n_heads * hd  # QK^T and AV, causal counted in full
    return linear, attn


def test_linear_bi_bw_equal_forward():
    w = Linear(64, 96).to(torch.bfloat16)
    x = torch.empty(32, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    m = measure(w, [x], list(w.parameters()))
    assert m.fwd_flops == m.bwd_input_flops == m.bwd_weight_flops == 2 * 32 * 64 * 96
    assert m.saved_act_bytes == 32 * 64 * 2  # the input only; the weight is excluded
    assert m.gemm == (32, 96, 64)


@pytest.mark.parametrize("name,B,s", [("gpt-tiny", 2, 128), ("llama3-8b", 1, 2048)])
def test_dense_block_flops_match_formula(name, B, s):
    cfg = get_config(name)
    linear, attn = _dense_expected(cfg, B, s)
    layer = profile_model(cfg, B, s)[1]
    assert layer.name == "layers.0"
    assert layer.fwd_flops == pytest.approx(linear + attn, rel=0.01)
    assert layer.bwd_weight_flops == pytest.approx(linear, rel=0.01)
    # input grads of the linears + flash-attention backward (2.5x: it recomputes scores)
    assert layer.bwd_input_flops == pytest.approx(linear + 2.5 * attn, rel=0.01)
    if name == "llama3-8b":  # matmul-dominated: BI + BW ~ 2F
        assert layer.bwd_flops == pytest.approx(2 * layer.fwd_flops, rel=0.05)
        assert (layer.gemm_m, layer.gemm_n, layer.gemm_k) == (B * s, cfg.ffn, cfg.hidden)


def test_total_forward_flops_follow_param_count():
    cfg, B, s = get_config("llama3-8b"), 2, 1024
    segs = profile_model(cfg, B, s)
    norms = (2 * cfg.n_layers + 1) * cfg.hidden
    matmul_params = cfg.param_count() - cfg.vocab * cfg.hidden - norms  # embedding is a lookup
    attn = cfg.n_layers * 4 * B * s * s * cfg.hidden
    assert sum(g.fwd_flops for g in segs) == 2 * B * s * matmul_params + attn
    assert sum(g.param_count for g in segs) == cfg.param_count()


def test_embed_and_head():
    cfg, B, s = get_config("gpt-tiny"), 2, 64
    segs = profile_model(cfg, B, s, dtype=torch.float32)
    embed, head = segs[0], segs[-1]
    assert embed.fwd_flops == embed.bwd_flops == 0
    assert embed.param_count == cfg.vocab * cfg.hidden and embed.out_bytes == B * s * cfg.hidden * 4
    assert head.fwd_flops == head.bwd_input_flops == head.bwd_weight_flops == 2 * B * s * cfg.hidden * cfg.vocab
    assert head.out_bytes == 4  # the scalar loss
    assert head.saved_act_bytes >= B * s * cfg.vocab * 4  # log-softmax output for the loss


def test_moe_segments():
    cfg, B, s = get_config("moe-tiny"), 2, 64
    T = B * s
    segs = profile_model(cfg, B, s)
    assert [g.name for g in segs] == [seg for u in unit_names(cfg) for seg in unit_segments(cfg, u)]
    pre, experts = segs[1], segs[2]
    assert (pre.name, pre.unit, pre.is_expert) == ("layers.0.pre", "layers.0", False)
    assert (experts.name, experts.unit, experts.is_expert) == ("layers.0.experts", "layers.0", True)
    h, f, k, E = cfg.hidden, cfg.expert_ffn, cfg.top_k, cfg.n_experts
    assert experts.fwd_flops == 2 * T * k * 3 * h * f  # uniform routing over all experts
    assert experts.bwd_input_flops == experts.bwd_weight_flops == experts.fwd_flops
    assert experts.param_count == E * 3 * h * f
    assert experts.a2a_bytes == T * k * h * 2 and pre.a2a_bytes == 0
    assert (experts.gemm_m, experts.gemm_n, experts.gemm_k) == (T * k // E, f, h)
    # pre = attention + router: its flops include the router's 2*T*h*E
    lin, attn = _dense_expected(cfg, B, s)
    assert pre.fwd_flops == lin - 2 * T * 3 * h * cfg.ffn + attn + 2 * T * h * E
    assert sum(g.param_count for g in segs) == cfg.param_count()


def test_bytes_scale_with_micro_batch_and_dtype():
    cfg = get_config("moe-tiny")
    one, two, four = (profile_model(cfg, mb, 128) for mb in (1, 2, 4))
    for a, m, b in zip(one, two, four):
        assert b.tokens == 4 * a.tokens and b.a2a_bytes == 4 * a.a2a_bytes
        assert b.fwd_flops == 4 * a.fwd_flops
        # affine in the micro-batch; the constant (rotary tables) is small
        slope = m.saved_act_bytes - a.saved_act_bytes
        assert b.saved_act_bytes - m.saved_act_bytes == 2 * slope
        assert 0 <= a.saved_act_bytes - slope < 0.1 * slope
        if a.name != "head":
            assert b.out_bytes == 4 * a.out_bytes
        assert b.param_bytes == a.param_bytes
    fp32 = profile_model(cfg, 2, 128, dtype=torch.float32)
    bf16 = profile_model(cfg, 2, 128, dtype=torch.bfloat16)
    for a, b in zip(fp32, bf16):
        assert b.param_bytes * 2 == a.param_bytes and b.a2a_bytes * 2 == a.a2a_bytes
        assert b.fwd_flops == a.fwd_flops
        if a.name != "head":
            assert b.out_bytes * 2 == a.out_bytes
        if a.name.startswith("layers"):  # embed saves int64 token ids; head an fp32 loss input
            # fp32 bits (rstd, log-sum-exp, router probabilities) do not halve
            assert 0.5 <= b.saved_act_bytes / a.saved_act_bytes < 0.56


def test_cache_returns_identical_objects():
    cfg = get_config("gpt-tiny")
    a = profile_model(cfg, 3, 32)
    hits = profile_kind.cache_info().hits
    b = profile_model(cfg, 3, 32)
    assert a == b and all(x is y for x, y in zip(a, b))
    assert a is not b  # callers get their own list
    assert isinstance(a[1], SegmentCost) and a[1] is not a[2] and a[1].fwd_flops == a[2].fwd_flops
    # the eight identical layers were profiled once
    profile_model(cfg, 5, 32)
    assert profile_kind.cache_info().hits >= hits + 7


@pytest.mark.parametrize("name,n_segments", [("llama3-405b", 128), ("deepseek-v3", 1 + 3 + 58 * 2 + 1)])
def test_full_size_models_profile_on_meta(name, n_segments):
    cfg = get_config(name)
    t0 = time.perf_counter()
    segs = profile_model(cfg, 1, 4096)
    assert time.perf_counter() - t0 < 60  # sanity bound only
    assert len(segs) == n_segments
    assert sum(g.param_count for g in segs) == cfg.param_count()
    assert all(g.fwd_flops >= 0 and g.bwd_weight_flops >= 0 for g in segs)
    if cfg.is_moe:
        experts = [g for g in segs if g.is_expert]
        assert len(experts) == 58 and experts[0].a2a_bytes == 4096 * 8 * cfg.hidden * 2
        # routed-expert flops per token ~ 2 * top_k * (3 h F_e)
        assert experts[0].fwd_flops == 4096 * 2 * 8 * 3 * cfg.hidden * cfg.expert_ffn


def test_bad_arguments():
    with pytest.raises(ValueError):
        profile_model(get_config("gpt-tiny"), 0, 16)
    with pytest.raises(ValueError):
        profile_kind(get_config("gpt-tiny"), "bogus", 1, 16, torch.float32)
