"""Runs on the laptop (validate): the vocabulary of a preflight report, the machine it runs on,
and the pieces of a cluster config the rules look at (its commands are read in cluster/shell.py,
its ports and addresses in cluster/network.py).

Rules are pure functions of the config (and of facts gathered elsewhere) that return
CheckResults; nothing here talks to Ray or AWS."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterable


class Status(str, Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    message: str

    def line(self) -> str:
        return f"{self.status.value.upper():4}  {self.name:24}  {self.message}"


def passed(name: str, message: str) -> CheckResult:
    return CheckResult(name, Status.PASS, message)


def warned(name: str, message: str) -> CheckResult:
    return CheckResult(name, Status.WARN, message)


def failed(name: str, message: str) -> CheckResult:
    return CheckResult(name, Status.FAIL, message)


def skipped(name: str, message: str) -> CheckResult:
    return CheckResult(name, Status.SKIP, message)


def any_failed(results: Iterable[CheckResult]) -> bool:
    return any(result.status is Status.FAIL for result in results)


def file_mode(path: Path) -> int | None:
    """Permission bits of a file on this machine, None when there is no such file."""
    try:
        return path.stat().st_mode & 0o777 if path.is_file() else None
    except OSError:
        return None


@dataclass(frozen=True)
class Laptop:
    """Facts about the machine validate runs on, the one that runs `ray up` and submits jobs:
    where `~` is, the repository the config lives in, and how to read a file's permission bits
    (None: no such file; tests pass a fake)."""
    home: Path
    repo_root: Path | None = None
    file_mode: Callable[[Path], int | None] = file_mode

    def path(self, local: str) -> Path:
        """A file_mounts source path here (`~` is home; relative: the directory `ray up` runs in)."""
        local = str(local)
        return (self.home / local[2:] if local.startswith("~/") else Path(local)).resolve()

    def in_repository(self, path: Path) -> bool:
        return self.repo_root is not None and path.is_relative_to(self.repo_root.resolve())

    def may_be_in_repository(self, local: str) -> bool:
        """Whether a file_mounts source could be a file of the repository: a relative one is read
        from wherever `ray up` runs, which the shipped configs say is the repository's root, so it
        is taken from there as well as from here (whether or not the file exists yet)."""
        local = str(local)
        relative = not (local.startswith("~") or Path(local).is_absolute())
        places = [self.path(local)] + ([(self.repo_root / local).resolve()] if relative and self.repo_root else [])
        return any(self.in_repository(place) for place in places)


# --- reading a prepared config ------------------------------------------------------------


def provider_type(config: dict[str, Any]) -> str:
    return config.get("provider", {}).get("type", "")


def worker_types(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    head = config.get("head_node_type")
    return {name: spec for name, spec in config.get("available_node_types", {}).items() if name != head}


def head_type(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("available_node_types", {}).get(config.get("head_node_type"), {})


def instance_type(node_type: dict[str, Any]) -> str | None:
    """The machine type: EC2's InstanceType, or the Azure ARM template's vmSize."""
    node = node_type.get("node_config") or {}
    return node.get("InstanceType") or (node.get("azure_arm_parameters") or {}).get("vmSize")


def is_spot(node_type: dict[str, Any]) -> bool:
    node = node_type.get("node_config") or {}
    market = node.get("InstanceMarketOptions") or {}
    azure_priority = (node.get("azure_arm_parameters") or {}).get("priority", "")
    return str(market.get("MarketType", "")).lower() == "spot" or str(azure_priority).lower() == "spot"


def declared_gpus(node_type: dict[str, Any], gpus_by_instance: dict[str, int]) -> int:
    """GPUs the node offers Ray: declared resources first, else what the instance type has
    (Ray autodetects it on AWS)."""
    resources = node_type.get("resources") or {}
    if "GPU" in resources:
        return int(resources["GPU"])
    return int(gpus_by_instance.get(instance_type(node_type) or "", 0))


def zones(config: dict[str, Any]) -> list[str]:
    value = config.get("provider", {}).get("availability_zone", "") or ""
    return [zone.strip() for zone in value.split(",") if zone.strip()]
