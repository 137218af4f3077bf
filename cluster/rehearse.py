"""Autoscaling rehearsal on one machine: a cluster config's node types become Ray's fake
multi-node provider (same names, same resources, logical GPUs), a head starts locally with it,
and a job that needs several GPU workers runs; the autoscaler launches fake nodes and releases
them when idle. Ray does the scaling; this module only translates, starts, watches and stops."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from cluster.checks import head_type, worker_types
from cluster.config import ConfigError, load_and_prepare

FAKE_HEAD_TYPE = "ray.head.default"  # the fake provider tags its head with this type
GCS_PORT = 6379                      # launched fake nodes only find a head on the default port


@dataclass(frozen=True)
class RehearsalResult:
    events: tuple[dict, ...]
    peak_gpu_nodes: int
    scaled_down: bool
    active_at_peak: tuple[str, ...] = ()   # `ray status` "Active:" lines, e.g. "2 gpu_spot"

    @property
    def ok(self) -> bool:
        return self.peak_gpu_nodes > 0 and self.scaled_down


def fake_cluster_config(prepared: dict, gpu_workers: int, idle_timeout_s: float) -> dict:
    """The node types of `prepared` on Ray's fake_multinode provider; max_workers capped at what
    the rehearsal needs so one machine is not flooded with raylets."""
    types = {FAKE_HEAD_TYPE: {"resources": dict(head_type(prepared).get("resources") or {"CPU": 1}),
                              "node_config": {}, "max_workers": 0}}
    for name, spec in worker_types(prepared).items():
        resources = dict(spec.get("resources") or {})
        if not resources:
            raise ConfigError(f"node type {name} declares no resources: the rehearsal needs them")
        types[name] = {"resources": resources, "node_config": {}, "min_workers": 0,
                       "max_workers": min(int(spec.get("max_workers", 0)), gpu_workers),
                       "priority": int(spec.get("priority", 0))}
    return {"cluster_name": f"{prepared.get('cluster_name', 'cluster')}-rehearsal",
            "max_workers": gpu_workers, "upscaling_speed": float(prepared.get("upscaling_speed", 1.0)),
            "idle_timeout_minutes": idle_timeout_s / 60.0,
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True},
            "available_node_types": types, "head_node_type": FAKE_HEAD_TYPE,
            "auth": {}, "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
            "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
            "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
            "worker_start_ray_commands": []}


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (read from /proc: the fake nodes are children of Ray's monitor)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _stop(head: subprocess.Popen) -> None:
    """Stop only what this rehearsal started: the head's process group, then any descendant."""
    stragglers = _descendants(head.pid)
    try:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in stragglers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _active_node_types(env: dict) -> list[str]:
    """The "Active:" section of `ray status`: how many nodes of each type the autoscaler runs."""
    done = subprocess.run([str(Path(sys.executable).parent / "ray"), "status", f"--address=127.0.0.1:{GCS_PORT}"],
                          env=env, capture_output=True, text=True, timeout=60)
    lines, inside = [], False
    for line in done.stdout.splitlines():
        if line.strip().startswith("Active:"):
            inside = True
        elif inside and (not line.strip() or line.strip().endswith(":")):
            break
        elif inside:
            lines.append(line.strip())
    return lines


def rehearse(path: str | os.PathLike, gpu_workers: int = 2, idle_timeout_s: float = 10.0,
             timeout_s: float = 240.0, echo=print) -> RehearsalResult:
    _, prepared = load_and_prepare(path)
    config = fake_cluster_config(prepared, gpu_workers, idle_timeout_s)
    if not _port_free(GCS_PORT):
        raise ConfigError(f"port {GCS_PORT} is in use (another Ray head?): the fake cluster needs it")
    workdir = Path(tempfile.mkdtemp(prefix="cluster-rehearsal-"))
    (workdir / "autoscaling.yaml").write_text(yaml.safe_dump(config))
    head_resources = config["available_node_types"][FAKE_HEAD_TYPE]["resources"]
    bin_dir = Path(sys.executable).parent
    # Token authentication on, with a token of the rehearsal's own (what `ray get-auth-token --generate`
    # writes): `ray start` in token mode refuses to start without one, and the user's ~/.ray/auth_token
    # (for a real cluster) is neither needed nor touched.
    token = workdir / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    env.pop("RAY_AUTH_TOKEN", None)
    echo(f"rehearsal: node types {', '.join(config['available_node_types'])}; head {head_resources}; "
         f"idle timeout {idle_timeout_s:g} s; config {workdir / 'autoscaling.yaml'}")
    head = subprocess.Popen(
        [str(bin_dir / "ray"), "start", "--head", "--block", f"--port={GCS_PORT}",
         f"--autoscaling-config={workdir / 'autoscaling.yaml'}", "--include-dashboard=false",
         f"--num-cpus={head_resources.get('CPU', 1)}", f"--num-gpus={head_resources.get('GPU', 0)}",
         "--disable-usage-stats"],
        env=env, stdout=open(workdir / "head.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    events: list[dict] = []
    active: list[str] = []
    try:
        job = subprocess.Popen([sys.executable, "-m", "cluster.rehearse_job", str(gpu_workers), str(timeout_s)],
                               cwd=Path(__file__).resolve().parent.parent, text=True,
                               env={**env, "RAY_ADDRESS": f"127.0.0.1:{GCS_PORT}"},
                               stdout=subprocess.PIPE, stderr=open(workdir / "job.log", "w"))
        for line in job.stdout:
            if line.startswith("{"):
                event = json.loads(line)
                events.append(event)
                echo(f"  {event['t_s']:6.1f} s  {event['event']:16} "
                     + " ".join(f"{k}={v}" for k, v in event.items() if k not in ("t_s", "event")))
                if not active and len(event.get("gpu_nodes", [])) >= gpu_workers:
                    active = _active_node_types(env)
                    echo(f"           ray status: active {', '.join(active) or '?'}")
        job.wait(timeout=timeout_s)
    finally:
        _stop(head)
    peak = max((len(e.get("gpu_nodes", [])) for e in events), default=0)
    result = RehearsalResult(tuple(events), peak, any(e["event"] == "scaled_down" for e in events), tuple(active))
    echo(f"rehearsal {'passed' if result.ok else 'failed'}: up to {peak} GPU node(s), "
         f"{'released when idle' if result.scaled_down else 'NOT released'} (logs: {workdir})")
    return result
