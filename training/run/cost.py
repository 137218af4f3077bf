"""On the driver, after a run: its estimated cluster cost and GPU energy, when it runs on a cluster described by a
cluster config (tracking.cluster_config, or $TRAINING_CLUSTER_CONFIG, which cluster.yaml sets on
the head to the launcher's own copy of the config). Priced by cluster/cost.py."""

from __future__ import annotations

import os
from typing import Optional

from cluster.config import load_and_prepare
from cluster.cost import estimate_run, node_costs
from cluster.prices import load_price_table


def cluster_config_path(configured: Optional[str]) -> Optional[str]:
    path = configured or os.environ.get("TRAINING_CLUSTER_CONFIG")
    return os.path.expanduser(path) if path else None


def gpu_nodes(world_size: int, use_gpu: bool) -> int:
    """GPU worker nodes a run of `world_size` workers held. With GPUs, one node per worker: each
    worker holds one GPU (run/resources.py) and cluster.yaml's GPU types have one GPU each (a type
    with several would be over-counted). On CPUs none: only the head is priced, and CPU workers
    that the autoscaler placed on GPU nodes are not counted."""
    if world_size < 0:
        raise ValueError(f"world_size must be >= 0, got {world_size}")
    return world_size if use_gpu else 0


def estimate_cost_metrics(cluster_config: str, wall_s: float, gpu_nodes: int) -> dict[str, float]:
    """{cluster_cost_usd_estimate, cluster_gpu_energy_kwh_estimate} for a run of wall_s seconds on
    the head and gpu_nodes GPU nodes of that cluster, filled as the autoscaler prefers (spot first)."""

    _, config = load_and_prepare(cluster_config)
    costs, _ = node_costs(config, load_price_table())
    return estimate_run(costs, config["head_node_type"], wall_s / 3600.0, gpu_nodes).as_metrics()
