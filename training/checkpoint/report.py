"""A step's report to Ray Train, with a checkpoint when one is due: run on every worker (every
worker calls `ray.train.report` at every report; only the ones that write a checkpoint pass one).

The checkpoint is written to a local directory in the format of `training/checkpoint/format.py`
and uploaded by `training/checkpoint/upload.py`; what it cost the training loop (bytes, seconds)
is reported with the next metrics.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Optional

import ray.train
import torch
from ray.train import CheckpointUploadMode

from training.checkpoint import format as ckpt
from training.checkpoint.upload import RetryPolicy, upload_fn
from training.failure.restart import Preemption
from training.observe.system import SYSTEM_KEY

# What a synchronous (preemption) upload leaves free before the deadline, for Ray Train to register it.
DEADLINE_SLACK_S = 2.0


def synchronous_upload_budget_s(deadline_s: Optional[float], now_s: float) -> float:
    """The seconds a synchronous upload may spend retrying: what the preemption deadline leaves
    (less a slack), or, with no deadline known, the least that a final save is given before one."""
    if deadline_s is None:
        return Preemption.margin_s
    return max(0.0, deadline_s - now_s - DEADLINE_SLACK_S)


class CheckpointReporter:
    """Reports metrics, and saves and uploads the whole training state with them when asked."""

    def __init__(self, config: dict, upload: str, run_dir: str, *, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler, sharded: bool, rank: int, steps_per_epoch: int,
                 world_size: int, frozen: bool = True):
        """`config`: the resolved job config each checkpoint stores; `upload`: checkpoint.upload;
        `frozen`: whether checkpoints hold the frozen parameters (family.checkpoints_frozen)."""
        self.model, self.optimizer, self.scheduler, self.sharded = model, optimizer, scheduler, sharded
        self.frozen = frozen
        self.writes = rank == 0 or sharded  # sharded: every worker writes and uploads its shard
        self.asynchronous = upload == "async"
        self.config = config
        self.steps_per_epoch, self.world_size = steps_per_epoch, world_size
        self.run_dir, self.retry = run_dir, RetryPolicy()
        self.upload = upload_fn(run_dir, self.retry)  # meta.json last, storage errors retried
        self.cost: dict = {}  # what the last checkpoint cost the training loop, reported with the next metrics

    def report(self, metrics: dict, loop: ckpt.LoopState, *, checkpoint: bool, synchronous: bool,
               deadline_s: Optional[float] = None, system: Optional[list] = None) -> None:
        """`synchronous`: the checkpoint counts only once uploaded (before a preemption deadline);
        its upload stops retrying in time for `deadline_s` (time.time()), when given. `system`: this
        worker's system-metric samples since its last report, for the controller (not the checkpoint)."""
        metrics = {**metrics, **self.cost}
        reported = {**metrics, SYSTEM_KEY: system} if system else metrics
        if not (checkpoint and self.writes):
            ray.train.report(reported)
            return
        save_start = time.perf_counter()
        directory = tempfile.mkdtemp(prefix="ckpt-")  # outlives an asynchronous upload
        ckpt.write(directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                   sharded=self.sharded, loop=loop, config=self.config, steps_per_epoch=self.steps_per_epoch,
                   world_size=self.world_size, metrics=metrics, frozen=self.frozen)
        asynchronous = self.asynchronous and not synchronous
        upload = self.upload if not synchronous else upload_fn(
            self.run_dir, self.retry.within(synchronous_upload_budget_s(deadline_s, time.time())))
        saved_s = time.perf_counter() - save_start
        size = ckpt.written_bytes(directory)
        try:
            ray.train.report(
                reported, checkpoint=ray.train.Checkpoint.from_directory(directory),
                checkpoint_dir_name=ckpt.checkpoint_dir_name(loop.step),
                checkpoint_upload_mode=CheckpointUploadMode.ASYNC if asynchronous else CheckpointUploadMode.SYNC,
                delete_local_checkpoint_after_upload=asynchronous, checkpoint_upload_fn=upload)
        finally:
            if not asynchronous:
                shutil.rmtree(directory, ignore_errors=True)
        self.cost = {"checkpoint_bytes": size, "checkpoint_save_s": saved_s,
                     "checkpoint_blocking_s": time.perf_counter() - save_start}
