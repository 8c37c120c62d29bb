"""The cost-model interface a simulator uses, and its implementations.

Times are seconds, sizes bytes. `get_costmodel` picks an implementation by name:
  "analytic"            roofline compute + alpha-beta collectives on the cluster (default)
  "unit:F=1,BI=1,..."   constant times per op kind, for schedule tests and bubble counting
  path/to/calib.json    analytic, with the measured parameters of a calibration file
                        (schema in costmodel.calibration)
"""

from __future__ import annotations

import dataclasses
import math
import os

from costmodel import collectives as coll
from costmodel import compute, operators
from costmodel.calibration import fit_time, load_calibration
from costmodel.hardware import CPU, GPU_FIELDS, Cluster
from costmodel.moe import MoEOptions, Routing

# the compute kinds of piper_sim.plan (costmodel imports nothing of ours; tests/test_seams.py checks they agree)
COMPUTE_KINDS = ("F", "B", "BI", "BW", "OPT")


class CostModel:
    """Base class. `comm_compute_slowdown` (>= 1) multiplies compute time while a comm
    kernel runs on the same device; `comm_overlap_slowdown` (>= 1) multiplies comm time
    while its rank computes. `host_bound`: compute runs on the thread that also posts
    communication (a CPU rank), so a comm op is posted only between compute ops, and
    `post_time` of it delays the next one; on an accelerator the host only launches."""

    name: str = "costmodel"
    comm_compute_slowdown: float = 1.0
    comm_overlap_slowdown: float = 1.0
    host_bound: bool = False

    def post_time(self, kind: str, nbytes: float) -> float:
        """Host seconds the call that posts an async comm op takes (a collective kind,
        SEND or RECV); 0 unless measured (a calibration's "post")."""
        return 0.0

    def compute_time(self, kind: str, flops: float, mem_bytes: float = 0.0,
                     gemm: tuple[int, int, int] | None = None) -> float:
        raise NotImplementedError

    def kernels_time(self, rows) -> float | None:
        """Seconds for an operator-level table (``costmodel.operators``); None when this
        model prices whole ops only (the simulator then uses :meth:`compute_time`)."""
        return None

    def collective_time(self, kind: str, nbytes: float, ranks: list[int]) -> float:
        raise NotImplementedError

    def all_to_all_time(self, nbytes: float, ranks: list[int], direction: str = "dispatch",
                        routing: Routing | None = None) -> float:
        """An expert-parallel dispatch or combine (costmodel.moe); by default a plain ALL_TO_ALL."""
        return self.collective_time("ALL_TO_ALL", nbytes, ranks)

    @property
    def expert_load_factor(self) -> float:
        """Expert compute on the most loaded EP rank over the mean (costmodel.moe)."""
        return 1.0

    def p2p_time(self, nbytes: float, src: int, dst: int) -> float:
        raise NotImplementedError

    def links(self, kind: str, ranks) -> list[str]:
        """Link ids the op occupies (for SEND/RECV `ranks` is (src, dst)); [] = no sharing."""
        return []

    def link_bandwidth(self, link_id: str) -> float:
        return math.inf

    def collective_ports(self, kind: str, ranks) -> list[str] | None:
        """The ports every member of a collective occupies (its links are
        ``{port}:rank{r}:{tx|rx}`` for each member ``r``), or None when `links` says it another way."""
        return None

    def optimizer_time(self, param_count: float) -> float:
        raise NotImplementedError


class AnalyticCostModel(CostModel):
    """Roofline compute and alpha-beta comm on `cluster` (costmodel.compute, .collectives).

    `overrides` may hold any GPU field (e.g. {"nic_bw": 25e9}; "peak_flops" may be one
    number for `dtype`), "dtype" (default "bf16"), "algorithm" (collective algorithm,
    default "auto"), "comm_compute_slowdown", "moe" (costmodel.moe.MoEOptions fields, over
    the cluster's, e.g. {"moe": {"imbalance": 1.1, "fp8_dispatch": True}}), and the
    calibration keys "efficiency_table", "collectives", "p2p", "post", "overlap_slowdown",
    "comm_overlap_slowdown".
    """

    KEYS = GPU_FIELDS | {"dtype", "gemm_dtype", "algorithm", "comm_compute_slowdown", "efficiency_table", "collectives",
                         "p2p", "post", "compute_slots", "moe", "memory_bw_table"}

    def __init__(self, cluster: Cluster, overrides: dict | None = None, name: str = "analytic",
                 dtype: str | None = None):
        ov = dict(overrides or {})
        unknown = set(ov) - self.KEYS
        if unknown:
            raise ValueError(f"unknown cost-model overrides {sorted(unknown)}; known: {sorted(self.KEYS)}")
        self.name = name
        # one dtype knob: the plan's (``dtype``, when the device has a peak for it), else the
        # calibration's, else bf16
        file_dtype = ov.pop("dtype", "bf16")
        self.dtype = dtype if dtype in cluster.gpu.peak_flops else file_dtype
        # dtype GEMMs run in when it differs from the model's (e.g. "fp8": DeepSeek-V3's FP8 GEMMs)
        self.gemm_dtype = ov.pop("gemm_dtype", None)
        # ranks that can compute at full speed at once on a node: a CPU's cores are shared
        # by its ranks (None: one accelerator per rank)
        default_slots = (os.cpu_count() or 1) if cluster.gpu.name == CPU.name else None
        self.compute_slots = ov.pop("compute_slots", default_slots)
        self.algorithm = ov.pop("algorithm", "auto")
        self.table = None
        self.mem_bw = operators.BandwidthTable(ov.pop("memory_bw_table")) if "memory_bw_table" in ov else None
        if "efficiency_table" in ov:
            self.table = compute.EfficiencyTable.from_rows(ov.pop("efficiency_table"))
            ov.setdefault("mamf_eff", max(e for _, e in self.table.points))
        if "comm_compute_slowdown" in ov:
            ov["overlap_slowdown"] = ov.pop("comm_compute_slowdown")
        self.collective_fits = {k: {int(n): f for n, f in v.items()} for k, v in ov.pop("collectives", {}).items()}
        self.post_fits = dict(ov.pop("post", None) or {})
        p2p = ov.pop("p2p", None)
        self.p2p_fits = {"intra": p2p, "inter": p2p} if p2p and "alpha_s" in p2p else dict(p2p or {})
        gpu = cluster.gpu
        if not isinstance(ov.get("peak_flops", {}), dict):
            ov["peak_flops"] = {**gpu.peak_flops, self.dtype: float(ov["peak_flops"])}
        moe = ov.pop("moe", None)
        if moe is not None:
            if not isinstance(moe, (dict, MoEOptions)):
                raise ValueError(f"cost-model override moe must be a mapping of MoE options, got {moe!r}")
            moe = MoEOptions.from_dict(moe if isinstance(moe, MoEOptions) else
                                       {**dataclasses.asdict(cluster.moe), **moe})
            cluster = dataclasses.replace(cluster, moe=moe)
        self.cluster = dataclasses.replace(cluster, gpu=dataclasses.replace(gpu, **ov))
        self.moe = self.cluster.moe
        self.gpu = self.cluster.gpu
        self.gpu.peak(self.dtype)  # fail early on a dtype the device lacks
        if self.comm_compute_slowdown < 1:
            raise ValueError(f"comm_compute_slowdown must be >= 1, got {self.comm_compute_slowdown}")
        if self.comm_overlap_slowdown < 1:
            raise ValueError(f"comm_overlap_slowdown must be >= 1, got {self.comm_overlap_slowdown}")

    @property
    def comm_compute_slowdown(self) -> float:
        return self.gpu.overlap_slowdown

    @property
    def host_bound(self) -> bool:
        return self.gpu.name == CPU.name

    def post_time(self, kind, nbytes):
        fit = self.post_fits.get(kind)
        return fit_time(fit, nbytes) if fit else 0.0

    @property
    def comm_overlap_slowdown(self) -> float:
        return self.gpu.comm_overlap_slowdown

    def compute_time(self, kind, flops, mem_bytes=0.0, gemm=None):
        if kind == "OPT":
            return compute.optimizer_step_time(self.gpu, flops, mem_bytes)
        return compute.compute_time(self.gpu, flops, mem_bytes, gemm, self.dtype, self.table)

    def kernels_time(self, rows):
        return operators.table_time(self.gpu, rows, gemm_dtype=self.gemm_dtype, gemm_table=self.table,
                                    mem_bw=self.mem_bw)

    def collective_time(self, kind, nbytes, ranks):
        fits = self.collective_fits.get(kind)
        if not fits:  # the formulas (they sort the group themselves)
            return coll.collective_time(kind, nbytes, ranks, self.cluster, self.algorithm)
        group = sorted(set(ranks))
        if len(group) <= 1:
            return coll.collective_time(kind, nbytes, group, self.cluster, self.algorithm)
        for r in group:
            self.cluster.node_of(r)
        n = len(group)
        m = min(fits, key=lambda s: (abs(math.log(s / n)), s))  # nearest fitted group size
        measured = fit_time(fits[m], nbytes)
        if m == n:
            return measured
        alpha = fits[m]["alpha_s"] * coll.ring_steps(kind, n) / coll.ring_steps(kind, m)
        bw = fits[m]["bw_Bps"] * coll.busbw_factor(kind, m) / coll.busbw_factor(kind, n)
        # the group-size scaling of the alpha-beta line, applied to the measured time
        line_m = fits[m]["alpha_s"] + nbytes / fits[m]["bw_Bps"]
        return measured * (alpha + nbytes / bw) / line_m if line_m > 0 else alpha + nbytes / bw

    def all_to_all_time(self, nbytes, ranks, direction="dispatch", routing=None):
        if coll.a2a_algorithm(self.moe, self.cluster) == "nccl":
            group = sorted(set(ranks))
            return self.collective_time("ALL_TO_ALL", nbytes * coll.a2a_bytes_factor(direction, self.moe), group)
        return coll.moe_all_to_all_time(nbytes, ranks, self.cluster, direction, routing, self.moe, self.algorithm)

    @property
    def expert_load_factor(self) -> float:
        return self.moe.load_factor()

    def p2p_time(self, nbytes, src, dst):
        fit = self.p2p_fits.get("intra" if self.cluster.same_node((src, dst)) else "inter")
        if fit is None or src == dst:
            return coll.p2p_time(nbytes, src, dst, self.cluster)
        return fit_time(fit, nbytes)

    def links(self, kind, ranks):
        return coll.links_used(kind, ranks, self.cluster)

    def collective_ports(self, kind, ranks):
        return coll.ports_used(kind, ranks, self.cluster)

    def link_bandwidth(self, link_id):
        return coll.link_bandwidth(link_id, self.cluster)

    def optimizer_time(self, param_count):
        return compute.optimizer_time(self.gpu, param_count)


class UnitCostModel(CostModel):
    """Constant times: F, BI, BW, B (default BI+BW), OPT (default 0) per compute op; `comm`
    per collective; `p2p` per send/recv (default `comm`); `slowdown` of compute while comm
    runs; `commslowdown` of comm while its rank computes; `post` host time to post each comm
    op; `host=1`: compute holds the host (`CostModel.host_bound`)."""

    UNIT_FORMS = "unit[:F=1,BI=1,BW=1,B=2,OPT=0,comm=0,p2p=0,slowdown=1,commslowdown=1,post=0,host=0]"
    EXTRA = ("comm", "p2p", "slowdown", "commslowdown", "post", "host")

    def __init__(self, F=1.0, BI=1.0, BW=1.0, B=None, OPT=0.0, comm=0.0, p2p=None, slowdown=1.0,
                 commslowdown=1.0, post=0.0, host=0.0):
        self.times = {"F": F, "BI": BI, "BW": BW, "B": BI + BW if B is None else B, "OPT": OPT}
        self.comm = comm
        self.p2p = comm if p2p is None else p2p
        self.comm_compute_slowdown = slowdown
        self.comm_overlap_slowdown = commslowdown
        self.post = post
        self.host_bound = bool(host)
        if min(*self.times.values(), self.comm, self.p2p, post) < 0 or min(slowdown, commslowdown) < 1 \
                or host not in (0, 1):
            raise ValueError("unit cost model needs times >= 0, slowdown, commslowdown >= 1 and host 0 or 1")
        items = [*self.times.items(), ("comm", comm), ("p2p", self.p2p), ("slowdown", slowdown)]
        items += [(k, v) for k, v in (("commslowdown", commslowdown), ("post", post), ("host", host))
                  if v != (1 if k == "commslowdown" else 0)]
        self.name = "unit:" + ",".join(f"{k}={v:g}" for k, v in items)

    @classmethod
    def parse(cls, spec: str) -> "UnitCostModel":
        head, _, body = spec.partition(":")
        if head.strip().lower() != "unit":
            raise ValueError(f"bad unit cost model {spec!r}; expected {cls.UNIT_FORMS}")
        kwargs = {}
        for item in filter(None, (s.strip() for s in body.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip()
            key = key.upper() if key.upper() in COMPUTE_KINDS else key.lower()
            if not eq or key not in COMPUTE_KINDS + cls.EXTRA:
                raise ValueError(f"bad unit cost model {spec!r} at {item!r}; expected {cls.UNIT_FORMS}")
            try:
                kwargs[key] = float(value)
                if not math.isfinite(kwargs[key]):
                    raise ValueError
            except ValueError:
                msg = f"bad unit cost model {spec!r}: {key} must be a finite number, got {value.strip()!r}"
                raise ValueError(msg) from None
        return cls(**kwargs)

    def compute_time(self, kind, flops=0.0, mem_bytes=0.0, gemm=None):
        if kind not in self.times:
            raise ValueError(f"unit cost model has no compute kind {kind!r}; known: {', '.join(self.times)}")
        return self.times[kind]

    def collective_time(self, kind, nbytes, ranks):
        return self.comm if len(set(ranks)) > 1 else 0.0

    def p2p_time(self, nbytes, src, dst):
        return self.p2p if src != dst else 0.0

    def post_time(self, kind, nbytes):
        return self.post

    def optimizer_time(self, param_count):
        return self.times["OPT"]


COSTMODEL_FORMS = "'analytic', 'unit:F=1,BI=1,BW=1,comm=0', or a calibration .json path"


def get_costmodel(name_or_file: str | CostModel | None = "analytic", cluster: Cluster | None = None,
                  dtype: str | None = None) -> CostModel:
    """Build a cost model from its name (see module docstring); ``dtype``: the plan's, which
    prices compute and sets the peak MFU is measured against."""
    if isinstance(name_or_file, CostModel):
        return name_or_file
    spec = (name_or_file or "analytic").strip()
    if spec.lower().startswith("unit"):
        return UnitCostModel.parse(spec)
    is_file = spec.lower().endswith(".json") or os.path.isfile(spec)
    if spec.lower() != "analytic" and not is_file:
        raise ValueError(f"unknown cost model {spec!r}; expected {COSTMODEL_FORMS}")
    if cluster is None:
        raise ValueError(f"cost model {spec!r} needs a cluster")
    if not is_file:
        return AnalyticCostModel(cluster, dtype=dtype)
    data = load_calibration(spec)
    overrides = {k: v for k, v in data.items() if k not in ("kind", "device", "meta")}
    meta = data.get("meta", {})
    cores = meta.get("machine", {}).get("cores")
    if cores and meta.get("machine", {}).get("device") == "cpu":
        overrides.setdefault("compute_slots", max(1, cores // int(meta.get("threads_per_rank", 1))))
    return AnalyticCostModel(cluster, overrides, name=f"calibration:{spec}", dtype=dtype)
