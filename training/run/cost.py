"""On the driver, after a run: its estimated cluster cost and GPU energy, when it runs on a cluster described by a
cluster config (tracking.cluster_config, or $TRAINING_CLUSTER_CONFIG, which cluster.yaml sets on
the head to the launcher's own copy of the config). Priced by cluster/cost.py."""

from __future__ import annotations

import os
from typing import Optional


def cluster_config_path(configured: Optional[str]) -> Optional[str]:
    path = configured or os.environ.get("TRAINING_CLUSTER_CONFIG")
    return os.path.expanduser(path) if path else None


def estimate_cost_metrics(cluster_config: str, wall_s: float, gpu_workers: int) -> dict[str, float]:
    """{cluster_cost_usd_estimate, cluster_gpu_energy_kwh_estimate} for a run of wall_s seconds on
    gpu_workers GPU nodes of that cluster."""
    from cluster.config import load_and_prepare
    from cluster.cost import estimate_run, node_costs
    from cluster.prices import load_price_table

    _, config = load_and_prepare(cluster_config)
    costs, _ = node_costs(config, load_price_table())
    return estimate_run(costs, config["head_node_type"], wall_s / 3600.0, gpu_workers).as_metrics()
