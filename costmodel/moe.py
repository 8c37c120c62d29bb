"""Expert-parallel (MoE) options and routing arithmetic: who sends how many bytes where.

Pricing lives in `costmodel.collectives.moe_all_to_all_time`; this module holds the
options a cost model is built with (`MoEOptions`), the model facts the simulator reads from
the plan (`Routing`), and the expected-traffic formulas below. It imports nothing of ours.

Traffic of one dispatch (combine: the same bytes, the other way)
-----------------------------------------------------------------
A rank holds T tokens of h elements of b bytes; each token goes to its top-k experts of E,
spread evenly over the n ranks of the EP group (E/n each), which sit on N nodes (g ranks,
E/N experts per node). The plan's ALL_TO_ALL carries S = T·k·h·b bytes (k copies per token,
what a plain all-to-all such as NCCL's, Megatron's "alltoall" dispatcher or our executor
sends).

Uniform routing: a token's k experts are k distinct experts drawn uniformly from its pool
of P experts (P = E without a node limit). A bucket of c experts of the pool (a rank,
c = E/n, or a node, c = E/N) is hit with probability 1 − C(P−c, k)/C(P, k), so a token
hits on average

    D(buckets) = (P / c) · (1 − C(P − c, k) / C(P, k))                              (1)

distinct buckets. Node-limited routing (DeepSeek-V3: each token goes to at most M = 4
nodes [DSV3 §3.2.2]; DeepEP's benchmark picks top-min(N, 4) node groups by score, then
top-k experts inside them [DEP tests/legacy/test_internode.py]): the token first picks
M' = min(M, N) nodes, uniformly by the symmetry of its scores, then its k experts among
their P = M'·E/N experts; (1) holds with that pool.

Cross-node bytes. The token's own node is one of N equally likely nodes, so of the nodes it
hits, a share (N − 1)/N is remote on average — with or without the node limit:

  * k copies, no de-duplication (NCCL all-to-all): a share (N − 1)/N of S crosses nodes.
    Node-limited routing does not change this share: it picks *which* nodes, not how many
    copies land on the own node (that stays k·(M'/N)·(1/M') = k/N).
  * De-duplicated per node (DeepEP normal kernels, DeepSeek-V3): a token crosses the NIC
    once per remote node it hits and is forwarded over NVLink inside that node, so the NIC
    carries T·h·b·D_nodes·(N − 1)/N ≤ T·h·b·min(k, M')·(N − 1)/N. This is where the node
    limit pays: at most M' sends per token instead of up to k. (The bound is (M − 1)
    sends only for a router that always keeps the token's own node among its M; uniform
    scores do not.)
  * NVLink (DeepEP): every (token, destination rank) pair arrives through NVLink once:
    T·h·b·D_ranks, the token's own rank included, which is how DeepEP counts its NVLink
    bandwidth (received `recv_x` bytes) [DEP tests/legacy/test_intranode.py].

DeepEP counts its "RDMA" bandwidth as T·h·b·D_nodes, the own node included [DEP
tests/legacy/test_internode.py, `num_rdma_token_sent`]; its V2 README calls this "logical
bandwidth" that "contains local rank traffic". The NIC carries only the remote share.

FP8 dispatch: each element is one byte plus one fp32 scale per 128 elements, DeepEP's
`fp8_factor = (1 + 4/128) / 2` of bf16 [DEP tests]; the combine stays bf16 [DSV3 §3.3.2].
"dispatch" means tokens (forward) or their output gradients (backward) moving to the
experts — the backward of a combine runs the dispatch kernel, as in DeepEP.

Load imbalance and capacity
---------------------------
`imbalance` = max over EP ranks of the tokens a rank's experts receive, over the mean
(>= 1; per rank, so at most the per-expert max/mean). The most loaded rank computes and
receives that much more, and a step waits for it: expert compute time and all-to-all bytes
are multiplied by the load factor

    L = imbalance                         dropless (capacity_factor 0, Megatron's default)
    L = min(imbalance, capacity_factor)   tokens beyond an expert's capacity
                                          tokens·topk·CF/num_experts are dropped [Megatron-LM
                                          moe/README.md]; a rank of capacity-bound experts
                                          gets at most CF × the mean
    L = capacity_factor                   with pad_to_capacity (every expert padded to it)

Default imbalance 1.0 (perfect balance): no measured max/mean per-rank load factor for
training was found among the sources collected (shared/reference/kernels.md "Gaps": none
from DeepSeek-V3, MegaBlocks or Tutel; the aux-loss-free balancing paper, arXiv
2408.15664, reports its MaxVio metric, max/mean − 1, but its tables were not retrieved).
Set it from your own router statistics: 1 + MaxVio of the tokens per EP rank (e.g.
Megatron's per-layer tokens-per-expert logging, summed over each rank's experts), as
`{"moe": {"imbalance": 1.1}}` in the cost-model overrides or the cluster file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

# DeepEP's FP8 wire format relative to bf16: 1 byte + a 4-byte scale per 128 elements,
# over 2 bytes [DEP tests/legacy/test_intranode.py `fp8_factor`].
FP8_DISPATCH_FACTOR = (1 + 4 / 128) / 2
A2A_ALGORITHMS = ("auto", "deepep", "nccl")


@dataclass(frozen=True)
class MoEOptions:
    """How expert-parallel traffic and expert compute are priced (see the module doc).

    a2a_algorithm: "deepep" (de-duplicated per rank and node, DeepEP's measured
        bandwidths), "nccl" (a plain all-to-all of k copies on the collective model or its
        calibration fit; what the executor runs) or "auto" (deepep on GPUs, nccl on CPU).
    max_nodes_per_token: node-limited routing M (0: no limit).
    fp8_dispatch: dispatch in FP8 (combine stays bf16).
    imbalance: max/mean tokens per EP rank (>= 1).
    capacity_factor: Megatron's expert capacity factor (0: dropless); with
        pad_to_capacity every expert is padded to its capacity.
    """

    a2a_algorithm: str = "auto"
    max_nodes_per_token: int = 0
    fp8_dispatch: bool = False
    imbalance: float = 1.0
    capacity_factor: float = 0.0
    pad_to_capacity: bool = False

    def __post_init__(self):
        if self.a2a_algorithm not in A2A_ALGORITHMS:
            raise ValueError(f"moe.a2a_algorithm must be one of {', '.join(A2A_ALGORITHMS)}, "
                             f"got {self.a2a_algorithm!r}")
        if isinstance(self.max_nodes_per_token, bool) or not isinstance(self.max_nodes_per_token, int) \
                or self.max_nodes_per_token < 0:
            raise ValueError(f"moe.max_nodes_per_token must be an integer >= 0 (0: no limit), "
                             f"got {self.max_nodes_per_token!r}")
        for name in ("fp8_dispatch", "pad_to_capacity"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"moe.{name} must be true or false, got {getattr(self, name)!r}")
        if not _number(self.imbalance) or self.imbalance < 1:
            raise ValueError(f"moe.imbalance is max/mean tokens per EP rank and must be a number >= 1, "
                             f"got {self.imbalance!r}")
        cf = self.capacity_factor
        if not _number(cf) or (cf != 0 and cf < 1):
            raise ValueError(f"moe.capacity_factor must be 0 (dropless) or a number >= 1 (below 1 drops "
                             f"tokens even when balanced, not modelled), got {cf!r}")
        if self.pad_to_capacity and not cf:
            raise ValueError("moe.pad_to_capacity needs a moe.capacity_factor >= 1")

    @classmethod
    def from_dict(cls, d) -> "MoEOptions":
        if isinstance(d, MoEOptions):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"moe options must be a mapping of {', '.join(f.name for f in fields(cls))}, got {d!r}")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown moe option(s) {sorted(unknown)}; known: {[f.name for f in fields(cls)]}")
        return cls(**d)

    def load_factor(self) -> float:
        """L: the most loaded rank's share of expert work and bytes over the mean."""
        if self.capacity_factor:
            return self.capacity_factor if self.pad_to_capacity else min(self.imbalance, self.capacity_factor)
        return self.imbalance


@dataclass(frozen=True)
class Routing:
    """Model facts the traffic depends on: top-k of n_experts routed experts."""

    top_k: int
    n_experts: int

    def __post_init__(self):
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"routing needs 1 <= top_k <= n_experts, got top_k {self.top_k}, "
                             f"n_experts {self.n_experts}")


def expected_hits(pool: int, per_bucket: float, top_k: int) -> float:
    """Formula (1): distinct buckets of `per_bucket` experts hit by `top_k` distinct experts
    drawn uniformly from `pool` experts."""
    if per_bucket <= 0 or pool < top_k:
        raise ValueError(f"expected_hits needs pool >= top_k and buckets of > 0 experts, got pool {pool}, "
                         f"top_k {top_k}, bucket {per_bucket}")
    if per_bucket >= pool:
        return 1.0
    c = int(round(per_bucket))
    miss = math.comb(pool - c, top_k) / math.comb(pool, top_k)
    return pool / per_bucket * (1.0 - miss)


@dataclass(frozen=True)
class Traffic:
    """Per-token destinations of one rank's tokens (module doc): distinct ranks (NVLink
    receives, own rank included), distinct nodes (own node included) and remote nodes."""

    ranks: float
    nodes: float
    remote_nodes: float
    copies: int  # k: what the plan's S counts per token


def traffic(n: int, nodes: int, routing: Routing | None, max_nodes_per_token: int = 0) -> Traffic:
    """Expected per-token destinations for an EP group of `n` ranks on `nodes` nodes.

    Without `routing` (k unknown) every copy is taken to a distinct rank: no
    de-duplication, as for a plain all-to-all.
    """
    if routing is None:
        share = (nodes - 1) / nodes
        return Traffic(ranks=1.0, nodes=1.0, remote_nodes=share, copies=1)
    k, E = routing.top_k, routing.n_experts
    if E % n:
        raise ValueError(f"{E} experts do not spread evenly over {n} EP ranks")
    m = min(max_nodes_per_token, nodes) if max_nodes_per_token else nodes
    pool = E * m // nodes
    if pool < k:
        raise ValueError(f"moe.max_nodes_per_token {max_nodes_per_token} leaves {pool} experts per token, "
                         f"fewer than top_k {k}")
    d_nodes = expected_hits(pool, E / nodes, k)
    return Traffic(ranks=expected_hits(pool, E / n, k), nodes=d_nodes,
                   remote_nodes=d_nodes * (nodes - 1) / nodes, copies=k)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# --------------------------------------------------------------------------- DeepEP's benchmark


def deepep_bytes(tokens: int, hidden: int, n: int, nodes: int, routing: Routing, max_nodes_per_token: int = 0,
                 fp8: bool = True) -> dict[str, float]:
    """Per-rank bytes of one DeepEP benchmark dispatch (combine: fp8=False), as DeepEP counts
    them and as the links carry them (module doc): "nvlink" (received tokens, own rank
    included: DeepEP's NVL count and what NVLink carries), "rdma_counted" (DeepEP's RDMA
    count, own node included) and "nic" (its remote share, on the wire)."""
    tr = traffic(n, nodes, routing, max_nodes_per_token)
    per_token = hidden * (2 * FP8_DISPATCH_FACTOR if fp8 else 2)
    return {"nvlink": tokens * per_token * tr.ranks, "rdma_counted": tokens * per_token * tr.nodes,
            "nic": tokens * per_token * tr.remote_nodes}


def link_bw_from_row(published_Bps: float, counted_bytes: float, link_bytes: float, alpha_s: float) -> float:
    """The link bandwidth a published DeepEP row implies: counted_bytes / published_Bps is the
    measured time; less the per-op latency, it moved `link_bytes` over its bottleneck link."""
    t = counted_bytes / published_Bps - alpha_s
    if t <= 0:
        raise ValueError(f"latency {alpha_s} s exceeds the row's time {counted_bytes / published_Bps} s")
    return link_bytes / t
