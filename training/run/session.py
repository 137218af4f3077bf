"""The Ray session of a driver (a training run, a sweep, the benchmark): join the cluster this
driver belongs to, or start a local one, and leave it as it was found.

Which cluster: inside a submitted job, or with $RAY_ADDRESS set, Ray's own address; else a cluster
started on this machine with `ray start`, if its GCS answers and its session is on disk; \
else a new local cluster for this
process alone, stopped at the end.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from training.adaptors import ray_private
from training.errors import UserError, first_line
from training.plugins import plugin_module_paths
from training.redaction import redact
from training.run.interrupt import keep_handlers
from training.run.paths import in_submitted_job

# Read by the Ray Train controller when it starts, so they must be set before Ray starts a run.
TRAIN_ENV_DEFAULTS = {
    # The controller takes at most one report per worker per poll; poll more often than the
    # default 2 s so that reports do not stall fast steps.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    # A preemption notice gives about two minutes: notice it within a second, not five.
    "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1",
    # failure.mode continue: torchft's Rust side (the lighthouse actor, each worker's manager) logs
    # every quorum at info level, several lines a step; read by the processes a local Ray starts.
    "RUST_LOG": "warn",
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
    import ray  # (lazy: ray)

    for key, value in {**TRAIN_ENV_DEFAULTS, **(env or {})}.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        yield RaySession(started=False, local_only=False)
        return
    plugin_paths = [] if in_submitted_job() else plugin_module_paths(*plugin_specs)
    if own_cluster:
        try:
            live_local_cluster()  # forgets a dead cluster's address, which Ray's state API would wait on
        except UserError:
            pass  # a recorded cluster that cannot be joined: this driver starts its own anyway
        address = "local"
    else:
        address = None if os.environ.get("RAY_ADDRESS") else (live_local_cluster() or "local")
    # Started locally, Ray includes the dashboard: it serves the state API that Ray Train's
    # placement-group cleaner needs.
    try:
        with keep_handlers():  # (Ctrl-C and SIGTERM stay the driver's: training/run/interrupt.py)
            ray.init(address=address, log_to_driver=log_to_driver, num_cpus=os.cpu_count() if own_cluster else None,
                     runtime_env={"py_modules": plugin_paths, "excludes": UPLOAD_EXCLUDES} if plugin_paths else None)
    except (ConnectionError, ray.exceptions.AuthenticationError) as exc:  # (no token here / the wrong one)
        if address == "local":
            raise
        raise UserError(cannot_join_message(address or os.environ.get("RAY_ADDRESS", ""), exc)) from None
    try:
        yield RaySession(started=True, local_only=address == "local")
    finally:
        ray.shutdown()


# What to do when the cluster to join cannot be reached.
UNREACHABLE_HINT = ("check the address and that the cluster is up (`ray status --address ADDRESS`), "
                    "or unset RAY_ADDRESS to run on a local Ray of this machine")


def cannot_join_message(address: str, exc: BaseException) -> str:
    """What to do when the Ray cluster to join does not let this driver in."""

    chain, cause = [], exc
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    where = f"the Ray cluster at {redact(address)}" + (" (RAY_ADDRESS)" if os.environ.get("RAY_ADDRESS") else "")
    import ray  # (lazy: ray)

    if any(isinstance(e, ray.exceptions.AuthenticationError) or "InvalidAuthToken" in str(e) for e in chain):
        return (f"{where} refused this driver: it needs the cluster's authentication token. On the cluster's "
                "machine `ray get-auth-token` prints it; put it in ~/.ray/auth_token here (or RAY_AUTH_TOKEN) and "
                "set RAY_AUTH_MODE=token; or submit the run with "
                "`ray job submit --working-dir . -- python -m training CONFIG`")
    return f"could not join {where}: {first_line(exc, 1000)}; {UNREACHABLE_HINT}"


# How long the recorded cluster's GCS has to answer: a live one answers in milliseconds. A cluster
# named by RAY_ADDRESS may be across a network: longer.
GCS_ANSWER_TIMEOUT_S = 3.0
RAY_ADDRESS_ANSWER_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RecordedClusterDecision:
    """What to do with the cluster address that `ray start` recorded on this machine."""
    join: bool                   # connect to it
    forget: bool = False         # remove the record (as `ray stop` does) and start a local cluster
    problem: Optional[str] = None  # neither: what is wrong and how to clear it (the user's to fix)


def decide_recorded_cluster(address: str, record_file: str, answered: bool, session_name: Optional[str],
                            session_dir_exists: bool) -> RecordedClusterDecision:
    """`answered`, `session_name`: how the address answered Ray's first call (see
    ray_private.ask_gcs_session_name); `session_dir_exists`: whether that session's directory is
    next to the record. A port that is open is not enough: a cluster left by a killed run keeps
    its GCS port open after its session files are deleted, and `ray.init` then fails after 40 s."""
    if not answered:  # a killed cluster's record, or another program on its old port
        return RecordedClusterDecision(join=False, forget=True)
    if session_name is None or session_dir_exists:  # a refusal (auth, TLS) is Ray's own to explain
        return RecordedClusterDecision(join=True)
    session_dir = os.path.join(os.path.dirname(record_file), session_name)
    return RecordedClusterDecision(join=False, problem=(
        f"the Ray cluster recorded in {record_file} ({address}) is running but its session directory "
        f"{session_dir} is gone (a run killed earlier left it): stop it with `ray stop` (or end its "
        "processes), or set RAY_ADDRESS to the cluster to use, and run again"))


def live_local_cluster() -> Optional[str]:
    """The address of a cluster started on this machine with `ray start`, if it can be joined. A
    dead cluster's address (left in /tmp/ray/ray_current_cluster when its head was killed) is
    forgotten, as `ray stop` would: `ray.init()` would wait on it, and so would the state API in
    every process of the next cluster (40 s per call: Ray Train's placement-group cleaner stalls
    each run's end). A live cluster that cannot be joined raises UserError saying how to clear it."""

    try:
        address = ray_private.recorded_local_address()
        record_file = ray_private.recorded_address_file()
    except Exception:  # none recorded (or Ray's private helpers moved): start a local cluster
        return None
    if address is None:
        return None
    answer = ray_private.ask_gcs_session_name(address, GCS_ANSWER_TIMEOUT_S)
    session_dir = os.path.join(os.path.dirname(record_file), answer.session_name or "")
    decision = decide_recorded_cluster(address, record_file, answer.answered, answer.session_name,
                                       bool(answer.session_name) and os.path.isdir(session_dir))
    if decision.problem:
        raise UserError(decision.problem)
    if decision.forget:
        ray_private.forget_recorded_address()
    return address if decision.join else None


def check_cluster_to_join() -> None:
    """Before anything starts: UserError if the cluster this driver would join cannot be joined: a
    recorded local cluster in that state (see live_local_cluster), or a RAY_ADDRESS where no GCS
    answers (ray.init would wait minutes on it)."""
    import ray  # (lazy: ray)

    if ray.is_initialized() or in_submitted_job():
        return
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if not address:
        live_local_cluster()
        return
    if address in ("auto", "local") or "://" in address or ":" not in address:
        return  # Ray's own words for the recorded or a new cluster; a Ray Client address

    try:
        answer = ray_private.ask_gcs_session_name(address, RAY_ADDRESS_ANSWER_TIMEOUT_S)
    except ray.exceptions.AuthenticationError as exc:  # token auth on, and no token here
        raise UserError(cannot_join_message(address, exc)) from None
    if not answer.answered:
        raise UserError(f"no Ray cluster answers at RAY_ADDRESS={redact(address)} (within "
                        f"{RAY_ADDRESS_ANSWER_TIMEOUT_S:g} s): {UNREACHABLE_HINT}")
