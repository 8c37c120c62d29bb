"""costmodel: hardware catalog, compute/collective/memory models, calibration files.

Imports nothing else of piper-sim. Entry points: `parse_cluster`, `get_costmodel`.
"""

from costmodel.calibration import fit_alpha_beta, load_calibration, save_calibration
from costmodel.collectives import collective_time, link_bandwidth, links_used, moe_all_to_all_time, p2p_time
from costmodel.compute import compute_time, efficiency
from costmodel.hardware import GPU, GPUS, Cluster, get_gpu, parse_cluster
from costmodel.memory import bucket_sizes, comm_buffer_bytes, dp_collectives, fits, model_state_bytes
from costmodel.model import AnalyticCostModel, CostModel, UnitCostModel, get_costmodel
from costmodel.moe import MoEOptions, Routing

__all__ = [
    "GPU", "GPUS", "Cluster", "get_gpu", "parse_cluster",
    "compute_time", "efficiency",
    "collective_time", "p2p_time", "links_used", "link_bandwidth", "moe_all_to_all_time", "MoEOptions", "Routing",
    "model_state_bytes", "dp_collectives", "bucket_sizes", "comm_buffer_bytes", "fits",
    "fit_alpha_beta", "load_calibration", "save_calibration",
    "CostModel", "AnalyticCostModel", "UnitCostModel", "get_costmodel",
]
