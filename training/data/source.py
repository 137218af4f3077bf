"""The data-source seam (driver and workers): what one kind of data (`data.source: NAME`) provides,
used by the driver to prepare it and by the workers to read it. Each source is one module
(digits, tinylm, parquet, text, and plug-ins by import string) registered by name in
training/data/registry.py; nothing else in the tree names it.

Driver, in this order (everything a user can get wrong fails in `plan`, before anything is written):

    source.plan(section, cache_root)  the input listed once and checked, without Ray: a DataPlan
    plan.check_unchanged(root)        a resumed run's input must be what it started on (UserError)
    plan.wants_cluster()              whether preparing it would run on a Ray cluster (Ray starts first)
    plan.prepare(check, log)          the prepared data's Manifest (cached by key); `check(task, spec,
                                      rows)` runs on the data before anything is written

Workers:

    source.open(manifest, batch_plan, seed)  this worker's part of every global batch (a TrainData)
    source.rows(manifest, split)             rows of a split by position (validation, a sample)

Columns come out as numpy arrays named and typed as the task says (training/tasks.py); the worker
makes tensors of them. Each source's section of the job config is a `DataSection` whose `options`
is the source's own typed model: validated once, when the config is, and passed on typed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import numpy as np
from pydantic import Field, field_validator

from training.data.manifest import Manifest
from training.data.order import BatchPlan, part_bounds
from training.schema import OptionsSection, storage_location

# (task name, spec, rows per split) -> None; raises UserError. The driver's checks of a job on its data.
DataCheck = Callable[[str, dict, dict], None]


class DataSection(OptionsSection):
    """The `data` section of a job config; each source's section sets `source` and `options`."""

    source: str
    options: Any = None  # the source's own options model
    # Where prepared data is cached; default: <checkpoint.storage_path>/datasets.
    cache_dir: Optional[str] = None
    # Shards a table source is written in (digits, tinylm, plug-ins).
    num_shards: int = Field(4, ge=1, le=4096)

    @field_validator("cache_dir")
    @classmethod
    def _cache_dir(cls, value):
        return storage_location(value)


class TrainData(Protocol):
    """One worker's part of every global batch of the training split."""

    steps_per_epoch: int

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This worker's part of global batch number `step` (counted from the start of the run)."""

    def sample_ids(self, step: int) -> np.ndarray:
        """The split's row numbers in this worker's part of global batch `step` (after `batch(step)`)."""

    def digest(self, step: int) -> int:
        """This worker's part of global batch `step`'s data digest (training.data.order.batch_digest of
        its sample ids; after `batch(step)`)."""

    def close(self) -> None:
        """Stop reading ahead (threads, open files)."""


class SplitRows(Protocol):
    num_rows: int

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Rows of the split by position."""


class DataPlan(Protocol):
    """A source's input, listed and checked: what the driver prepares."""

    # What the config alone says of the data, checked before anything is prepared: its task
    # (training/tasks.py; None when only the loaded data says, as a plug-in's tables), and the
    # partitions the streaming loader draws every batch from (data.options.partitions; None when
    # the data is not streamed).
    task: Optional[str]
    batch_partitions: Optional[int]

    def check_unchanged(self, recorded_root: Optional[str]) -> None: ...

    def wants_cluster(self) -> bool: ...

    def prepare(self, check: Optional[DataCheck], log: Callable[[str], None]) -> Manifest: ...


class DataSource(Protocol):
    name: str
    Config: type[DataSection]

    def plan(self, section: DataSection, cache_root: str) -> DataPlan: ...

    def plugins(self, section: DataSection) -> list[str]:
        """Import strings of the plug-ins the source runs, which Ray ships to the cluster."""

    def track(self, tracker, manifest: Manifest, log: Callable[[str], None]) -> None:
        """What MLflow records of the data beside its datasets (a new run's)."""

    def open(self, manifest: Manifest, plan: BatchPlan, seed: int) -> TrainData: ...

    def rows(self, manifest: Manifest, split: str) -> SplitRows: ...


def validation_part(rows: SplitRows, world_size: int, rank: int) -> dict[str, np.ndarray]:
    """This rank's contiguous part of a split (every rank scores its part; the sums are added). A
    split of fewer rows than ranks leaves some ranks none: their part is the columns with no rows."""
    lo, hi = part_bounds(rows.num_rows, world_size, rank)
    if lo == hi:
        return {name: column[:0] for name, column in rows.take(np.arange(min(1, rows.num_rows))).items()}
    return rows.take(np.arange(lo, hi))
