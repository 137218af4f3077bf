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

import ray.train
import torch
from ray.train import CheckpointUploadMode

from training.checkpoint import format as ckpt
from training.checkpoint.upload import upload_fn
from training.config import JobConfig


class CheckpointReporter:
    """Reports metrics, and saves and uploads the whole training state with them when asked."""

    def __init__(self, job: JobConfig, run_dir: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler, sharded: bool, rank: int, steps_per_epoch: int, world_size: int):
        self.model, self.optimizer, self.scheduler, self.sharded = model, optimizer, scheduler, sharded
        self.writes = rank == 0 or sharded  # sharded: every worker writes and uploads its shard
        self.asynchronous = job.checkpoint.upload == "async"
        self.config = job.model_dump(mode="json")
        self.steps_per_epoch, self.world_size = steps_per_epoch, world_size
        self.upload = upload_fn(run_dir)  # meta.json last, storage errors retried
        self.cost: dict = {}  # what the last checkpoint cost the training loop, reported with the next metrics

    def report(self, metrics: dict, loop: ckpt.LoopState, *, checkpoint: bool, synchronous: bool) -> None:
        """`synchronous`: the checkpoint counts only once uploaded (before a preemption deadline)."""
        metrics = {**metrics, **self.cost}
        if not (checkpoint and self.writes):
            ray.train.report(metrics)
            return
        save_start = time.perf_counter()
        directory = tempfile.mkdtemp(prefix="ckpt-")  # outlives an asynchronous upload
        ckpt.write(directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                   sharded=self.sharded, loop=loop, config=self.config, steps_per_epoch=self.steps_per_epoch,
                   world_size=self.world_size, metrics=metrics)
        asynchronous = self.asynchronous and not synchronous
        saved_s = time.perf_counter() - save_start
        size = ckpt.written_bytes(directory)
        try:
            ray.train.report(
                metrics, checkpoint=ray.train.Checkpoint.from_directory(directory),
                checkpoint_dir_name=ckpt.checkpoint_dir_name(loop.step),
                checkpoint_upload_mode=CheckpointUploadMode.ASYNC if asynchronous else CheckpointUploadMode.SYNC,
                delete_local_checkpoint_after_upload=asynchronous, checkpoint_upload_fn=self.upload)
        finally:
            if not asynchronous:
                shutil.rmtree(directory, ignore_errors=True)
        self.cost = {"checkpoint_bytes": size, "checkpoint_save_s": saved_s,
                     "checkpoint_blocking_s": time.perf_counter() - save_start}
