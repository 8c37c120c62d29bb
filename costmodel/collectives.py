"""Alpha-beta models of NCCL collectives and p2p (Thakur et al. 2005; nccl-tests conventions).

What `S` (nbytes) means, as in nccl-tests where algbw = S / t:
  ALLREDUCE       the buffer, identical in and out on every rank
  REDUCE_SCATTER  the full input buffer on each rank (each rank keeps S / n)
  ALL_GATHER      the full output buffer on each rank (each rank contributes S / n)
  ALL_TO_ALL      each rank's send buffer (S / n to every peer, itself included)

Per-rank times for n ranks on a link of bandwidth B and per-step latency α:
  ring ALLREDUCE        2(n−1)/n · S/B + 2(n−1)α
  ring RS / AG / A2A    (n−1)/n · S/B + (n−1)α
  tree ALLREDUCE        2·S/B + 2·((g−1)·α_intra + ceil(log2 m)·α_inter)
                        (NCCL's tree: a chain inside each node, a binary tree across the
                        m nodes [NCCL tuning.cc]; inside one node it never beats the ring)
  hierarchical          (groups spanning nodes; g ranks per node, m nodes)
      ALLREDUCE   intra RS(S, g) + inter AR(S/g, m) + intra AG(S, g)
      RS / AG     intra RS(S, g) + inter RS(S/g, m)   (AG in reverse order, same time)
      A2A         the intra share (g−1)/n·S on NVLink and the inter share (n−g)/n·S on
                  the NIC, concurrently: max of the two
  rails           (AR / RS / AG over groups spanning nodes) NCCL's multi-node ring: one
                  channel per GPU's NIC rail, node-crossing hops on the NIC, the others on
                  NVLink, all pipelined:
                      max(f·S / (g·B_nic), f·S·(g−1)/g / B_nvl) + latency
                  f = busbw_factor; latency = NCCL's ring latency for the Simple protocol
                  (the one that carries bandwidth-bound messages) [NCCL tuning.cc]:
                  base 8.4 µs + (steps − crossings)·3.4 µs (NVLink) + crossings·14 µs (NET),
                  steps = ring_steps(n), crossings = ring_steps(m) for m nodes. It reproduces
                  the measured 4-node all-reduce at both ends: busbw 364.9 GB/s on 32 H200 at
                  4 GiB (the NIC's achieved rate, hardware.NIC_400G_ACHIEVED_BW) and, on 32
                  B200, 89 vs 64 GB/s measured at 16 MiB, 380 vs 362 at 1 GiB [MLE-B]; the
                  hierarchical sum of phases gives 227 GB/s at 4 GiB and 160 at 16 MiB.
                  "auto" over nodes takes rails (and the tree for an all-reduce when it is
                  faster: small messages), not the hierarchical form.
busbw = algbw · factor: 2(n−1)/n for ALLREDUCE, (n−1)/n for the others [NT]; in the ring
model busbw equals B, so measured busbw is what `GPU.nvlink_bw` holds.

Expert-parallel all-to-all (`moe_all_to_all_time`; byte counts derived in costmodel.moe)
by algorithm, for one dispatch or combine whose plan size is S = T·k·h·b (k copies per
token), with the load factor L (max/mean per EP rank) and FP8 dispatch f = (1 + 4/128)/2
(1 for a combine or without FP8):
  deepep   de-duplicated per destination rank (NVLink) and node (NIC), node-limited routing:
               t = ep_alpha_s + L·f·S/k · max(D_ranks / B_nvl, D_remote_nodes / B_nic)
           with B_nvl, B_nic = `GPU.ep_links` (DeepEP-measured), D_* from costmodel.moe (the
           NIC term only when the group spans nodes)
  nccl     a plain all-to-all of S·L·f: the ALL_TO_ALL formulas above (cross-node share
           (N−1)/N of the bytes for N nodes, whatever the node limit)

Links: a group inside one node uses NVLink (`nvlink_bw`, `intra_alpha_s`); a group spanning
nodes uses the per-GPU NIC (`nic_bw`, `inter_alpha_s`), or both in the hierarchical case; a
group spanning pods of the cluster's fabric gets the NIC at the fabric's cross-pod efficiency
(`costmodel.hardware.Fabric`: oversubscription, ECMP collisions).
Link ids are per rank and direction ("nvlink:rank3:tx", "nic:rank17:rx"): NVSwitch is
non-blocking, so only transfers touching the same GPU port in the same direction compete.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from costmodel.hardware import CPU, Cluster
from costmodel.moe import FP8_DISPATCH_FACTOR, MoEOptions, Routing, traffic

KINDS = ("ALLREDUCE", "REDUCE_SCATTER", "ALL_GATHER", "ALL_TO_ALL")
P2P_KINDS = ("SEND", "RECV", "P2P")
ALGORITHMS = {
    "ALLREDUCE": ("ring", "tree", "hierarchical", "rails"),
    "REDUCE_SCATTER": ("ring", "hierarchical", "rails"),
    "ALL_GATHER": ("ring", "hierarchical", "rails"),
    "ALL_TO_ALL": ("ring", "hierarchical"),
}


@dataclass(frozen=True)
class Link:
    bw: float  # bytes/s
    alpha: float  # seconds per step


def intra_link(cluster: Cluster) -> Link:
    return Link(cluster.gpu.nvlink_bw, cluster.gpu.intra_alpha_s)


def inter_link(cluster: Cluster, ranks=()) -> Link:
    """The NIC link of a group spanning nodes; across pods of the fabric at its
    ``cross_pod_efficiency`` (`costmodel.hardware.Fabric`)."""
    bw = cluster.gpu.nic_bw
    if cluster.crosses_pods(ranks):
        bw *= cluster.fabric.cross_pod_efficiency
    return Link(bw, cluster.gpu.inter_alpha_s)


def busbw_factor(kind: str, n: int) -> float:
    """busbw = algbw · factor [NT]."""
    _check_kind(kind)
    f = (n - 1) / n
    return 2 * f if kind == "ALLREDUCE" else f


def ring_steps(kind: str, n: int) -> int:
    """Latency steps of the ring algorithm: 2(n−1) for ALLREDUCE, n−1 otherwise."""
    return 2 * (n - 1) if kind == "ALLREDUCE" else n - 1


def ring_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return busbw_factor(kind, n) * nbytes / link.bw + ring_steps(kind, n) * link.alpha


def tree_time(nbytes: float, ranks: list[int], cluster: Cluster, per_node: Counter | None = None) -> float:
    """Tree all-reduce (reduce up, broadcast down, pipelined): chain in a node, tree across nodes.
    ``per_node``: `Cluster.node_counts` of ``ranks`` when the caller has it."""
    if len(ranks) <= 1:
        return 0.0
    per_node = cluster.node_counts(ranks) if per_node is None else per_node
    g, m = max(per_node.values()), len(per_node)
    intra, inter = intra_link(cluster), inter_link(cluster, ranks)
    bw = inter.bw if m > 1 else intra.bw
    return 2 * nbytes / bw + 2 * ((g - 1) * intra.alpha + math.ceil(math.log2(m)) * inter.alpha)


def hierarchical_time(kind: str, nbytes: float, ranks: list[int], cluster: Cluster,
                      per_node: Counter | None = None) -> float:
    per_node = cluster.node_counts(ranks) if per_node is None else per_node
    g, m, n = max(per_node.values()), len(per_node), len(ranks)
    intra, inter = intra_link(cluster), inter_link(cluster, ranks)
    if kind == "ALLREDUCE":
        return 2 * ring_time("REDUCE_SCATTER", nbytes, g, intra) + ring_time("ALLREDUCE", nbytes / g, m, inter)
    if kind in ("REDUCE_SCATTER", "ALL_GATHER"):
        return ring_time(kind, nbytes, g, intra) + ring_time(kind, nbytes / g, m, inter)
    t_intra = (g - 1) / n * nbytes / intra.bw + (g - 1) * intra.alpha
    t_inter = (n - g) / n * nbytes / inter.bw + (n - g) * inter.alpha
    return max(t_intra, t_inter)


# NCCL's ring latency constants for the Simple protocol, seconds [NCCL] (tuning.cc: baseLat
# Ring/Simple 8.4 µs; hwLat NVLink Ring/Simple 3.4 µs, NET Ring/Simple 14 µs).
NCCL_SIMPLE_BASE_S = 8.4e-6
NCCL_SIMPLE_NVLINK_S = 3.4e-6
NCCL_SIMPLE_NET_S = 14e-6


def rails_time(kind: str, nbytes: float, ranks: list[int], cluster: Cluster,
               per_node: Counter | None = None) -> float:
    """NCCL's ring over nodes with one channel per NIC rail, pipelined (module doc)."""
    per_node = cluster.node_counts(ranks) if per_node is None else per_node
    g_min, g_max, m, n = min(per_node.values()), max(per_node.values()), len(per_node), len(ranks)
    intra, inter = intra_link(cluster), inter_link(cluster, ranks)
    f = busbw_factor(kind, n)
    t_bw = max(f * nbytes / (g_min * inter.bw), f * nbytes * (g_max - 1) / g_max / intra.bw)
    steps, crossing = ring_steps(kind, n), ring_steps(kind, m)
    return t_bw + NCCL_SIMPLE_BASE_S + (steps - crossing) * NCCL_SIMPLE_NVLINK_S + crossing * NCCL_SIMPLE_NET_S


def algorithm_times(kind: str, nbytes: float, ranks: list[int], cluster: Cluster) -> dict[str, float]:
    """Time of every algorithm that applies to this group."""
    _check_kind(kind)
    ranks = _group(ranks, cluster)
    return _algorithm_times(kind, nbytes, ranks, cluster, _node_counts(ranks, cluster))


def _algorithm_times(kind: str, nbytes: float, ranks: list[int], cluster: Cluster, per_node: Counter
                     ) -> dict[str, float]:
    """`algorithm_times` of a group `_group` made, its `_node_counts` read once for every formula."""
    n = len(ranks)
    one_node = len(per_node) == 1
    link = intra_link(cluster) if one_node else inter_link(cluster, ranks)
    times = {"ring": ring_time(kind, nbytes, n, link)}
    if kind == "ALLREDUCE":
        times["tree"] = tree_time(nbytes, ranks, cluster, per_node)
    times["hierarchical"] = hierarchical_time(kind, nbytes, ranks, cluster, per_node) if n > 1 else 0.0
    if kind != "ALL_TO_ALL":  # inside one node the rails ring is the ring
        times["rails"] = times["ring"] if one_node else rails_time(kind, nbytes, ranks, cluster, per_node)
    return times


def collective_time(kind: str, nbytes: float, ranks: list[int], cluster: Cluster, algorithm: str = "auto") -> float:
    """Seconds for one collective over `ranks`; "auto" takes the cheapest algorithm."""
    _check_kind(kind)
    ranks = _group(ranks, cluster)
    per_node = _node_counts(ranks, cluster)
    times = _algorithm_times(kind, nbytes, ranks, cluster, per_node)
    if algorithm == "auto":
        if "rails" in times and cluster.gpu.name != CPU.name and len(per_node) > 1:  # spans nodes
            return min(times["rails"], times.get("tree", math.inf))  # NCCL across nodes
        return min(times.values())
    if algorithm not in times:
        raise ValueError(f"no {algorithm!r} algorithm for {kind}; choose from auto, {', '.join(ALGORITHMS[kind])}")
    return times[algorithm]


A2A_DIRECTIONS = ("dispatch", "combine")


def a2a_algorithm(options: MoEOptions, cluster: Cluster) -> str:
    """The all-to-all algorithm "auto" stands for: deepep on GPUs, the plain one on CPU."""
    if options.a2a_algorithm != "auto":
        return options.a2a_algorithm
    return "nccl" if cluster.gpu.name == CPU.name else "deepep"


def a2a_bytes_factor(direction: str, options: MoEOptions) -> float:
    """Load factor times the FP8 factor (dispatch only) on an expert all-to-all's bytes."""
    if direction not in A2A_DIRECTIONS:
        raise ValueError(f"expert all-to-all direction must be dispatch or combine, got {direction!r}")
    fp8 = FP8_DISPATCH_FACTOR if options.fp8_dispatch and direction == "dispatch" else 1.0
    return options.load_factor() * fp8


def moe_all_to_all_time(nbytes: float, ranks: list[int], cluster: Cluster, direction: str = "dispatch",
                        routing: Routing | None = None, options: MoEOptions | None = None,
                        algorithm: str = "auto") -> float:
    """Seconds of one expert-parallel dispatch or combine of plan size `nbytes` (S, k copies
    per token) over `ranks`; `options` default to the cluster's. See the module doc."""
    options = cluster.moe if options is None else options
    ranks = _group(ranks, cluster)
    n = len(ranks)
    if n <= 1:
        return 0.0
    scaled = nbytes * a2a_bytes_factor(direction, options)
    if a2a_algorithm(options, cluster) == "nccl":
        return collective_time("ALL_TO_ALL", scaled, ranks, cluster, algorithm)
    nodes = len(_node_counts(ranks, cluster))
    tr = traffic(n, nodes, routing, options.max_nodes_per_token)
    b_nvl, b_nic = cluster.gpu.ep_links
    per_copy = scaled / tr.copies
    t = per_copy * tr.ranks / b_nvl
    if nodes > 1:
        t = max(t, per_copy * tr.remote_nodes / b_nic)
    return cluster.gpu.ep_alpha_s + t


def p2p_time(nbytes: float, src: int, dst: int, cluster: Cluster) -> float:
    """α + S/B on NVLink inside a node, on the NIC across nodes; 0 to oneself."""
    if src == dst:
        cluster.node_of(src)
        return 0.0
    link = intra_link(cluster) if cluster.same_node((src, dst)) else inter_link(cluster, (src, dst))
    return link.alpha + nbytes / link.bw


def links_used(kind: str, ranks, cluster: Cluster) -> list[str]:
    """Stable link ids a transfer occupies; for SEND/RECV/P2P `ranks` is (src, dst).

    A collective occupies both directions of NVLink on every member when some node holds
    two or more members, and both directions of the NIC when it spans nodes.
    """
    if kind in P2P_KINDS:
        src, dst = ranks
        if src == dst:
            return []
        port = "nvlink" if cluster.same_node((src, dst)) else "nic"
        return [f"{port}:rank{src}:tx", f"{port}:rank{dst}:rx"]
    ports = ports_used(kind, ranks, cluster)
    return [f"{p}:rank{r}:{d}" for p in ports for r in sorted(set(ranks)) for d in ("tx", "rx")]


def ports_used(kind: str, ranks, cluster: Cluster) -> list[str]:
    """The ports every member of a collective occupies, both directions (`links_used`):
    NVLink when some node holds two or more members, the NIC when the group spans nodes."""
    _check_kind(kind)
    ranks = _group(ranks, cluster)
    if len(ranks) <= 1:
        return []
    per_node = _node_counts(ranks, cluster)
    return (["nvlink"] if max(per_node.values()) > 1 else []) + (["nic"] if len(per_node) > 1 else [])


def link_bandwidth(link_id: str, cluster: Cluster) -> float:
    """Bandwidth in bytes/s of a link id from `links_used`."""
    port = link_id.split(":", 1)[0]
    if port == "nvlink":
        return cluster.gpu.nvlink_bw
    if port == "nic":
        return cluster.gpu.nic_bw
    raise ValueError(f"unknown link id {link_id!r}; expected nvlink:rankR:tx|rx or nic:rankR:tx|rx")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {', '.join(KINDS)}")


def _group(ranks, cluster: Cluster) -> list[int]:
    ranks = sorted(set(ranks))
    if not ranks:
        raise ValueError("collective over an empty group")
    cluster.node_of(ranks[0]), cluster.node_of(ranks[-1])  # range check (sorted: the extremes)
    return ranks


def _node_counts(ranks: list[int], cluster: Cluster) -> Counter:
    """`Cluster.node_counts` of a group `_group` made (sorted, range-checked), counted once per
    distinct group and node size: a simulator prices every bucket of a data-parallel group of
    4,096 ranks with it. The Counter is shared: read it, never change it."""
    return _counts_by_node(tuple(ranks), cluster.gpus_per_node)


@lru_cache(maxsize=256)
def _counts_by_node(ranks: tuple[int, ...], gpus_per_node: int) -> Counter:
    return Counter(map(gpus_per_node.__rfloordiv__, ranks))  # r // gpus_per_node
