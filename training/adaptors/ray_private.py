"""Every private Ray API that training and tuning use, in one place (any process imports it).

Ray 2.60 keeps these out of its stability promise; `tests/test_adaptors.py` checks each one, so a
Ray upgrade that moves one fails there, by name, instead of deep inside a run. Ray is imported
lazily: importing this module costs nothing.
"""

from __future__ import annotations

import logging
from typing import Optional

NIL_ACTOR = "f" * 32


def controller_callback_base() -> type:
    """Ray Train V2's `ControllerCallback` (a DeveloperAPI under `_internal`): hooks that run on the
    Train controller when the run ends or is aborted."""
    from ray.train.v2._internal.execution.callback import ControllerCallback

    return ControllerCallback


def default_preemption_deadline_s() -> float:
    """How long Ray Train waits for a drained node when the drain gave no deadline."""
    from ray.train.v2._internal.constants import DEFAULT_PREEMPTION_DEADLINE_S

    return float(DEFAULT_PREEMPTION_DEADLINE_S)


def checkpoint_upload_retry_markers() -> tuple[str, ...]:
    """The texts that make Ray Train retry a whole checkpoint upload (`_upload_checkpoint` retries
    when the error's message contains one): an upload that retries on its own keeps them out of
    the error it gives up with."""
    from ray.train.v2._internal.constants import AWS_RETRYABLE_TOKENS

    return tuple(AWS_RETRYABLE_TOKENS)


def quiet_report_logs() -> None:
    """Ray Train logs every report at INFO from a logger named after its context module's file;
    raise that logger to WARNING (the controller prints one progress line per report instead)."""
    try:
        from ray.train.v2._internal.execution import context as train_context
    except ImportError:
        return
    logging.getLogger(train_context.__file__).setLevel(logging.WARNING)


def recorded_local_address() -> Optional[str]:
    """The GCS address the last `ray start` on this machine recorded (/tmp/ray/ray_current_cluster),
    or None. Raises ImportError if Ray moved the helper."""
    from ray._private.services import get_ray_address_from_environment

    return get_ray_address_from_environment(None, None)


def forget_recorded_address() -> None:
    """Remove the recorded address, as `ray stop` does."""
    from ray._common.utils import reset_ray_address

    reset_ray_address()


def working_dir_upload_files(directory: str, excludes: list[str]) -> list[str]:
    """The files (paths relative to `directory`) that Ray would ship of it as a `working_dir` or in
    `py_modules` with these `excludes`: Ray's own packing (it honours .gitignore and .rayignore,
    .gitignore unless RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1), into a zip that is then read back."""
    import os
    import tempfile
    import zipfile

    from ray._private.ray_constants import RAY_RUNTIME_ENV_IGNORE_GITIGNORE
    from ray._private.runtime_env.packaging import _zip_files

    include_gitignore = os.environ.get(RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"
    with tempfile.TemporaryDirectory() as tmp:
        package = os.path.join(tmp, "package.zip")
        _zip_files(directory, list(excludes), package, include_gitignore=include_gitignore)
        with zipfile.ZipFile(package) as archive:
            return sorted(name for name in archive.namelist() if not name.endswith("/"))


def placement_groups() -> list:
    """Every placement group in the GCS table, as `gcs_pb2.PlacementGroupTableData`: the only view
    that says which actor created a group and whether that actor is dead."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    table = gcs_pb2.PlacementGroupTableData
    return [table.FromString(raw) for raw in state._connect_and_get_accessor().get_placement_group_table()]


def placement_group_removed_state() -> int:
    from ray.core.generated import gcs_pb2

    return gcs_pb2.PlacementGroupTableData.REMOVED


def result_grid_trials(grid) -> list:
    """The Tune trials behind a `ResultGrid`, in the grid's order: the only view that gives each
    result its trial id."""
    return list(grid._experiment_analysis.trials)
