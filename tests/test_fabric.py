"""The cluster's fabric (costmodel.hardware.Fabric): pods of nodes under one non-blocking tier,
and a collective or transfer spanning pods at the fabric's cross-pod efficiency."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from costmodel.collectives import collective_time, p2p_time
from costmodel.hardware import Fabric, parse_cluster
from piper_sim.api import compile
from piper_sim.simulator import simulate


def _cluster_file(tmp_path, **fabric):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"gpu": "h100", "nodes": 8, "gpus_per_node": 8, **({"fabric": fabric} if fabric else {})}))
    return str(path)


def test_a_group_inside_a_pod_is_priced_as_before_and_across_pods_at_the_efficiency(tmp_path):
    flat = parse_cluster("h100:8x8")
    tiered = parse_cluster(_cluster_file(tmp_path, nodes_per_pod=4, cross_pod_efficiency=0.5))
    round_trip = tmp_path / "round_trip.json"
    round_trip.write_text(json.dumps(tiered.to_dict()))
    assert parse_cluster(str(round_trip)) == tiered
    inside, across = list(range(0, 32, 8)), list(range(0, 64, 8))  # 4 nodes of one pod; 8 nodes, two pods
    big = 4 * 2**30
    for kind in ("ALLREDUCE", "REDUCE_SCATTER", "ALL_GATHER"):
        assert collective_time(kind, big, inside, tiered) == collective_time(kind, big, inside, flat)
        slow, fast = collective_time(kind, big, across, tiered), collective_time(kind, big, across, flat)
        assert 1.9 < slow / fast <= 2.0  # NIC-bound: the bandwidth term doubles, the latency does not
    assert p2p_time(big, 0, 24, tiered) == p2p_time(big, 0, 24, flat)
    assert p2p_time(big, 0, 32, tiered) > 1.9 * p2p_time(big, 0, 32, flat)
    one_pod = parse_cluster(_cluster_file(tmp_path, nodes_per_pod=8, cross_pod_efficiency=0.5))
    assert collective_time("ALLREDUCE", big, across, one_pod) == collective_time("ALLREDUCE", big, across, flat)


def test_fsdp_over_pods_of_an_oversubscribed_fabric_is_slower(tmp_path):
    def step(cluster: str) -> float:
        return simulate(compile({"model": "llama3-8b", "cluster": cluster, "global_batch": 64, "seq_len": 4096,
                                 "microbatches": 1, "directives": [{"op": "data_parallel", "degree": 64,
                                                                     "zero": 3}]})).step_time_s

    flat = step(_cluster_file(tmp_path))
    assert step(_cluster_file(tmp_path, nodes_per_pod=8, cross_pod_efficiency=0.5)) == flat
    assert step(_cluster_file(tmp_path, nodes_per_pod=2, cross_pod_efficiency=0.25)) > flat


@pytest.mark.parametrize("fabric,needle", [({"nodes_per_pod": -1}, "nodes_per_pod must be an integer >= 0"),
                                           ({"cross_pod_efficiency": 1.5}, "cross_pod_efficiency must be in (0, 1]"),
                                           ({"pods": 2}, "fabric: unknown field(s) pods")])
def test_bad_fabric_is_a_one_line_error(tmp_path, fabric, needle):
    path = _cluster_file(tmp_path, **fabric)
    with pytest.raises(ValueError) as e:
        parse_cluster(path)
    assert needle in str(e.value) and "\n" not in str(e.value)
    strategy = tmp_path / "s.json"
    strategy.write_text(json.dumps({"model": "gpt-tiny", "cluster": path, "global_batch": 8, "seq_len": 32,
                                    "directives": [{"op": "data_parallel", "degree": 64}]}))
    r = subprocess.run([sys.executable, "-m", "piper_sim", "compile", str(strategy), "-o", str(tmp_path / "p.json")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr
    assert Fabric() == Fabric(0, 1.0)
