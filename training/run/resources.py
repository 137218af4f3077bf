"""What a run's workers hold, and how large the Ray cluster can grow (from the cluster launcher's
config), resolved on the driver for training runs and sweeps alike.

An autoscaling cluster starts small (cluster.yaml: GPU workers from zero), so what Ray reports now
is not what a job may use. On a cluster started by `ray up cluster.yaml` the head holds the
launcher's copy of the config and `$TRAINING_CLUSTER_CONFIG` names it; the largest cluster is the
head plus every worker type at its `max_workers`, within the cluster's own `max_workers`. Without
a config (a laptop, a cluster of fixed machines) the cluster is what Ray reports now.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from cluster.config import ConfigError, load_cluster_yaml
from training.config import ScalingConfig
from training.errors import UserError


@dataclass(frozen=True)
class WorkerResources:
    use_gpu: bool                   # `scaling.use_gpu`, with `auto` resolved for this cluster
    per_worker: dict[str, float]    # what one training worker holds (Ray Train's resources_per_worker)


def worker_resources(scaling: ScalingConfig, cluster_now: dict[str, float],
                     largest: Optional[dict[str, float]]) -> WorkerResources:
    """The one rule for what a worker holds: a run places its workers with it, and a sweep counts
    how many trials fit with it, so the two cannot disagree."""
    use_gpu = use_gpus(cluster_now, largest) if scaling.use_gpu == "auto" else scaling.use_gpu
    per_worker = {"CPU": scaling.cpus_per_worker, **scaling.resources_per_worker, **({"GPU": 1.0} if use_gpu else {})}
    return WorkerResources(use_gpu, per_worker)


def maximum_resources() -> Optional[dict[str, float]]:
    """The logical resources of the cluster this driver runs on at its largest, from
    `$TRAINING_CLUSTER_CONFIG` (only the head's environment says which cluster it is: a job's
    `tracking.cluster_config` prices a run, it does not move it), or None without one. Node types
    whose resources the config leaves to autodetection are not counted (they are unknown here)."""
    path = os.environ.get("TRAINING_CLUSTER_CONFIG")
    if not path:
        return None

    try:
        config = load_cluster_yaml(os.path.expanduser(path))
    except ConfigError as exc:
        raise UserError(f"$TRAINING_CLUSTER_CONFIG: {exc}") from None
    return launcher_maximum(config)


def launcher_maximum(config: dict[str, Any]) -> dict[str, float]:
    types = config.get("available_node_types") or {}
    head_type = config.get("head_node_type")
    total: dict[str, float] = {}
    _add(total, (types.get(head_type) or {}).get("resources") or {}, 1)
    room = config.get("max_workers", math.inf)
    # The autoscaler prefers higher-priority types; fill the cluster's worker cap in that order.
    workers = sorted(((name, spec) for name, spec in types.items() if name != head_type),
                     key=lambda item: -float((item[1] or {}).get("priority", 0)))
    for _, spec in workers:
        spec = spec or {}
        count = min(int(spec.get("max_workers", 0)), room)
        room -= count
        _add(total, spec.get("resources") or {}, count)
    return total


def use_gpus(now: dict[str, float], maximum: Optional[dict[str, float]]) -> bool:
    """`scaling.use_gpu: auto`: GPUs if the cluster has any now or can be grown to have some."""
    return now.get("GPU", 0) > 0 or bool(maximum and maximum.get("GPU", 0) > 0)


def _add(total: dict[str, float], resources: dict, count: int) -> None:
    for key, value in resources.items():
        total[key] = total.get(key, 0.0) + float(value) * count
