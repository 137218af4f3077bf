"""Whether a run's worker group can be placed, decided on the driver once Ray is up and before the
run starts (pure: the driver reads the cluster and executes the decision).

A group that does not fit the cluster now either waits for the autoscaler to add nodes, or, when
the cluster cannot grow to hold it, is refused (exit 2) with what the run asks for and what the
cluster has. Where nothing says how far the cluster grows (a cluster joined by address, without
$TRAINING_CLUSTER_CONFIG and without a config the autoscaler published in Ray's GCS), the run waits:
Ray's autoscaler sees the group's placement group as pending demand, and failure.placement_timeout_s
bounds the wait.

Each worker is one bundle of Ray Train's placement group, placed whole on one node: a group fits
when the nodes hold `scaling.min_workers` bundles between them (an elastic run starts with that many
and grows), not when the totals do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from training.config import ScalingConfig
from training.run.resources import NodeGroup, shown_keys, summed

WAIT_SAY_EVERY_S = 30.0


@dataclass(frozen=True)
class PlacementDecision:
    action: str                   # start | wait | refuse
    message: Optional[str] = None  # refuse: the error; wait: what the run waits for


def bundles_that_fit(per_worker: dict[str, float], groups: list[NodeGroup]) -> float:
    """How many workers the nodes hold, each whole on one node."""
    total = 0.0
    for group in groups:
        each = min((math.floor(group.resources.get(k, 0.0) / v + 1e-9) for k, v in per_worker.items() if v > 0),
                   default=math.inf)
        if each > 0 and group.count > 0:
            total += each * group.count
    return total


def decide_placement(scaling: ScalingConfig, per_worker: dict[str, float], nodes_now: list[dict[str, float]],
                     largest: Optional[list[NodeGroup]], local_only: bool) -> PlacementDecision:
    """`nodes_now`: each live node's resources; `largest`: the cluster at the largest its autoscaler
    makes it, where known; `local_only`: a Ray of this machine alone, started by this driver (no
    autoscaler can grow it)."""
    need = scaling.min_workers
    if bundles_that_fit(per_worker, [NodeGroup(node, 1) for node in nodes_now]) >= need:
        return PlacementDecision("start")
    asks = asked(scaling, per_worker)
    has = f"the cluster has {cluster_line(nodes_now)}"
    fix = ("lower scaling.num_workers or what each worker holds (scaling.cpus_per_worker, scaling.use_gpu, "
           "scaling.resources_per_worker), or run on a larger cluster")
    if local_only:
        return PlacementDecision("refuse", f"{asks}; {has} and no autoscaler (a local Ray of this machine): {fix}")
    if largest is not None:
        grows = f"its autoscaler grows it to at most {_groups_line(largest)}"
        if bundles_that_fit(per_worker, largest) < need:
            return PlacementDecision("refuse", f"{asks}; {has} now and {grows}: {fix}")
        return PlacementDecision("wait", f"{asks}; {has} now and {grows}")
    return PlacementDecision("wait", f"{asks}; {has} now")


def asked(scaling: ScalingConfig, per_worker: dict[str, float]) -> str:
    need = scaling.min_workers
    total = {k: v * need for k, v in per_worker.items()}
    least = " (its minimum: an elastic run starts with it)" if scaling.min_workers < scaling.max_workers else ""
    value = scaling.num_workers if isinstance(scaling.num_workers, int) else list(scaling.num_workers)
    return f"scaling.num_workers {value}: the run asks for {need} workers{least} x {amounts(per_worker)} each " \
           f"({amounts(total)})"


def cluster_line(nodes: list[dict[str, float]]) -> str:
    total = summed([NodeGroup(node, 1) for node in nodes])
    if not nodes:
        return "no live node"
    largest = max(nodes, key=lambda node: (node.get("GPU", 0.0), node.get("CPU", 0.0)))
    return f"{amounts(total)} in {len(nodes)} node(s), its largest node {amounts(largest)}"


def _groups_line(groups: list[NodeGroup]) -> str:
    if any(math.isinf(g.count) for g in groups if g.count > 0):
        return "any number of " + ", ".join(f"nodes of {amounts(g.resources)}" for g in groups if math.isinf(g.count))
    total = summed(groups)
    largest = max((g.resources for g in groups if g.count > 0),
                  key=lambda node: (node.get("GPU", 0.0), node.get("CPU", 0.0)), default={})
    return f"{amounts(total)}, its largest node {amounts(largest)}"


def amounts(resources: dict[str, float]) -> str:
    """`4 CPU, 1 GPU`: the resources a person reads (resources.shown_keys), CPUs and GPUs first."""
    shown = shown_keys(resources)
    keys = [k for k in ("CPU", "GPU") if k in shown] + sorted(k for k in shown if k not in ("CPU", "GPU"))
    return ", ".join(f"{resources[k]:g} {k}" for k in keys) or "nothing"


@dataclass(frozen=True)
class WaitDecision:
    say: Optional[str]  # a line for the console now
    done: bool          # the group fits now: the wait is Ray's placement, no longer the autoscaler's


def decide_wait(message: str, waiting_since_s: float, last_said_s: Optional[float], now_s: float,
                fits_now: bool, every_s: float = WAIT_SAY_EVERY_S) -> WaitDecision:
    """While a group waits for nodes: a line at once and every `every_s` after, with how long it
    has waited and the pending demand (`message`); none once it fits."""
    if fits_now:
        return WaitDecision(None, True)
    if last_said_s is not None and now_s - last_said_s < every_s:
        return WaitDecision(None, False)
    return WaitDecision(f"waiting for the autoscaler to add nodes ({now_s - waiting_since_s:.0f} s so far): "
                        f"{message}", False)
