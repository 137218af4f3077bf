"""On the workers: the checkpoint upload to the run's storage (local or s3://) that Ray Train calls
through `report(checkpoint_upload_fn=...)`.

Two things Ray's default copy does not: files go in the format's order, meta.json last, so a
directory with meta.json and every file at its recorded size is complete (see format.py); and a
transient storage error (a dropped connection, a throttled request, an endpoint restarting) is
retried with backoff and logged, instead of failing the worker and costing a restart.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow.fs as pafs

from training import storage
from training.backoff import exponential_backoff_s
from training.checkpoint import format as ckpt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0

    def delay_s(self, failures: int) -> float:
        return exponential_backoff_s(failures, self.first_delay_s, self.max_delay_s)


def with_retries(action: Callable[[], None], what: str, policy: RetryPolicy = RetryPolicy(),
                 sleep: Callable[[float], None] = time.sleep) -> None:
    for failures in range(1, policy.attempts + 1):
        try:
            action()
            return
        except OSError as exc:  # pyarrow raises OSError subclasses for storage errors
            if failures == policy.attempts:
                raise OSError(f"{what} failed {failures} times; giving up: {exc}") from exc
            delay = policy.delay_s(failures)
            log.warning("%s failed (%s); retry %d of %d in %.0f s", what, str(exc).splitlines()[0][:200],
                        failures, policy.attempts - 1, delay)
            sleep(delay)


def upload(local_dir: str | Path, run_dir: str, dir_name: str, policy: RetryPolicy = RetryPolicy()) -> tuple[pafs.FileSystem, str]:
    """Copy a checkpoint directory to run_dir/dir_name, meta.json last; returns (filesystem, path)."""
    fs, destination = storage.filesystem(storage.join(run_dir, dir_name))
    local = pafs.LocalFileSystem()
    with_retries(lambda: fs.create_dir(destination, recursive=True), f"creating {destination}", policy)
    for name in ckpt.upload_order(p.name for p in Path(local_dir).iterdir()):
        source, target = str(Path(local_dir) / name), f"{destination}/{name}"
        with_retries(lambda: pafs.copy_files(source, target, source_filesystem=local, destination_filesystem=fs),
                     f"uploading {name} to {destination}", policy)
    return fs, destination


def upload_fn(run_dir: str, policy: RetryPolicy = RetryPolicy()):
    """The `checkpoint_upload_fn` for ray.train.report."""
    import ray.train

    def upload_checkpoint(checkpoint: "ray.train.Checkpoint", dir_name: str) -> "ray.train.Checkpoint":
        fs, path = upload(checkpoint.path, run_dir, dir_name, policy)
        return ray.train.Checkpoint(path, filesystem=fs)

    return upload_checkpoint
