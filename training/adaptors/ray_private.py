"""Every private Ray API that training and tuning use, in one place (any process imports it).

Ray 2.60 keeps these out of its stability promise; `tests/test_adaptors.py` checks each one, so a
Ray upgrade that moves one fails there, by name, instead of deep inside a run. Ray is imported
lazily: importing this module costs nothing.
"""

from __future__ import annotations

import logging
import os
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Optional

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


def result_grid_trials(grid) -> list:
    """The Tune trials behind a `ResultGrid`, in the grid's order: the only view that gives each
    result its trial id."""
    return list(grid._experiment_analysis.trials)


def controller_state_name(state) -> str:
    """The name of a Ray Train controller state (`TrainControllerStateType`: RUNNING, RESTARTING,
    PREEMPTING, ...) as `ControllerCallback.after_controller_state_update` receives it."""
    return state._state_type.name
