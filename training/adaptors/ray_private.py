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
