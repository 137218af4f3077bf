"""Runs on the laptop (validate): the vocabulary of a preflight report, and the pieces of a
cluster config the rules look at, read the way Ray's launcher will run them.

Rules are pure functions of the config (and of facts gathered elsewhere) that return
CheckResults; nothing here talks to Ray or AWS."""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from enum import Enum
from typing import Any, Callable, Iterable, Iterator, Mapping


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


# Every list of shell commands the launcher runs on a node.
COMMAND_KEYS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands")


def commands(config: dict[str, Any], key: str) -> str:
    """One string of the node's start commands (to search for flags; not for what runs in which
    shell: see simple_commands)."""
    return "\n".join(str(command) for command in config.get(key, []) or [])


def flag_value(script: str, flag: str) -> str | None:
    """The value of `--flag=value` or `--flag value` in a command string."""
    match = re.search(rf"{re.escape(flag)}[ =]+([^\s;]+)", script)
    return match.group(1) if match else None


# --- one launcher command, as the shell runs it --------------------------------------------
# Ray's launcher runs each entry of a command list in a new shell: a variable exported in one
# entry never reaches `ray start` in another. These read one entry at a time.

SUBSTITUTION = "$__substituted__"  # stands for $(...) and `...`: a value computed on the node
_OPERATORS = re.compile(r"&&|\|\||>>|>&|&>|<<|[;&|()<>\n]")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# Wrappers that run the next word as the command, with the same environment.
_WRAPPERS = {"nohup", "exec", "time", "command"}
_SHELLS = {"bash", "sh", "dash", "zsh"}


@dataclass(frozen=True)
class SimpleCommand:
    """One simple command: `NAME=value ... program args > target`, and what joined it to the
    one before (`;`, `&&`, `||`, `|`, `&`, a newline, or '' at the start)."""
    assignments: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]
    redirects: tuple[str, ...]
    joined_by: str = ""


def _without_substitutions(text: str) -> str:
    """`$(...)` and backquotes replaced by SUBSTITUTION, so that a `|` or `;` inside them does not
    split the command around them."""
    out, i, quote = [], 0, ""
    while i < len(text):
        char = text[i]
        if quote != "'" and text.startswith("$(", i):
            depth, j = 1, i + 2
            while j < len(text) and depth:
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                j += 1
            out.append(SUBSTITUTION)
            i = j
            continue
        if quote != "'" and char == "`":
            end = text.find("`", i + 1)
            out.append(SUBSTITUTION)
            i = len(text) if end < 0 else end + 1
            continue
        if char in "'\"" and quote in ("", char):
            quote = "" if quote else char
        elif char == "\\" and quote != "'":
            out.append(text[i:i + 2])
            i += 2
            continue
        out.append(char)
        i += 1
    return "".join(out)


def _tokens(command: str) -> list[str]:
    lexer = shlex.shlex(_without_substitutions(command.replace("\\\n", " ")), posix=True,
                        punctuation_chars=";&|()<>\n")
    lexer.whitespace, lexer.whitespace_split = " \t\r", True
    try:
        raw = list(lexer)
    except ValueError:  # an unclosed quote: the shell would refuse it too; read it as words
        raw = command.split()
    tokens = []
    for token in raw:
        if token and set(token) <= set(";&|()<>\n"):
            tokens += _OPERATORS.findall(token)
        else:
            tokens.append(token)
    return tokens


def shell_items(command: str) -> Iterator[SimpleCommand | str]:
    """The simple commands of one launcher command in order, with '(' and ')' where a subshell
    starts and ends (what is exported inside one does not outlive it)."""
    words, redirects, joined_by, target_next = [], [], "", False

    def flush() -> Iterator[SimpleCommand]:
        if words or redirects:
            count = next((i for i, w in enumerate(words) if not _ASSIGNMENT.match(w)), len(words))
            assignments = tuple(tuple(w.split("=", 1)) for w in words[:count])
            yield SimpleCommand(assignments, tuple(words[count:]), tuple(redirects), joined_by)
        words.clear()
        redirects.clear()

    for token in _tokens(command):
        if target_next:
            redirects.append(token)
            target_next = False
        elif token in (">", ">>", "&>", "<", "<<", ">&"):
            target_next = token != "<<"
            if token == ">&" and words and words[-1].isdigit():
                words.pop()  # 2>&1: the 2 belongs to the redirection
        elif token in ("(", ")"):
            yield from flush()
            yield token
            joined_by = ""
        elif token in (";", "&&", "||", "|", "&", "\n"):
            yield from flush()
            joined_by = token
        else:
            words.append(token)
    yield from flush()


def simple_commands(command: str) -> list[SimpleCommand]:
    return [item for item in shell_items(command) if isinstance(item, SimpleCommand)]


def program(simple: SimpleCommand) -> tuple[dict[str, str | None], tuple[str, ...]]:
    """(environment changes, argv) of what actually runs: `env NAME=value -u NAME prog`, `nohup
    prog` and the like are unwrapped; None marks a variable removed."""
    changes: dict[str, str | None] = dict(simple.assignments)
    argv = list(simple.argv)
    while argv:
        name = os.path.basename(argv[0])
        if name in _WRAPPERS:
            argv = argv[1:]
        elif name == "env":
            argv = argv[1:]
            while argv and (argv[0].startswith("-") or _ASSIGNMENT.match(argv[0])):
                word = argv.pop(0)
                if word in ("-u", "--unset") and argv:
                    changes[argv.pop(0)] = None
                elif _ASSIGNMENT.match(word):
                    key, value = word.split("=", 1)
                    changes[key] = value
        else:
            break
    return changes, tuple(argv)


def is_ray_start(argv: tuple[str, ...]) -> bool:
    return len(argv) >= 2 and os.path.basename(argv[0]) == "ray" and argv[1] == "start"


def is_mlflow_server(argv: tuple[str, ...]) -> bool:
    if len(argv) >= 3 and os.path.basename(argv[0]).startswith("python") and argv[1:3] == ("-m", "mlflow"):
        argv = argv[2:]
    return len(argv) >= 2 and os.path.basename(argv[0]) == "mlflow" and argv[1] in ("server", "ui")


def option(argv: tuple[str, ...], *names: str) -> str | None:
    """The value of `--name value`, `--name=value` or `-n value` in one command's argv (the last
    one wins, as with click)."""
    value = None
    for i, word in enumerate(argv):
        for name in names:
            if word == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif word.startswith(name + "=") and name.startswith("--"):
                value = word[len(name) + 1:]
    return value


def env_at(command: str, runs: Callable[[tuple[str, ...]], bool],
           initial: Mapping[str, str] | None = None) -> list[tuple[tuple[str, ...], dict[str, str]]]:
    """(argv, exported environment) of each program in this one command for which runs(argv)
    is true, starting from a new shell's environment `initial` (the container's, if any)."""
    exported, shell_vars, marked, saved, seen = dict(initial or {}), {}, set(), [], []
    for item in shell_items(command):
        if item == "(":
            saved.append((dict(exported), dict(shell_vars), set(marked)))
            continue
        if item == ")":
            exported, shell_vars, marked = saved.pop() if saved else (exported, shell_vars, marked)
            continue
        changes, argv = program(item)
        if not item.argv:  # NAME=value alone: a shell variable, exported only if marked for export
            for key, value in item.assignments:
                shell_vars[key] = value
                if key in exported or key in marked:
                    exported[key] = value
        elif argv[:1] == ("export",):
            for word in argv[1:]:
                key, _, value = word.partition("=")
                if "=" in word or key in shell_vars:
                    exported[key] = value if "=" in word else shell_vars[key]
                else:
                    marked.add(key)
        elif argv[:1] == ("unset",):
            for name in argv[1:]:
                exported.pop(name, None)
                shell_vars.pop(name, None)
                marked.discard(name)
        elif runs(argv):
            env = {**exported, **changes}
            seen.append((argv, {key: value for key, value in env.items() if value is not None}))
        elif argv and os.path.basename(argv[0]) in _SHELLS and option(argv, "-c"):  # bash -c '...'
            env = {key: value for key, value in {**exported, **changes}.items() if value is not None}
            seen += env_at(option(argv, "-c") or "", runs, env)
    return seen


def auth_mode_at_ray_start(command: str, initial: Mapping[str, str] | None = None) -> list[str | None]:
    """RAY_AUTH_MODE as each `ray start` in this one command sees it (None: not set)."""
    return [env.get("RAY_AUTH_MODE") for _, env in env_at(command, is_ray_start, initial)]


def exports_auth_token(command: str, initial: Mapping[str, str] | None = None) -> bool:
    """This one command runs `ray start`, and every `ray start` in it runs with RAY_AUTH_MODE=token."""
    modes = auth_mode_at_ray_start(command, initial)
    return bool(modes) and all(mode == "token" for mode in modes)


# --- what the nodes listen on, and who can reach it -----------------------------------------

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
        ("--dashboard-agent-grpc-port", 0, "dashboard agent gRPC"), ("--runtime-env-agent-port", 0, "runtime env agent"))]
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
