"""The plain Ray Train baseline: a Ray Train V2 loop as Ray's own guides write one, and nothing of
the service's but the model class. TorchTrainer, DDP through `ray.train.torch.prepare_model`, the
whole training split in each worker's memory, the steps of bench/baseline_ddp.py (its data, batches,
step and clock). Two uses:
- restarts (`fit`, `train_loop`): a checkpoint every N steps with `ray.train.report`, resumed from
  `ray.train.get_checkpoint()` after a failure (`FailureConfig(max_failures=-1)`);
- throughput (`throughput`, `throughput_loop`): no checkpoint, the steady-state samples/s measured
  as bench/baseline_ddp.py measures its own, the overhead row's third side.

The recovery row kills its workers as it kills the service's and reads the same two facts: when
each worker group finished its first step and from which step it started, which rank 0 appends to
an events file (one JSON line per group start and per checkpoint) on this machine."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.baseline_ddp import SteadyClock, batches, train_step, training_split
from training.models.registry import build_model, model_section  # the same nn.Module the service trains


def _worker_setup(config: dict):
    """On each worker: (rank, world size, the training split's inputs and targets, the model wrapped by
    `ray.train.torch.prepare_model`, its AdamW optimizer)."""
    import ray.train  # (lazy: ray.train)
    import ray.train.torch  # (lazy: ray.train)


    rank = ray.train.get_context().get_world_rank()
    world = ray.train.get_context().get_world_size()
    torch.set_num_threads(1)
    manifest, inputs, targets = training_split(config["manifest"])
    torch.manual_seed(config["seed"])
    model = ray.train.torch.prepare_model(
        build_model(model_section({"name": config["model"], "options": config["model_options"]}),
                    {"task": manifest["task"], **manifest["spec"]}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    return rank, world, inputs, targets, model, optimizer


def train_loop(config: dict) -> None:
    """The recovery row's loop: a checkpoint every `every` steps, resumed after a failure."""
    started = time.time()  # the train function starts on a (new) worker group

    import ray.train  # (lazy: ray.train)

    rank, world, inputs, targets, model, optimizer = _worker_setup(config)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "state.pt"), weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]

    def event(**facts) -> None:
        if rank == 0:
            with open(config["events"], "a") as out:
                out.write(json.dumps({**facts, "time": time.time()}) + "\n")

    steps = config["steps"]
    for step, batch in batches(len(inputs), config["global_batch"], world, rank, config["seed"], start, steps):
        loss = train_step(model, optimizer, inputs[batch], targets[batch])
        if step == start:
            event(first_step_time=time.time(), start_step=start, worker_start_time=started)
        done = step + 1
        if done % config["every"] == 0 or done == steps:
            with tempfile.TemporaryDirectory() as folder:
                saved = None
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "step": done}, os.path.join(folder, "state.pt"))
                    saved = ray.train.Checkpoint.from_directory(folder)
                ray.train.report({"step": done, "loss": loss.item()}, checkpoint=saved)
            event(checkpoint_step=done)


def throughput_loop(config: dict) -> dict:
    """The overhead row's loop: `steps` steps of the same work as bench/baseline_ddp.py, no checkpoint,
    no report; returns the steady-state samples/s (rank 0's return value is the Result's)."""
    rank, world, inputs, targets, model, optimizer = _worker_setup(config)
    clock = SteadyClock(config["warmup"])
    for step, batch in batches(len(inputs), config["global_batch"], world, rank, config["seed"], 0, config["steps"]):
        train_step(model, optimizer, inputs[batch], targets[batch])
        clock.step_done(step)
    return clock.result(config["steps"], config["global_batch"])


def _trainer(train_fn, config: dict, workers: int, run_config):
    import ray.cloudpickle  # (lazy: ray)
    import ray.train  # (lazy: ray.train)
    from ray.train.torch import TorchTrainer  # (lazy: ray.train)

    # bench/ is not installed on workers: this module and bench/baseline_ddp.py travel by value
    for module in (sys.modules[__name__], sys.modules[train_step.__module__]):
        ray.cloudpickle.register_pickle_by_value(module)
    return TorchTrainer(train_fn, train_loop_config=config, run_config=run_config,
                        scaling_config=ray.train.ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}))


def fit(manifest_root: str, events: Path, storage: str, name: str, model: str, model_options: dict, steps: int,
        every: int, global_batch: int, workers: int = 2, lr: float = 3e-3, seed: int = 0) -> float:
    """Train to `steps` on the cluster this process is connected to; returns the wall seconds."""
    import ray.train  # (lazy: ray.train)

    config = {"manifest": manifest_root, "events": str(events), "model": model, "model_options": model_options,
              "steps": steps, "every": every, "global_batch": global_batch, "lr": lr, "seed": seed}
    trainer = _trainer(train_loop, config, workers,
                       ray.train.RunConfig(name=name, storage_path=storage,
                                           failure_config=ray.train.FailureConfig(max_failures=-1),
                                           checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1)))
    started = time.monotonic()
    trainer.fit()
    return time.monotonic() - started


def throughput(manifest_root: str, model: str, model_options: dict, steps: int, warmup_steps: int, global_batch: int,
               workers: int, lr: float = 1e-3, seed: int = 0) -> float:
    """Steady-state samples/s of `throughput_loop` on the cluster this process is connected to (its
    Ray Train settings, RAY_TRAIN_HEALTH_CHECK_INTERVAL_S among them, are the service's: the same
    environment), as bench/baseline_ddp.py measures its own; run outputs in a temporary folder."""
    import ray.train  # (lazy: ray.train)

    config = {"manifest": manifest_root, "model": model, "model_options": model_options, "steps": steps,
              "warmup": warmup_steps, "global_batch": global_batch, "lr": lr, "seed": seed}
    with tempfile.TemporaryDirectory() as storage:
        trainer = _trainer(throughput_loop, config, workers,
                           ray.train.RunConfig(name=f"raytrain-throughput-{time.monotonic_ns()}", storage_path=storage))
        return trainer.fit().return_value["samples_per_s"]


def read_events(events: Path) -> list[dict]:
    return [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []


def newest_checkpoint(events: Path) -> int:
    return max((e["checkpoint_step"] for e in read_events(events) if "checkpoint_step" in e), default=-1)


def as_metrics(events: Path) -> dict[str, list[tuple[int, float]]]:
    """The events in the shape bench.recovery.analyse reads from the service's MLflow run."""
    found = read_events(events)
    starts = [e for e in found if "first_step_time" in e]
    return {"wall_time": [(e["checkpoint_step"], e["time"]) for e in found if "checkpoint_step" in e],
            "first_step_time": [(e["start_step"], e["first_step_time"]) for e in starts],
            "start_step": [(e["start_step"], e["start_step"]) for e in starts],
            "worker_start_time": [(e["start_step"], e["worker_start_time"]) for e in starts]}
