"""Memory: activation bytes per layer against a closed form, FSDP-style ZeRO-3 (per-unit
gathers) on Llama-3-70B against a hand calculation, recompute modes, the fits verdict."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import costmodel.memory
from costmodel.hardware import get_gpu
from piper_sim.api import compile
from piper_sim.compiler import compile_strategy
from piper_sim.memory import model_memory, piece_memory
from piper_sim.models import get_config, unit_param_count
from piper_sim.profiling import profile_model
from piper_sim.simulator import simulate

GB = 1e9


# ----------------------------------------------------------------------------- closed form


def layer_activation_bytes(cfg, B: int, s: int) -> dict[str, float]:
    """Bytes one SwiGLU + GQA + flash-attention layer keeps for its backward, bf16, per
    micro-batch of B sequences of s tokens, derived tensor by tensor:

    attention half: layer input x (RMSNorm input, 2h) + RMSNorm rstd (fp32, 4) + normed x
    (input of the q/k/v projections, 2h) + q and k after rotary and v (flash inputs,
    2h + 2·2·h_kv) + flash output (= o_proj input, 2h) + flash log-sum-exp (fp32, 4·heads);
    MLP half: residual after attention (RMSNorm input, 2h) + rstd (4) + normed (gate/up
    input, 2h) + gate output (SiLU input, 2f) + SiLU output (2f) + up output (2f) + their
    product (down_proj input, 2f); plus the rotary cos/sin tables (2·s·head_dim·2).
    No s×s tensor (flash attention), no dropout masks.
    """
    T, h, f, H, d = B * s, cfg.hidden, cfg.ffn, cfg.n_heads, cfg.head_dim
    hkv = cfg.n_kv_heads * d
    attention = 2 * h + 4 + 2 * h + (2 * h + 2 * hkv + 2 * hkv) + 2 * h + 4 * H
    mlp = 2 * h + 4 + 2 * h + 4 * 2 * f
    none = T * (attention + mlp) + 2 * s * d * 2
    return {
        "none": none,
        # the attention core runs again in backward: only its log-sum-exp is not kept
        "selective": none - T * H * 4,
        # a checkpoint: the layer input only; its backward recomputes the layer (working set)
        "full": T * h * 2,
        "full_working": none,
    }


@pytest.mark.parametrize("name,B,s", [("llama3-8b", 2, 4096), ("llama3-70b", 1, 8192)])
def test_activation_per_layer_matches_closed_form(name, B, s):
    cfg = get_config(name)
    want = layer_activation_bytes(cfg, B, s)
    segs = profile_model(cfg, B, s, torch.bfloat16)
    layer = next(x for x in segs if x.name == "layers.3")
    mem = model_memory(cfg, segs, B, s, torch.bfloat16)["layers.3"]
    assert layer.saved_act_bytes == pytest.approx(want["none"], rel=0.10)  # the profile
    assert mem.kept("none") == pytest.approx(want["none"], rel=0.10)
    assert mem.kept("selective") == pytest.approx(want["selective"], rel=0.10)
    assert mem.kept("full") == pytest.approx(want["full"], rel=0.10)
    assert piece_memory([("layers.3", mem)], "full", False).working == pytest.approx(want["full_working"], rel=0.10)
    # with flash attention, selective recompute frees only the log-sum-exp: < 1% of a layer
    assert 0 < mem.kept("none") - mem.kept("selective") < 0.01 * mem.kept("none")


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_plan_allocates_the_closed_form_per_layer(mode):
    """Under ZeRO-3 every layer is its own piece: its forward keeps exactly one layer's bytes."""
    cfg, B, s = get_config("llama3-8b"), 1, 4096
    d = [{"op": "data_parallel", "degree": 8, "zero": 3}]
    if mode != "none":
        d.append({"op": "recompute", "mode": mode})
    plan = compile({"model": cfg.name, "cluster": "h100:1x8", "global_batch": 8, "seq_len": s,
                    "microbatches": 1, "directives": d})
    ops = {i.id: i for i in plan.classes[0].instructions()}
    f = ops["F.s0.mb0.p4"]  # layers.3 (p0 is the embedding); it also drops its gathered unit
    assert f.alloc - (f.free - ops["AG.F.s0.i0.b4"].alloc) == pytest.approx(layer_activation_bytes(cfg, B, s)[mode], rel=0.10)


# ----------------------------------------------------------------------------- Llama-3-70B FSDP


def llama70b(zero: int, recompute: str | None = "full") -> dict:
    d: list[dict] = [{"op": "data_parallel", "degree": 64, "zero": zero}]
    if recompute:
        d.append({"op": "recompute", "mode": recompute})
    return {"model": "llama3-70b", "cluster": "h100:8x8", "global_batch": 64, "seq_len": 8192,
            "microbatches": 1, "directives": d}


@pytest.fixture(scope="module")
def runs():
    out = {}
    for zero in (1, 3):
        plan = compile_strategy(llama70b(zero)).plan
        out[zero] = (plan, simulate(plan))
    return out


def hand_zero3_peak(cfg, n: int, T: int, dtype_bytes: int = 2) -> float:
    """ZeRO-3 (FSDP) with full recompute, peak at the head's backward (the first backward
    piece, when every checkpoint is still held)."""
    h, V = cfg.hidden, cfg.vocab
    states = 16 * cfg.param_count() / n                                     # 16 B/param, sharded
    unit = lambda name: unit_param_count(cfg, name) * dtype_bytes * (n - 1) / n  # noqa: E731 gathered, less own shard
    gathered = unit("head") + unit(f"layers.{cfg.n_layers - 1}")            # in use + the prefetched next unit
    grads = unit("head")                                                    # unsharded until its reduce-scatter
    checkpoints = (cfg.n_layers + 1) * T * h * dtype_bytes                  # every layer's and the head's input
    working = T * (2 * h + 4 + 2 * h + 4 * V + 8)   # head recomputed: norm in/rstd/out, fp32 log-probs, targets
    logits = T * V * (dtype_bytes + 4)                                      # bf16 logits + fp32 copy for the loss
    return states + gathered + grads + checkpoints + working + logits


def test_llama3_70b_fsdp_fits_and_zero1_does_not(runs):
    z1, z3 = runs[1][1], runs[3][1]
    p1, p3 = (max(s.peak_memory_bytes for s in r.rank_stats) for r in (z1, z3))
    assert p3 < 80 * GB <= get_gpu("h100").hbm_bytes and z3.fits is True and all(s.fits for s in z3.rank_stats)
    assert p1 >= 3 * p3 and z1.fits is False
    cfg = get_config("llama3-70b")
    assert p3 == pytest.approx(hand_zero3_peak(cfg, 64, 8192), rel=0.15)
    # the states are what ZeRO says; the rest is transient (gathers, checkpoints, working set, logits)
    s3 = z3.rank_stats[0]
    assert s3.params_bytes + s3.grads_bytes + s3.optimizer_bytes == pytest.approx(16 * cfg.param_count() / 64)


def test_llama3_70b_fsdp_with_microbatches_reduces_each_one():
    """MPT-70B-like FSDP with gradient accumulation (llama3-70b, 64 H100, 4 micro-batches of
    one 4096-token sequence, full recompute): each micro-batch's unit gradients are
    reduce-scattered after its backward, so the peak is the one-micro-batch peak (states/N,
    two gathered units, the checkpoints, one unit's working set, one or two unsharded
    gradient units), not the whole model's unsharded gradients (``reduce: per_step``)."""
    cfg = get_config("llama3-70b")
    peaks, fit = {}, {}
    for m, reduce in ((1, None), (4, None), (4, "per_step")):
        d = {"op": "data_parallel", "degree": 64, "zero": 3, **({"reduce": reduce} if reduce else {})}
        r = simulate(compile_strategy({"model": "llama3-70b", "cluster": "h100:8x8", "global_batch": 64 * m,
                                       "seq_len": 4096, "microbatches": m,
                                       "directives": [d, {"op": "recompute", "mode": "full"}]}).plan)
        peaks[(m, reduce)] = max(st.peak_memory_bytes for st in r.rank_stats)
        fit[(m, reduce)] = r.fits
    p1, p4, step = peaks[(1, None)], peaks[(4, None)], peaks[(4, "per_step")]
    assert p4 < 80 * GB and fit[(4, None)] is True
    assert p4 <= 1.2 * p1
    assert p4 == pytest.approx(hand_zero3_peak(cfg, 64, 4096), rel=0.15)
    # accumulated per step, the whole model's unsharded gradients (less the own shard) wait for the last backward
    assert fit[(4, "per_step")] is False
    assert step - p4 == pytest.approx(2 * cfg.param_count() * 63 / 64, rel=0.05)


def test_zero3_gathers_one_unit_ahead(runs):
    """Each piece waits for its own unit's gather; the gather of unit i+2 waits for piece i;
    at most two gathered units are alive at once."""
    plan, r = runs[3]
    ops = {i.id: i for i in plan.classes[0].instructions()}
    n_units = get_config("llama3-70b").n_layers + 2
    assert sum(1 for k in ops if k.startswith("F.s0.mb0.p")) == n_units
    for p in range(n_units):
        f = ops[f"F.s0.mb0.p{p}"]
        assert f"AG.F.s0.i0.b{p}" in f.deps
        if p >= 2:
            assert f"F.s0.mb0.p{p - 2}" in ops[f"AG.F.s0.i0.b{p}"].deps
        assert ops[f"AG.F.s0.i0.b{p}"].alloc > 0 and f.free >= ops[f"AG.F.s0.i0.b{p}"].alloc
        assert ops[f"B.s0.mb0.p{p}"].id in ops[f"RS.s0.mb0.b{p}"].deps
    ev = r.events[r.events["rank"] == 0].set_index("op_id")
    spans = []
    for p in range(n_units):
        for pas in ("F", "B"):
            spans.append((ev.loc[f"AG.{pas}.s0.i0.b{p}", "start"], ev.loc[f"{pas}.s0.mb0.p{p}", "end"]))
    points = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda t: (t[0], t[1]))
    live = peak = 0
    for _, d in points:
        live += d
        peak = max(peak, live)
    assert peak == 2


def test_zero3_peak_under_recompute_modes():
    """Without recompute every layer's activations stay (~220 GB); full recompute keeps one
    input per layer; selective saves almost nothing with flash attention."""
    peaks = {}
    for mode in (None, "selective", "full"):
        r = simulate(compile_strategy(llama70b(3, mode)).plan)
        peaks[mode] = max(s.peak_memory_bytes for s in r.rank_stats)
    assert peaks["full"] < 80 * GB < get_gpu("h100").hbm_bytes < peaks["selective"] <= peaks[None]
    assert peaks[None] - peaks["selective"] < 0.01 * peaks[None]


# ----------------------------------------------------------------------------- verdict


def test_fits_verdict_in_json_and_warning(runs, tmp_path, capsys):
    from piper_sim.cli import main

    for zero, expect in ((3, True), (1, False)):
        path = tmp_path / f"z{zero}.json"
        runs[zero][0].save(str(path))
        assert main(["simulate", str(path), "--json"]) == 0
        out, err = capsys.readouterr()
        d = json.loads(out)
        assert d["fits"] is expect and d["memory_capacity_bytes"] == get_gpu("h100").hbm_bytes
        assert [r["fits"] for r in d["per_rank"]] == [expect]
        assert ("does not fit" in err) is (not expect)
        if not expect:
            assert err.count("\n") == 1 and "80 GiB per GPU" in err


def test_one_fits_check_for_simulator_and_explorer():
    import piper_sim.explore
    import piper_sim.simulator

    assert piper_sim.simulator.memory_verdict is costmodel.memory.memory_verdict
    assert piper_sim.simulator.memory_need is piper_sim.explore.memory_need is costmodel.memory.memory_need
    assert piper_sim.explore.fits is costmodel.memory.fits
    assert costmodel.memory.fits(80e9, 80e9) and not costmodel.memory.fits(80e9 + 1, 80e9)


def test_fits_is_none_without_a_cluster():
    from piper_sim.plan import Instruction, Layout, Plan, RankClass

    layout = Layout(pp=1, dp=1, stage_ranks={0: [0]})
    cls = RankClass(pp_rank=0, ranks=[0], stages=[0],
                    streams={"compute": [Instruction("F.s0.mb0", "F", "compute", stage=0, mb=0, flops=1.0,
                                                     alloc=5.0)]})
    r = simulate(Plan(layout=layout, classes=[cls], meta={}), "unit:F=1,BI=1,BW=1,comm=0")
    assert r.fits is None and r.rank_stats[0].fits is None


# ----------------------------------------------------------------------------- executor recompute


def test_executor_stage_checkpoints_what_the_mode_says():
    """The executor's full recompute keeps each layer's input only (torch.utils.checkpoint);
    selective keeps all but what the attention core alone saves."""
    from executor.stage import Stage
    from piper_sim.recompute import Recompute

    cfg = get_config("gpt-tiny")
    units = ["layers.0", "layers.1"]
    stage = Stage(cfg, 1, 3, units, [units], 1, 0, torch.device("cpu"), torch.float32, 0)
    params = {p.untyped_storage()._cdata for p in stage.units.parameters()}
    x = torch.randn(2, 16, cfg.hidden)

    def run(mode="none"):
        stage.set_recompute(Recompute(mode))

        def fn():
            stage.forward_piece(0, {"x": x}, {}, None, 1.0)
        saved: dict[int, int] = {}

        def pack(t):
            key = t.untyped_storage()._cdata
            if key not in params:
                saved[key] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(saved.values())

    plain = run()
    full = run("full")
    selective = run("selective")
    layer_input = 2 * 16 * cfg.hidden * 4
    assert full == 2 * layer_input  # one input per layer
    assert plain - selective == 2 * 2 * cfg.n_heads * 16 * 4  # two layers' fp32 log-sum-exp [B, H, s]
    # the meta measure of selective recompute agrees with what the real module saves
    segs = profile_model(cfg, 2, 16, torch.float32)
    mem = model_memory(cfg, segs, 2, 16, torch.float32)["layers.0"]
    assert mem.saved - mem.selective == pytest.approx((plain - selective) / 2, rel=0.05)


def test_recompute_directive_modes_and_errors():
    from piper_sim.strategy import StrategyError

    base = {"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 4, "seq_len": 16, "microbatches": 4,
            "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"}]}

    def with_rc(*rc):
        return {**base, "directives": base["directives"] + list(rc)}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = compile(base)
        full = compile(with_rc({"op": "recompute"}))
        sel = compile(with_rc({"op": "recompute", "mode": "selective"}))
        mixed = compile(with_rc({"op": "recompute", "mode": "selective"},
                                {"op": "recompute", "mode": "full", "stages": [1]}))
    assert full.meta["recompute"] == {"0": "full", "1": "full"}
    assert mixed.meta["recompute"] == {"0": "selective", "1": "full"}
    assert "recompute" not in plain.meta

    def op(plan, pp, op_id):
        return next(i for i in plan.classes[pp].streams["compute"] if i.id == op_id)

    fp, bp = op(plain, 0, "F.s0.mb0"), op(plain, 0, "B.s0.mb0")
    fs, bs = op(sel, 0, "F.s0.mb0"), op(sel, 0, "B.s0.mb0")
    ff = op(full, 0, "F.s0.mb0")
    # selective: a little less kept, the attention cores' forward again in backward
    assert ff.alloc < fs.alloc - fs.free < fp.alloc - fp.free
    assert bp.flops < bs.flops < op(full, 0, "B.s0.mb0").flops and bs.recompute
    for bad, msg in [({"op": "recompute", "mode": "some"}, "field 'mode' must be one of full, selective, op, every"),
                     ({"op": "recompute", "stages": [5]}, "names stage(s) [5], but there are 2 stages"),
                     ({"op": "recompute", "stages": "first"}, "field 'stages' must be \"all\" or a list"),
                     ({"op": "recompute", "layers": 2}, "unknown field(s) layers")]:
        with pytest.raises(StrategyError, match="recompute") as e:
            compile(with_rc(bad))
        assert msg in str(e.value) and "\n" not in str(e.value)


def test_zero3_bucket_mb_groups_whole_units():
    s = {"model": "gpt-tiny", "cluster": "cpu:2", "global_batch": 4, "seq_len": 16, "microbatches": 2,
         "directives": [{"op": "data_parallel", "degree": 2, "zero": 3, "bucket_mb": 1}]}
    plan = compile(s)
    buckets = plan.meta["zero3_buckets"][0][""]
    assert [u for b in buckets for u in b] == ["embed", *(f"layers.{i}" for i in range(8)), "head"]
    assert len(buckets) < 10  # units share buckets up to 1 MB
    ops = {i.id: i for i in plan.classes[0].instructions()}
    gathers = [k for k in ops if k.startswith("AG.F.s0.i0.")]
    assert len(gathers) == len(buckets)
    # a bucket is gathered before its first piece and dropped after its last
    last = len(buckets[0]) - 1
    assert ops[f"F.s0.mb0.p{last}"].free >= ops["AG.F.s0.i0.b0"].alloc


@pytest.mark.parametrize("directives", [
    [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "dualpipev"},
     {"op": "data_parallel", "degree": 2, "zero": 3}, {"op": "expert_parallel", "degree": 2},
     {"op": "recompute", "mode": "full"}],
    [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "zb1p"},
     {"op": "data_parallel", "degree": 2, "zero": 2}, {"op": "expert_parallel", "degree": 2},
     {"op": "recompute", "mode": "selective"}],
    [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "zbv"},
     {"op": "data_parallel", "degree": 2, "zero": 3}, {"op": "recompute", "mode": "full", "stages": [0, 3]}],
], ids=["dualpipev-ep2-z3-full", "zb1p-ep2-z2-selective", "zbv-z3-full-some-stages"])
def test_every_byte_taken_is_given_back(directives):
    """Per rank, what ops take they give back by the end of the step, and the transient
    memory never goes below zero."""
    plan = compile({"model": "moe-tiny", "cluster": "cpu:4", "global_batch": 8, "seq_len": 16,
                    "microbatches": 4, "directives": directives})
    for c in plan.classes:
        ins = c.instructions()
        assert sum(i.alloc for i in ins) == pytest.approx(sum(i.free for i in ins))
        assert all(i.alloc >= 0 and i.free >= 0 for i in ins)
    r = simulate(plan, "unit:F=1,BI=1,BW=1,comm=0")
    assert r.memory["bytes"].min() >= -1e-6
    assert all(s.activations_bytes > 0 for s in r.rank_stats)


# ----------------------------------------------------------------------------- as the device holds it

def test_memory_need_is_reserved_tensors_plus_the_runtime_closed_form():
    from costmodel.memory import (CUBLAS_HANDLES, CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, LIBRARY_KERNELS_BYTES,
                                  NCCL_ALL_TO_ALL_BYTES_PER_PEER, NCCL_GROUP_BYTES, NCCL_PAIR_BYTES,
                                  RESERVED_OVER_ALLOCATED, memory_need)

    need = memory_need(10 * 2**30, 30 * 2**30, "hopper", expandable_segments=False, pairs=2, groups=3,
                       all_to_all_peers=7)
    runtime = (CUDA_CONTEXT_BYTES + LIBRARY_KERNELS_BYTES + CUBLAS_HANDLES * CUBLAS_WORKSPACE_BYTES["hopper"]
               + 2 * NCCL_PAIR_BYTES + 3 * NCCL_GROUP_BYTES + 7 * NCCL_ALL_TO_ALL_BYTES_PER_PEER)
    assert need.allocated == 40 * 2**30  # model states are not fragmented, the transient part is
    assert need.reserved == pytest.approx(10 * 2**30 + 30 * 2**30 * RESERVED_OVER_ALLOCATED[False])
    assert need.runtime == pytest.approx(runtime) and need.total == pytest.approx(need.reserved + runtime)
    assert memory_need(10 * 2**30, 30 * 2**30, "hopper", True).reserved < need.reserved  # expandable segments fragment less
    cpu = memory_need(0.5e9, 0.5e9, "cpu", pairs=4)
    assert cpu.reserved == 1e9 and cpu.runtime == 0  # gloo ranks on host memory: nothing on a device


def test_verdict_fits_tight_oom_at_the_headroom():
    """fits: the expected need (reserved + runtime) below capacity - headroom; oom: even
    unfragmented (allocated + runtime) above capacity; tight between."""
    from costmodel.memory import MemoryNeed, memory_verdict

    gib = 2**30

    def need(allocated, reserved):
        return MemoryNeed(allocated=allocated * gib, reserved=reserved * gib, runtime=1 * gib)

    assert memory_verdict(need(70, 76), 80 * gib, 2 * gib) == "fits"
    assert memory_verdict(need(70, 78), 80 * gib, 2 * gib) == "tight"  # within the headroom
    assert memory_verdict(need(70, 90), 80 * gib, 2 * gib) == "tight"  # fits only if it fragments little
    assert memory_verdict(need(79.5, 90), 80 * gib, 2 * gib) == "oom"  # even unfragmented it does not
    assert memory_verdict(need(70, 78), 80 * gib, 0) == "fits"


def test_simulator_counts_the_communicators_each_rank_uses():
    """PP2 x DP2 x TP2 on 8 GPUs: a rank talks to its pipeline peer (a pair), its TP group (a
    pair), its DP group (a pair) and the world (8): three 2-rank communicators and one larger."""
    from piper_sim.simulator import communicators

    plan = compile_strategy({"model": "gpt-tiny", "cluster": "h100:1x8", "global_batch": 8, "seq_len": 32,
                             "microbatches": 2, "directives": [{"op": "pipeline", "degree": 2},
                                                               {"op": "data_parallel", "degree": 2, "zero": 1},
                                                               {"op": "tensor_parallel", "degree": 2}]}).plan
    assert [communicators(plan, c) for c in plan.classes] == [(3, 1, 0, ()), (3, 1, 0, ())]
    moe = compile_strategy({"model": "moe-tiny", "cluster": "h100:1x4", "global_batch": 8, "seq_len": 32,
                            "microbatches": 1, "directives": [{"op": "expert_parallel", "degree": 4}]}).plan
    assert communicators(moe, moe.classes[0])[2] == 3  # a 4-rank all-to-all group: 3 peers


def test_deepep_buffers_are_deepeps_size_hints():
    """DeepEP's NVL/RDMA buffer hints (csrc/legacy/config.hpp) for DeepSeek-V3's 7168-wide bf16
    tokens, 20 SMs (10 channels), the 64-rank dispatch config (NVL recv 288 tokens, RDMA recv 128)
    and its combine config (the same sizes): far below NCCL's all-to-all connections (~0.47 GB per peer)."""
    from costmodel.memory import NCCL_ALL_TO_ALL_BYTES_PER_PEER, deepep_buffer_bytes

    per_token = 7168 * 2 + 8 + 128 * 8 + 128 * 4 + 128 * 4  # hidden, SourceMeta, top-k ids, weights, scales
    nvl = 10 * 8 * ((2 * 8 + 3) * 4 + 288 * per_token)
    rdma = 10 * 8 * 2 * ((8 * 2 + 2) * 4 + 128 * (per_token + 16))
    assert deepep_buffer_bytes(7168 * 2, 64) == nvl + rdma
    assert deepep_buffer_bytes(7168 * 2, 8) == 10 * 8 * ((2 + 3) * 4 + 256 * per_token)  # one node: no RDMA
    assert deepep_buffer_bytes(7168 * 2, 64) < 0.03 * 63 * NCCL_ALL_TO_ALL_BYTES_PER_PEER


def test_a_deepep_all_to_all_holds_deepeps_buffers_not_nccls():
    from costmodel.hardware import parse_cluster
    from costmodel.memory import deepep_buffer_bytes
    from costmodel.model import AnalyticCostModel
    from piper_sim.simulator import simulate

    plan = compile_strategy({"model": "moe-tiny", "cluster": "h100:1x4", "global_batch": 8, "seq_len": 32,
                             "microbatches": 1, "directives": [{"op": "expert_parallel", "degree": 4}]}).plan
    cluster = parse_cluster("h100:1x4")
    nccl = simulate(plan, AnalyticCostModel(cluster, {"moe": {"a2a_algorithm": "nccl"}})).rank_stats[0].runtime_bytes
    deepep = simulate(plan, AnalyticCostModel(cluster, {"moe": {"a2a_algorithm": "deepep"}})).rank_stats[0].runtime_bytes
    from costmodel.memory import NCCL_ALL_TO_ALL_BYTES_PER_PEER

    assert nccl - deepep == pytest.approx(3 * NCCL_ALL_TO_ALL_BYTES_PER_PEER - deepep_buffer_bytes(64 * 2, 4))


def test_simulate_reports_reserved_and_runtime_and_strict_exits_1(tmp_path, capsys):
    """Llama-3-8B FSDP on 8 H100: the verdict follows the headroom, and --strict exits 1 when
    the plan is not 'fits'."""
    from piper_sim.cli import main

    plan = compile_strategy({"model": "llama3-8b", "cluster": "h100:1x8", "global_batch": 16, "seq_len": 8192,
                             "microbatches": 1, "directives": [{"op": "data_parallel", "degree": 8, "zero": 3},
                                                               {"op": "recompute"}]}).plan
    path = tmp_path / "plan.json"
    plan.save(str(path))
    r = simulate(plan)
    w = r.rank_stats[0]
    assert w.reserved_bytes > w.peak_memory_bytes and w.runtime_bytes > 2**30
    need, cap = w.device_bytes, r.memory_capacity_bytes
    assert r.memory_verdict == "fits"
    assert main(["simulate", str(path), "--strict"]) == 0
    out, _ = capsys.readouterr()
    assert "memory: fits" in out and "reserved" in out and "runtime" in out
    # a headroom that leaves less than the plan needs: tight, and --strict fails
    headroom_gib = (cap - need) / 2**30 + 1
    assert main(["simulate", str(path), "--memory-headroom", f"{headroom_gib}"]) == 0
    assert "memory: tight" in capsys.readouterr()[0]
    assert main(["simulate", str(path), "--memory-headroom", f"{headroom_gib}", "--strict", "--json"]) == 1
    d = json.loads(capsys.readouterr()[0])
    assert d["memory_verdict"] == "tight" and d["per_rank"][0]["memory_verdict"] == "tight"
    assert main(["simulate", str(path), "--memory-headroom", "-1"]) == 2
    assert "--memory-headroom" in capsys.readouterr()[1]


def test_explore_never_ranks_a_tight_plan_first():
    """With a headroom that makes the fastest plans tight, the winner is the fastest that fits
    with it; the tight ones are listed after, marked."""
    from piper_sim.explore import explore, format_table

    kw = dict(zero_levels=(0, 3), recompute=(False, True), tp_degrees=[1], schedules=["1f1b"], workers=1)
    free = explore("llama3-8b", "h100:1x8", 16, 4096, **kw)
    fastest = free.best
    headroom = free.settings["memory_headroom_bytes"]
    hbm = 79.65 * 2**30
    # a headroom just larger than what the fastest plan leaves free
    tight_headroom = hbm - fastest.device_memory_bytes + 2**30
    r = explore("llama3-8b", "h100:1x8", 16, 4096, memory_headroom_bytes=tight_headroom, **kw)
    assert headroom != tight_headroom
    tight = [x for x in r.rows if x.status == "tight"]
    assert tight and r.best is not None and r.best.status == "ok"
    assert r.best.device_memory_bytes <= hbm - tight_headroom
    assert all(x.status == "ok" for x in r.ok[:r.ok.index(tight[0])] if x is not None)
    assert "tight" in format_table(r, top=50)


def test_dispatch_buffer_larger_than_what_the_experts_keep_is_freed():
    """The forward dispatch's receive buffer becomes what the expert piece keeps; when that piece
    keeps less (its input cached in FP8, its activation recomputed: moe_act), the rest is freed as
    the piece ends, so every rank's step allocates what it frees and the peak does not grow with
    the number of micro-batches. With the router's weights applied in the experts (``moe_probs``)
    the forward combine's buffer is not kept for the backward either."""
    import dataclasses

    from piper_sim.compiler import build_dag
    from piper_sim.configs import ZOO
    from piper_sim.sources import register_model
    from piper_sim.strategy import parse_strategy

    register_model("moe-thin-experts", dataclasses.replace(ZOO["moe-small"], name="moe-thin-experts", hidden=512,
                                                            expert_ffn=64))
    try:
        peaks = []
        for m, probs in ((4, "combine"), (8, "combine"), (8, "experts")):
            st = {"model": "moe-thin-experts", "cluster": "h100:1x8", "global_batch": 4 * m, "seq_len": 512,
                  "microbatches": m, "stack": {"fp8": "tensorwise", "fp8_activations": "fp8", "moe_probs": probs},
                  "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "1f1b"},
                                 {"op": "data_parallel", "degree": 4}, {"op": "expert_parallel", "degree": 4},
                                 {"op": "recompute", "mode": "selective", "modules": ["moe_act"]}]}
            dag, ctx, _ = build_dag(parse_strategy(st), folded=True)
            experts = next(v for k, v in ctx.memory.items() if k.endswith(".experts"))
            buffer = next(dag.ins(n).bytes for n in dag.g.nodes if dag.ins(n).kind == "ALL_TO_ALL")
            assert experts.kept_under("selective", ("moe_act",), True) < buffer  # the case this covers
            balance: dict[int, float] = {}
            for n in dag.g.nodes:
                ins = dag.ins(n)
                balance[n[0]] = balance.get(n[0], 0.0) + ins.alloc - ins.free
            assert all(abs(b) < 1 for b in balance.values()), balance
            peaks.append(max(s.activations_bytes for s in simulate(compile(st)).rank_stats))
        assert peaks[0] == pytest.approx(peaks[1])
        # probs applied in the experts: the combined outputs are not kept for a weighted sum's backward
        assert peaks[2] < peaks[1]
    finally:
        del ZOO["moe-thin-experts"]
