"""The restart baseline: a plain Ray Train V2 loop as Ray's own guides write one, and nothing of the
service's but the model class. TorchTrainer, DDP through `ray.train.torch.prepare_model`, the whole
training split in each worker's memory, a checkpoint every N steps with `ray.train.report`, resumed
from `ray.train.get_checkpoint()` after a failure (`FailureConfig(max_failures=-1)`).

The recovery row kills its workers as it kills the service's and reads the same two facts: when
each worker group finished its first step and from which step it started, which rank 0 appends to
an events file (one JSON line per group start and per checkpoint) on this machine."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def train_loop(config: dict) -> None:
    started = time.time()  # the train function starts on a (new) worker group
    import os
    import tempfile

    import pyarrow.parquet as pq
    import torch
    import torch.nn.functional as F

    import ray.train
    import ray.train.torch

    from training.models import build_model  # the same nn.Module the service trains

    rank = ray.train.get_context().get_world_rank()
    world = ray.train.get_context().get_world_size()
    torch.set_num_threads(1)
    root = config["manifest"]
    manifest = json.loads(Path(root, "manifest.json").read_text())
    table = pq.read_table([os.path.join(root, s["path"]) for s in manifest["splits"]["train"]["shards"]])
    column = table.column("x").combine_chunks()
    inputs = torch.from_numpy(column.flatten().to_numpy().reshape(-1, column.type.list_size).copy())
    targets = torch.from_numpy(table.column("y").to_numpy().copy())

    torch.manual_seed(config["seed"])
    model = ray.train.torch.prepare_model(
        build_model(config["model"], config["model_options"], {"task": manifest["task"], **manifest["spec"]}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
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

    n, batch_size, steps = len(inputs), config["global_batch"], config["steps"]
    per_epoch = n // batch_size
    order, order_epoch = None, -1
    for step in range(start, steps):
        epoch, index = divmod(step, per_epoch)
        if epoch != order_epoch:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(config["seed"] + epoch))
            order_epoch = epoch
        batch = order[index * batch_size:(index + 1) * batch_size].tensor_split(world)[rank]
        logits = model(inputs[batch])
        loss = F.cross_entropy(logits, targets[batch])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
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


def fit(manifest_root: str, events: Path, storage: str, name: str, model: str, model_options: dict, steps: int,
        every: int, global_batch: int, workers: int = 2, lr: float = 3e-3, seed: int = 0) -> float:
    """Train to `steps` on the cluster this process is connected to; returns the wall seconds."""
    import ray.cloudpickle
    import ray.train
    from ray.train.torch import TorchTrainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # bench/ is not installed on workers
    config = {"manifest": manifest_root, "events": str(events), "model": model, "model_options": model_options, "steps": steps, "every": every,
              "global_batch": global_batch, "lr": lr, "seed": seed}
    trainer = TorchTrainer(
        train_loop, train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name=name, storage_path=storage,
                                       failure_config=ray.train.FailureConfig(max_failures=-1),
                                       checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1)))
    started = time.monotonic()
    trainer.fit()
    return time.monotonic() - started


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
