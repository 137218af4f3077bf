"""The vocabulary of a preflight report, and the pieces of a cluster config the rules look at.

Rules are pure functions of the config (and of facts gathered elsewhere) that return
CheckResults; nothing here talks to Ray or AWS."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterable


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


# --- reading a prepared config ------------------------------------------------------------


def provider_type(config: dict[str, Any]) -> str:
    return config.get("provider", {}).get("type", "")


def worker_types(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    head = config.get("head_node_type")
    return {name: spec for name, spec in config.get("available_node_types", {}).items() if name != head}


def head_type(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("available_node_types", {}).get(config.get("head_node_type"), {})


def instance_type(node_type: dict[str, Any]) -> str | None:
    return node_type.get("node_config", {}).get("InstanceType")


def is_spot(node_type: dict[str, Any]) -> bool:
    market = node_type.get("node_config", {}).get("InstanceMarketOptions", {})
    return str(market.get("MarketType", "")).lower() == "spot"


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


def commands(config: dict[str, Any], key: str) -> str:
    """One string of the node's start commands (to search for flags and exports)."""
    return "\n".join(str(command) for command in config.get(key, []) or [])


def exports_auth_token(script: str) -> bool:
    """RAY_AUTH_MODE=token is set before `ray start`, and nothing turns it off."""
    if re.search(r"RAY_AUTH_MODE\s*=\s*[\"']?disabled", script):
        return False
    token = re.search(r"RAY_AUTH_MODE\s*=\s*[\"']?token", script)
    start = script.find("ray start")
    return bool(token) and start >= 0 and token.start() < start


def flag_value(script: str, flag: str) -> str | None:
    """The value of `--flag=value` or `--flag value` in a command string."""
    match = re.search(rf"{re.escape(flag)}[ =]+([^\s;]+)", script)
    return match.group(1) if match else None
