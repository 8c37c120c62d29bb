"""Operator-level profiles (piper_sim.kernels) and their prices (costmodel.operators)."""

import dataclasses
import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from costmodel import operators
from costmodel.hardware import A100, H100, B200
from costmodel.stragglers import slowest_factor
from piper_sim import kernels
from piper_sim.compiler import compile_strategy
from piper_sim.models import build_units, get_config
from piper_sim.plan import Plan
from piper_sim.profiling import profile_kind
from piper_sim.simulator import simulate

BF16 = torch.bfloat16


def test_dense_layer_profile_lists_its_kernels():
    cfg = get_config("llama3-8b")
    c = profile_kind(cfg, "dense", 1, 2048, BF16)
    gemms = [r for r in c.kernels_f if r[0] == "gemm"]
    assert sum(r[4] for r in gemms) == 7  # q, k, v, o, gate, up, down
    assert {r[2][:3] for r in gemms} >= {(2048, 4096, 4096), (2048, 1024, 4096), (2048, 14336, 4096),
                                         (2048, 4096, 14336)}
    attn = [r for r in c.kernels_f if r[0] == "attn_fwd"]
    assert len(attn) == 1 and attn[0][2] == (1, 32, 2048, 2048, 128, 1)
    assert [r for r in c.kernels_bi if r[0] == "attn_bwd"]
    names = {r[1] for r in c.kernels_f if r[0] == "mem"}
    assert {"rms_norm", "silu", "mul", "add"} <= names
    # the weight pass is the 7 weight-gradient GEMMs and nothing else
    assert {r[0] for r in c.kernels_bw} == {"gemm"} and sum(r[4] for r in c.kernels_bw) == 7
    # flop totals equal the rows' flops
    assert c.fwd_flops == round(kernels.totals(c.kernels_f)[0])
    assert c.bwd_weight_flops == pytest.approx(kernels.totals(c.kernels_bw)[0], rel=1e-9)


def test_recorded_flops_equal_flop_counter_mode():
    cfg = get_config("gpt-small")
    layer = build_units(cfg, ["layers.0"], device="meta", dtype=BF16)["layers.0"]
    x = torch.empty(2, 128, cfg.hidden, device="meta", dtype=BF16, requires_grad=True)
    with FlopCounterMode(display=False) as fc:
        layer(x)
    c = profile_kind(cfg, "dense", 2, 128, BF16)
    assert c.fwd_flops == fc.get_total_flops()


def test_views_launch_nothing_and_inplace_counts_the_write():
    x = torch.empty(4, 8, device="meta", dtype=BF16)
    with kernels.KernelRecorder() as rec:
        x.view(8, 4).transpose(0, 1)
        x.add_(1.0)
        (x * 2).sum()
    rows = {r[1]: r for r in rec.table()}
    assert "view" not in rows and "transpose" not in rows
    assert rows["add_"][6] == 2 * x.numel() * 2  # read + write of 64 bytes
    assert rows["mul"][6] == 2 * 64 and rows["sum"][4] == 1


def test_expert_rows_regroup_under_expert_parallelism():
    # 256 calls of one expert's up-projection: 128 tokens x 7168 -> 2048 (bf16)
    elems = 128 * 7168 + 7168 * 2048 + 128 * 2048
    fwd = (("gemm", "mm", (128, 2048, 7168, 1), "bf16", 256, 256 * 2.0 * 128 * 2048 * 7168, 256 * 2.0 * elems),
           ("mem", "silu", (1000,), "bf16", 256, 0.0, 256000.0))
    out = kernels.regroup(fwd, 64)
    assert out[0][2] == (8192, 2048, 7168, 1) and out[0][4] == 4  # tokens are m: m grows
    assert out[1][2] == (64000,) and out[1][4] == 4
    assert kernels.totals(out)[0] == kernels.totals(fwd)[0]  # the same FLOPs
    # each merged call reads its expert's weight once: bytes of the new shape (closed form)
    assert out[0][6] == pytest.approx(4 * 2 * (8192 * 7168 + 7168 * 2048 + 8192 * 2048))
    assert out[1][6] == 256000.0
    # the weight gradient g.T @ x: tokens are k, which grows; m, n (the weight) stay
    bw = (("gemm", "mm", (2048, 7168, 128, 1), "bf16", 256, 256 * 2.0 * 128 * 2048 * 7168, 256 * 2.0 * elems),)
    (row,) = kernels.regroup(bw, 64, weight_grad=True)
    assert row[2] == (2048, 7168, 8192, 1) and row[4] == 4
    assert row[6] == pytest.approx(4 * 2 * (2048 * 8192 + 8192 * 7168 + 2048 * 7168))


def test_expert_gemms_under_ep_equal_the_closed_form():
    """A profiled expert segment's GEMMs, regrouped for EP, have the shapes and bytes of one
    GEMM per local expert on EP x the tokens (F/BI: m = tokens, BW: k = tokens)."""
    from piper_sim.models import ModelConfig
    from piper_sim.profiling import profile_kind

    cfg = ModelConfig(name="moe-ep-check", n_layers=2, hidden=256, n_heads=4, n_kv_heads=4, ffn=512, vocab=512,
                      n_experts=16, top_k=2, expert_ffn=384)
    seg = profile_kind(cfg, "moe_experts", 2, 128, "bf16")
    ep, per_expert = 4, 2 * 128 * 2 // 16  # tokens per expert per micro-batch (uniform routing)
    for table, weight_grad in ((seg.kernels_f, False), (seg.kernels_bi, False), (seg.kernels_bw, True)):
        gemms = [r for r in kernels.regroup(table, ep, weight_grad) if r[0] == "gemm"]
        assert gemms
        for cls, name, (m, n, k, b), dtype, count, flops, nbytes in gemms:
            tokens = k if weight_grad else m
            assert tokens == per_expert * ep
            assert nbytes == pytest.approx(count * 2 * (m * k + k * n + m * n) * b)
            assert flops == pytest.approx(count * 2.0 * m * n * k * b)


def test_gemm_price_is_the_measured_xla_point():
    # XLA's sm_90 table: 4096^3 bf16 at 783.33 TFLOP/s (costmodel/data/xla_matmul.csv)
    # at the clock a training run sustains (hardware.SUSTAINED_HOPPER: MSMF / MAMF)
    t = operators.gemm_time(H100, 4096, 4096, 4096)
    assert 2 * 4096 ** 3 / t == pytest.approx(783328793548203 * H100.sustained_ratio, rel=1e-6)
    # beyond the table: the plateau, never above the GPU's MAMF
    assert operators.gemm_efficiency(H100, 16384, 16384, 16384) <= H100.mamf_eff
    # below the table (m = 64) the edge's efficiency, no guessed derate; the roofline's bytes
    # bound such a thin GEMM: 64 tokens x 4096 x 4096 moves 2 (64k + kn + 64n) bytes
    assert operators.gemm_efficiency(H100, 64, 4096, 4096) == operators.gemm_efficiency(H100, 256, 4096, 4096)
    row = ("gemm", "mm", (64, 4096, 4096, 1), "bf16", 1, 2.0 * 64 * 4096 * 4096, 2.0 * (2 * 64 * 4096 + 4096 ** 2))
    assert operators.table_time(H100, [row]) == pytest.approx(
        H100.launch_s + row[6] / (H100.hbm_bw * operators.MEM_BW_EFF))
    # Blackwell: its own table, measured on B200 (sm_100: 4096^3 at 1416.87 TFLOP/s; 1024 x 2048 x
    # 2048 at 760.3), at Blackwell's sustained clock
    tb = operators.gemm_time(B200, 4096, 4096, 4096)
    assert 2 * 4096 ** 3 / tb == pytest.approx(1416867213789406 * B200.sustained_ratio, rel=1e-6)
    assert operators.gemm_efficiency(B200, 1024, 2048, 2048) == pytest.approx(
        760305770224818 / B200.peak("bf16") * B200.sustained_ratio, rel=1e-6)
    # another GPU of the family scales B200's points by its MAMF; a family without a table of its
    # own (ampere) takes sm_90's scaled by its MAMF and its own sustained clock
    gb200 = dataclasses.replace(B200, name="GB200", peak_flops={"bf16": 2.5e15}, mamf_eff=0.729)
    assert operators.gemm_efficiency(gb200, 4096, 4096, 4096) == pytest.approx(
        operators.gemm_efficiency(B200, 4096, 4096, 4096) * 0.729 / B200.mamf_eff)
    assert operators.gemm_efficiency(A100, 4096, 4096, 4096) == pytest.approx(
        operators.gemm_efficiency(H100, 4096, 4096, 4096) * A100.mamf_eff / H100.mamf_eff
        * A100.sustained_ratio / H100.sustained_ratio)
    # FP8: the FP8 peak at FP8's MAMF share
    assert operators.gemm_time(H100, 4096, 4096, 4096, dtype="fp8") < 0.6 * t


def test_attention_price_reproduces_the_flash_attention_benchmark():
    # FA2 on H100, hd128 causal, 8k: 308 TFLOP/s fwd+bwd, 333 fwd [FA-repo], a burst: priced at
    # the clock a training run sustains (H100.sustained_ratio)
    sus = H100.sustained_ratio
    fwd = operators.attention_tflops(H100, 8192, 128, True, backward=False)
    bwd = operators.attention_tflops(H100, 8192, 128, True, backward=True)
    assert fwd == pytest.approx(333e12 * sus)
    both = 3.5 / (1 / fwd + 2.5 / bwd)
    assert both == pytest.approx(308e12 * sus)
    # batch 2, 16 heads of 128 = hidden 2048, seq 8k (the benchmark's setting)
    shape = (2, 16, 8192, 8192, 128, 1)
    t = operators.attention_time(H100, shape, False) + operators.attention_time(H100, shape, True)
    assert 3.5 * 4 * 2 * 16 * 8192 ** 2 * 128 / 2 / t == pytest.approx(308e12 * sus)
    assert operators.attention_tflops(A100, 16384, 128, True, False) < fwd


@pytest.mark.parametrize("kernel, seq, causal, measured, over", [
    ("flash3", 8192, True, 602, 333),   # flash3_fp16_fwd.png, H100 hd128 causal 8k: FA3 602 vs FA2 333
    ("cudnn", 2048, True, 484, 298),    # same chart, 2k: cuDNN 484 vs FA2 298
    ("cudnn", 16384, False, 595, 370),
])
def test_attention_kernels_forward_match_their_chart(kernel, seq, causal, measured, over):
    fa2 = operators.attention_tflops(H100, seq, 128, causal, backward=False)
    assert operators.attention_tflops(H100, seq, 128, causal, False, kernel) == pytest.approx(fa2 * measured / over)


def test_triton_attention_is_the_a100_chart_ratio():
    # flash2_a100_fwd_bwd_benchmark.png, causal hd128, 4k: Triton 74 vs FA2 173 TFLOP/s fwd+bwd
    for bwd in (False, True):
        ratio = (operators.attention_tflops(A100, 4096, 128, True, bwd, "triton")
                 / operators.attention_tflops(A100, 4096, 128, True, bwd))
        assert ratio == pytest.approx(74 / 173)
    with pytest.raises(ValueError, match="unknown attention kernel"):
        operators.attention_kernel_ratio("sdpa-math", 4096, True, False)


def test_memory_bound_and_launch_prices():
    rows = [("mem", "add", (1e9,), "bf16", 10, 0.0, 1e10)]
    assert operators.table_time(H100, rows) == pytest.approx(1e10 / (H100.hbm_bw * 0.9) + 10 * H100.launch_s)


def _strategy(**kw):
    s = {"model": "gpt-small", "cluster": "h100:1x2", "global_batch": 4, "seq_len": 128, "microbatches": 2,
         "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"}]}
    s.update(kw)
    return s


def test_plan_carries_the_tables_and_round_trips(tmp_path):
    plan = compile_strategy(_strategy()).plan
    used = {i.kernels for c in plan.classes for i in c.instructions() if i.kind in ("F", "B")}
    assert used and "" not in used and used <= set(plan.kernels)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    again = Plan.load(str(path))
    assert again.content_hash() == plan.content_hash()
    assert again.kernels == {k: [tuple(r) for r in v] for k, v in plan.kernels.items()}
    assert "kernels" in json.loads(path.read_text())


def test_simulated_compute_is_the_sum_of_its_kernels():
    plan = compile_strategy(_strategy()).plan
    res = simulate(plan, "analytic")
    ev = res.events
    f = ev[(ev["op_id"] == "F.s0.mb0") & (ev["rank"] == 0)].iloc[0]
    ins = next(i for i in plan.classes[0].instructions() if i.id == "F.s0.mb0")
    # at the pace of the job's expected slowest GPU (costmodel.stragglers)
    expected = operators.table_time(H100, plan.kernels[ins.kernels]) * slowest_factor(plan.world_size)
    assert f["end"] - f["start"] == pytest.approx(expected, rel=1e-6)
    # more work than the pure GEMM roofline: memory-bound ops and attention add time
    gemm_only = sum(r[5] for r in plan.kernels[ins.kernels] if r[0] == "gemm") / (989e12 * H100.mamf_eff)
    assert expected > gemm_only
    assert math.isfinite(res.step_time_s)


def test_cost_balanced_cut_counts_embedding_and_head():
    from piper_sim.compiler import cost_balanced_layers

    assert cost_balanced_layers([1.0] * 8, 0.0, 0.0, 4) == [2, 2, 2, 2]
    # a head worth 3 layers leaves the last stage one layer
    assert cost_balanced_layers([1.0] * 10, 0.0, 3.0, 4) == [3, 3, 3, 1]
    # every stage keeps at least one layer even when the head alone exceeds a stage's share
    assert cost_balanced_layers([1.0] * 4, 0.0, 10.0, 4) == [1, 1, 1, 1]


def test_balanced_pipeline_is_faster_and_interleaved_beats_1f1b():
    def run(sched, v, lps):
        pipe = {"op": "pipeline", "degree": 4, "stages_per_rank": v}
        if lps:
            pipe["layers_per_stage"] = lps
        st = {"model": "llama3-8b", "cluster": "h100:1x4", "global_batch": 8, "seq_len": 4096, "microbatches": 8,
              "directives": [pipe, {"op": "schedule", "name": sched}]}
        c = compile_strategy(st)
        return c.plan.meta["stage_units"], simulate(c.plan).step_time_s

    units, even = run("1f1b", 1, None)
    units_b, balanced = run("1f1b", 1, "balanced")
    assert len(units_b[-1]) < len(units[-1]) and balanced < even
    _, inter = run("interleaved_1f1b", 2, "balanced")
    assert inter < balanced  # as in every published comparison (Narayanan et al. 2021, Fig. 12)


def test_calibrated_memory_bandwidth_by_size_prices_small_ops_faster():
    from costmodel.fit import memory_bw_table
    from costmodel.hardware import CPU

    raw = [{"op": "copy", "mib": 4, "bytes_moved": 8e6, "seconds": 2e-4, "bw_Bps": 40e9},
           {"op": "copy", "mib": 256, "bytes_moved": 5e8, "seconds": 4e-2, "bw_Bps": 12.5e9}]
    table = operators.BandwidthTable(memory_bw_table(raw))
    assert table(1e3) == 40e9 and table(1e10) == 12.5e9 and 12.5e9 < table(6e7) < 40e9
    small = [("mem", "add", (1e6,), "fp32", 1, 0.0, 1e6)]
    assert operators.table_time(CPU, small, mem_bw=table) == pytest.approx(CPU.launch_s + 1e6 / 40e9)
    with pytest.raises(ValueError, match="memory_bw_table"):
        operators.BandwidthTable([[0, 1e9]])
