"""The dated price table shipped in cluster/prices.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PRICE_TABLE_FILE = Path(__file__).with_name("prices.json")


@dataclass(frozen=True)
class InstancePrice:
    instance_type: str
    vcpus: int
    gpus: int
    gpu_model: str | None
    gpu_rated_watts: int
    on_demand_usd_per_hour: float
    spot_usd_per_hour: float


@dataclass(frozen=True)
class PriceTable:
    as_of: str
    regions: tuple[str, ...]
    instances: dict[str, InstancePrice]

    def get(self, instance_type: str | None) -> InstancePrice | None:
        return self.instances.get(instance_type or "")

    def gpus_by_instance(self) -> dict[str, int]:
        return {name: price.gpus for name, price in self.instances.items()}


def load_price_table(path: str | Path = PRICE_TABLE_FILE) -> PriceTable:
    data = json.loads(Path(path).read_text())
    instances = {
        name: InstancePrice(
            instance_type=name,
            vcpus=int(row["vcpus"]),
            gpus=int(row["gpus"]),
            gpu_model=row.get("gpu_model"),
            gpu_rated_watts=int(row["gpu_rated_watts"]),
            on_demand_usd_per_hour=float(row["on_demand_usd_per_hour"]),
            spot_usd_per_hour=float(row["spot_usd_per_hour"]),
        )
        for name, row in data["instance_types"].items()
    }
    return PriceTable(as_of=data["as_of"], regions=tuple(data.get("regions", ())), instances=instances)
