"""Cost before launch: $/hour per node type (on-demand vs spot), the cost of a run at a given size
and duration, and its GPU energy from rated power. Pure arithmetic over the price table; spot
prices may be refreshed from AWS spot price history (refresh_spot_prices)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Mapping

from cluster.aws_facts import current_spot_prices
from cluster.checks import declared_gpus, head_type, instance_type, is_spot, worker_types, zones
from cluster.prices import PriceTable


@dataclass(frozen=True)
class NodeCost:
    node_type: str
    instance_type: str
    spot: bool
    gpus: int
    gpu_model: str | None
    gpu_rated_watts: int
    on_demand_usd_per_hour: float
    spot_usd_per_hour: float
    max_workers: int
    priority: int

    @property
    def usd_per_hour(self) -> float:
        """What this node type pays: its market's price."""
        return self.spot_usd_per_hour if self.spot else self.on_demand_usd_per_hour


@dataclass(frozen=True)
class RunEstimate:
    hours: float
    workers: dict[str, int]          # GPU node type -> nodes, filled by priority (spot first)
    head_usd: float
    workers_usd: float
    on_demand_usd: float             # the same run with every node on-demand
    gpu_kwh: float
    unplaced_workers: int            # asked for more than all GPU types' max_workers

    @property
    def total_usd(self) -> float:
        return self.head_usd + self.workers_usd

    def as_metrics(self) -> dict[str, float]:
        """What a training run logs about its cluster (names carry the units)."""
        return {"cluster_cost_usd_estimate": round(self.total_usd, 4),
                "cluster_gpu_energy_kwh_estimate": round(self.gpu_kwh, 4)}


def node_costs(config: dict, table: PriceTable, spot_usd_per_hour: Mapping[str, float] | None = None
               ) -> tuple[list[NodeCost], list[str]]:
    """(priced node types, node types missing from the table), head first."""
    head_name = config["head_node_type"]
    named = {head_name: head_type(config), **worker_types(config)}
    priced, unknown = [], []
    for name, spec in named.items():
        price = table.get(instance_type(spec))
        if price is None:
            unknown.append(f"{name} ({instance_type(spec) or 'no InstanceType'})")
            continue
        priced.append(NodeCost(
            node_type=name, instance_type=price.instance_type, spot=is_spot(spec),
            gpus=declared_gpus(spec, table.gpus_by_instance()), gpu_model=price.gpu_model,
            gpu_rated_watts=price.gpu_rated_watts, on_demand_usd_per_hour=price.on_demand_usd_per_hour,
            spot_usd_per_hour=(spot_usd_per_hour or {}).get(price.instance_type, price.spot_usd_per_hour),
            max_workers=1 if name == head_name else int(spec.get("max_workers", 0)),
            priority=int(spec.get("priority", 0))))
    return priced, unknown


def gpu_types_by_preference(costs: list[NodeCost], head_name: str) -> list[NodeCost]:
    """GPU worker types in the order the cluster fills them: priority, then spot, then price."""
    gpu = [cost for cost in costs if cost.node_type != head_name and cost.gpus > 0]
    return sorted(gpu, key=lambda c: (-c.priority, not c.spot, c.usd_per_hour))


def estimate_run(costs: list[NodeCost], head_name: str, hours: float, workers: int | None = None) -> RunEstimate:
    """A run of `hours` on `workers` GPU nodes (default: the preferred type's max_workers)."""
    if hours < 0 or (workers is not None and workers < 0):
        raise ValueError("hours and workers must be >= 0")
    head = next(cost for cost in costs if cost.node_type == head_name)
    preferred = gpu_types_by_preference(costs, head_name)
    remaining = workers if workers is not None else (preferred[0].max_workers if preferred else 0)
    placed: dict[str, int] = {}
    for cost in preferred:
        take = min(remaining, cost.max_workers)
        if take:
            placed[cost.node_type] = take
            remaining -= take
    by_name = {cost.node_type: cost for cost in costs}
    workers_usd = sum(n * by_name[name].usd_per_hour * hours for name, n in placed.items())
    on_demand = sum(n * by_name[name].on_demand_usd_per_hour * hours for name, n in placed.items())
    gpu_watts = sum(n * by_name[name].gpus * by_name[name].gpu_rated_watts for name, n in placed.items())
    return RunEstimate(hours=hours, workers=placed, head_usd=head.usd_per_hour * hours, workers_usd=workers_usd,
                       on_demand_usd=head.on_demand_usd_per_hour * hours + on_demand,
                       gpu_kwh=gpu_watts * hours / 1000.0, unplaced_workers=remaining)


def refresh_spot_prices(config: dict, session: Any = None) -> dict[str, float]:
    """Current spot $/h per spot instance type: the median over the config's zones of each zone's
    latest Linux/UNIX price (boto3 describe_spot_price_history)."""
    import boto3  # (lazy: boto3)

    session = session or boto3.Session()
    ec2 = session.client("ec2", region_name=config["provider"]["region"])
    listed = set(zones(config))
    prices = {}
    for name in sorted({instance_type(s) for s in config["available_node_types"].values() if is_spot(s)}):
        latest = current_spot_prices(ec2, name, listed)
        if latest:
            prices[name] = statistics.median(latest.values())
    return prices
