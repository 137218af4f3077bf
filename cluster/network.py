"""Runs on the laptop (validate): what a cluster's nodes listen on (Ray's and MLflow's ports, as
the start commands start them) and who can reach it (addresses as ranges, ingress rules as ports
open to them). The policy both the static and the live security-group checks share.

Pure functions; nothing here opens a socket or talks to AWS."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from cluster.shell import env_at, is_mlflow_server, is_ray_start, option

# --- what the nodes listen on --------------------------------------------------------------

# A port given as 0 (or left to Ray) is picked by the kernel from Linux's ephemeral range.
EPHEMERAL_PORTS = (32768, 60999)
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True)
class Listener:
    """A port (or range) a node listens on, what listens, and the address it binds when the
    service takes one (None: every interface)."""
    low: int
    high: int
    what: str
    host: str | None = None

    def label(self) -> str:
        ports = str(self.low) if self.low == self.high else f"{self.low}-{self.high}"
        return f"{ports} ({self.what})"


def _port(argv: tuple[str, ...], flag: str, default: int) -> int | None:
    value = option(argv, flag)
    try:
        return default if value is None else int(value)
    except ValueError:  # $VAR or garbage: Ray decides at start; assume its default
        return default


def ray_start_listeners(argv: tuple[str, ...]) -> list[Listener]:
    """The ports one `ray start` opens, from its flags and Ray 2.60's defaults; the ports left
    to the kernel are one range."""
    wanted = []  # (port or 0 for random, what, bind address)
    if "--head" in argv:
        wanted.append((_port(argv, "--port", 6379), "GCS", None))
        if (option(argv, "--include-dashboard") or "true").lower() not in ("false", "0"):
            wanted.append((_port(argv, "--dashboard-port", 8265), "dashboard",
                           option(argv, "--dashboard-host") or "127.0.0.1"))
        wanted.append((_port(argv, "--ray-client-server-port", 10001), "Ray client", None))
    wanted += [(_port(argv, flag, default), what, None) for flag, default, what in (
        ("--object-manager-port", 0, "object manager"), ("--node-manager-port", 0, "node manager"),
        ("--metrics-export-port", 0, "metrics"), ("--dashboard-agent-listen-port", 52365, "dashboard agent"),
        ("--dashboard-agent-grpc-port", 0, "dashboard agent gRPC"),
        ("--runtime-env-agent-port", 0, "runtime env agent"))]
    found = [Listener(port, port, what, host) for port, what, host in wanted if port]
    random = [what for port, what, _ in wanted if not port]
    if random:
        found.append(Listener(*EPHEMERAL_PORTS, f"random: {', '.join(random)}"))
    listed = option(argv, "--worker-port-list")
    if listed:
        found += [Listener(int(p), int(p), "worker") for p in listed.split(",") if p.strip().isdigit()]
    else:
        found.append(Listener(_port(argv, "--min-worker-port", 10002) or EPHEMERAL_PORTS[0],
                              _port(argv, "--max-worker-port", 19999) or EPHEMERAL_PORTS[1], "worker ports"))
    return found


def mlflow_listener(argv: tuple[str, ...]) -> Listener:
    port = _port(argv, "-p", 5000) if option(argv, "-p") is not None else _port(argv, "--port", 5000)
    return Listener(port, port, "MLflow", option(argv, "--host", "-h") or "127.0.0.1")


def listeners(config: dict[str, Any]) -> list[Listener]:
    """Every port Ray and MLflow listen on, as the start commands start them (deduplicated)."""
    found: list[Listener] = []
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for command in config.get(key) or []:
            for argv, _ in env_at(str(command), lambda a: is_ray_start(a) or is_mlflow_server(a)):
                found += ray_start_listeners(argv) if is_ray_start(argv) else [mlflow_listener(argv)]
    return list(dict.fromkeys(found))


def default_listeners(mlflow_port: int) -> list[Listener]:
    """What a head and a worker started with plain `ray start`, and MLflow on mlflow_port, open."""
    return list(dict.fromkeys([*ray_start_listeners(("ray", "start", "--head")),
                               Listener(mlflow_port, mlflow_port, "MLflow")]))


def mlflow_port(config: dict) -> int:
    """The port MLflow listens on: the start commands' `mlflow server`, else metadata.mlflow_port."""
    started = [item for item in listeners(config) if item.what == "MLflow"]
    return started[0].low if started else int((config.get("metadata") or {}).get("mlflow_port", 5000))


# --- addresses: the internet or not --------------------------------------------------------

PRIVATE_NETWORKS = tuple(ipaddress.ip_network(net) for net in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "127.0.0.0/8", "169.254.0.0/16",  # RFC 1918, loopback, link-local
    "fc00::/7", "fe80::/10", "::1/128"))


def reaches_internet(cidr: str, trusted: Iterable[str] = ()) -> bool:
    """True unless the range lies entirely inside private, loopback or link-local space (or a
    trusted range such as the cluster's VPC). An unreadable range counts as the internet."""
    try:
        network = ipaddress.ip_network(str(cidr).strip(), strict=False)
        inside = [*PRIVATE_NETWORKS, *(ipaddress.ip_network(t, strict=False) for t in trusted)]
    except ValueError:
        return True
    return not any(network.version == net.version and network.subnet_of(net) for net in inside)


def public_span(cidrs: Iterable[str]) -> list[str]:
    """The internet-reachable ranges among cidrs, merged (0.0.0.0/1 and 128.0.0.0/1 are 0.0.0.0/0)."""
    nets = []
    for cidr in cidrs:
        if reaches_internet(cidr):
            try:
                nets.append(ipaddress.ip_network(str(cidr).strip(), strict=False))
            except ValueError:
                nets.append(ipaddress.ip_network("0.0.0.0/0"))
    merged = [*ipaddress.collapse_addresses(n for n in nets if n.version == 4),
              *ipaddress.collapse_addresses(n for n in nets if n.version == 6)]
    return [str(net) for net in merged]


def is_too_wide(cidr: str) -> bool:
    """Wider than one organisation plausibly owns: more than a /8 of IPv4 or a /32 of IPv6."""
    network = ipaddress.ip_network(cidr, strict=False)
    return network.prefixlen < (8 if network.version == 4 else 32)


# --- ingress rules: which listeners the internet reaches -----------------------------------


def _ports(rule: dict) -> tuple[int, int] | None:
    """The TCP port range an ingress rule opens (Ray and MLflow speak TCP only); None for UDP/ICMP."""
    protocol = str(rule.get("IpProtocol", "-1")).lower()
    if protocol in ("-1", "all"):
        return 0, 65535
    if protocol not in ("tcp", "6"):
        return None
    low = rule.get("FromPort", -1)
    if low in (-1, None):
        return 0, 65535
    high = rule.get("ToPort", low)
    return int(low), 65535 if high in (-1, None) else int(high)


def _sources(rule: dict) -> list[str]:
    return ([str(r.get("CidrIp", "")) for r in rule.get("IpRanges", []) or []]
            + [str(r.get("CidrIpv6", "")) for r in rule.get("Ipv6Ranges", []) or []])


def exposure(rules: list[dict], mlflow_port: int = 5000, listening: Sequence[Listener] | None = None,
             trusted: Iterable[str] = ()) -> tuple[list[str], list[str], list[str]]:
    """(Ray/MLflow ports the internet reaches, SSH ranges too wide to be one network, SSH sources):
    the policy shared by the static rule (config) and the live one (an existing security group).
    listening: what the nodes listen on (default: plain `ray start` and MLflow on mlflow_port);
    trusted: ranges that are not the internet besides private space (the cluster's VPC)."""
    listening = sorted(default_listeners(mlflow_port) if listening is None else listening,
                       key=lambda item: (item.low, item.high))
    trusted = list(trusted)
    open_ports, ssh_sources = [], []
    for rule in rules:
        ports = _ports(rule)
        if ports is None:
            continue
        low, high = ports
        if any(reaches_internet(source, trusted) for source in _sources(rule)):
            open_ports += [item.label() for item in listening if item.low <= high and low <= item.high]
        if low <= 22 <= high:
            ssh_sources += sorted(_sources(rule))
    ssh_world = [span for span in public_span(ssh_sources) if is_too_wide(span)]
    return list(dict.fromkeys(open_ports)), ssh_world, ssh_sources
