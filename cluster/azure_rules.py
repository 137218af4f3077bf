"""Runs on the laptop (validate): the static rules for a cluster on Ray's `azure` provider: the
provider-neutral rules of cluster/rules.py where they apply, and Azure's own (resource group and
location, VM sizes, Spot with an eviction policy, a price cap and a fallback, zones, the network
security group the file describes, Blob run storage, the managed identity, cache_stopped_nodes,
no storage key, SAS token or client secret in the file). Pure functions of the prepared config."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import parse_qs, urlsplit

from cluster import rules
from cluster.checks import (
    CheckResult,
    Laptop,
    declared_gpus,
    failed,
    is_spot,
    passed,
    warned,
    worker_types,
)
from cluster.network import exposure, listeners, mlflow_port
from cluster.shell import commands, option

# Sources an NSG rule may name besides CIDRs: Azure's service tags and wildcards.
INTERNET_SOURCES = {"*", "any", "internet", "0.0.0.0/0"}
VNET_SOURCES = {"virtualnetwork", "azureloadbalancer"}
BLOB_SCHEMES = ("abfs", "abfss")
MLFLOW_BLOB_SCHEMES = ("wasbs", "abfss")
# What a storage key, SAS token or client secret looks like when written out.
SECRET_PATTERNS = (
    ("a storage account key", re.compile(r"AccountKey=[^;\s'\"]+", re.I)),
    ("a SAS token", re.compile(r"(?:[?&]|\b)sig=[A-Za-z0-9%+/=]{16,}", re.I)),
    ("a SAS token", re.compile(r"SharedAccessSignature=[^;\s'\"]+", re.I)),
    ("a storage key or SAS in a URI", re.compile(r"[?&](?:account_key|sas_token)=[^&\s'\"]+", re.I)),
)
SECRET_VARIABLES = ("AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_CONNECTION_STRING",
                    "AZURE_STORAGE_SAS_TOKEN", "AZURE_CLIENT_SECRET", "AZURE_CLIENT_CERTIFICATE_PASSWORD")
SECRET_FLAGS = ("--account-key", "--sas-token", "--connection-string", "--client-secret")


def azure_static_checks(prepared: dict[str, Any], gpus_by_size: dict[str, int],
                        laptop: Laptop | None = None) -> list[CheckResult]:
    """Every static rule for an Azure cluster, in report order."""
    laptop = laptop or Laptop(Path.home())
    return [
        location_and_group(prepared),
        vm_sizes(prepared),
        rules.gpu_worker_type(prepared, gpus_by_size),
        rules.head_without_gpu(prepared, gpus_by_size),
        rules.worker_counts(prepared),
        rules.autoscaling_settings(prepared),
        spot_with_fallback(prepared, gpus_by_size),
        availability_zones(prepared),
        cache_stopped_nodes(prepared),
        rules.auth_token(prepared, laptop),
        rules.local_token(prepared, laptop),
        *network_security_group(prepared),
        managed_identity(prepared),
        blob_storage_and_tracking(prepared),
        no_azure_secrets(prepared),
        rules.mlflow_auth(prepared, laptop),
        rules.pinned_image(prepared),
    ]


def _arm(spec: dict) -> dict:
    return (spec.get("node_config") or {}).get("azure_arm_parameters") or {}


def location_and_group(config: dict) -> CheckResult:
    provider = config.get("provider") or {}
    missing = [f"provider.{key}" for key in ("resource_group", "location") if not provider.get(key)]
    if missing:
        return failed("azure_provider", f"set {' and '.join(missing)}: Ray's azure provider needs both "
                      "(the resource group it deploys into, the region of every VM)")
    return passed("azure_provider", f"resource group {provider['resource_group']} in {provider['location']}")


def vm_sizes(config: dict) -> CheckResult:
    missing = [name for name, spec in config.get("available_node_types", {}).items() if not _arm(spec).get("vmSize")]
    if missing:
        return failed("vm_sizes", f"no VM size for {', '.join(missing)}: set "
                      "node_config.azure_arm_parameters.vmSize (e.g. Standard_NC4as_T4_v3)")
    return passed("vm_sizes", "every node type names its vmSize")


def spot_with_fallback(config: dict, gpus_by_size: dict[str, int]) -> CheckResult:
    """Spot GPU types delete their VM on eviction and cap their price; a regular type backs them."""
    gpu = {name: spec for name, spec in worker_types(config).items() if declared_gpus(spec, gpus_by_size) > 0}
    problems = []
    for name, spec in gpu.items():
        if not is_spot(spec):
            continue
        arm = _arm(spec)
        if str(arm.get("evictionPolicy", "")).lower() != "delete":
            problems.append(f"{name}: set evictionPolicy: Delete (Deallocate keeps paying for the disk of a "
                            "VM Ray will never restart)")
        price = (arm.get("billingProfile") or {}).get("maxPrice")
        if isinstance(price, bool) or not isinstance(price, (int, float)) or not (price == -1 or price > 0):
            problems.append(f"{name}: set billingProfile.maxPrice to the most USD/hour you accept "
                            "(-1: up to the regular price)")
    if problems:
        return failed("spot_fallback", "; ".join(problems))
    spot = any(is_spot(spec) for spec in gpu.values())
    regular = any(not is_spot(spec) for spec in gpu.values())
    if spot and regular:
        return passed("spot_fallback", "Spot GPU workers (evicted VMs deleted, price capped) with a regular fallback")
    return warned("spot_fallback", "add " + ("a Spot GPU type (priority: Spot; cheaper)" if not spot
                                             else "a regular-priority GPU fallback type"))


def _zones(value: Any) -> list[str]:
    return [zone.strip() for zone in str(value or "").split(",") if zone.strip()]


def availability_zones(config: dict) -> CheckResult:
    provider_zones = _zones((config.get("provider") or {}).get("availability_zone"))
    narrow = []
    for name, spec in worker_types(config).items():
        listed = _zones(_arm(spec).get("availability_zone")) or provider_zones
        if [z.lower() for z in listed] != ["auto"] and len([z for z in listed if z.lower() != "none"]) < 2:
            narrow.append(name)
    if narrow:
        return warned("zones", f"{', '.join(narrow)} may use fewer than 2 zones: list several in "
                      "provider.availability_zone (\"1,2,3\"): spot capacity differs per zone")
    return passed("zones", f"workers spread over zones {', '.join(provider_zones) or 'per node type'}")


def cache_stopped_nodes(config: dict) -> CheckResult:
    value = (config.get("provider") or {}).get("cache_stopped_nodes")
    if value is None:
        return failed("cache_stopped_nodes", "state provider.cache_stopped_nodes: Ray's default (true) deallocates "
                      "idle workers instead of deleting them, and deallocated VMs still pay for their disks; "
                      "false deletes them")
    if value:
        return warned("cache_stopped_nodes", "cache_stopped_nodes: true keeps deallocated workers (their disks are "
                      "paid for while stopped); false deletes them")
    return passed("cache_stopped_nodes", "idle workers are deleted, not deallocated")


# --- the network security group ------------------------------------------------------------


def _source_cidrs(rule: dict) -> list[str]:
    """An NSG rule's sources as ranges; Azure's tags for the internet become 0.0.0.0/0 and those for
    the virtual network a private range (neither reaches the internet)."""
    listed = [rule.get("source_address_prefix"), *(rule.get("source_address_prefixes") or [])]
    cidrs = []
    for source in (str(s).strip() for s in listed if s is not None):
        cidrs.append("0.0.0.0/0" if source.lower() in INTERNET_SOURCES
                     else "10.0.0.0/8" if source.lower() in VNET_SOURCES else source)
    return cidrs


def _ports(text: str) -> tuple[Any, Any]:
    text = str(text).strip()
    if text == "*":
        return -1, -1
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def as_ip_permissions(security_rules: Iterable[dict]) -> list[dict]:
    """Inbound Allow NSG rules in EC2's IpPermissions shape, so the one exposure policy
    (cluster/network.py) judges both clouds."""
    permissions = []
    for rule in security_rules:
        if str(rule.get("direction", "Inbound")).lower() != "inbound" or str(rule.get("access", "")).lower() != "allow":
            continue
        protocol = str(rule.get("protocol", "*")).lower()
        ranges = [rule.get("destination_port_range"), *(rule.get("destination_port_ranges") or [])]
        for text in (r for r in ranges if r is not None):
            try:
                low, high = _ports(text)
            except ValueError:
                low, high = -1, -1  # unreadable: assume every port
            permissions.append({"IpProtocol": "-1" if protocol in ("*", "any") else protocol,
                                "FromPort": low, "ToPort": high,
                                "IpRanges": [{"CidrIp": cidr} for cidr in _source_cidrs(rule)]})
    return permissions


def network_security_group(config: dict) -> list[CheckResult]:
    """open_ports, ssh_cidr and bind_address from the rules metadata.network_security_group describes."""
    described = (config.get("metadata") or {}).get("network_security_group")
    listening = listeners(config)
    if not described:
        return [warned("open_ports", "no metadata.network_security_group: Ray's template opens only SSH (to any "
                       "source); describe the rules you apply after `ray up` so they are checked"),
                warned("ssh_cidr", "Ray's template opens SSH to any source: describe your narrower rule in "
                       "metadata.network_security_group and apply it after `ray up` (docs/azure.md)"),
                rules.dashboard_binding(listening, [])]
    permissions = as_ip_permissions(described.get("security_rules") or [])
    open_ray, ssh_world, ssh_sources = exposure(permissions, mlflow_port(config), listening)
    results = [failed("open_ports", f"open beyond the virtual network: {', '.join(open_ray)}; remove the rule, "
                      "use SSH tunnels") if open_ray
               else passed("open_ports", "no Ray, dashboard or MLflow port open beyond the virtual network")]
    if ssh_world:
        results.append(failed("ssh_cidr", f"SSH open to {', '.join(ssh_world)}: restrict it to your network's CIDR"))
    elif not ssh_sources:
        results.append(warned("ssh_cidr", "no SSH rule described: Ray's template opens SSH to any source"))
    elif set(ssh_sources) & rules.PLACEHOLDER_CIDRS:
        results.append(warned("ssh_cidr", f"SSH from {', '.join(ssh_sources)}: a documentation range; set your CIDR"))
    else:
        results.append(passed("ssh_cidr", f"SSH only from {', '.join(ssh_sources)}"))
    return [*results, rules.dashboard_binding(listening, open_ray)]


# --- identity, storage, secrets --------------------------------------------------------------


def managed_identity(config: dict) -> CheckResult:
    provider = config.get("provider") or {}
    name, group = provider.get("msi_name"), provider.get("msi_resource_group")
    if not (name and group):
        return failed("managed_identity", "name the nodes' managed identity: provider.msi_name and "
                      "provider.msi_resource_group (created once, with Storage Blob Data Contributor on the run "
                      "container: docs/azure.md); without both Ray makes a new identity that cannot reach storage")
    return passed("managed_identity", f"nodes run as {group}/{name}")


def blob_location(uri: str, schemes: tuple[str, ...], host_suffix: str) -> str | None:
    """Why a URI is not a usable Blob location (None: it is): scheme, container@account host, no
    credential in its query."""
    parts = urlsplit(uri)
    if parts.scheme not in schemes:
        return f"{uri or 'nothing'} is not Azure Blob storage"
    if "@" not in parts.netloc or not parts.netloc.split("@", 1)[1].endswith(host_suffix):
        return f"{uri} does not name CONTAINER@ACCOUNT{host_suffix}"
    if parts.query and set(parse_qs(parts.query)) & {"account_key", "sas_token", "sig", "client_secret"}:
        return f"{uri} carries a credential in its query"
    return None


def blob_storage_and_tracking(config: dict) -> CheckResult:
    storage = str((config.get("metadata") or {}).get("storage_path", ""))
    problem = blob_location(storage, BLOB_SCHEMES, ".dfs.core.windows.net")
    if problem:
        return failed("storage_tracking", f"metadata.storage_path: {problem}; set "
                      "abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/PATH (pyarrow's AzureFileSystem, with the "
                      "node's managed identity; it does not read az:// URIs)")
    servers = rules.mlflow_servers(config)
    if not servers or "MLFLOW_TRACKING_URI" not in commands(config, "worker_start_ray_commands"):
        return failed("storage_tracking", "start `mlflow server` on the head and export MLFLOW_TRACKING_URI "
                      "in worker_start_ray_commands")
    argv = servers[0][0]
    if (option(argv, "--host", "-h") or "127.0.0.1") in ("0.0.0.0", "::"):
        return warned("storage_tracking", "MLflow bound to all interfaces: bind the head's private address")
    artifacts = option(argv, "--artifacts-destination") or ""
    suffix = ".dfs.core.windows.net" if artifacts.startswith("abfss") else ".blob.core.windows.net"
    problem = blob_location(artifacts, MLFLOW_BLOB_SCHEMES, suffix)
    if problem:
        return failed("storage_tracking", f"MLflow --artifacts-destination: {problem}; use "
                      "wasbs://CONTAINER@ACCOUNT.blob.core.windows.net/PATH")
    return passed("storage_tracking", f"runs in {storage}; MLflow on the head, artifacts in {artifacts}")


def _strings(value: Any, where: str = "") -> Iterable[tuple[str, str]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _strings(item, f"{where}[{i}]")
    elif isinstance(value, str):
        yield where, value


def azure_secrets(config: dict) -> list[tuple[str, str]]:
    """(where, what) for each kind of Azure secret written out in the file, first place seen; the
    secret itself is never repeated."""
    found: dict[str, str] = {}
    for where, text in _strings(config):
        for what, pattern in SECRET_PATTERNS:
            if pattern.search(text):
                found.setdefault(what, where)
        for name in SECRET_VARIABLES:
            match = re.search(rf"(?<![A-Za-z0-9_]){name}=(\S+)", text)
            if match and rules._literal(match.group(1).strip("'\"")):
                found.setdefault(f"{name}=<literal>", where)
        for flag in SECRET_FLAGS:
            match = re.search(rf"{flag}[= ]+(\S+)", text)
            if match and rules._literal(match.group(1).strip("'\"")):
                found.setdefault(f"{flag} <literal>", where)
    return [(where, what) for what, where in found.items()]


def no_azure_secrets(config: dict) -> CheckResult:
    found = azure_secrets(config)
    if found:
        listed = "; ".join(f"{what} in {where}" for where, what in found)
        return failed("azure_secrets", f"a secret is written in the file ({listed}): remove it; the nodes reach "
                      "Blob storage with their managed identity")
    return passed("azure_secrets", "no storage key, SAS token or client secret in the file")
