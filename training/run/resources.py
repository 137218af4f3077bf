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
class NodeGroup:
    resources: dict[str, float]  # one node's logical resources
    count: float                 # nodes of this shape (math.inf: the autoscaler sets no bound)


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
    groups = maximum_node_groups()
    return None if groups is None else summed(groups)


def maximum_node_groups() -> Optional[list[NodeGroup]]:
    """The nodes of the cluster at its largest, by shape (see maximum_resources), or None."""
    path = os.environ.get("TRAINING_CLUSTER_CONFIG")
    if not path:
        return None

    try:
        config = load_cluster_yaml(os.path.expanduser(path))
    except ConfigError as exc:
        raise UserError(f"$TRAINING_CLUSTER_CONFIG: {exc}") from None
    return launcher_node_groups(config)


def launcher_maximum(config: dict[str, Any]) -> dict[str, float]:
    return summed(launcher_node_groups(config))


def launcher_node_groups(config: dict[str, Any]) -> list[NodeGroup]:
    types = config.get("available_node_types") or {}
    head_type = config.get("head_node_type")
    groups = [NodeGroup(_floats((types.get(head_type) or {}).get("resources") or {}), 1)]
    room = config.get("max_workers", math.inf)
    # The autoscaler prefers higher-priority types; fill the cluster's worker cap in that order.
    workers = sorted(((name, spec) for name, spec in types.items() if name != head_type),
                     key=lambda item: -float((item[1] or {}).get("priority", 0)))
    for _, spec in workers:
        spec = spec or {}
        count = min(int(spec.get("max_workers", 0)), room)
        room -= count
        groups.append(NodeGroup(_floats(spec.get("resources") or {}), count))
    return groups


def summed(groups: list[NodeGroup]) -> dict[str, float]:
    total: dict[str, float] = {}
    for group in groups:
        for key, value in group.resources.items():
            total[key] = total.get(key, 0.0) + value * group.count
    return total


def within(need: dict[str, float], resources: dict[str, float]) -> bool:
    return all(resources.get(k, 0.0) + 1e-9 >= v for k, v in need.items())


def describe(resources: dict) -> str:
    """`CPU 4, GPU 1`: the resources a person reads (see shown_keys)."""
    return ", ".join(f"{k} {resources[k]:g}" for k in sorted(shown_keys(resources)))


def shown_keys(resources: dict) -> list[str]:
    """CPUs, GPUs and custom resources; not Ray's own (node ids, memory, object store, accelerator types)."""
    return [k for k in resources if k in ("CPU", "GPU") or not k.startswith(
        ("node:", "memory", "object_store", "accelerator"))]


def use_gpus(now: dict[str, float], maximum: Optional[dict[str, float]]) -> bool:
    """`scaling.use_gpu: auto`: GPUs if the cluster has any now or can be grown to have some."""
    return now.get("GPU", 0) > 0 or bool(maximum and maximum.get("GPU", 0) > 0)


def _floats(resources: dict) -> dict[str, float]:
    return {key: float(value) for key, value in resources.items()}
