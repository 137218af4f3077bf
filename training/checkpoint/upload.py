"""On the workers: the checkpoint upload to the run's storage (local or s3://) that Ray Train calls
through `report(checkpoint_upload_fn=...)`.

Two things Ray's default copy does not: files go in the format's order, meta.json last, so a
directory with meta.json and every file at its recorded size is complete (see format.py); and a
transient storage error (a dropped connection, a throttled request, an endpoint restarting) is
retried with backoff and logged, instead of failing the worker and costing a restart.

This is the only retry layer around an upload. Ray Train wraps `checkpoint_upload_fn` in its own
retry (three runs of the whole function when the error's text names a retryable AWS error), which
would multiply with ours: 3 x 6 attempts and well over a minute blocked in a synchronous upload,
while a preemption's final save has only what is left before the deadline. So one budget (attempts
and seconds) covers the whole upload, every file together, and the error that ends it is worded so
that Ray's retry does not start it over (see `UploadFailed`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import pyarrow.fs as pafs

from training import storage
from training.adaptors.ray_private import checkpoint_upload_retry_markers
from training.backoff import RetryPolicy
from training.checkpoint import format as ckpt
from training.errors import first_line
from training.retry import Retrier

log = logging.getLogger(__name__)


class UploadFailed(OSError):
    """An upload that used up its retries. Its message leaves out the storage error's retryable
    markers ("AWS Error NETWORK_CONNECTION", ...), which Ray Train's retry of the upload function
    looks for in the message alone: a failed upload is not started over. The rest of the storage's
    message stays (Ray re-raises it `from None`, so the chained cause is not shown)."""

    @classmethod
    def of(cls, what: str, failures: int, elapsed_s: float, cause: BaseException) -> "UploadFailed":
        reason = first_line(cause)
        for marker in checkpoint_upload_retry_markers():
            reason = reason.replace(marker, marker.lower())
        return cls(f"{what} failed {failures} times in {elapsed_s:.0f} s; giving up: {reason}")


def with_retries(action: Callable[[], None], what: str, policy: RetryPolicy = RetryPolicy(),
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
    Retrier(policy, UploadFailed.of, log, clock, sleep).run(action, what)


def upload(local_dir: str | Path, run_dir: str, dir_name: str, policy: RetryPolicy = RetryPolicy(), *,
           sleep: Callable[[float], None] = time.sleep,
           clock: Callable[[], float] = time.monotonic) -> tuple[pafs.FileSystem, str]:
    """Copy a checkpoint directory to run_dir/dir_name, meta.json last; returns (filesystem, path).
    Raises UploadFailed once the policy's attempts or seconds are used up, all files together."""
    fs, destination = storage.filesystem(storage.join(run_dir, dir_name))
    local = pafs.LocalFileSystem()
    retrier = Retrier(policy, UploadFailed.of, log, clock, sleep)
    retrier.run(lambda: fs.create_dir(destination, recursive=True), f"creating {destination}")
    for name in ckpt.upload_order(p.name for p in Path(local_dir).iterdir()):
        source, target = str(Path(local_dir) / name), f"{destination}/{name}"
        retrier.run(lambda: pafs.copy_files(source, target, source_filesystem=local, destination_filesystem=fs),
                    f"uploading {name} to {destination}")
    return fs, destination


def upload_fn(run_dir: str, policy: RetryPolicy = RetryPolicy()):
    """The `checkpoint_upload_fn` for ray.train.report."""
    import ray.train  # (lazy: ray.train)

    def upload_checkpoint(checkpoint: "ray.train.Checkpoint", dir_name: str) -> "ray.train.Checkpoint":
        fs, path = upload(checkpoint.path, run_dir, dir_name, policy)
        return ray.train.Checkpoint(path, filesystem=fs)

    return upload_checkpoint
