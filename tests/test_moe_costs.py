"""Expert-parallel pricing: all-to-all by algorithm against hand calculations, FP8 dispatch,
load imbalance and capacity, the DeepEP-derived constants, and the plan/simulator wiring."""

import json
import math
import statistics

import pytest
import yaml

from costmodel import AnalyticCostModel, collective_time, parse_cluster
from costmodel.collectives import moe_all_to_all_time
from costmodel.hardware import B200, DEEPEP_ALPHA_S, DEEPEP_H800_NIC_BW, DEEPEP_H800_NVLINK_BW, H100, H800
from costmodel.moe import FP8_DISPATCH_FACTOR, MoEOptions, Routing, deepep_bytes, link_bw_from_row, traffic

DSV3 = Routing(top_k=8, n_experts=256)
T, H = 4096, 7168
S = T * 8 * H * 2  # the plan's dispatch: 4096 tokens x top-8 copies x 7168 x bf16
ALPHA, B_NVL, B_NIC = 26.1e-6, 156.9e9, 45.17e9  # the H800 catalog numbers, written out


def p_hit(pool, per_bucket, k=8):
    """Probability that a bucket of `per_bucket` experts is among a token's k of `pool`."""
    return 1 - math.comb(pool - per_bucket, k) / math.comb(pool, k)


def a2a(cluster, n, **options):
    return moe_all_to_all_time(S, list(range(n)), parse_cluster(cluster), "dispatch", DSV3, MoEOptions(**options))


# --- all-to-all against hand calculations ---------------------------------------------------

def test_intranode_ep8_by_hand():
    # 8 ranks of 32 experts: a token reaches 8·P(hit) distinct ranks, each gets one copy over NVLink
    d_ranks = 8 * p_hit(256, 32)
    assert d_ranks == pytest.approx(5.295, abs=1e-3)
    expected = ALPHA + T * H * 2 * d_ranks / B_NVL
    assert a2a("h800:1x8", 8) == pytest.approx(expected)
    assert expected == pytest.approx(2.008e-3, rel=1e-3)  # 311 MB at 156.9 GB/s + 26.1 us


def test_ep16_across_two_nodes_by_hand():
    d_ranks = 16 * p_hit(256, 16)  # 6.52 ranks per token, all through NVLink
    d_nodes = 2 * p_hit(256, 128)  # 1.99 nodes per token, half of them remote
    nvl, nic = T * H * 2 * d_ranks / B_NVL, T * H * 2 * d_nodes * (1 / 2) / B_NIC
    assert nvl > nic  # NVLink forwarding is the bottleneck at EP16
    assert a2a("h800:2x8", 16) == pytest.approx(ALPHA + nvl)


def test_ep64_with_and_without_node_limit_by_hand():
    # no limit: a token's 8 experts are anywhere among 256, on 8 nodes of 32 experts
    d_nodes = 8 * p_hit(256, 32)
    d_ranks = 64 * p_hit(256, 4)
    free = ALPHA + max(T * H * 2 * d_ranks / B_NVL, T * H * 2 * d_nodes * 7 / 8 / B_NIC)
    assert a2a("h800:8x8", 64) == pytest.approx(free)
    # M = 4: first 4 of the 8 nodes, then 8 of their 128 experts
    d_nodes4 = 4 * p_hit(128, 32)
    d_ranks4 = 32 * p_hit(128, 4)
    limited = ALPHA + max(T * H * 2 * d_ranks4 / B_NVL, T * H * 2 * d_nodes4 * 7 / 8 / B_NIC)
    assert a2a("h800:8x8", 64, max_nodes_per_token=4) == pytest.approx(limited)
    assert d_nodes4 * 7 / 8 == pytest.approx(3.175, abs=1e-3) and d_nodes * 7 / 8 == pytest.approx(4.633, abs=1e-3)
    assert limited < 0.72 * free  # the NIC-bound step shrinks with the remote nodes per token


def test_node_limit_does_not_move_copies_of_a_plain_all_to_all():
    """k copies, no de-duplication: a share (N-1)/N crosses nodes whatever M (module doc)."""
    ranks, c = list(range(64)), parse_cluster("h800:8x8")
    plain = collective_time("ALL_TO_ALL", S, ranks, c)
    for m in (0, 2, 4):
        assert a2a("h800:8x8", 64, a2a_algorithm="nccl", max_nodes_per_token=m) == pytest.approx(plain)
    assert traffic(64, 8, DSV3, 4).remote_nodes / traffic(64, 8, DSV3, 4).nodes == pytest.approx(7 / 8)


def test_without_routing_every_copy_travels():
    c = parse_cluster("h800:2x8")
    t = moe_all_to_all_time(S, list(range(16)), c, "combine", None, MoEOptions(a2a_algorithm="deepep"))
    assert t == pytest.approx(ALPHA + max(S / B_NVL, S / 2 / B_NIC))


def test_fp8_dispatch_halves_dispatch_bytes_not_combine():
    c = parse_cluster("h800:1x8")
    bf16 = AnalyticCostModel(c)
    fp8 = AnalyticCostModel(c, {"moe": {"fp8_dispatch": True}})
    ranks = list(range(8))
    # one byte per element plus an fp32 scale per 128 elements (DeepEP's fp8_factor)
    assert FP8_DISPATCH_FACTOR == pytest.approx(0.5 * (1 + 1 / 32))
    assert fp8.all_to_all_time(S, ranks, "dispatch", DSV3) - ALPHA == pytest.approx(
        FP8_DISPATCH_FACTOR * (bf16.all_to_all_time(S, ranks, "dispatch", DSV3) - ALPHA))
    assert fp8.all_to_all_time(S, ranks, "combine", DSV3) == bf16.all_to_all_time(S, ranks, "combine", DSV3)
    plain = AnalyticCostModel(c, {"moe": {"fp8_dispatch": True, "a2a_algorithm": "nccl"}})
    assert plain.all_to_all_time(S, ranks, "dispatch", DSV3) == pytest.approx(
        collective_time("ALL_TO_ALL", S * FP8_DISPATCH_FACTOR, ranks, c))


def test_load_factor_imbalance_and_capacity():
    assert MoEOptions().load_factor() == 1.0
    assert MoEOptions(imbalance=1.25).load_factor() == 1.25
    assert MoEOptions(imbalance=1.4, capacity_factor=1.1).load_factor() == 1.1  # drops beyond capacity
    assert MoEOptions(imbalance=1.05, capacity_factor=1.1).load_factor() == 1.05
    assert MoEOptions(imbalance=1.0, capacity_factor=1.5, pad_to_capacity=True).load_factor() == 1.5
    c = parse_cluster("h800:8x8")
    base = AnalyticCostModel(c).all_to_all_time(S, list(range(64)), "dispatch", DSV3)
    hot = AnalyticCostModel(c, {"moe": {"imbalance": 1.25}}).all_to_all_time(S, list(range(64)), "dispatch", DSV3)
    assert hot - ALPHA == pytest.approx(1.25 * (base - ALPHA))


# --- the catalog numbers come from DeepEP's rows ------------------------------------------------

def test_deepep_constants_reproduce_their_source_rows():
    ll = [(77, 114), (118, 195), (155, 273), (173, 314), (192, 369), (194, 360)]  # EP8..EP256 [DEP legacy]
    ratio = 1 / FP8_DISPATCH_FACTOR
    alphas = [d - (c - d) / (ratio - 1) for d, c in ll]
    assert DEEPEP_ALPHA_S == pytest.approx(statistics.median(alphas) * 1e-6, abs=0.05e-6)
    assert (DEEPEP_ALPHA_S, DEEPEP_H800_NVLINK_BW, DEEPEP_H800_NIC_BW) == (ALPHA, B_NVL, B_NIC)
    b = deepep_bytes(T, H, 8, 1, DSV3, 4)
    assert H800.ep_nvlink_bw == pytest.approx(link_bw_from_row(153e9, b["nvlink"], b["nvlink"], ALPHA), rel=1e-3)
    b = deepep_bytes(T, H, 64, 8, DSV3, 4)
    assert H800.ep_nic_bw == pytest.approx(link_bw_from_row(51e9, b["rdma_counted"], b["nic"], ALPHA), rel=1e-3)
    b = deepep_bytes(8192, H, 8, 1, DSV3, 4)
    assert B200.ep_nvlink_bw == pytest.approx(link_bw_from_row(726e9, b["nvlink"], b["nvlink"], ALPHA), rel=1e-3)
    b = deepep_bytes(8192, H, 16, 2, DSV3, 4)
    assert B200.ep_nic_bw == pytest.approx(link_bw_from_row(90e9, b["rdma_counted"], b["nic"], ALPHA), rel=1e-3)
    # presets without DeepEP rows take H800's shares of their own links
    assert H100.ep_links == pytest.approx((H100.nvlink_bw * B_NVL / 160e9, H100.nic_bw * B_NIC / 50e9))


def test_simulated_source_rows_match_published_bandwidth():
    """The rows the constants came from come back; the others are predictions (benchmark)."""
    c = parse_cluster("h800:8x8")
    fp8 = MoEOptions(fp8_dispatch=True, max_nodes_per_token=4)
    b = deepep_bytes(T, H, 8, 1, DSV3, 4)
    t = moe_all_to_all_time(S, list(range(8)), c, "dispatch", DSV3, fp8)
    assert b["nvlink"] / t == pytest.approx(153e9, rel=1e-3)
    b = deepep_bytes(T, H, 64, 8, DSV3, 4)
    t = moe_all_to_all_time(S, list(range(64)), c, "dispatch", DSV3, fp8)
    assert b["rdma_counted"] / t == pytest.approx(51e9, rel=1e-3)


# --- options: where they live, bad input -----------------------------------------------------

def test_moe_options_in_a_cluster_file_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"gpu": "h800", "nodes": 8, "gpus_per_node": 8,
                                    "moe": {"max_nodes_per_token": 4, "fp8_dispatch": True}}))
    c = parse_cluster(str(path))
    assert c.moe == MoEOptions(max_nodes_per_token=4, fp8_dispatch=True)
    assert c.to_dict()["moe"]["max_nodes_per_token"] == 4
    m = AnalyticCostModel(c, {"moe": {"imbalance": 1.1}})  # overrides go over the cluster's
    assert m.moe == MoEOptions(max_nodes_per_token=4, fp8_dispatch=True, imbalance=1.1)
    assert m.expert_load_factor == 1.1


@pytest.mark.parametrize("options, field", [
    ({"imbalance": 0.9}, "moe.imbalance"), ({"imbalance": "high"}, "moe.imbalance"),
    ({"capacity_factor": 0.5}, "moe.capacity_factor"), ({"max_nodes_per_token": 2.5}, "moe.max_nodes_per_token"),
    ({"fp8_dispatch": "yes"}, "moe.fp8_dispatch"), ({"a2a_algorithm": "mpi"}, "moe.a2a_algorithm"),
    ({"pad_to_capacity": True}, "moe.pad_to_capacity"), ({"imbalanse": 1.1}, "imbalanse"),
])
def test_bad_moe_options_name_the_field(options, field):
    with pytest.raises(ValueError) as e:
        AnalyticCostModel(parse_cluster("h800:1x8"), {"moe": options})
    assert field in str(e.value) and "\n" not in str(e.value)


def test_bad_moe_options_in_a_cluster_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"gpu": "h100", "nodes": 1, "gpus_per_node": 8, "moe": {"imbalance": 0}}))
    with pytest.raises(ValueError, match=r"c\.json.*moe\.imbalance"):
        parse_cluster(str(path))


def test_node_limit_below_top_k_experts_is_refused():
    with pytest.raises(ValueError, match="max_nodes_per_token 1 leaves 4 experts"):
        traffic(8, 8, Routing(top_k=8, n_experts=32), max_nodes_per_token=1)


# --- the plan and the simulator -------------------------------------------------------------

def _moe_plan():
    from piper_sim.api import compile

    return compile({"model": "moe-tiny", "cluster": "h100:1x4", "global_batch": 8, "seq_len": 32,
                    "microbatches": 2, "directives": [{"op": "pipeline", "degree": 1},
                                                      {"op": "schedule", "name": "zb1p"},
                                                      {"op": "expert_parallel", "degree": 4}]})


def test_plan_marks_expert_pieces_and_a2a_directions():
    plan = _moe_plan()
    assert plan.meta["moe"] == {"top_k": 2, "n_experts": 4}
    ins = {i.id: i for i in plan.classes[0].instructions()}
    assert ins["A2A.F.s0.mb0.e0.dispatch"].a2a == "dispatch" and ins["A2A.F.s0.mb0.e0.combine"].a2a == "combine"
    # backward: the output gradients go to the experts (dispatch kernel), input gradients come back
    assert ins["A2A.B.s0.mb0.e0.combine"].a2a == "dispatch" and ins["A2A.B.s0.mb0.e0.dispatch"].a2a == "combine"
    experts = [i for i in ins.values() if i.kind in ("F", "BI") and i.expert_flops]
    assert experts and all(i.expert_flops == i.flops for i in experts)
    assert all(not i.expert_flops for i in ins.values() if i.kind in ("F", "BI") and i not in experts)
    bw = ins["BW.s0.mb0"]
    assert 0 < bw.expert_flops < bw.flops  # the experts' weight gradients inside the stage's BW


def test_imbalance_raises_expert_compute_by_its_factor():
    from piper_sim.simulator import simulate

    plan = _moe_plan()
    cluster = parse_cluster("h100:1x4")
    flat = {"comm_compute_slowdown": 1.0}  # compute durations free of comm overlap
    base = simulate(plan, AnalyticCostModel(cluster, flat)).events
    hot = simulate(plan, AnalyticCostModel(cluster, {**flat, "moe": {"imbalance": 1.25}})).events
    dur = {k: (ev.assign(d=ev["end"] - ev["start"]).set_index(["rank", "op_id"])["d"]) for k, ev in
           (("base", base), ("hot", hot))}
    ins = {i.id: i for i in plan.classes[0].instructions()}
    for (rank, op), d in dur["base"].items():
        i = ins[op]
        ratio = dur["hot"][(rank, op)] / d if d else 1.0
        if i.kind in ("F", "B", "BI") and i.expert_flops:
            assert ratio == pytest.approx(1.25)
        elif i.kind == "BW":
            assert ratio == pytest.approx(1 + 0.25 * i.expert_flops / i.flops)
        elif i.kind in ("F", "BI", "OPT"):
            assert ratio == pytest.approx(1.0)
        elif i.a2a:
            assert ratio > 1.0  # more bytes to the most loaded rank
