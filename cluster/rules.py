"""Runs on the laptop (validate): this project's static rules for a cluster config, after Ray's
schema check: pure functions from the prepared config to CheckResults. They read the commands
the way Ray's launcher runs them (each entry in its own shell: cluster/shell.py) and the security
group as sets of addresses and ports (cluster/network.py). Live AWS checks are in
cluster/aws_checks.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from cluster.checks import (
    CheckResult,
    Laptop,
    declared_gpus,
    failed,
    head_type,
    is_spot,
    passed,
    provider_type,
    warned,
    worker_types,
    zones,
)
from cluster.network import LOOPBACK_HOSTS, Listener, exposure, listeners, mlflow_port
from cluster.shell import (
    COMMAND_KEYS,
    auth_mode_at_ray_start,
    commands,
    container_env,
    env_at,
    flag_value,
    is_mlflow_server,
    option,
    program,
    simple_commands,
)

PLACEHOLDER_CIDRS = {"203.0.113.0/24", "198.51.100.0/24", "192.0.2.0/24"}
# More nodes than this in one cluster is a typo (1e9) or a blank cheque, not a plan.
MAX_SANE_WORKERS = 1000
# Variables whose value is a secret: the file may name a file or $(cat ...) them, never hold them.
SECRET_VARIABLES = ("RAY_AUTH_TOKEN", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_AUTH_ADMIN_PASSWORD",
                    "MLFLOW_FLASK_SERVER_SECRET_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
TOKEN_REMOTE = "~/.ray/auth_token"
MLFLOW_CREDENTIALS_REMOTE = "~/.mlflow/credentials"  # MLflow clients read username/password here


def static_checks(prepared: dict[str, Any], gpus_by_instance: dict[str, int],
                  laptop: Laptop | None = None) -> list[CheckResult]:
    """Every static rule, in report order."""
    laptop = laptop or Laptop(Path.home())
    return [
        gpu_worker_type(prepared, gpus_by_instance),
        head_without_gpu(prepared, gpus_by_instance),
        worker_counts(prepared),
        autoscaling_settings(prepared),
        spot_with_fallback(prepared, gpus_by_instance),
        availability_zones(prepared),
        auth_token(prepared, laptop),
        local_token(prepared, laptop),
        *network_exposure(prepared),
        *node_hardening(prepared),
        storage_and_tracking(prepared),
        mlflow_auth(prepared, laptop),
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
    caps = {"max_workers": config.get("max_workers"),
            **{f"available_node_types.{name}.max_workers": spec.get("max_workers")
               for name, spec in worker_types(config).items()}}
    absurd = [f"{field} is {value!r}" + (" (not a whole number)" if not isinstance(value, int) else "")
              for field, value in caps.items() if value is not None
              and (isinstance(value, bool) or not isinstance(value, int) or value > MAX_SANE_WORKERS)]
    if absurd:
        return failed("worker_counts", f"{'; '.join(absurd)}: the autoscaler may launch that many paid nodes; "
                      f"set a whole number of at most {MAX_SANE_WORKERS} (what you mean to pay for)")
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


# --- token authentication and secrets -----------------------------------------------------


def _literal(value: str) -> bool:
    """A value written out in the file, not a reference ($VAR, $(cat file)) or a file path."""
    return bool(value) and "$" not in value and "/" not in value and not value.startswith("-")


def _shell_texts(config: dict) -> list[tuple[str, str]]:
    """(where, text) of every shell command and docker option list in the config."""
    texts = [(f"{key}[{i}]", str(command)) for key in COMMAND_KEYS for i, command in enumerate(config.get(key) or [])]
    docker = config.get("docker") or {}
    texts += [(f"docker.{key}", " ".join(str(o) for o in docker.get(key) or []))
              for key in ("run_options", "head_run_options", "worker_run_options") if docker.get(key)]
    return texts


def literal_secrets(config: dict) -> list[tuple[str, str]]:
    """(where, what) for each kind of secret written out in the file, where it is first seen:
    `NAME=<literal>`, `--env NAME <literal>`, or `echo <literal> > ...auth_token`. The secret
    itself is never repeated."""
    found = []
    for where, text in _shell_texts(config):
        simples = simple_commands(text)
        for n, simple in enumerate(simples):
            words = [f"{k}={v}" for k, v in simple.assignments] + list(simple.argv)
            for i, word in enumerate(words):
                for name in SECRET_VARIABLES:
                    at = word.find(name + "=")
                    if at >= 0 and (at == 0 or not (word[at - 1].isalnum() or word[at - 1] == "_")) \
                            and _literal(word[at + len(name) + 1:]):
                        found.append((where, f"{name}=<literal>"))
                    elif word == name and i + 1 < len(words) and _literal(words[i + 1]):
                        found.append((where, f"{name} <literal>"))
            _, argv = program(simple)
            if argv[:1] in (("echo",), ("printf",)) and any(_literal(w) for w in argv[1:]):
                piped_to = [s.argv for s in simples[n + 1:n + 2] if s.joined_by == "|"]
                targets = [*simple.redirects, *(w for a in piped_to if a[:1] == ("tee",) for w in a[1:])]
                if any("auth_token" in target for target in targets):
                    found.append((where, "a literal token written to auth_token"))
    # Ray's prepare_config copies setup_commands into head_ and worker_setup_commands: name each once.
    first = {}
    for where, what in found:
        first.setdefault(what, where)
    return [(where, what) for what, where in first.items()]


def _mounted_from(config: dict, remote: str) -> str | None:
    """The local source of the file_mounts entry for this remote path (`~/x` and `$HOME/x` alike)."""
    def normal(path: str) -> str:
        return str(path).replace("$HOME/", "~/").replace("${HOME}/", "~/").rstrip("/")
    mounts = {normal(r): local for r, local in (config.get("file_mounts") or {}).items()}
    return mounts.get(normal(remote))


def auth_token(config: dict, laptop: Laptop) -> CheckResult:
    problems = []
    for role in ("head", "worker"):
        key = f"{role}_start_ray_commands"
        initial = container_env(config, role)
        starts = [(i, mode) for i, command in enumerate(config.get(key) or [])
                  for mode in auth_mode_at_ray_start(str(command), initial)]
        if not starts:
            problems.append(f"no `ray start` in {key}")
        for i, mode in starts:
            if mode == "token":
                continue
            command = str(config[key][i])
            why = (f"RAY_AUTH_MODE={mode}" if mode else
                   "RAY_AUTH_MODE unset (`unset` before it)" if "unset RAY_AUTH_MODE" in command else
                   "RAY_AUTH_MODE unset (an export in another command does not reach it: each command "
                   "runs in a new shell)" if any("RAY_AUTH_MODE=token" in str(c) for c in config[key]) else
                   "RAY_AUTH_MODE unset")
            problems.append(f"{key}[{i}]: `ray start` runs with {why}")
    if problems:
        return failed("auth_token", "token authentication is off: " + "; ".join(problems) +
                      "; set it in the command that starts Ray: `export RAY_AUTH_MODE=token && ray start ...`")
    literals = [f"{what} in {where}" for where, what in literal_secrets(config)
                if "RAY_AUTH_TOKEN" in what or "auth_token" in what]
    if literals:
        return failed("auth_token", f"a token is written in the file ({'; '.join(literals)}): ship "
                      f"{TOKEN_REMOTE} by file_mounts, never inline")
    local = _mounted_from(config, TOKEN_REMOTE)
    if local is None:
        return failed("auth_token", f"the token is not shipped: add file_mounts `{TOKEN_REMOTE}: {TOKEN_REMOTE}`")
    if laptop.may_be_in_repository(local):
        return failed("auth_token", f"the token file {local} is inside the repository (where `ray up` runs), "
                      f"to be shipped with it or committed: keep it in {TOKEN_REMOTE}")
    return passed("auth_token", "RAY_AUTH_MODE=token in every command that runs `ray start`; "
                  f"token shipped from {local}")


def local_token(config: dict, laptop: Laptop) -> CheckResult:
    """The laptop needs the token too: `ray up` copies it, `ray job submit` and the dashboard send it."""
    path = laptop.path(_mounted_from(config, TOKEN_REMOTE) or TOKEN_REMOTE)
    mode = laptop.file_mode(path)
    if mode is None:
        return warned("local_token", f"{path} does not exist on this machine: run `ray get-auth-token --generate` "
                      "before `ray up` (it copies the file to every node; `ray job submit` and the dashboard "
                      "need it here)")
    if mode & 0o077:
        return warned("local_token", f"{path} is readable by other users: chmod 600 {path}")
    return passed("local_token", f"{path} exists, readable by you only")


# --- what the internet can reach -----------------------------------------------------------


def network_exposure(config: dict) -> list[CheckResult]:
    listening = listeners(config)
    if provider_type(config) != "aws":
        return [warned("open_ports", f"{provider_type(config)} provider: no firewall in this file; keep Ray "
                       "and MLflow ports reachable from cluster machines only"), dashboard_binding(listening, [])]
    rules = config.get("provider", {}).get("security_group", {}).get("IpPermissions", []) or []
    open_ray, ssh_world, ssh_sources = exposure(rules, mlflow_port(config), listening)
    results = [failed("open_ports", f"open to the internet: {', '.join(open_ray)}; remove the rule, use SSH tunnels")
               if open_ray else passed("open_ports", "no Ray, dashboard or MLflow port open to the internet")]
    if ssh_world:
        results.append(failed("ssh_cidr", f"SSH open to {', '.join(ssh_world)}: restrict it to your network's CIDR"))
    elif not ssh_sources:
        results.append(warned("ssh_cidr", "no SSH rule: if Ray creates the security group it opens SSH to "
                              "0.0.0.0/0; add a rule with your CIDR"))
    elif set(ssh_sources) & PLACEHOLDER_CIDRS:
        results.append(warned("ssh_cidr", f"SSH from {', '.join(ssh_sources)}: a documentation range; set your CIDR"))
    else:
        results.append(passed("ssh_cidr", f"SSH only from {', '.join(ssh_sources)}"))
    return [*results, dashboard_binding(listening, open_ray)]


def dashboard_binding(listening: Sequence[Listener], open_to_internet: Sequence[str]) -> CheckResult:
    dashboard = next((item for item in listening if item.what == "dashboard"), None)
    if dashboard is None:
        return passed("bind_address", "no dashboard started by this file")
    if dashboard.host in LOOPBACK_HOSTS:
        return passed("bind_address", "dashboard on loopback (reach it with `ray dashboard CLUSTER.yaml`)")
    if dashboard.label() in open_to_internet:
        return failed("bind_address", f"dashboard bound to {dashboard.host} with port {dashboard.low} open to the "
                      "internet: the job API (remote code execution) is guarded only by a token sent in clear "
                      "over HTTP; bind 127.0.0.1 and use `ray dashboard`")
    return warned("bind_address", f"dashboard bound to {dashboard.host}: bind 127.0.0.1 and use `ray dashboard`")


# --- the EC2 instances themselves ----------------------------------------------------------


def node_hardening(config: dict) -> list[CheckResult]:
    """IMDSv2 and encrypted volumes on every node type, head and workers alike."""
    if provider_type(config) != "aws":
        return []
    docker = config.get("docker") or {}
    imdsv1, unencrypted, hops = [], [], []
    for name, spec in config.get("available_node_types", {}).items():
        node = spec.get("node_config") or {}
        metadata = node.get("MetadataOptions")
        if not metadata:
            imdsv1.append(f"{name} (no MetadataOptions: AWS allows IMDSv1)")
        elif str(metadata.get("HttpTokens", "optional")).lower() != "required":
            imdsv1.append(f"{name} (HttpTokens {metadata.get('HttpTokens', 'unset')})")
        mappings = node.get("BlockDeviceMappings")
        if not mappings:
            unencrypted.append(f"{name} (no BlockDeviceMappings: the AMI's volume as it is)")
        unencrypted += [f"{name} ({m.get('DeviceName', '?')})" for m in mappings or []
                        if "Ebs" in m and (m.get("Ebs") or {}).get("Encrypted") is not True]
        role = "head" if name == config.get("head_node_type") else "worker"
        containers = bool(docker.get("image") or docker.get(f"{role}_image"))
        hop = int((metadata or {}).get("HttpPutResponseHopLimit", 1))
        if hop > 1 and not containers:
            hops.append(f"{name} has hop limit {hop} but runs no containers: set 1 (only a container, "
                        "one hop further, needs 2)")
        elif hop < 2 and containers:
            hops.append(f"{name} runs containers with hop limit {hop}: they cannot reach IMDSv2 (the spot "
                        "watcher and instance-profile credentials need 2)")
    return [
        failed("imdsv2", f"IMDSv1 allowed on {', '.join(imdsv1)}: set MetadataOptions: {{HttpTokens: required}}")
        if imdsv1 else passed("imdsv2", "IMDSv2 required on every node type"),
        failed("ebs_encryption", f"unencrypted volumes: {', '.join(unencrypted)}; declare each with Ebs: "
               "{Encrypted: true}") if unencrypted else passed("ebs_encryption", "every EBS volume encrypted"),
        warned("imds_hop_limit", "; ".join(hops)) if hops
        else passed("imds_hop_limit", "IMDS hop limit fits each node (2 with containers, else 1)"),
    ]


# --- run storage and MLflow ----------------------------------------------------------------


def mlflow_servers(config: dict) -> list[tuple[tuple[str, ...], dict[str, str]]]:
    """(argv, environment) of every `mlflow server` the head's start commands run."""
    initial = container_env(config, "head")
    return [found for command in config.get("head_start_ray_commands") or []
            for found in env_at(str(command), is_mlflow_server, initial)]


def storage_and_tracking(config: dict) -> CheckResult:
    storage = str((config.get("metadata") or {}).get("storage_path", ""))
    shared = storage.startswith("s3://") or (provider_type(config) == "local" and storage.startswith("/"))
    if not shared:
        return failed("storage_tracking", "set metadata.storage_path to storage every node reaches "
                      "(s3://bucket/prefix; on-prem also a shared filesystem path)")
    servers = mlflow_servers(config)
    if not servers or "MLFLOW_TRACKING_URI" not in commands(config, "worker_start_ray_commands"):
        return failed("storage_tracking", "start `mlflow server` on the head and export MLFLOW_TRACKING_URI "
                      "in worker_start_ray_commands")
    argv = servers[0][0]
    if (option(argv, "--host", "-h") or "127.0.0.1") in ("0.0.0.0", "::"):
        return warned("storage_tracking", "MLflow bound to all interfaces: bind the head's private address")
    artifacts = option(argv, "--artifacts-destination") or ""
    if provider_type(config) == "aws" and not artifacts.startswith("s3://"):
        return failed("storage_tracking", "MLflow artifacts must go to S3 (--artifacts-destination s3://...)")
    return passed("storage_tracking", f"runs in {storage}; MLflow on the head, artifacts in {artifacts or 'its store'}")


def mlflow_auth(config: dict, laptop: Laptop) -> CheckResult:
    """MLflow's basic-auth app, its config and the clients' credentials shipped from outside the
    repository (MLflow has no other login: without it anyone who reaches the port edits runs)."""
    literals = [f"{what} in {where}" for where, what in literal_secrets(config)
                if not ("RAY_AUTH_TOKEN" in what or "auth_token" in what)]
    if literals:
        return failed("mlflow_auth", f"a secret is written in the file ({'; '.join(literals)}): read it from a "
                      "file shipped by file_mounts")
    servers = mlflow_servers(config)
    if not servers:
        return passed("mlflow_auth", "no MLflow server started by this file")
    argv, env = servers[0]
    if option(argv, "--app-name") != "basic-auth":
        return warned("mlflow_auth", "MLflow starts without authentication: add `--app-name basic-auth` with "
                      "MLFLOW_AUTH_CONFIG_PATH set to an ini file shipped by file_mounts")
    problems, mounts = [], {}
    if "MLFLOW_FLASK_SERVER_SECRET_KEY" not in env:
        problems.append("MLFLOW_FLASK_SERVER_SECRET_KEY is not set for `mlflow server` (it refuses to start)")
    config_path = env.get("MLFLOW_AUTH_CONFIG_PATH")
    for what, remote in (("MLFLOW_AUTH_CONFIG_PATH", config_path), ("clients' credentials", MLFLOW_CREDENTIALS_REMOTE)):
        local = _mounted_from(config, remote) if remote else None
        if local is None:
            problems.append(f"{what} ({remote or 'unset'}) is not shipped by file_mounts")
        else:
            mounts[remote] = laptop.path(local)
    inside = [str(path) for path in mounts.values() if laptop.in_repository(path)]
    if inside:
        return failed("mlflow_auth", f"MLflow credentials mounted from inside the repository: {', '.join(inside)}")
    problems += [f"{path} does not exist on this machine" for path in dict.fromkeys(mounts.values())
                 if laptop.file_mode(path) is None]
    if problems:
        return warned("mlflow_auth", "; ".join(problems) + " (the header of cluster.yaml says what the file holds)")
    return passed("mlflow_auth", "MLflow basic-auth; credentials from "
                  f"{', '.join(map(str, dict.fromkeys(mounts.values())))}")


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
