"""Simulated expert-parallel dispatch/combine bandwidth next to DeepEP's published numbers.

    python benchmarks/bench_moe_a2a.py

DeepEP's normal-kernel benchmark (docs/legacy.md, H800 + CX7 400G): 4096 tokens per rank,
hidden 7168, top-8 of 256 experts, top-min(nodes, 4) node groups, FP8 dispatch and bf16
combine; EP8 on one node, EP16/32/64 on 2/4/8 nodes. Each dispatch/combine is priced by the
cost model the simulator uses (AnalyticCostModel.all_to_all_time on h800:Nx8) and turned
into a bandwidth the way DeepEP counts it: received bytes (own rank included) per second on
one node ("NVLink"), and bytes sent to nodes (own node included) per second across nodes
("RDMA").

These published numbers are component-level sources for the cost-model parameters AND the
check: the rows marked "source of ..." set a constant (they come back by construction);
the other rows are predictions of the same model. Nothing is fitted to end-to-end training.
"""

from __future__ import annotations

from costmodel.hardware import DEEPEP_ALPHA_S, H800, parse_cluster
from costmodel.model import AnalyticCostModel
from costmodel.moe import Routing, deepep_bytes, traffic

TOKENS, HIDDEN = 4096, 7168
ROUTING = Routing(top_k=8, n_experts=256)
# EP: (dispatch, combine) GB/s and the link DeepEP names the bottleneck [DEP docs/legacy.md]
PUBLISHED = {8: (153, 158, "NVLink"), 16: (43, 43, "RDMA"), 32: (58, 57, "RDMA"), 64: (51, 50, "RDMA")}
SOURCE = {8: "source of ep_nvlink_bw (dispatch)", 64: "source of ep_nic_bw (dispatch)"}


def simulated(ep: int) -> dict:
    nodes = max(1, ep // 8)
    cm = AnalyticCostModel(parse_cluster(f"h800:{nodes}x8"),
                           {"moe": {"a2a_algorithm": "deepep", "fp8_dispatch": True, "max_nodes_per_token": 4}})
    plain = AnalyticCostModel(parse_cluster(f"h800:{nodes}x8"), {"moe": {"a2a_algorithm": "nccl",
                                                                          "fp8_dispatch": True}})
    plan_bytes = TOKENS * ROUTING.top_k * HIDDEN * 2  # what the plan's ALL_TO_ALL carries (bf16 copies)
    ranks = list(range(ep))
    count = "nvlink" if nodes == 1 else "rdma_counted"
    out = {"nodes": nodes}
    for direction, fp8 in (("dispatch", True), ("combine", False)):
        counted = deepep_bytes(TOKENS, HIDDEN, ep, nodes, ROUTING, 4, fp8)[count]
        out[direction] = counted / cm.all_to_all_time(plan_bytes, ranks, direction, ROUTING)
        out[direction + "_plain"] = counted / plain.all_to_all_time(plan_bytes, ranks, direction, ROUTING)
    tr = traffic(ep, nodes, ROUTING, 4)
    b_nvl, b_nic = H800.ep_links
    out["bottleneck"] = "NVLink" if nodes == 1 or tr.ranks / b_nvl >= tr.remote_nodes / b_nic else "NIC"
    out["traffic"] = tr
    return out


def main() -> None:
    b_nvl, b_nic = H800.ep_links
    print(__doc__.split("\n\n")[2].replace("\n", " "))
    print(f"\nH800 constants: ep_nvlink_bw {b_nvl / 1e9:.1f} GB/s, ep_nic_bw {b_nic / 1e9:.2f} GB/s, "
          f"ep_alpha_s {DEEPEP_ALPHA_S * 1e6:.1f} us (median of the six low-latency rows' dispatch/combine "
          f"pairs, EP8..EP256)\n")
    sub = f"{'pub':>5} {'sim':>6} {'ratio':>6}"
    print(f"{'EP':>3} {'nodes':>5} {'ranks/tok':>9} {'nodes/tok':>9} {'remote':>6} | {'dispatch GB/s':^19} | "
          f"{'combine GB/s':^19} | {'sim bottleneck':>14} | {'plain a2a':>11} | row")
    print(f"{'':>36} | {sub} | {sub} | {'':>14} | {'disp/comb':>11} |")
    for ep, (pub_d, pub_c, link) in PUBLISHED.items():
        s = simulated(ep)
        tr = s["traffic"]
        d, c = s["dispatch"] / 1e9, s["combine"] / 1e9
        plain = f"{s['dispatch_plain'] / 1e9:.1f}/{s['combine_plain'] / 1e9:.1f}"
        print(f"{ep:>3} {s['nodes']:>5} {tr.ranks:>9.2f} {tr.nodes:>9.2f} {tr.remote_nodes:>6.2f} | "
              f"{pub_d:>5} {d:>6.1f} {d / pub_d:>6.2f} | {pub_c:>5} {c:>6.1f} {c / pub_c:>6.2f} | "
              f"{s['bottleneck']:>14} | {plain:>11} | {SOURCE.get(ep, 'prediction')}, DeepEP: {link}")
    print("\nranks/tok, nodes/tok: distinct destination ranks and nodes per token (own included), remote: "
          "nodes/tok x (N-1)/N; plain a2a: the same bytes counted, priced as a plain all-to-all of 8 copies "
          "per token on the NCCL model (a2a_algorithm nccl).")


if __name__ == "__main__":
    main()
