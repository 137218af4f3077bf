"""The Ray session of a driver (a training run, a sweep, the benchmark): join the cluster this
driver belongs to, or start a local one, and leave it as it was found.

Which cluster: inside a submitted job, or with $RAY_ADDRESS set, Ray's own address; else a cluster
started on this machine with `ray start`, if it is alive; else a new local cluster for this
process alone, stopped at the end.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from training.plugins import plugin_module_paths
from training.run.paths import in_submitted_job

# Read by the Ray Train controller when it starts, so they must be set before Ray starts a run.
TRAIN_ENV_DEFAULTS = {
    # The controller takes at most one report per worker per poll; poll more often than the
    # default 2 s so that reports do not stall fast steps.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    # A preemption notice gives about two minutes: notice it within a second, not five.
    "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1",
}

# Never shipped to the cluster with local plug-in source (nor, through .gitignore, with a job's
# --working-dir): the cluster's MLflow store copied here, Slurm logs, keys and secrets, Ray's state.
UPLOAD_EXCLUDES = ["mlflow*.db", "slurm-*.out", "*.pem", ".env", ".ray/"]


@dataclass(frozen=True)
class RaySession:
    started: bool     # this driver connected (and disconnects, or stops the cluster it started)
    local_only: bool  # a cluster of this machine alone, started here: no autoscaler can grow it


@contextmanager
def ray_session(*plugin_specs: str, env: Optional[dict[str, str]] = None, own_cluster: bool = False,
                log_to_driver: bool = True) -> Iterator[RaySession]:
    """Connect to Ray for the `with` block (or use the connection this process already has).
    `plugin_specs`: the job's model and data plug-ins, shipped to every node when they are local
    source (a submitted job ships them in its --working-dir); `env`: more defaults to set first;
    `own_cluster`: start a local cluster of this machine's CPUs for this process alone, whatever
    else runs here (the benchmark measures on a cluster nothing else uses)."""
    import ray

    for key, value in {**TRAIN_ENV_DEFAULTS, **(env or {})}.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        yield RaySession(started=False, local_only=False)
        return
    plugin_paths = [] if in_submitted_job() else plugin_module_paths(*plugin_specs)
    if own_cluster:
        live_local_cluster()  # forgets a dead cluster's address, which Ray's state API would wait on
        address = "local"
    else:
        address = None if os.environ.get("RAY_ADDRESS") else (live_local_cluster() or "local")
    # Started locally, Ray includes the dashboard: it serves the state API that Ray Train's
    # placement-group cleaner needs.
    ray.init(address=address, log_to_driver=log_to_driver, num_cpus=os.cpu_count() if own_cluster else None,
             runtime_env={"py_modules": plugin_paths, "excludes": UPLOAD_EXCLUDES} if plugin_paths else None)
    try:
        yield RaySession(started=True, local_only=address == "local")
    finally:
        ray.shutdown()


def live_local_cluster() -> Optional[str]:
    """The address of a cluster started on this machine with `ray start`, if it is alive. A dead
    cluster's address (left in /tmp/ray/ray_current_cluster when its head was killed) is forgotten,
    as `ray stop` would: `ray.init()` would wait on it, and so would the state API in every process
    of the next cluster (40 s per call: Ray Train's placement-group cleaner stalls each run's end)."""
    from training.adaptors.ray_private import forget_recorded_address, recorded_local_address

    try:
        address = recorded_local_address()
    except Exception:  # none recorded (or Ray's private helpers moved): start a local cluster
        return None
    if address is None:
        return None
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except (OSError, ValueError):
        forget_recorded_address()
        return None
    return address
