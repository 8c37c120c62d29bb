"""Tensor and sequence parallelism: the named-axis mesh, the directives and their errors, the
shard's profile, Korthikanti et al. 2022's activation memory, the TP communication volume,
folding, and the executor's refusal of TP plans."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import warnings

import pytest
import torch

from costmodel.collectives import busbw_factor
from costmodel.hardware import parse_cluster
from piper_sim.api import compile
from piper_sim.compiler import compile_strategy, compile_unfolded
from piper_sim.directives import expand, resolve
from piper_sim.memory import segment_memory
from piper_sim.models import ZOO, get_config, tp_shard
from piper_sim.plan import Layout
from piper_sim.profiling import profile_kind, profile_model
from piper_sim.simulator import fold_is_exact, simulate
from piper_sim.strategy import StrategyError, parse_strategy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def strategy(model="llama3-8b", cluster="h100:1x8", tp=4, sp=False, pp=2, dp=1, zero=1, sched="1f1b", m=4,
             gb=None, seq=1024, extra=()):
    d = [{"op": "pipeline", "degree": pp}, {"op": "schedule", "name": sched}]
    if dp > 1:
        d.append({"op": "data_parallel", "degree": dp, "zero": zero})
    d.append({"op": "tensor_parallel", "degree": tp, "sequence_parallel": sp})
    return {"model": model, "cluster": cluster, "global_batch": gb or m * dp, "seq_len": seq, "microbatches": m,
            "directives": d + list(extra)}


# A small model of the GPT-3 architecture (LayerNorm, GELU MLP of 4h, dropout, MHA), whose
# activation memory is Korthikanti et al.'s closed form; 12 heads so that TP3 is possible.
GPT_SMALL = dataclasses.replace(get_config("gpt3-175b"), name="gpt3-small-test", n_layers=4, hidden=768,
                                n_heads=12, n_kv_heads=12, ffn=3072, vocab=4096, max_seq=1024)


@pytest.fixture
def gpt_small(monkeypatch):
    monkeypatch.setitem(ZOO, GPT_SMALL.name, GPT_SMALL)
    return GPT_SMALL.name


# ----------------------------------------------------------------------------- mesh


def test_mesh_rank_formula_and_groups_of_every_axis():
    L = Layout(pp=2, dp=4, ep=2, tp=4, stage_ranks={0: [0], 1: [1]})
    assert L.world_size == 32 and L.class_size == 16
    for r in range(32):
        pp, d = L.coords(r)
        t = L.tp_rank(r)
        assert r == (pp * 4 + d) * 4 + t == L.rank(pp, d, t)
        assert L.mesh_coords(r) == {"pp": pp, "dp": d, "ep": d % 2, "cp": 0, "tp": t}
    # rank 13 = pp 0, dp 3, tp 1
    assert L.group_ranks("tp", 13) == [12, 13, 14, 15]
    assert L.group_ranks("dp", 13) == [1, 5, 9, 13]
    assert L.group_ranks("ep", 13) == [9, 13]
    assert L.group_ranks("pp", 13) == [13, 29]
    assert L.group_ranks("stage:1", 13) == [17, 21, 25, 29]  # DP sync of tp shard 1 of stage 1
    assert L.group_ranks("stage:1:edp", 13) == [21, 29]
    assert Layout.from_json(L.to_json()) == L
    # tp innermost: with tp dividing the GPUs per node every TP group is inside one node
    cluster = parse_cluster("h100:4x8")
    big = Layout(pp=2, dp=2, tp=8, stage_ranks={0: [0], 1: [1]})
    assert all(cluster.same_node(big.group_ranks("tp", r)) for r in range(32))
    # without TP the formula and the JSON are what they were
    old = Layout(pp=3, dp=5, stage_ranks={0: [0], 1: [1], 2: [2]})
    assert [old.rank(p, d) for p in range(3) for d in range(5)] == list(range(15))
    assert "tp" not in old.to_json()


# The content hashes of four plans compiled on main before tensor parallelism was merged (the last two
# re-recorded after ZeRO-2/3 began reducing per micro-batch; the three DP ones again when bucket
# readiness came from the backward's flops: only dep_progress and the buckets' issue order
# changed; the two MoE ones when the expert-GEMM merge under EP (kernels.regroup) was fixed: only their
# expert kernel tables changed; the same two when a gradient bucket's sync came to wait for the backward
# piece that completes it, not every piece of the last micro-batch (parallel.data._bucket_sources),
# and again when split backwards (BW: one op per stage) went back to waiting for that op, with
# shares over the stage (moe-tiny zb1p: its original hash; qwen3 dualpipe: the last bucket's share
# clipped at 0, was -1e-6 b): only those edges changed; torch 2.13.0): plans without TP stay byte-identical.
UNCHANGED = [
    ("acf2a9c869554c41", {"model": "gpt-tiny", "cluster": "cpu:4", "global_batch": 16, "seq_len": 64, "microbatches": 8,
                          "directives": [{"op": "pipeline", "degree": 2, "stages_per_rank": 2},
                                         {"op": "schedule", "name": "dualpipev"},
                                         {"op": "data_parallel", "degree": 2, "zero": 1}]}),
    ("986d9b0cddfbc917", {"model": "moe-tiny", "cluster": "cpu:4", "global_batch": 16, "seq_len": 64, "microbatches": 4,
                          "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "zb1p"},
                                         {"op": "expert_parallel", "degree": 2},
                                         {"op": "recompute", "mode": "selective"}]}),
    ("dbcae28e7bca3778", {"model": "llama3-8b", "cluster": "h100:2x8", "global_batch": 64, "seq_len": 4096,
                          "microbatches": 8,
                          "directives": [{"op": "pipeline", "degree": 4, "layers_per_stage": "balanced"},
                                         {"op": "schedule", "name": "interleaved_1f1b"},
                                         {"op": "data_parallel", "degree": 4, "zero": 3}, {"op": "recompute"}]}),
    ("1646a013dd38d6c9", {"model": "qwen3-moe-9b", "cluster": "h100:2x8", "global_batch": 64, "seq_len": 2048,
                          "microbatches": 8,
                          "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "dualpipe"},
                                         {"op": "data_parallel", "degree": 8, "zero": 2},
                                         {"op": "expert_parallel", "degree": 4}]}),
]


@pytest.mark.skipif(torch.__version__.split("+")[0] != "2.13.0", reason="hashes recorded with torch 2.13.0")
@pytest.mark.parametrize("expected,s", UNCHANGED, ids=[s["model"] for _, s in UNCHANGED])
def test_plans_without_tensor_parallel_are_byte_identical(expected, s):
    """Hashes recorded before plan format 2; format 2 only added typed instruction fields."""
    assert _hash_without_v2_fields(compile_strategy(s).plan) == expected


V2_FIELDS = ("direction", "bucket", "experts", "block", "round", "name")


def _hash_without_v2_fields(plan) -> str:
    from piper_sim.plan import _hash

    body = plan.body_json()
    for c in body["classes"]:
        for lst in c["streams"].values():
            for ins in lst:
                for k in V2_FIELDS:
                    ins.pop(k, None)
    return _hash(body)


# ----------------------------------------------------------------------------- directives


def test_directive_expands_to_shard_tensor_and_the_plan_says_so(tmp_path, capsys):
    st = parse_strategy(strategy(tp=4, sp=True))
    low = expand(st)
    assert {"op": "shard_tensor", "degree": 4, "sequence_parallel": True} in low
    setup = resolve(low)
    assert (setup.tp, setup.sp) == (4, True) and "tp4 sp" in st.short()
    plan = compile(strategy(tp=4, sp=True))
    assert plan.world_size == 8 and plan.layout.tp == 4
    assert plan.meta["tensor_parallel"] == {"degree": 4, "sequence_parallel": True}
    assert [c.ranks for c in plan.classes] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # one class per pipeline rank
    assert plan.program(6).tp_rank == 2 and plan.program(6).streams["send.pp0"][0].peer == 2
    path = tmp_path / "p.json"
    plan.save(str(path))
    from piper_sim.cli import main

    assert main(["show", str(path)]) == 0
    assert "tp=4 (sequence parallel)" in capsys.readouterr().out


ODD_FFN = dataclasses.replace(get_config("gpt-tiny"), name="gpt-odd-ffn", ffn=250)
ODD_EXPERTS = dataclasses.replace(get_config("moe-tiny"), name="moe-odd-experts", expert_ffn=125)


@pytest.mark.parametrize("s,message", [
    (strategy(tp=3, pp=1, cluster="h100:1x3"), "degree 3 does not divide the 32 attention heads (n_heads)"),
    (strategy(tp=16, pp=1, cluster="h100:2x8"), "degree 16 does not divide the 8 KV heads (n_kv_heads)"),
    (strategy("gpt-odd-ffn", tp=4, pp=1, cluster="h100:1x4"), "the 250 MLP width (ffn)"),
    (strategy("moe-odd-experts", tp=2, pp=1, cluster="h100:1x2"), "the 125 experts' MLP width (expert_ffn)"),
    (strategy(tp=4, sp=True, seq=1022), "sequence_parallel splits seq_len 1022 over degree 4"),
    (strategy(tp=4, cluster="h100:2x8"), "PP×DP×TP = 2×1×4 = 8 ranks but cluster h100:2x8 has 16"),
    ({**strategy(), "directives": [{"op": "tensor_parallel", "degree": 2, "sequence_parallel": "yes"}]},
     "field 'sequence_parallel' must be true or false"),
    ({**strategy(), "directives": [{"op": "tensor_parallel", "degree": 0}]}, "field 'degree' must be an integer"),
], ids=["heads", "kv-heads", "ffn", "expert-ffn", "seq-len", "world", "sp-type", "degree"])
def test_bad_combinations_are_one_line_errors_naming_the_field(monkeypatch, s, message):
    monkeypatch.setitem(ZOO, ODD_FFN.name, ODD_FFN)
    monkeypatch.setitem(ZOO, ODD_EXPERTS.name, ODD_EXPERTS)
    with pytest.raises(StrategyError) as e:
        compile(s)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_tensor_parallel_across_nodes_warns(gpt_small):
    with pytest.warns(UserWarning, match="degree 12 spans nodes"):
        compile(strategy(gpt_small, tp=12, pp=1, m=1, cluster="h100:3x4", seq=128))


# ----------------------------------------------------------------------------- shards and memory

# What Korthikanti et al.'s Table 2 leaves out, per layer and micro-batch (bytes): each of the two
# LayerNorms keeps an fp32 mean and rstd per token (8·s·b), flash attention its fp32 log-sum-exp
# per head and token (4·a·s·b) and its RNG state (24 bytes on meta).
FLASH_RNG_STATE = 24


@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (8, False), (2, True), (8, True)])
def test_activation_memory_per_layer_is_korthikanti(t, sp):
    """Korthikanti et al. 2022 Table 2, flash-attention form (no 5as/h term), 16-bit: per layer
    sbh·34 without TP, sbh(10 + 24/t) with TP, 34·sbh/t with TP and SP; selective recompute
    frees the attention core's own (flash: the log-sum-exp); full recompute keeps 2sbh (/t with SP)."""
    cfg = get_config("gpt3-175b")
    s, b, h, a = 2048, 1, cfg.hidden, cfg.n_heads
    sbh = s * b * h
    if t == 1:
        closed = 34 * sbh
    elif not sp:
        closed = sbh * (10 + 24 / t)
    else:
        closed = 34 * sbh / t
    norms = 16 * s * b / (t if sp else 1)
    lse = 4 * a * s * b / t
    shard = tp_shard(cfg, t, sp)
    seg = profile_kind(shard, "dense", b, s, torch.bfloat16)
    mem = segment_memory(shard, seg, b, s, torch.bfloat16)
    assert seg.saved_act_bytes == closed + norms + lse + FLASH_RNG_STATE
    assert mem.kept("selective") == closed + norms
    assert mem.kept("full") == 2 * sbh / (t if sp else 1)
    if t == 8 and sp:  # the paper's GPT-3 175B example: 0.107 GB per layer with TP8 + SP + selective
        assert mem.kept("selective") / 1e9 == pytest.approx(0.107, abs=5e-4)


def test_compiled_forward_keeps_korthikanti_bytes(gpt_small):
    """The compiler's F piece of each layer takes what the closed form says (TP4 + SP)."""
    t, s, b = 4, 512, 2
    plan = compile(strategy(gpt_small, tp=t, sp=True, pp=1, m=1, seq=s, gb=b, cluster="h100:1x4"))
    cfg = GPT_SMALL
    sbh = s * b * cfg.hidden
    want = 34 * sbh / t + 16 * s * b / t + 4 * cfg.n_heads * s * b / t + FLASH_RNG_STATE
    f = {i.id: i for i in plan.classes[0].streams["compute"] if i.kind == "F"}
    layers = plan.meta["stage_parts"][0][1:-1]
    assert [p for [p] in layers] == [f"layers.{i}" for i in range(4)]
    for i in range(1, 5):
        assert f[f"F.s0.mb0.p{i}"].alloc == want


def test_parameters_gradients_and_optimizer_state_divide_by_t():
    """A rank holds 1/T of every matrix (vocabulary rows included); the norms are replicated."""
    cfg = get_config("llama3-8b")
    t = 8
    norms = (2 * cfg.n_layers + 1) * cfg.hidden
    shard = profile_model(tp_shard(cfg, t, True), 1, 256)
    assert sum(x.param_count for x in shard) == (cfg.param_count() - norms) / t + norms
    plan = compile(strategy(tp=t, sp=True, pp=1, m=1, seq=256, cluster="h100:1x8"))
    sm = plan.classes[0].static_memory
    per_rank = (cfg.param_count() - norms) / t + norms
    assert sm == {"params_bytes": 2 * per_rank, "grads_bytes": 2 * per_rank, "optimizer_bytes": 12 * per_rank}
    # the model flops count the whole model, not a shard (MFU stays comparable)
    one = compile({**strategy(tp=1, pp=1, m=1, seq=256, cluster="h100:1x1"), "directives": []})
    assert plan.meta["model_flops_per_step"] == one.meta["model_flops_per_step"]


# ----------------------------------------------------------------------------- communication


def _tp_events(sp: bool):
    cfg = get_config("llama3-8b")
    m, b, s = 2, 1, 1024
    plan = compile(strategy(tp=4, sp=sp, pp=2, m=m, gb=m * b, seq=s))
    ev = simulate(plan).events
    return cfg, m, b * s * cfg.hidden * 2, b * s * 4, ev[ev["stream"] == "tp"]


def test_tp_communication_volume_per_layer_is_the_closed_form():
    """Per layer per micro-batch: 4 all-reduces of b·s·h (2 in F, 2 in B) without SP; with SP
    an all-gather and a reduce-scatter of b·s·h per block and pass (2 + 2 in F, 2 + 2 in B):
    the same bytes on the wire (ring all-reduce = reduce-scatter + all-gather), plus the
    re-gather of each block's saved input shard for the weight gradients (2 all-gathers in B)."""
    cfg, m, act, loss, ar = _tp_events(False)
    L = cfg.n_layers
    layer = ar[ar["op_id"].str.contains(r"\.l\d+\.")]
    assert set(layer["kind"]) == {"ALLREDUCE"} and set(layer["bytes"]) == {act}
    assert len(layer) == 4 * L * m
    assert len(layer[layer["op_id"].str.startswith("TP.F.")]) == 2 * L * m
    # vocabulary-parallel embedding (F) and head (its input's gradient in B), the loss's 3 small all-reduces
    other = ar[~ar.index.isin(layer.index)]
    assert sorted(other["bytes"]) == sorted([act] * 2 * m + [loss] * 3 * m)

    *_, sp = _tp_events(True)
    layer_sp = sp[sp["op_id"].str.contains(r"\.l\d+\.")]
    regather = layer_sp[layer_sp["op_id"].str.endswith(".regather")]
    blocks = layer_sp[~layer_sp.index.isin(regather.index)]
    assert len(blocks[blocks["kind"] == "ALL_GATHER"]) == len(blocks[blocks["kind"] == "REDUCE_SCATTER"]) == 4 * L * m
    assert set(blocks["bytes"]) == {act}

    def wire(df):  # bytes a rank sends: busbw factor x size (nccl-tests conventions)
        return sum(busbw_factor(k, 4) * x for k, x in zip(df["kind"], df["bytes"]))

    assert wire(blocks) == pytest.approx(wire(layer))
    assert len(regather) == 2 * L * m and set(regather["kind"]) == {"ALL_GATHER"} and set(regather["bytes"]) == {act}


def test_tp_collectives_are_on_the_critical_path():
    """Without async TP the next GEMM waits for each collective: cheaper TP links, shorter steps."""
    from costmodel.model import AnalyticCostModel

    plan = compile(strategy(tp=4, pp=1, m=2, seq=2048, cluster="h100:1x4"))
    cluster = parse_cluster("h100:1x4")
    slow = simulate(plan, AnalyticCostModel(cluster)).step_time_s
    fast = simulate(plan, AnalyticCostModel(cluster, {"nvlink_bw": 1e15, "intra_alpha_s": 0.0})).step_time_s
    ev = simulate(plan).events
    tp_time = float((ev[ev["stream"] == "tp"]["end"] - ev[ev["stream"] == "tp"]["start"]).sum())
    assert slow - fast == pytest.approx(tp_time, rel=0.05)


@pytest.mark.parametrize("tp_overlap", [False, True])
def test_tp_collectives_block_the_next_chunk_too(gpt_small, tp_overlap):
    """Pipeline chunks of one layer (interleaved, 2 chunks per rank): without async TP a
    chunk's collectives hold the compute stream until they end, whichever op runs next
    (torch waits on a collective by making the current stream wait: ProcessGroupNCCL
    ``WorkNCCL::synchronizeStream``), so no compute op of a rank overlaps one of its TP
    collectives; with ``tp_overlap`` they run beside the GEMMs."""
    s = strategy(gpt_small, tp=4, sp=True, pp=2, m=4, seq=1024, cluster="h100:1x8", sched="interleaved_1f1b")
    s["directives"][0]["stages_per_rank"] = 2
    if tp_overlap:
        s["stack"] = {"tp_overlap": True}
    ev = simulate(compile(s)).events
    overlap = 0.0
    for _, e in ev.groupby("rank"):
        tp, comp = e[e["stream"] == "tp"], e[e["stream"] == "compute"]
        overlap += sum(max(0.0, min(a1, b1) - max(a0, b0))
                       for a0, a1 in zip(tp["start"], tp["end"]) for b0, b1 in zip(comp["start"], comp["end"]))
    assert (overlap > 0) == tp_overlap


# ----------------------------------------------------------------------------- folding


@pytest.mark.filterwarnings("ignore:replicate")
@pytest.mark.parametrize("s", [
    strategy("gpt-tiny", tp=2, sp=False, pp=2, dp=2, zero=3, m=4, seq=64),
    strategy("gpt-tiny", tp=2, sp=True, pp=2, dp=2, zero=1, sched="zbv", m=4, seq=64, extra=[{"op": "recompute"}]),
    strategy("moe-tiny", tp=2, sp=True, pp=2, dp=2, zero=1, sched="dualpipev", m=4, seq=64,
             extra=[{"op": "expert_parallel", "degree": 2}]),
], ids=["tp2-pp2-dp2-z3", "tp2-sp-zbv-recompute", "moe-tp2-ep2-dualpipev"])
def test_folded_tp_plan_expands_to_the_unfolded_compile(s):
    folded = compile_strategy(s).plan
    unfolded = compile_unfolded(s)
    expanded = folded.expand()
    assert len(expanded) == len(unfolded) == folded.world_size == 8
    for a, b in zip(expanded, unfolded):
        assert (a.rank, a.tp_rank) == (b.rank, b.tp_rank) and a.streams.keys() == b.streams.keys()
        for name in a.streams:
            assert [i.to_json() for i in a.streams[name]] == [i.to_json() for i in b.streams[name]]


@pytest.mark.parametrize("sp", [False, True])
def test_fold_equals_unfold_with_tensor_parallel(sp):
    plan = compile(strategy(tp=4, sp=sp, pp=2, dp=2, m=4, seq=1024, cluster="h100:2x8"))
    assert fold_is_exact(plan, parse_cluster("h100:2x8"))[0]
    folded, unfolded = simulate(plan), simulate(plan, fold=False)
    assert folded.folded and not unfolded.folded and folded.num_events * 8 == unfolded.num_events
    assert folded.step_time_s == pytest.approx(unfolded.step_time_s, rel=1e-9)
    assert max(x.peak_memory_bytes for x in folded.rank_stats) == max(x.peak_memory_bytes for x in unfolded.rank_stats)


def test_fold_falls_back_when_tp_groups_straddle_nodes(gpt_small):
    # TP3 on nodes of 4 GPUs: group 0-2 is inside node 0, group 3-5 spans nodes 0 and 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = compile(strategy(gpt_small, tp=3, pp=1, dp=4, m=1, seq=128, cluster="h100:3x4"))
    exact, why = fold_is_exact(plan, parse_cluster("h100:3x4"))
    assert not exact and "tp" in why
    r = simulate(plan)
    assert not r.folded and r.step_time_s == simulate(plan, fold=False).step_time_s


# ----------------------------------------------------------------------------- executor


def test_executor_refuses_tp_plans_before_any_process_group(tmp_path):
    path = str(tmp_path / "tp.json")
    # zoo models run tensor-parallel (tests/test_executor_tp.py); the stack's tp_overlap is refused
    compile({**strategy("moe-tiny", tp=2, pp=1, m=1, seq=64, cluster="cpu:2"), "stack": {"tp_overlap": True}}).save(path)
    line = "tensor parallel plans (tp 2) with the stack's tp_overlap (collectives overlapped with the GEMMs; compile " \
        "with tp_overlap false) are simulate-only in this version"
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}  # nobody listens there: a rendezvous attempt would fail differently
    r = subprocess.run([sys.executable, "-m", "executor", path], cwd=ROOT, capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 2 and line in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([sys.executable, "-m", "piper_sim.cli", "run", path], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and line in r.stderr and "torch.distributed" not in r.stderr
