"""Every private Ray API that training and tuning use, in one place (any process imports it).

Ray 2.60 keeps these out of its stability promise; `tests/test_adaptors.py` checks each one, so a
Ray upgrade that moves one fails there, by name, instead of deep inside a run. Ray is imported
lazily: importing this module costs nothing.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import time
import zipfile
from dataclasses import dataclass
from typing import Callable, Optional

NIL_ACTOR = "f" * 32


def controller_callback_base() -> type:
    """Ray Train V2's `ControllerCallback` (a DeveloperAPI under `_internal`): hooks that run on the
    Train controller when the run ends or is aborted."""
    from ray.train.v2._internal.execution.callback import ControllerCallback  # (lazy: ray.train)

    return ControllerCallback


def default_preemption_deadline_s() -> float:
    """How long Ray Train waits for a drained node when the drain gave no deadline."""
    from ray.train.v2._internal.constants import DEFAULT_PREEMPTION_DEADLINE_S  # (lazy: ray.train)

    return float(DEFAULT_PREEMPTION_DEADLINE_S)


def checkpoint_upload_retry_markers() -> tuple[str, ...]:
    """The texts that make Ray Train retry a whole checkpoint upload (`_upload_checkpoint` retries
    when the error's message contains one): an upload that retries on its own keeps them out of
    the error it gives up with."""
    from ray.train.v2._internal.constants import AWS_RETRYABLE_TOKENS  # (lazy: ray.train)

    return tuple(AWS_RETRYABLE_TOKENS)


def quiet_report_logs() -> None:
    """Ray Train logs every report at INFO from a logger named after its context module's file;
    raise that logger to WARNING (the controller prints one progress line per report instead)."""
    try:
        from ray.train.v2._internal.execution import context as train_context  # (lazy: ray.train)
    except ImportError:
        return
    logging.getLogger(train_context.__file__).setLevel(logging.WARNING)


def recorded_local_address() -> Optional[str]:
    """The GCS address the last `ray start` on this machine recorded (/tmp/ray/ray_current_cluster),
    or None. Raises ImportError if Ray moved the helper."""
    from ray._private.services import get_ray_address_from_environment  # (lazy: ray)

    return get_ray_address_from_environment(None, None)


def recorded_address_file() -> str:
    """Where `ray start` records the address (/tmp/ray/ray_current_cluster, or under $RAY_TMPDIR):
    its session directories lie next to it."""
    from ray._common.utils import get_ray_address_file  # (lazy: ray)

    return get_ray_address_file(None)


@dataclass(frozen=True)
class GcsAnswer:
    answered: bool                # a gRPC server answered the call (Ray's GCS, or one that refused it)
    session_name: Optional[str]   # what Ray's GCS holds as this cluster's session, when it said


def ask_gcs_session_name(address: str, timeout_s: float) -> GcsAnswer:
    """The real RPC that a driver joining a cluster makes first (`ray.init` reads the session name
    from the GCS's key-value store), with a deadline: ray.init itself waits about 40 s on an
    address where no GCS answers. TLS and token auth as Ray's own clients set them up."""
    import grpc  # (Ray's transport: 0.05 s the config path does without)
    from ray._private.grpc_utils import init_grpc_channel  # (lazy: ray)
    from ray._private.ray_constants import KV_NAMESPACE_SESSION  # (lazy: ray)
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc  # (lazy: ray)

    channel = init_grpc_channel(address)
    try:
        reply = gcs_service_pb2_grpc.InternalKVGcsServiceStub(channel).InternalKVGet(
            gcs_service_pb2.InternalKVGetRequest(key=b"session_name", namespace=KV_NAMESPACE_SESSION),
            timeout=timeout_s)
    except grpc.RpcError as exc:
        no_answer = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        return GcsAnswer(answered=not no_answer, session_name=None)
    finally:
        channel.close()
    name = reply.value.decode() if reply.status.code == 0 and reply.value else None
    return GcsAnswer(answered=True, session_name=name)


def forget_recorded_address() -> None:
    """Remove the recorded address, as `ray stop` does."""
    from ray._common.utils import reset_ray_address  # (lazy: ray)

    reset_ray_address()


def working_dir_upload_files(directory: str, excludes: list[str]) -> list[str]:
    """The files (paths relative to `directory`) that Ray would ship of it as a `working_dir` or in
    `py_modules` with these `excludes`: Ray's own packing (it honours .gitignore and .rayignore,
    .gitignore unless RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1), into a zip that is then read back."""

    from ray._private.ray_constants import RAY_RUNTIME_ENV_IGNORE_GITIGNORE  # (lazy: ray)
    from ray._private.runtime_env.packaging import _zip_files  # (lazy: ray)

    include_gitignore = os.environ.get(RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"
    with tempfile.TemporaryDirectory() as tmp:
        package = os.path.join(tmp, "package.zip")
        _zip_files(directory, list(excludes), package, include_gitignore=include_gitignore)
        with zipfile.ZipFile(package) as archive:
            return sorted(name for name in archive.namelist() if not name.endswith("/"))


def placement_groups() -> list:
    """Every placement group in the GCS table, as `gcs_pb2.PlacementGroupTableData`: the only view
    that says which actor created a group and whether that actor is dead."""
    from ray._private.state import state  # (lazy: ray)
    from ray.core.generated import gcs_pb2  # (lazy: ray)

    table = gcs_pb2.PlacementGroupTableData
    return [table.FromString(raw) for raw in state._connect_and_get_accessor().get_placement_group_table()]


def placement_group_removed_state() -> int:
    from ray.core.generated import gcs_pb2  # (lazy: ray)

    return gcs_pb2.PlacementGroupTableData.REMOVED


def actor_records(job_id: str) -> list:
    """Every actor of job `job_id` (hex) in the GCS table, alive or dead, as `gcs_pb2.ActorTableData`:
    the only view that says which worker runs an actor (`address.worker_id`, kept once it is dead)
    and which worker owns it (`owner_address.worker_id`: an actor started from a thread of another
    actor is owned by that actor's worker)."""
    import ray  # (lazy: ray)
    from ray._private.state import state  # (lazy: ray)
    from ray.core.generated import gcs_pb2  # (lazy: ray)

    table = gcs_pb2.ActorTableData
    accessor = state._connect_and_get_accessor()
    return [table.FromString(raw) for raw in accessor.get_actor_table(ray.JobID(bytes.fromhex(job_id)), None)]


def actor_dead_state() -> int:
    from ray.core.generated import gcs_pb2  # (lazy: ray)

    return gcs_pb2.ActorTableData.DEAD


def trial_actor_id(trial) -> Optional[str]:
    """The hex id of the actor a Tune trial runs in now (as a Tune callback's `on_trial_start`
    receives the trial), or None when it has none."""
    actor = trial.temporary_state.ray_actor
    return actor._actor_id.hex() if actor is not None else None


def kill_actor_by_id(actor_id: str, timeout_s: float = 10.0) -> None:
    """End an actor at once, not restarted, as `ray.kill` does, for an actor this process holds no
    handle to (`ray.kill` needs one, and Ray's core worker aborts the process when asked for a handle
    it never had): the GCS's own kill call, with TLS and token auth as Ray's clients set them up."""
    import ray  # (lazy: ray)
    from ray._private.grpc_utils import init_grpc_channel  # (lazy: ray)
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc  # (lazy: ray)

    channel = init_grpc_channel(ray.get_runtime_context().gcs_address)
    try:
        reply = gcs_service_pb2_grpc.ActorInfoGcsServiceStub(channel).KillActorViaGcs(
            gcs_service_pb2.KillActorViaGcsRequest(actor_id=bytes.fromhex(actor_id), force_kill=True, no_restart=True),
            timeout=timeout_s)
    finally:
        channel.close()
    if reply.status.code != 0:
        raise RuntimeError(f"actor {actor_id}: the GCS refused to kill it: {reply.status.message}")


def result_grid_trials(grid) -> list:
    """The Tune trials behind a `ResultGrid`, in the grid's order: the only view that gives each
    result its trial id."""
    return list(grid._experiment_analysis.trials)


def controller_state_name(state) -> str:
    """The name of a Ray Train controller state (`TrainControllerStateType`: RUNNING, RESTARTING,
    PREEMPTING, ...) as `ControllerCallback.after_controller_state_update` receives it."""
    return state._state_type.name


def worker_failures(error: BaseException) -> list[BaseException]:
    """The exceptions the workers failed with, when `error` is Ray Train's `WorkerGroupError` (as
    `fit` raises it, and as the controller's failure policy receives it); else none. Ray Train hands
    each worker's own exception over (unwrapped from its `UserExceptionWithTraceback`)."""
    return list((getattr(error, "worker_failures", None) or {}).values())


def caused_by(error: BaseException, kinds: tuple[type, ...]) -> Optional[BaseException]:
    """The first exception of `kinds` in `error` or in what it wraps (the cause a worker's error was
    raised from, a Ray task error's cause, Ray Train's wrapper of a worker's exception); else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kinds):
            return error
        seen.add(id(error))
        error = (getattr(error, "_base_exc", None) or getattr(error, "cause", None)
                 or getattr(error, "health_check_failure", None) or error.__cause__)
    return None


def unplaceable_workers(error: BaseException) -> Optional[int]:
    """How many workers Ray Train's controller could not place, when it failed to start a worker
    group because its placement group was not placed within Ray Train's wait
    (`WorkerGroupStartupTimeoutError`, in a `ControllerError`); else None."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError  # (lazy: ray.train)

    failure = getattr(error, "controller_failure", None)
    return failure.num_workers if isinstance(failure, WorkerGroupStartupTimeoutError) else None


class BoundedFailurePolicy:
    """Ray Train's own failure policy (the one its `fit` builds from the FailureConfig), with two
    rules before it, decided on the Train controller:

    - a worker failure caused by one of `final` (a deterministic data error: a restart reads the
      same file and fails the same way) ends the run at once, whatever `max_failures` allows;
    - a worker group that cannot be placed (Ray Train waits for its placement group a minute at a
      time and, with `controller_failure_limit` -1, tries again for ever) ends the run once it has
      been unplaceable for `placement_timeout_s` in a row.

    Ray Train's `FailurePolicy` interface is its one method, `make_decision`; the controller calls
    nothing else. `clock` is injected (monotonic seconds)."""

    def __init__(self, inner, final: tuple[type, ...], placement_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.inner, self.final, self.placement_timeout_s, self.clock = inner, final, placement_timeout_s, clock
        self.failure_config = inner.failure_config
        self.unplaceable_since: Optional[float] = None

    def make_decision(self, training_failed_error):
        from ray.train.v2._internal.execution.failure_handling import FailureDecision  # (lazy: ray.train)

        if any(caused_by(failure, self.final) for failure in worker_failures(training_failed_error)):
            return FailureDecision.RAISE
        if unplaceable_workers(training_failed_error) is not None:
            now = self.clock()
            if self.unplaceable_since is None:
                self.unplaceable_since = now
            if now - self.unplaceable_since >= self.placement_timeout_s:
                return FailureDecision.RAISE
        else:
            self.unplaceable_since = None  # any other outcome: a group was placed since, or it failed otherwise
        return self.inner.make_decision(training_failed_error)


@functools.cache
def torch_trainer_class() -> type:
    """Ray Train's TorchTrainer, whose controller decides failures by a `BoundedFailurePolicy`
    around the policy Ray Train builds (`DataParallelTrainer.fit` passes it to
    `_initialize_and_run_controller` as `failure_policy`). Give it `final_errors` and
    `placement_timeout_s` as keyword arguments."""
    from ray.train.torch import TorchTrainer  # (lazy: ray.train, torch)

    class BoundedTorchTrainer(TorchTrainer):
        def __init__(self, *args, final_errors: tuple[type, ...], placement_timeout_s: float, **kwargs):
            super().__init__(*args, **kwargs)
            self.final_errors, self.placement_timeout_s = final_errors, placement_timeout_s

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            controller_init_kwargs["failure_policy"] = BoundedFailurePolicy(
                controller_init_kwargs["failure_policy"], self.final_errors, self.placement_timeout_s)
            return super()._initialize_and_run_controller(**controller_init_kwargs)

        def _register_sigint_handler(self, controller):
            """Ctrl-C is the driver's (training/run/interrupt.py): Ray Train's handler waits on the
            controller's abort, a minute and more while the group waits for placement."""

    return BoundedTorchTrainer


def autoscaler_node_groups() -> Optional[list[tuple[dict[str, float], float]]]:
    """The node groups an autoscaler published in the GCS (KubeRay, Ray's autoscaler v2), as
    (one node's resources, the most nodes of it: inf for no bound), or None where none is published
    (a local or fixed cluster; the launcher's autoscaler: $TRAINING_CLUSTER_CONFIG says it there)."""
    try:
        from ray._private.state import state  # (connected: the driver's Ray session)

        config = state.get_cluster_config()
    except Exception:  # (Ray's private state API moved, or the GCS did not answer: not known)
        return None
    if config is None or not config.node_group_configs:
        return None
    return [({key: float(value) for key, value in group.resources.items()},
             float("inf") if group.max_count == -1 else float(group.max_count)) for group in config.node_group_configs]
