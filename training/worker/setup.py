"""Everything one worker trains with, built and restored (on every worker, when the training function
starts on a new worker group): the data, the model as the failure mode wraps it, the optimizer and
its schedule, the loop's state from the restore point, and the helpers of the loop's step
(training/worker/loop.py reads top to bottom with these).

A fresh run is a resume from step 0.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch

from training.checkpoint.format import LoopState
from training.checkpoint.report import CheckpointReporter
from training.checkpoint.restore import resume
from training.data.manifest import Manifest
from training.data.order import BatchPlan
from training.data.registry import source_of
from training.data.source import TrainData, validation_part
from training.failure.mode import WorkerContext
from training.failure.registry import FAILURE_MODES
from training.models.registry import family_of
from training.observe.system import SystemSampler
from training.tasks import TASKS, Task
from training.worker import parallel
from training.worker.config import WorkerConfig
from training.worker.evaluate import evaluate
from training.worker.optim import build_optimizer, lr_factor
from training.worker.policy import StepPolicy
from training.worker.profile import StepProfiler
from training.worker.progress import Progress, RunFacts
from training.worker.seeding import StepSeeder


def tensors(columns: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """A batch's columns as tensors (sharing the arrays' memory)."""
    return {name: torch.from_numpy(np.ascontiguousarray(column)) for name, column in columns.items()}


@dataclass
class Worker:
    config: WorkerConfig
    rank: int
    device: torch.device
    task: Task
    plan: BatchPlan
    data: TrainData
    val_rows: dict[str, torch.Tensor]
    total_steps: int
    # Each worker's summed loss is scaled so that DDP's average over workers is the exact mean over
    # the global batch, however unevenly it is divided: the same gradient at any world size. (The
    # gradient the backward starts from: a tensor on the device, made once.)
    loss_scale: torch.Tensor
    autocast: Any
    model: torch.nn.Module  # unwrapped: its own parameter names
    train_model: torch.nn.Module  # what the forward runs (DDP, FSDP, a replica group's DDP)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sharded: bool
    mode: Any  # the failure mode's worker side (training/failure/mode.py)
    state: LoopState
    policy: StepPolicy
    progress: Progress
    reporter: CheckpointReporter
    profiler: StepProfiler
    sampler: Optional[SystemSampler]
    # The data digest proves that every global batch was trained on: a mode whose workers skip
    # samples by design (not in lockstep: continue) keeps none.
    keeps_digest: bool
    seed: StepSeeder  # seeds a step's draws (dropout) from (seed, step, rank)

    def __post_init__(self):
        self.on_cpu = self.device.type == "cpu"

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """This worker's part of global batch `step` on the device; the wait counted as data wait.
        (Past the last step, a replica group's sync round reads the last batch again.)"""
        fetch_s = time.perf_counter()
        data_step = min(step, self.total_steps - 1)
        batch = tensors(self.data.batch(data_step))
        if not self.on_cpu:
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        if self.keeps_digest:
            self.progress.add_digest(self.data.digest(data_step))
        self.progress.waited_for_data(time.perf_counter() - fetch_s)
        return batch

    def micro_batches(self, batch: dict[str, torch.Tensor]):
        """(micro-batch, whether the gradients are reduced after it): the last one reduces."""
        parts = self.plan.micro_batches(next(iter(batch.values())).shape[0])
        if len(parts) == 1:
            yield batch, True
            return
        for index, part in enumerate(parts):
            yield {k: v[part] for k, v in batch.items()}, index == len(parts) - 1

    def optimizer_step(self) -> None:
        if self.config.optim.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.grad_clip_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def evaluate(self) -> dict:
        return evaluate(self.model, self.task, self.val_rows, self.config.train.micro_batch_size or 256, self.device,
                        self.autocast, lockstep=self.sharded)

    def system_samples(self) -> Optional[list]:
        """This node's system metrics and this worker's memory since the last report; the run's
        last report takes one more now (a sample after it would never be sent)."""
        if not self.sampler:
            return None
        if self.state.step >= self.total_steps or self.state.stopped_early:
            self.sampler.sample_now()
        return self.sampler.take()

    def close(self) -> None:
        self.data.close()  # a streamed split's read-ahead threads
        self.mode.close()
        if self.sampler:
            self.sampler.stop()


def start_worker(config: WorkerConfig) -> Worker:
    """Build this worker's part of the run and restore it from the restore point, if any."""
    worker_start_s = time.time()
    manifest = Manifest.load(config.manifest_root)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    torch.set_num_threads(config.train.torch_threads or max(1, int(config.cpus_per_worker)))
    task, spec = TASKS[manifest.task], {"task": manifest.task, **manifest.spec}
    failure = FAILURE_MODES[config.failure_mode]
    sampler = SystemSampler.for_worker(config.system_metrics_interval_s, ray.get_runtime_context().get_node_id(), rank)

    plan = BatchPlan(config.train.global_batch_size, world_size, rank, config.train.micro_batch_size)
    source = source_of(manifest.source)
    data = source.open(manifest, plan, config.seed)
    # A mode whose workers do not step in lockstep evaluates all of the validation split on each.
    parts, part = (world_size, rank) if failure.lockstep else (1, 0)
    val_rows = tensors(validation_part(source.rows(manifest, "validation"), parts, part))
    total_steps = config.train.total_steps(data.steps_per_epoch)
    loss_scale = torch.tensor(world_size / (config.train.global_batch_size * task.units_per_sample(manifest.spec)),
                              dtype=torch.float32, device=device)
    policy = StepPolicy.of(config.train, config.checkpoint, total_steps)

    family = family_of(config.model.name)
    sharded = parallel.shards_parameters(config.parallel)
    # Weights read from files under FSDP (a pretrained model): built on the meta device, sharded, then
    # each worker reads only its shards; never the whole model per worker.
    load_after_sharding = sharded and family.loads_after_sharding(config.model)
    torch.manual_seed(config.seed)  # the same initial weights on every worker
    with torch.device("meta") if load_after_sharding else contextlib.nullcontext():
        model = family.build(config.model, spec)
    model = model if load_after_sharding else model.to(device)
    wrap = functools.partial(parallel.wrap, config=config.parallel, device=device, blocks=family.blocks(model),
                             compile=config.train.compile)
    mode = failure.worker(WorkerContext(rank, world_size, config.train.global_batch_size, total_steps, device, policy,
                                        wrap, ray.train.get_preemption_info))
    train_model = mode.wrap(model)  # (FSDP shards in place: the optimizer is built after)
    if load_after_sharding:
        family.load_after_sharding(config.model, model, device)
    optimizer = build_optimizer(config.optim, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(config.optim, total_steps))
    frozen = family.checkpoints_frozen(config.model)
    state = resume(config.run_dir, config.initial_checkpoint, model, optimizer, scheduler, sharded,
                  agree=failure.lockstep, frozen=frozen)

    progress = Progress(RunFacts(
        config.train.global_batch_size, data.steps_per_epoch, total_steps, world_size, start_step=state.step,
        worker_start_s=worker_start_s, seq_len=task.tokens_per_sample(manifest.spec),
        flops_per_token=family.flops_per_token(model), peak_flops_per_s=parallel.peak_flops_per_s(device)),
        # a worker not in lockstep: its window is its own (no reduce across workers), timed by its own clock
        rank if failure.lockstep else 0, device)
    mode.start(state, model, optimizer, scheduler, progress)
    reporter = CheckpointReporter(config.job_record, config.checkpoint.upload, config.run_dir, model=model,
                                  optimizer=optimizer, scheduler=scheduler, sharded=sharded, rank=rank,
                                  steps_per_epoch=data.steps_per_epoch, world_size=world_size, frozen=frozen)
    profiler = StepProfiler(config.train.profile, rank, device, config.run_dir)
    return Worker(config, rank, device, task, plan, data, val_rows, total_steps, loss_scale,
                  parallel.autocast(config.train.precision, device), model, train_model, optimizer, scheduler, sharded,
                  mode, state, policy, progress, reporter, profiler, sampler, keeps_digest=failure.lockstep,
                  seed=StepSeeder(config.seed, rank, device))
