"""Where a worker group continues from, and loading it: run on every worker, at the start of the
training function (a fresh run is a resume from step 0)."""

from __future__ import annotations

import ray.train
import ray.train.collective
import torch

from training import storage
from training.checkpoint import format as ckpt


def restore_point(run_dir: str, initial_checkpoint: str | None, agree: bool = True) -> ray.train.Checkpoint | None:
    """The checkpoint to continue from, the same on every worker: the newest complete one in the
    run's directory, even if Ray Train has not registered it yet; else the one Ray Train reports;
    else `initial_checkpoint` (a run seeded from another run's checkpoint); else none.

    `agree=False` (failure.mode continue): each worker looks for itself, with no collective. A
    worker that replaces a dead one must not wait at Ray's barrier for peers that are training;
    and workers that pick different checkpoints need no agreement: torchft's first quorum heals
    every group from the one at the newest step."""
    choice = None
    if not agree or ray.train.get_context().get_world_rank() == 0:
        registered = ray.train.get_checkpoint()
        registered_step = ckpt.step_of(registered.path) if registered is not None else None
        fs, path = storage.filesystem(run_dir)
        newer = ckpt.newest_complete(fs, path, newer_than=registered_step if registered_step is not None else -1)
        if newer is not None and (registered is None or registered_step is not None):
            choice = ("path", run_dir.rstrip("/") + "/" + newer[1].rsplit("/", 1)[-1])
        elif registered is not None:
            choice = ("registered", None)
        elif initial_checkpoint:
            choice = ("path", initial_checkpoint)
    # One worker decides (an upload may complete between two workers' looks) and tells the others.
    if agree:
        choice = ray.train.collective.broadcast_from_rank_zero(choice)
    kind, uri = choice or (None, None)
    if kind == "registered":
        return ray.train.get_checkpoint()
    if kind == "path":
        fs, path = storage.filesystem(uri)
        return ray.train.Checkpoint(path, filesystem=fs)
    return None


def final_checkpoint(registered: ray.train.Checkpoint | None, run_dir: str) -> ray.train.Checkpoint | None:
    """A finished run's last checkpoint: the newest complete one in its directory when that is newer
    than the one Ray Train registered last (registration lags the upload: a group restarted after
    its last checkpoint was written resumes at the last step, trains nothing and reports nothing),
    else the registered one."""
    registered_step = ckpt.step_of(registered.path) if registered is not None else None
    fs, path = storage.filesystem(run_dir)
    newer = ckpt.newest_complete(fs, path, newer_than=registered_step if registered_step is not None else -1)
    if newer is None:
        return registered
    return ray.train.Checkpoint(newer[1], filesystem=fs)


def resume(run_dir: str, initial_checkpoint: str | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           scheduler, sharded: bool, agree: bool = True, frozen: bool = True) -> ckpt.LoopState:
    """Load the restore point, if any, into `model`, `optimizer` and `scheduler` (in place);
    returns the loop state to continue from. `agree`: see restore_point; `frozen`: whether the
    checkpoint holds the frozen parameters (family.checkpoints_frozen)."""
    checkpoint = restore_point(run_dir, initial_checkpoint, agree)
    if checkpoint is None:
        return ckpt.LoopState()
    with checkpoint.as_directory() as directory:  # sharded: each worker reads its part, at any world size
        loop = ckpt.restore(directory, model, optimizer, scheduler, sharded=sharded, frozen=frozen)
    context = ray.train.get_context()
    if context.get_world_rank() == 0 or not agree:
        workers = context.get_world_size()
        print(f"resumed from step {loop.step} with {workers} worker{'s' if workers != 1 else ''} ({checkpoint.path})")
    return loop
