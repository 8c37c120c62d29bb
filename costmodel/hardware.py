"""Hardware catalog: one `GPU` per accelerator, a `Cluster` of identical nodes.

All numbers are per GPU, in SI units (FLOP/s, bytes, bytes/s, seconds). Bandwidths are
unidirectional and, where a measurement is sourced, the *achieved* value (nccl-tests
busbw for the intra-node link), so that ring formulas reproduce measured large-message
times. Source keys refer to the legend of shared/reference/hardware-costs-traces.md;
"(inferred)" = computed from cited numbers, "(assumed)" = not sourced, calibrate it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from dataclasses import dataclass, field

from costmodel.moe import MoEOptions
from costmodel.stragglers import GPU_SPEED_SPREAD
from costmodel.names import unknown_name, unknown_names

# Achieved per-GPU NIC bandwidth of NCCL over 400 Gb/s rails: 32×H200 (4 p5en nodes, 8×400G EFA)
# ring all-reduce busbw 364.9 GB/s at 4 GiB [MLE-B] over 8 rails (inferred; the ring's busbw is
# g · B_nic, costmodel.collectives "rails"): 91% of the 50 GB/s line rate.
NIC_400G_ACHIEVED_BW = 364.9e9 / 8

# Latencies shared by the GPU presets (per ring step).
# 8×H200 all-reduce floor ≈ 18 µs over 2·7 ring steps [MLE-B] (inferred).
NVLINK_ALPHA_S = 1.3e-6
# 32×B200 (4 nodes) all-reduce floor ≈ 99 µs [MLE-B]; minus the 18 µs intra part, over the
# 2·3 inter-node steps of a hierarchical all-reduce (inferred); NCCL NET ring hwLat 14 µs [NCCL].
NIC_ALPHA_S = 13.5e-6
# Kernel launch overhead added to every compute op (assumed; small-GEMM overhead is
# already inside the efficiency table).
GPU_LAUNCH_S = 2e-6
# Compute slowdown while a collective kernel runs on the same GPU (its CTAs take SMs, its
# copies take HBM bandwidth): on average 18.9% (max 40.0%) over the overlapped compute and
# collective kernels measured on A100/H100-class GPUs [COV25] (Ahmed et al., "Characterizing
# Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning: Performance and
# Power Implications", arXiv 2507.03114, abstract). Replaces the earlier 1.1 (assumed). The
# CPU preset keeps its own (assumed) value: gloo does not share an accelerator.
GPU_OVERLAP_SLOWDOWN = 1.189

# Expert-parallel all-to-all, DeepEP normal kernels (byte counts: costmodel.moe; pricing:
# collectives.moe_all_to_all_time). tests/test_moe_costs.py re-derives every number here.
# Per-op latency: DeepEP low-latency kernels, 128 tokens, hidden 7168, top-8, H800 + CX7
# [DEP legacy]: a row's dispatch (FP8) and combine (bf16) move bytes in the ratio
# 2/(1 + 4/128); t = alpha + bytes/B through each (dispatch, combine) pair gives alpha =
# 37.6, 36.0, 29.4, 22.9, 3.6, 17.3 us for EP8..EP256; this is their median (inferred).
DEEPEP_ALPHA_S = 26.1e-6
# Link bandwidths implied by a published row (costmodel.moe.link_bw_from_row: DeepEP's
# counted bytes / published bandwidth = the measured time; less DEEPEP_ALPHA_S, over the
# bytes the bottleneck link really carries), DeepSeek-V3 setting: 4096 tokens, hidden 7168,
# top-8 of 256 experts, top-min(nodes, 4) node groups, FP8 dispatch [DEP legacy].
DEEPEP_H800_NVLINK_BW = 156.9e9  # intranode EP8 dispatch row, 153 GB/s (NVLink) [DEP legacy] (inferred)
# internode EP64 dispatch row, 51 GB/s "RDMA", counted with the own node's tokens; the NIC
# carries 7/8 of them (8 nodes) [DEP legacy] (inferred)
DEEPEP_H800_NIC_BW = 45.17e9
# The shares of H800's measured NVLink 160 GB/s and IB 50 GB/s [DSV3 §3.2.2] they reach;
# presets without DeepEP measurements take these shares of their own nvlink_bw / nic_bw
# (inferred).
DEEPEP_NVLINK_SHARE = DEEPEP_H800_NVLINK_BW / 160e9
DEEPEP_NIC_SHARE = DEEPEP_H800_NIC_BW / 50e9


# Sustained / burst tensor-core throughput (shared/reference/stacks-and-clocks.md §1).
# Hopper: stas00/ml-engineering compute/accelerator/README.md (branch fast-mamf @082816f, lines
# ~347-387) H200 SXM BF16 MSMF 708.5 vs MAMF 841.9 TFLOP/s (0.842; clock ~1465 vs ~1980 MHz), and the
# same repo's later benchmarks README, five runs: MSMF 743-746 vs MAMF 843-850 (0.879); the mean of the
# two measurements. H100 and H800 share H200's tensor cores and clocks (inferred).
SUSTAINED_HOPPER = 0.86
# Blackwell: same sources, B200 MSMF 1456.3 vs MAMF 1770.9 (0.822) and 1421-1428 vs 1682-1705 (0.842).
SUSTAINED_BLACKWELL = 0.83
# Ampere: NVIDIA's HPL Rpeak uses the clock sustained at the power limit, A100 1305 MHz vs 1410 MHz
# boost (glennklockwood.com "peak FLOPS" notes): 0.926; throughput scales with the clock (inferred).
SUSTAINED_AMPERE = 1305 / 1410


@dataclass(frozen=True)
class GPU:
    """One accelerator. `peak_flops` maps dtype ("bf16", "fp8", "fp32") to dense FLOP/s."""

    name: str
    peak_flops: dict[str, float]
    hbm_bytes: float
    hbm_bw: float
    nvlink_bw: float  # intra-node, per GPU, unidirectional, achievable
    nic_bw: float  # scale-out, per GPU, unidirectional
    mamf_eff: float  # max achievable matmul efficiency (bf16), caps the efficiency table
    launch_s: float = GPU_LAUNCH_S
    intra_alpha_s: float = NVLINK_ALPHA_S
    inter_alpha_s: float = NIC_ALPHA_S
    overlap_slowdown: float = GPU_OVERLAP_SLOWDOWN  # compute slowdown while a comm kernel shares the device
    # comm slowdown while its rank computes: 1 where comm has its own engine; on a CPU the
    # comm thread (gloo) shares the cores with the compute thread
    comm_overlap_slowdown: float = 1.0
    # expert-parallel all-to-all (DeepEP-style, see costmodel.moe); 0 = this GPU's
    # nvlink_bw / nic_bw times DEEPEP_NVLINK_SHARE / DEEPEP_NIC_SHARE
    ep_nvlink_bw: float = 0.0
    ep_nic_bw: float = 0.0
    ep_alpha_s: float = DEEPEP_ALPHA_S
    # GEMM efficiency by shape: XLA's measured table of its family (sm_90, sm_100) scaled by MAMF (costmodel.operators);
    # False: a flat ``mamf_eff`` (CPU BLAS has no 128-wide tiles to leave empty)
    gemm_by_shape: bool = True
    # Tensor-core throughput a training run sustains over the burst that MAMF, XLA's table and
    # the FlashAttention charts measure (clock settled at the power limit vs boost); see the
    # SUSTAINED_* constants. 1.0: no sourced figure (the burst is used).
    sustained_ratio: float = 1.0
    # the architecture whose kernel measurements price it (the FlashAttention table: A100's
    # for "ampere", H100's for "hopper", "blackwell", "cdna3"; "cpu" keeps A100's, scaled)
    family: str = "hopper"
    # relative standard deviation of per-GPU speed across a fleet of this SKU: a synchronous
    # step computes at the pace of its slowest GPU (costmodel.stragglers; Sinha et al. SC'22)
    speed_spread: float = GPU_SPEED_SPREAD

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"{self.name} has no {dtype!r} peak; known: {', '.join(self.peak_flops)}")
        return self.peak_flops[dtype]

    @property
    def ep_links(self) -> tuple[float, float]:
        """(NVLink, NIC) bytes/s an expert-parallel all-to-all achieves."""
        return (self.ep_nvlink_bw or DEEPEP_NVLINK_SHARE * self.nvlink_bw,
                self.ep_nic_bw or DEEPEP_NIC_SHARE * self.nic_bw)


A100 = GPU(
    name="A100-80G",
    # bf16 [MLE-A][TT-U]; fp32 (non-tensor) 19.5 TFLOP/s from NVIDIA's datasheet (not in the note).
    peak_flops={"bf16": 312e12, "fp32": 19.5e12},
    # "80 GB" is 80 GiB: nvidia-smi reports 81920 MiB total on an A100 80GB; bandwidth [MLE-A] §1
    hbm_bytes=81920 * 2**20, hbm_bw=2.039e12,
    nvlink_bw=235e9,  # measured nccl-tests all-reduce busbw, ≈80% of 300 GB/s [MLE-N]
    nic_bw=25e9,  # 200 Gb/s HDR IB per GPU [MEG21]
    mamf_eff=0.869,  # 271.2 / 312 [MLE-A]
    sustained_ratio=SUSTAINED_AMPERE,
    family="ampere",
)

H100 = GPU(
    name="H100",
    # [MLE-A][TT-U]; fp32 67 TFLOP/s from NVIDIA's datasheet (not in the note).
    peak_flops={"bf16": 989e12, "fp8": 1979e12, "fp32": 67e12},
    # "80 GB" is 80 GiB: nvidia-smi reports 81559 MiB total on an H100 80GB HBM3; bandwidth [MLE-A] §1
    hbm_bytes=81559 * 2**20, hbm_bw=3.35e12,
    # 8×H200 NVLink4 all-reduce busbw with NVLS off: 367.6 GB/s [MLE-B]; same NVLink4 (inferred).
    nvlink_bw=367.6e9,
    nic_bw=NIC_400G_ACHIEVED_BW,  # 400 Gb/s CX7 per GPU [L3 §3.3.1][TT-B], NCCL-achieved (above)
    mamf_eff=0.803,  # 794.5 / 989 [MLE-A]
    sustained_ratio=SUSTAINED_HOPPER,
)

H200 = dataclasses.replace(
    H100,
    name="H200",
    # "141 GB": nvidia-smi reports 143771 MiB total on an H200; bandwidth [MLE-A] §1
    hbm_bytes=143771 * 2**20, hbm_bw=4.8e12,
    nvlink_bw=367.6e9,  # measured, NVLS off [MLE-B]
    nic_bw=NIC_400G_ACHIEVED_BW,  # 400 Gb/s, same HGX (inferred); NCCL-achieved [MLE-B] (above)
    mamf_eff=0.803,  # "H200 same" as H100 [MLE-A]
)

H800 = dataclasses.replace(
    H100,
    name="H800",
    # Same Hopper tensor cores and HBM as H100 (inferred) [DSISCA §4.1].
    nvlink_bw=160e9,  # measured [DSV3 §3.2.2] (spec 200 GB/s uni [DSISCA §4.1])
    nic_bw=50e9,  # IB measured 50 GB/s [DSV3 §3.2.2]
    ep_nvlink_bw=DEEPEP_H800_NVLINK_BW,  # DeepEP EP8 row [DEP legacy] (inferred, see above)
    ep_nic_bw=DEEPEP_H800_NIC_BW,  # DeepEP EP64 row [DEP legacy] (inferred, see above)
)

B200 = GPU(
    name="B200",
    # [MLE-A][TT-U]; fp32 ≈ 80 TFLOP/s from NVIDIA's HGX B200 datasheet (not in the note).
    peak_flops={"bf16": 2250e12, "fp8": 4500e12, "fp32": 80e12},
    hbm_bytes=180e9, hbm_bw=8e12,  # 180 GB usable [KW-B][MLE-A]
    # 80% of 900 GB/s uni, the ring rule of thumb (inferred); the measured 839 GB/s busbw
    # at 16 GiB [MLE-B] likely uses NVLS, which the ring model does not describe.
    nvlink_bw=720e9,
    nic_bw=50e9,  # 400 Gb/s CX7 [DEP README]
    mamf_eff=0.776,  # 1745 / 2250 [MLE-A]
    sustained_ratio=SUSTAINED_BLACKWELL,
    family="blackwell",
    # DeepEP V2, SM100, 8K tokens, hidden 7168, top-8, FP8 dispatch [DEP README]: the EP8 row
    # 726 GB/s (NVLink, 64 SMs) and the EP8x2 row 90 GB/s (RDMA, "logical": half of it is the
    # own node's) through link_bw_from_row with DEEPEP_ALPHA_S and 256 experts (inferred)
    ep_nvlink_bw=771.6e9,
    ep_nic_bw=45.89e9,
)

MI300X = GPU(
    name="MI300X",
    # [MLE-A][TT-U]; fp32 163.4 TFLOP/s from AMD's datasheet (not in the note).
    peak_flops={"bf16": 1300e12, "fp8": 2610e12, "fp32": 163.4e12},
    hbm_bytes=192e9, hbm_bw=5.3e12,  # [MLE-A] §1
    nvlink_bw=312.9e9,  # xGMI, measured 8×MI300X all-reduce busbw at 4 GB [MLE-N]
    nic_bw=50e9,  # 400 Gb/s (inferred)
    mamf_eff=0.514,  # 668.4 / 1300, ROCm 6.3 [MLE-A]
    family="cdna3",
    # sustained_ratio: no sourced MI300X sustained-vs-burst figure; the burst is used
)

# Local CPU ranks (gloo). Rough per-core peak: 2 FMA ports × 8 fp32 lanes × 2 FLOP × 2.5 GHz
# = 80 GFLOP/s (assumed), one core per rank. Everything here is a placeholder that the
# calibration command replaces.
CPU_CORE_FLOPS = 80e9
CPU = GPU(
    name="CPU",
    peak_flops={"fp32": CPU_CORE_FLOPS, "bf16": CPU_CORE_FLOPS},
    hbm_bytes=16e9, hbm_bw=20e9,  # DRAM share per rank (assumed)
    nvlink_bw=2e9, nic_bw=1.25e9,  # gloo over loopback / 10 GbE (assumed)
    mamf_eff=0.5,
    launch_s=10e-6,  # eager op dispatch (assumed)
    intra_alpha_s=30e-6, inter_alpha_s=100e-6,  # gloo (assumed)
    overlap_slowdown=1.1,
    # no DeepEP on CPU: the "auto" all-to-all algorithm is the plain (gloo) one
    ep_nvlink_bw=2e9, ep_nic_bw=1.25e9, ep_alpha_s=30e-6,
    gemm_by_shape=False,
    family="cpu",
    speed_spread=0.0,  # the ranks of a CPU run share one machine's cores
)

GPUS: dict[str, GPU] = {
    "a100": A100, "h100": H100, "h200": H200, "h800": H800,
    "b200": B200, "mi300x": MI300X, "cpu": CPU,
}


# Board power under training, W per GPU, keyed by GPU name (one table per fact; used by the
# energy model, costmodel.training_run). Vendor TDP / board power: A100 SXM 400 W (NVIDIA A100
# datasheet), H100 SXM 700 W (NVIDIA H100 datasheet; Llama 3 arXiv 2407.21783 §3.3.1 "700W TDP"),
# H200 SXM up to 700 W (NVIDIA H200 datasheet), B200 1000 W (HGX B200, shared/reference
# hardware-costs-traces.md §1), MI300X 750 W (AMD Instinct MI300X datasheet, peak board power).
# Sustained training draws at the limit: the MSMF runs (clock settled for minutes) draw ≈693 W on
# H200 and ≈994 W on B200 (stas00/ml-engineering fast-mamf, reference stacks-and-clocks.md §1), so
# the TDP is used, not a lower figure. H800: H100's board (inferred). CPU and custom GPUs: none.
TRAINING_POWER_W: dict[str, float] = {
    "A100-80G": 400.0, "H100": 700.0, "H200": 700.0, "H800": 700.0, "B200": 1000.0, "MI300X": 750.0,
}


def training_power_w(gpu: GPU) -> float | None:
    """W one GPU board draws under training (`TRAINING_POWER_W`), None when not sourced."""
    return TRAINING_POWER_W.get(gpu.name)


def get_gpu(name: str) -> GPU:
    """Look a preset up by short key ("h100") or full name ("A100-80G"), case-insensitive."""
    key = name.lower()
    for k, gpu in GPUS.items():
        if key in (k, gpu.name.lower()):
            return gpu
    raise ValueError(unknown_name("GPU", name, GPUS))


@dataclass(frozen=True)
class Fabric:
    """The scale-out network above the nodes' NICs, as a two-tier fat tree: pods of
    ``nodes_per_pod`` consecutive nodes under one non-blocking tier (a rail-optimised leaf
    group), and the share of its NIC bandwidth a collective gets once its group spans pods
    (``cross_pod_efficiency``). The default is one non-blocking tier (every node in one pod),
    what the presets' NCCL-measured ``nic_bw`` was measured on. Sourced values to set:
    ``1/r`` for a spine oversubscribed r:1 (the tier carries 1/r of the pods' NIC bandwidth);
    about 0.7 for ECMP hash collisions on RoCE (Baidu AIPod: "effective bandwidth around 70 Gbps
    on a 100 Gbps link", Baidu Intelligent Cloud, "How to eliminate network hash collisions in
    large-model training"; Meta, Gangidi et al. SIGCOMM'24 "RDMA over Ethernet for Distributed AI
    Training at Meta Scale": E-ECMP with QP scaling "up to 40%" faster AllReduce than baseline
    ECMP, 1/1.4 = 0.71); 1.0 with adaptive routing or packet spraying. Prices the NIC link of
    the collective formulas and point-to-point transfers (`costmodel.collectives.inter_link`);
    DeepEP's measured links (`GPU.ep_links`) are kept as measured."""

    nodes_per_pod: int = 0  # 0: one pod (a single non-blocking tier)
    cross_pod_efficiency: float = 1.0

    def __post_init__(self):
        if isinstance(self.nodes_per_pod, bool) or not isinstance(self.nodes_per_pod, int) or self.nodes_per_pod < 0:
            raise ValueError(f"fabric nodes_per_pod must be an integer >= 0 (0: one pod), got {self.nodes_per_pod!r}")
        e = self.cross_pod_efficiency
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 < e <= 1:
            raise ValueError(f"fabric cross_pod_efficiency must be in (0, 1] (1/r for an r:1 oversubscribed "
                             f"spine, ~0.7 under ECMP collisions), got {e!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "Fabric":
        if not isinstance(d, dict):
            raise ValueError(f"fabric must be a mapping of nodes_per_pod, cross_pod_efficiency, got {d!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError("fabric: " + unknown_names("field", unknown, sorted(names)))
        return cls(**d)


@dataclass(frozen=True)
class Cluster:
    """`nodes` identical nodes of `gpus_per_node` GPUs; rank r lives on node r // gpus_per_node.
    `moe`: how expert-parallel traffic and expert compute are priced (costmodel.moe); `fabric`:
    the network's tiers above the NICs (`Fabric`)."""

    gpu: GPU
    nodes: int
    gpus_per_node: int
    moe: MoEOptions = field(default_factory=MoEOptions)
    fabric: Fabric = field(default_factory=Fabric)

    def __post_init__(self):
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"cluster needs nodes >= 1 and gpus_per_node >= 1, got {self.nodes}x{self.gpus_per_node}")

    def crosses_pods(self, ranks) -> bool:
        """Whether a group of ``ranks`` spans two pods of the fabric (pods hold consecutive nodes)."""
        npp = self.fabric.nodes_per_pod
        if not npp or self.nodes <= npp:  # one pod: every collective formula asks, keep it cheap
            return False
        ranks = list(ranks)
        if not ranks:
            return False
        return self.node_of(min(ranks)) // npp != self.node_of(max(ranks)) // npp

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside cluster of {self.world_size} ranks")
        return rank // self.gpus_per_node

    def node_counts(self, ranks) -> Counter:
        """node -> how many of ``ranks`` it holds (the ranks range-checked as `node_of` does)."""
        ranks = list(ranks)
        if ranks:
            self.node_of(min(ranks)), self.node_of(max(ranks))  # range check
        return Counter(map(self.gpus_per_node.__rfloordiv__, ranks))  # r // gpus_per_node

    def same_node(self, ranks) -> bool:
        ranks = list(ranks)
        if not ranks:
            return True
        lo, hi = self.node_of(min(ranks)), self.node_of(max(ranks))  # range checked; nodes grow with ranks
        return lo == hi

    def to_dict(self) -> dict:
        """Plain dict with inline GPU fields; `parse_cluster` reads it back (YAML or JSON)."""
        out = {"gpu": dataclasses.asdict(self.gpu), "nodes": self.nodes, "gpus_per_node": self.gpus_per_node}
        if self.moe != MoEOptions():
            out["moe"] = dataclasses.asdict(self.moe)
        if self.fabric != Fabric():
            out["fabric"] = dataclasses.asdict(self.fabric)
        return out


SPEC_FORMS = (
    "a100|h100|h200|h800|b200|mi300x:NxG (N nodes of G GPUs), cpu:N (N local ranks), "
    "or a path to a .yaml/.yml/.json cluster file"
)
GPU_FIELDS = {f.name for f in dataclasses.fields(GPU)}
# the architectures `GPU.family` names (each selects its kernel measurements and FP8 recipes)
GPU_FAMILIES = ("ampere", "hopper", "blackwell", "cdna3", "cpu")


def parse_cluster(spec: str) -> Cluster:
    """`h100:4x8` -> 4 nodes × 8 H100; `cpu:4` -> 4 CPU ranks on one node; or a cluster file.

    A cluster file (YAML or JSON) holds `gpu` (a preset name, or a mapping of GPU fields,
    which starts from the preset named by its `name` when there is one), `nodes`,
    `gpus_per_node`, optionally any GPU field at top level as an override, e.g.
    `nic_bw: 25e9`, and `moe` (costmodel.moe.MoEOptions fields, e.g.
    `moe: {max_nodes_per_token: 4, fp8_dispatch: true, imbalance: 1.1}`), and `fabric`
    (`Fabric` fields, e.g. `fabric: {nodes_per_pod: 32, cross_pod_efficiency: 0.5}` for a 2:1
    oversubscribed spine above pods of 32 nodes).
    """
    spec = str(spec).strip()
    if spec.lower().endswith((".yaml", ".yml", ".json")) or os.path.isfile(spec):
        return _load_cluster_file(spec)
    bad = ValueError(f"bad cluster spec {spec!r}; accepted: {SPEC_FORMS}")
    key, _, shape = spec.lower().partition(":")
    if key not in GPUS or not shape:
        raise bad
    try:
        if key == "cpu":
            nodes, per_node = 1, int(shape)
        else:
            n, x, g = shape.partition("x")
            if not x:
                raise bad
            nodes, per_node = int(n), int(g)
        return Cluster(GPUS[key], nodes, per_node)
    except ValueError:
        raise bad from None


def _load_cluster_file(path: str) -> Cluster:
    if not os.path.isfile(path):
        raise ValueError(f"cluster file {path!r} not found; accepted: {SPEC_FORMS}")
    import yaml

    try:
        with open(path) as f:
            data = json.load(f) if path.lower().endswith(".json") else yaml.safe_load(f)
    except (ValueError, yaml.YAMLError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"cluster file {path!r} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: "
                         + " ".join(str(e).split())) from None
    if not isinstance(data, dict) or not {"gpu", "nodes", "gpus_per_node"} <= data.keys():
        raise ValueError(f"cluster file {path!r} needs keys gpu, nodes, gpus_per_node")
    unknown = set(data) - {"gpu", "nodes", "gpus_per_node", "moe", "fabric"} - GPU_FIELDS
    if unknown:
        raise ValueError(f"cluster file {path!r}: " + unknown_names(
            "key", unknown, ["gpu", "nodes", "gpus_per_node", "moe", "fabric", *sorted(GPU_FIELDS)]))
    overrides = {k: v for k, v in data.items() if k in GPU_FIELDS}
    gpu = _gpu_from(data["gpu"], overrides, path)
    try:
        moe = MoEOptions.from_dict(data.get("moe") or {})
    except ValueError as e:
        raise ValueError(f"cluster file {path!r}: {e}") from None
    try:
        fabric = Fabric.from_dict(data.get("fabric") or {})
    except (ValueError, TypeError) as e:
        raise ValueError(f"cluster file {path!r}: {e}") from None
    for key in ("nodes", "gpus_per_node"):
        if isinstance(data[key], bool) or not isinstance(data[key], int) or data[key] < 1:
            raise ValueError(f"cluster file {path!r}: {key} must be an integer >= 1 (got {data[key]!r})")
    return Cluster(gpu, data["nodes"], data["gpus_per_node"], moe, fabric)


def _gpu_from(entry, overrides: dict, path: str) -> GPU:
    fields = dict(entry) if isinstance(entry, dict) else {"name": str(entry)}
    fields.update(overrides)
    unknown = set(fields) - GPU_FIELDS
    if unknown:
        raise ValueError(f"cluster file {path!r}: {unknown_names('GPU field', unknown, sorted(GPU_FIELDS))}")
    try:
        base = get_gpu(fields.get("name", ""))
    except ValueError:
        if not isinstance(entry, dict):
            raise
        base = None
    if base is None:
        # family too: it picks the kernel tables, FP8 recipes and casts; a silent "hopper" default
        # would price a Blackwell GPU described in a file with Hopper's
        required = {f.name for f in dataclasses.fields(GPU) if f.default is dataclasses.MISSING} | {"family"}
        missing = required - set(fields)
        if missing:
            name = fields.get("name")
            raise ValueError(f"cluster file {path!r}: GPU {name!r} is no preset; missing fields {sorted(missing)}")
        gpu = GPU(**fields)
    else:
        gpu = dataclasses.replace(base, **fields)
    if gpu.family not in GPU_FAMILIES:
        raise ValueError(f"cluster file {path!r}: GPU {gpu.name!r} family {gpu.family!r} is unknown; "
                         f"choose one of {', '.join(GPU_FAMILIES)}")
    return dataclasses.replace(
        gpu,
        peak_flops={k: float(v) for k, v in gpu.peak_flops.items()},
        **{f: float(getattr(gpu, f)) for f in GPU_FIELDS - {"name", "peak_flops", "family"}},
    )
