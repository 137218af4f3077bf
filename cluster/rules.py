"""This project's static rules for a cluster config (after Ray's schema check): pure functions
from the prepared config to CheckResults. Live AWS checks are in cluster/aws_checks.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from cluster.checks import (CheckResult, commands, declared_gpus, exports_auth_token, failed,
                            flag_value, head_type, is_spot, passed, provider_type,
                            warned, worker_types, zones)

WORLD = {"0.0.0.0/0", "::/0"}
# GCS, object manager, Ray client, dashboard, metrics export, dashboard agent (MLflow is added).
RAY_PORTS = {6379: "GCS", 8076: "object manager", 10001: "Ray client", 8265: "dashboard",
             8080: "metrics", 52365: "dashboard agent"}
PLACEHOLDER_CIDRS = {"203.0.113.0/24", "198.51.100.0/24", "192.0.2.0/24"}


def static_checks(prepared: dict[str, Any], gpus_by_instance: dict[str, int],
                  repo_root: Path | None = None) -> list[CheckResult]:
    """Every static rule, in report order."""
    return [
        gpu_worker_type(prepared, gpus_by_instance),
        head_without_gpu(prepared, gpus_by_instance),
        worker_counts(prepared),
        autoscaling_settings(prepared),
        spot_with_fallback(prepared, gpus_by_instance),
        availability_zones(prepared),
        auth_token(prepared, repo_root),
        *network_exposure(prepared),
        storage_and_tracking(prepared),
        pinned_image(prepared),
    ]


def gpu_worker_type(config: dict, gpus_by_instance: dict[str, int]) -> CheckResult:
    gpu_types = [name for name, spec in worker_types(config).items() if declared_gpus(spec, gpus_by_instance) > 0]
    if gpu_types:
        return passed("gpu_worker_type", f"GPU worker types: {', '.join(gpu_types)}")
    if provider_type(config) == "local":
        return warned("gpu_worker_type", "local provider: GPUs are detected on each machine at `ray start`; "
                      "make sure the worker machines have them")
    return failed("gpu_worker_type", "no worker type offers a GPU: add one with resources: {GPU: n} "
                  "(or a GPU instance type)")


def head_without_gpu(config: dict, gpus_by_instance: dict[str, int]) -> CheckResult:
    if provider_type(config) == "local":  # one node type for all machines: the head's flag decides
        if flag_value(commands(config, "head_start_ray_commands"), "--num-gpus") == "0":
            return passed("head_without_gpu", "the head starts with --num-gpus=0")
        return warned("head_without_gpu", "start the head with --num-gpus=0 so no training worker lands on it")
    gpus = declared_gpus(head_type(config), gpus_by_instance)
    if gpus:
        return failed("head_without_gpu", f"the head offers {gpus} GPU(s): training workers would land on it; "
                      "use a CPU instance or declare resources: {GPU: 0}")
    return passed("head_without_gpu", "the head offers no GPU: it only runs drivers, controllers, MLflow")


def worker_counts(config: dict) -> CheckResult:
    problems = [f"{name}: min_workers {spec.get('min_workers', 0)} > max_workers {spec.get('max_workers', 0)}"
                for name, spec in worker_types(config).items()
                if spec.get("min_workers", 0) > spec.get("max_workers", 0)]
    if problems:
        return failed("worker_counts", "; ".join(problems))
    idle = [name for name, spec in worker_types(config).items() if spec.get("min_workers", 0) > 0]
    if idle and provider_type(config) != "local":
        return warned("worker_counts", f"min_workers > 0 for {', '.join(idle)}: those nodes are paid for while idle")
    return passed("worker_counts", "min_workers <= max_workers for every worker type")


def autoscaling_settings(config: dict) -> CheckResult:
    # prepare_config fills in Ray's defaults (5 min, 1.0) when the file leaves them out.
    idle = config.get("idle_timeout_minutes")
    speed = config.get("upscaling_speed")
    if idle is None or speed is None or speed <= 0:
        return failed("autoscaling", "set idle_timeout_minutes and a positive upscaling_speed")
    return passed("autoscaling", f"idle workers released after {idle} min; upscaling_speed {speed}")


def spot_with_fallback(config: dict, gpus_by_instance: dict[str, int]) -> CheckResult:
    if provider_type(config) != "aws":
        return passed("spot_fallback", f"{provider_type(config)} provider: no spot market")
    gpu = [spec for spec in worker_types(config).values() if declared_gpus(spec, gpus_by_instance) > 0]
    spot, on_demand = any(is_spot(s) for s in gpu), any(not is_spot(s) for s in gpu)
    if spot and on_demand:
        return passed("spot_fallback", "spot GPU workers with an on-demand fallback type")
    missing = "a spot GPU type (cheaper)" if not spot else "an on-demand GPU fallback type"
    return warned("spot_fallback", f"add {missing}")


def availability_zones(config: dict) -> CheckResult:
    if provider_type(config) != "aws":
        return passed("zones", f"{provider_type(config)} provider: no zones")
    listed = zones(config)
    if len(listed) >= 2:
        return passed("zones", f"{len(listed)} zones: {', '.join(listed)}")
    return warned("zones", "list several zones in provider.availability_zone: spot capacity differs per zone")


def auth_token(config: dict, repo_root: Path | None) -> CheckResult:
    head, workers = commands(config, "head_start_ray_commands"), commands(config, "worker_start_ray_commands")
    off = [role for role, script in (("head", head), ("worker", workers)) if not exports_auth_token(script)]
    if off:
        return failed("auth_token", f"token authentication is off on the {' and '.join(off)}: "
                      "`export RAY_AUTH_MODE=token;` before `ray start` in the start commands")
    if re.search(r"RAY_AUTH_TOKEN\s*=\s*[\"']?[A-Za-z0-9]{8,}", yaml.safe_dump(config)):
        return failed("auth_token", "a literal RAY_AUTH_TOKEN is in the config: ship it as a file, never inline")
    mounts = config.get("file_mounts") or {}
    shipped = {remote: local for remote, local in mounts.items() if str(remote).rstrip("/").endswith(".ray/auth_token")}
    if not shipped:
        return failed("auth_token", "the token is not shipped: add file_mounts `~/.ray/auth_token: ~/.ray/auth_token`")
    local = Path(str(next(iter(shipped.values())))).expanduser().resolve()
    if repo_root is not None and local.is_relative_to(repo_root.resolve()):
        return failed("auth_token", f"the token file {local} is inside the repository: keep it in ~/.ray/auth_token")
    return passed("auth_token", f"RAY_AUTH_MODE=token on head and workers; token shipped from {local}")


def _ports(rule: dict) -> tuple[int, int]:
    if str(rule.get("IpProtocol")) == "-1" or rule.get("FromPort", -1) == -1:
        return 0, 65535
    return int(rule.get("FromPort", 0)), int(rule.get("ToPort", rule.get("FromPort", 0)))


def _sources(rule: dict) -> set[str]:
    return ({r.get("CidrIp", "") for r in rule.get("IpRanges", [])}
            | {r.get("CidrIpv6", "") for r in rule.get("Ipv6Ranges", [])})


def exposure(rules: list[dict], mlflow_port: int) -> tuple[list[str], list[str], list[str]]:
    """(Ray/MLflow ports open to the world, SSH open to the world?, SSH sources): the policy
    shared by the static rule (config) and the live one (an existing security group)."""
    ports = {**RAY_PORTS, mlflow_port: "MLflow"}
    open_ray, ssh_world, ssh_sources = [], [], []
    for rule in rules:
        low, high = _ports(rule)
        world = _sources(rule) & WORLD
        if world:
            open_ray += [f"{port} ({what})" for port, what in sorted(ports.items()) if low <= port <= high]
            if low <= 22 <= high:
                ssh_world.append(next(iter(world)))
        if low <= 22 <= high:
            ssh_sources += sorted(_sources(rule))
    return open_ray, ssh_world, ssh_sources


def network_exposure(config: dict) -> list[CheckResult]:
    head = commands(config, "head_start_ray_commands")
    host = flag_value(head, "--dashboard-host")
    bind = (warned("bind_address", f"dashboard bound to {host}: bind 127.0.0.1 and use `ray dashboard`")
            if host not in (None, "127.0.0.1", "localhost")
            else passed("bind_address", "dashboard on loopback (reach it with `ray dashboard CLUSTER.yaml`)"))
    if provider_type(config) != "aws":
        return [warned("open_ports", f"{provider_type(config)} provider: no firewall in this file; keep Ray "
                       "and MLflow ports reachable from cluster machines only"), bind]
    rules = config.get("provider", {}).get("security_group", {}).get("IpPermissions", []) or []
    open_ray, ssh_world, ssh_sources = exposure(rules, mlflow_port(config))
    results = [failed("open_ports", f"open to the internet: {', '.join(open_ray)}; remove the rule, use SSH tunnels")
               if open_ray else passed("open_ports", "no Ray, dashboard or MLflow port open to the internet")]
    if ssh_world:
        results.append(failed("ssh_cidr", f"SSH open to {ssh_world[0]}: restrict it to your network's CIDR"))
    elif not ssh_sources:
        results.append(warned("ssh_cidr", "no SSH rule: if Ray creates the security group it opens SSH to "
                              "0.0.0.0/0; add a rule with your CIDR"))
    elif set(ssh_sources) & PLACEHOLDER_CIDRS:
        results.append(warned("ssh_cidr", f"SSH from {', '.join(ssh_sources)}: a documentation range; set your CIDR"))
    else:
        results.append(passed("ssh_cidr", f"SSH only from {', '.join(ssh_sources)}"))
    return [*results, bind]


def mlflow_port(config: dict) -> int:
    return int((config.get("metadata") or {}).get("mlflow_port", 5000))


def storage_and_tracking(config: dict) -> CheckResult:
    storage = str((config.get("metadata") or {}).get("storage_path", ""))
    shared = storage.startswith("s3://") or (provider_type(config) == "local" and storage.startswith("/"))
    if not shared:
        return failed("storage_tracking", "set metadata.storage_path to storage every node reaches "
                      "(s3://bucket/prefix; on-prem also a shared filesystem path)")
    head, workers = commands(config, "head_start_ray_commands"), commands(config, "worker_start_ray_commands")
    if "mlflow server" not in head or "MLFLOW_TRACKING_URI" not in workers:
        return failed("storage_tracking", "start `mlflow server` on the head and export MLFLOW_TRACKING_URI "
                      "in worker_start_ray_commands")
    if flag_value(head, "--host") in ("0.0.0.0", "::"):
        return warned("storage_tracking", "MLflow bound to all interfaces: bind the head's private address")
    artifacts = flag_value(head, "--artifacts-destination") or ""
    if provider_type(config) == "aws" and not artifacts.startswith("s3://"):
        return failed("storage_tracking", "MLflow artifacts must go to S3 (--artifacts-destination s3://...)")
    return passed("storage_tracking", f"runs in {storage}; MLflow on the head, artifacts in {artifacts or 'its store'}")


def pinned_image(config: dict) -> CheckResult:
    docker = config.get("docker") or {}
    images = [docker.get(key) for key in ("image", "head_image", "worker_image") if docker.get(key)]
    loose = [image for image in images if ":" not in image or image.endswith((":latest", ":nightly"))]
    if loose:
        return warned("pinned_image", f"unpinned image {loose[0]}: pin a Ray 2.60 tag")
    if provider_type(config) == "aws":
        missing = [name for name, spec in config.get("available_node_types", {}).items()
                   if not spec.get("node_config", {}).get("ImageId")]
        if missing:
            return warned("pinned_image", f"no ImageId for {', '.join(missing)}: Ray picks its default AMI")
    return passed("pinned_image", f"pinned: {', '.join(images) or 'machines as installed'}")
