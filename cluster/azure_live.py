"""Runs on the laptop (validate): live checks of an Azure cluster config against the subscription,
only with Azure credentials (azure-identity's default chain: environment, workload or managed
identity, `az login`): the VM sizes exist in the region and the listed zones, unrestricted for this
subscription, and the quota covers max_workers (Spot VMs draw on `lowPriorityCores`, regular ones
on their family's vCPUs). Facts come from Azure Resource Manager's REST API with a bearer token
(`gather_facts`); the checks are pure (`live_checks`)."""

from __future__ import annotations

import json
import os
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from cluster.checks import (
    CheckResult,
    declared_gpus,
    failed,
    instance_type,
    is_spot,
    passed,
    skipped,
    warned,
    worker_types,
)

ARM = "https://management.azure.com"
ARM_SCOPE = "https://management.azure.com/.default"
SPOT_QUOTA = "lowPriorityCores"


@dataclass(frozen=True)
class VmSku:
    name: str
    family: str
    vcpus: int
    zones: frozenset[str] = frozenset()
    restricted_zones: frozenset[str] = frozenset()
    restricted_in_region: bool = False


@dataclass(frozen=True)
class AzureFacts:
    location: str
    skus: dict[str, VmSku] = field(default_factory=dict)
    quotas: dict[str, tuple[int, int]] = field(default_factory=dict)   # name -> (in use, limit)


def parse_skus(items: list[dict], location: str) -> dict[str, VmSku]:
    """Resource SKUs (Microsoft.Compute/skus) for virtual machines in one location."""
    skus = {}
    for item in items:
        if item.get("resourceType") != "virtualMachines":
            continue
        info = [i for i in item.get("locationInfo") or [] if str(i.get("location", "")).lower() == location.lower()]
        capabilities = {c.get("name"): c.get("value") for c in item.get("capabilities") or []}
        restricted_zones, in_region = set(), False
        for restriction in item.get("restrictions") or []:
            if restriction.get("type") == "Location":
                in_region = True
            elif restriction.get("type") == "Zone":
                restricted_zones |= set((restriction.get("restrictionInfo") or {}).get("zones") or [])
        skus[item["name"]] = VmSku(item["name"], str(item.get("family", "")), int(capabilities.get("vCPUs", 0) or 0),
                                   frozenset(z for i in info for z in i.get("zones") or []),
                                   frozenset(restricted_zones), in_region)
    return skus


def parse_usages(items: list[dict]) -> dict[str, tuple[int, int]]:
    return {str(u["name"]["value"]): (int(u.get("currentValue", 0)), int(u.get("limit", 0))) for u in items}


def _requested_zones(config: dict, spec: dict) -> list[str]:
    arm = (spec.get("node_config") or {}).get("azure_arm_parameters") or {}
    value = arm.get("availability_zone") or (config.get("provider") or {}).get("availability_zone") or ""
    return [z.strip() for z in str(value).split(",") if z.strip() and z.strip().lower() not in ("auto", "none")]


def live_checks(config: dict, facts: AzureFacts, gpus_by_size: dict[str, int]) -> list[CheckResult]:
    problems, notes = [], []
    for name, spec in config.get("available_node_types", {}).items():
        size = instance_type(spec)
        sku = facts.skus.get(size or "")
        if sku is None or sku.restricted_in_region:
            problems.append(f"{name}: {size} is not offered to this subscription in {facts.location}")
            continue
        wanted = _requested_zones(config, spec)
        usable = sku.zones - sku.restricted_zones
        if wanted and not set(wanted) & usable:
            problems.append(f"{name}: {size} is in none of zones {', '.join(wanted)} (usable: "
                            f"{', '.join(sorted(usable)) or 'none'})")
        elif set(wanted) - usable:
            notes.append(f"{name}: {size} not in zone(s) {', '.join(sorted(set(wanted) - usable))}")
    results = [failed("azure_vm_sizes", "; ".join(problems)) if problems else
               warned("azure_vm_sizes", "; ".join(notes)) if notes else
               passed("azure_vm_sizes", f"every VM size is offered in {facts.location} and its zones")]
    return results + [gpu_quota(config, facts, gpus_by_size)]


def gpu_quota(config: dict, facts: AzureFacts, gpus_by_size: dict[str, int]) -> CheckResult:
    """vCPUs the GPU types may launch at max_workers against what the quota leaves free."""
    needed: dict[str, int] = {}
    for spec in worker_types(config).values():
        sku = facts.skus.get(instance_type(spec) or "")
        if sku is None or declared_gpus(spec, gpus_by_size) <= 0:
            continue
        quota = SPOT_QUOTA if is_spot(spec) else sku.family
        needed[quota] = needed.get(quota, 0) + int(spec.get("max_workers", 0)) * sku.vcpus
    short = []
    for quota, vcpus in sorted(needed.items()):
        used, limit = facts.quotas.get(quota, (0, 0))
        if limit - used < vcpus:
            short.append(f"{quota}: max_workers need {vcpus} vCPUs, {max(limit - used, 0)} free of {limit}")
    if short:
        return failed("azure_gpu_quota", "; ".join(short) + ": request more quota (Portal > Quotas) or lower "
                      "max_workers")
    return passed("azure_gpu_quota", "quota covers max_workers: " +
                  (", ".join(f"{q} {n} vCPUs" for q, n in sorted(needed.items())) or "no GPU types"))


def _get_all(url: str, token: str, opener: Callable = urllib.request.urlopen) -> list[dict]:
    items = []
    while url:
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        with opener(request, timeout=30) as response:
            page = json.loads(response.read().decode())
        items += page.get("value") or []
        url = page.get("nextLink")
    return items


def gather_facts(config: dict, subscription_id: str, token: str, arm_url: str = ARM) -> AzureFacts:
    location = config["provider"]["location"]
    base = f"{arm_url}/subscriptions/{subscription_id}/providers/Microsoft.Compute"
    skus = _get_all(f"{base}/skus?api-version=2021-07-01&$filter=location%20eq%20'{location}'", token)
    usages = _get_all(f"{base}/locations/{location}/usages?api-version=2023-07-01", token)
    return AzureFacts(location, parse_skus(skus, location), parse_usages(usages))


def azure_live_results(config: dict, gpus_by_size: dict[str, int], *, env: Mapping[str, str] = os.environ,
                       live: bool = True, credential: Any = None) -> list[CheckResult]:
    if not live:
        return [skipped("azure_live", "live Azure checks turned off (--offline)")]
    if credential is None:
        try:
            from azure.identity import DefaultAzureCredential  # (lazy: azure-identity, optional)
        except ImportError:
            return [skipped("azure_live", "azure-identity is not installed (pip install azure-identity): live "
                            "checks skipped; the exit code reflects the static checks only")]
        credential = DefaultAzureCredential()
    try:
        token = credential.get_token(ARM_SCOPE).token
    except Exception as error:  # CredentialUnavailableError, ClientAuthenticationError: no login here
        return [skipped("azure_live", f"no Azure credentials ({type(error).__name__}; `az login` or a managed "
                        "identity): live checks skipped; the exit code reflects the static checks only")]
    subscription = (config.get("provider") or {}).get("subscription_id") or env.get("AZURE_SUBSCRIPTION_ID")
    if not subscription:
        return [skipped("azure_live", "no subscription: set provider.subscription_id or AZURE_SUBSCRIPTION_ID")]
    try:
        facts = gather_facts(config, subscription, token)
    except Exception as error:  # no network, access denied: say so, do not crash
        return [failed("azure_live", f"live checks could not run: {type(error).__name__}: {str(error)[:200]}")]
    return live_checks(config, facts, gpus_by_size)
