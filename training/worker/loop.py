"""The per-worker training loop, run by Ray Train on every worker.

build -> restore the latest checkpoint if there is one -> for each step: this worker's part of the
global batch, forward, backward, optimizer step; every N steps: report, evaluate, checkpoint.
Resume is the normal path: a fresh run is a resume from step 0.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import ray.train
import ray.train.collective
import ray.train.torch
from ray.train import CheckpointUploadMode
import torch
import torch.distributed as dist

from training.checkpoint import format as ckpt
from training import storage
from training.worker import parallel
from training.config import JobConfig, OptimConfig
from training.data.loader import BatchPlan, SplitReader, TrainShard, validation_part
from training.data.prepare import Manifest
from training.models import build_model
from training.worker.seeding import seed_all, step_seed
from training.tasks import forward_loss, units_per_sample, validation_metrics
from training.adaptors.ray_private import default_preemption_deadline_s, quiet_report_logs
from training.checkpoint.upload import upload_fn


def build_optimizer(optim: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if optim.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=optim.lr, momentum=optim.momentum,
                               weight_decay=optim.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)


def lr_factor(optim: OptimConfig, total_steps: int):
    """Linear warmup, then cosine decay to min_lr_ratio: a pure function of the step."""

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        progress = (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * cosine

    return factor


def total_steps_of(job: JobConfig, steps_per_epoch: int) -> int:
    if job.train.max_steps is not None:
        return job.train.max_steps
    return max(1, int(round(job.train.epochs * steps_per_epoch)))


def _sum_across_workers(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


def _max_across_workers(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def _autocast(job: JobConfig, device: torch.device):
    wants_bf16 = job.train.precision == "bf16" or (job.train.precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if wants_bf16 else nullcontext()


@torch.no_grad()
def evaluate(model, task: str, rows: dict[str, torch.Tensor], batch_size: int, device, autocast,
             lockstep: bool = False) -> dict:
    model.eval()
    loss_sum = units = correct = 0.0
    count = next(iter(rows.values())).shape[0]
    batches = math.ceil(count / batch_size)
    if lockstep:  # FSDP: every forward all-gathers parameters, so every worker runs as many
        batches = int(_max_across_workers(batches, device))
    for start in range(0, batches * batch_size, batch_size):
        if start >= count:  # this worker's rows are done: a forward the others need, not counted
            with autocast:
                forward_loss(task, model, {k: v[:1].to(device) for k, v in rows.items()})
            continue
        batch = {k: v[start:start + batch_size].to(device) for k, v in rows.items()}
        with autocast:
            batch_loss, batch_units, batch_correct = forward_loss(task, model, batch, count_correct=True)
        loss_sum += batch_loss.item()
        units += batch_units
        correct += batch_correct.item()
    model.train()
    return validation_metrics(task, *_sum_across_workers([loss_sum, units, correct], device))


def train_loop_per_worker(loop_config: dict) -> None:
    quiet_report_logs()
    worker_start = time.time()
    job = JobConfig.model_validate(loop_config["job"])
    manifest = Manifest.load(loop_config["manifest_root"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    torch.set_num_threads(job.train.torch_threads or max(1, int(job.scaling.cpus_per_worker)))
    autocast = _autocast(job, device)
    task, spec = manifest.task, {"task": manifest.task, **manifest.spec}

    plan = BatchPlan(job.train.global_batch_size, world_size, rank, job.train.micro_batch_size)
    train_data = TrainShard(SplitReader(manifest, "train"), plan, job.seed)
    val_rows = validation_part(SplitReader(manifest, "validation"), world_size, rank)
    total_steps = total_steps_of(job, train_data.steps_per_epoch)
    # Each worker's loss is scaled so that DDP's average over workers is the exact mean over the
    # global batch, however unevenly it is divided: the same gradient at any world size.
    loss_scale = world_size / (job.train.global_batch_size * units_per_sample(task, manifest.spec))

    torch.manual_seed(job.seed)  # the same initial weights on every worker
    model = build_model(job.model.name, job.model.options, spec).to(device)
    flops_per_token = model.flops_per_token() if hasattr(model, "flops_per_token") else None
    peak_flops = parallel.peak_flops_per_s(device)
    # DDP wraps the model (train_model); FSDP shards it in place (train_model is model).
    train_model = parallel.wrap(model, job.parallel, device, compile=job.train.compile)
    sharded = parallel.is_sharded(job.parallel)
    optimizer = build_optimizer(job.optim, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(job.optim, total_steps))
    loop = ckpt.LoopState()

    checkpoint = restore_point(loop_config)
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            if sharded:  # each worker reads its part, whatever the world size that wrote it
                state = ckpt.load_sharded(directory, model, optimizer)
            else:
                state = ckpt.load(directory)
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        loop = state["loop"]
        if rank == 0:
            print(f"resumed from step {loop.step} with {world_size} workers ({checkpoint.path})")

    start_step = loop.step  # where this worker group took over (steps redone after a failure)
    window_loss = window_units = window_steps = 0.0
    window_start = time.perf_counter()
    val_metrics: dict = {}
    first_step_done = None
    checkpoint_cost: dict = {}
    preemption: Preemption | None = None
    upload_checkpoint = upload_fn(loop_config["run_dir"])  # meta.json last, storage errors retried

    while loop.step < total_steps and not loop.stopped_early:
        batch = {k: v.to(device, non_blocking=True) for k, v in train_data.batch(loop.step).items()}
        seed_all(step_seed(job.seed, loop.step, rank), device)  # dropout: a function of the step
        micro_batches = plan.micro_batches(next(iter(batch.values())).shape[0])
        for index, part in enumerate(micro_batches):
            sync = index == len(micro_batches) - 1
            with parallel.gradient_sync(train_model, sync), autocast:
                loss_sum, units, _ = forward_loss(task, train_model, {k: v[part] for k, v in batch.items()})
            (loss_sum * loss_scale).backward()
            window_loss += loss_sum.detach()  # a tensor: no device sync per step
            window_units += units
        if job.optim.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), job.optim.grad_clip_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loop.step += 1
        window_steps += 1
        if first_step_done is None:
            first_step_done = time.time()

        last = loop.step == total_steps
        log_due = loop.step % job.train.log_every_n_steps == 0
        checkpoint_due = loop.step % job.checkpoint.every_n_steps == 0 or last
        eval_due = loop.step % job.train.eval_every_n_steps == 0 or checkpoint_due
        if not (log_due or eval_due):
            continue

        # Rank 0's clock decides for all, through the same all-reduce that sums the losses,
        # so every worker makes the same choice and calls report the same number of times.
        elapsed = time.perf_counter() - window_start if rank == 0 else 0.0
        final_wanted = float(rank == 0 and preemption is not None and preemption.final_save_due())
        loss_total, units_total, elapsed, final_save = _sum_across_workers(
            [float(window_loss), window_units, elapsed, final_wanted], device)
        final_save = final_save > 0
        if not (eval_due or final_save) and elapsed < job.train.min_report_interval_s:
            continue
        # A node holding a worker is being drained for preemption: checkpoint now rather than at
        # the next interval, and once more just before the deadline (see Preemption). Every worker
        # asks at every report: it is a collective.
        notice = ray.train.get_preemption_info()
        fresh_notice = notice is not None and (preemption is None or preemption.key != Preemption.key_of(notice))
        if fresh_notice:
            preemption = Preemption.of(notice)
        if fresh_notice or final_save:
            checkpoint_due = True
            eval_due = eval_due or not val_metrics  # a scored checkpoint needs the score metric
        samples_per_s = window_steps * job.train.global_batch_size / elapsed
        metrics = {"step": loop.step, "epoch": loop.step / train_data.steps_per_epoch,
                   "train_loss": loss_total / units_total, "samples_per_s": samples_per_s,
                   "lr": scheduler.get_last_lr()[0], "world_size": world_size, "total_steps": total_steps,
                   # wall clock (rank 0) for throughput over any span, and when this worker group
                   # started and finished its first step (cold start, recovery time)
                   "wall_time": time.time(), "worker_start_time": worker_start,
                   "first_step_time": first_step_done, "start_step": start_step}
        if task == "language_model":
            metrics["tokens_per_s"] = samples_per_s * manifest.spec["seq_len"]
            if flops_per_token and peak_flops:  # model FLOPs utilisation (GPUs in the peak table)
                metrics["mfu"] = metrics["tokens_per_s"] * flops_per_token / (peak_flops * world_size)
        if device.type == "cuda":
            metrics["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        if eval_due:
            val_metrics = evaluate(model, task, val_rows, job.train.micro_batch_size or 256, device, autocast,
                                   lockstep=sharded)
            _update_early_stopping(job, loop, val_metrics)
            checkpoint_due = checkpoint_due or loop.stopped_early
        if checkpoint_due or eval_due:  # (a scored checkpoint carries the latest validation metrics)
            metrics.update(val_metrics)
        if fresh_notice or final_save:
            metrics["preemption_checkpoint_step"] = loop.step

        metrics.update(checkpoint_cost)
        if checkpoint_due and (rank == 0 or sharded):  # sharded: every worker writes and uploads its shard
            save_start = time.perf_counter()
            directory = tempfile.mkdtemp(prefix="ckpt-")  # outlives an asynchronous upload
            saved = dict(scheduler_state=scheduler.state_dict(), loop=loop, config=job.model_dump(mode="json"),
                         steps_per_epoch=train_data.steps_per_epoch, world_size=world_size, metrics=metrics)
            if sharded:
                ckpt.save_sharded(directory, model=model, optimizer=optimizer, **saved)
            else:
                ckpt.save(directory, model_state=model.state_dict(), optimizer_state=optimizer.state_dict(), **saved)
            # Before a preemption deadline, a checkpoint counts only once it is uploaded.
            asynchronous = job.checkpoint.upload == "async" and not (fresh_notice or final_save)
            saved_s = time.perf_counter() - save_start
            size = sum(f.stat().st_size for f in Path(directory).iterdir())
            try:
                ray.train.report(
                    metrics, checkpoint=ray.train.Checkpoint.from_directory(directory),
                    checkpoint_dir_name=ckpt.checkpoint_dir_name(loop.step),
                    checkpoint_upload_mode=CheckpointUploadMode.ASYNC if asynchronous else CheckpointUploadMode.SYNC,
                    delete_local_checkpoint_after_upload=asynchronous, checkpoint_upload_fn=upload_checkpoint)
            finally:
                if not asynchronous:
                    shutil.rmtree(directory, ignore_errors=True)
            # What the last checkpoint cost the training loop, reported with the next metrics.
            checkpoint_cost = {"checkpoint_bytes": size, "checkpoint_save_s": saved_s,
                               "checkpoint_blocking_s": time.perf_counter() - save_start}
        else:
            ray.train.report(metrics)
        if fresh_notice and rank == 0:
            preemption.plan_final_save(checkpoint_cost["checkpoint_blocking_s"])
            print(f"preemption notice for node(s) {', '.join(n[:12] for n in notice.preempted_node_ids)} "
                  f"(ranks {notice.preempted_ranks}, {preemption.deadline_s - time.time():.0f} s left): "
                  f"checkpoint saved at step {loop.step}; the final one {preemption.margin_s:.0f} s before the deadline",
                  flush=True)
        if final_save:
            if rank == 0:
                print(f"preemption deadline near: checkpoint saved at step {loop.step}; waiting for the restart",
                      flush=True)
            preemption.hold()  # steps taken now would be lost: wait for Ray Train to restart the group
        window_loss = window_units = window_steps = 0.0
        window_start = time.perf_counter()


@dataclass
class Preemption:
    """A node of this run is being drained for preemption. The run checkpoints at once (in case
    the node goes early), keeps training, checkpoints again `margin_s` before the deadline and then
    waits for Ray Train to restart the group without the node: no finished step is lost."""

    key: tuple
    deadline_s: float
    margin_s: float = 10.0
    final_saved: bool = False

    @staticmethod
    def key_of(notice) -> tuple:
        return notice.deadline_ms, tuple(notice.preempted_node_ids)

    @classmethod
    def of(cls, notice) -> "Preemption":
        # Without a deadline Ray Train waits its default before restarting.
        deadline_s = notice.deadline_ms / 1000 if notice.deadline_ms else time.time() + default_preemption_deadline_s()
        return cls(cls.key_of(notice), deadline_s)

    def plan_final_save(self, save_s: float) -> None:
        self.margin_s = max(10.0, 3 * save_s)

    def final_save_due(self) -> bool:
        return not self.final_saved and time.time() >= self.deadline_s - self.margin_s

    def hold(self, poll_s: float = 0.5, after_deadline_s: float = 60.0) -> None:
        self.final_saved = True
        while time.time() < self.deadline_s + after_deadline_s:  # the restart comes at the deadline
            time.sleep(poll_s)


def restore_point(loop_config: dict) -> ray.train.Checkpoint | None:
    """The checkpoint to continue from, the same on every worker: the newest complete one in the
    run's directory, even if Ray Train has not registered it yet; else the one Ray Train reports;
    else `initial_checkpoint` (a run seeded from another run's checkpoint); else none."""
    choice = None
    if ray.train.get_context().get_world_rank() == 0:
        registered = ray.train.get_checkpoint()
        registered_step = ckpt.step_of(registered.path) if registered is not None else None
        fs, run_dir = storage.filesystem(loop_config["run_dir"])
        newer = ckpt.newest_complete(fs, run_dir, newer_than=registered_step if registered_step is not None else -1)
        if newer is not None and (registered is None or registered_step is not None):
            choice = ("path", loop_config["run_dir"].rstrip("/") + "/" + newer[1].rsplit("/", 1)[-1])
        elif registered is not None:
            choice = ("registered", None)
        elif loop_config.get("initial_checkpoint"):
            choice = ("path", loop_config["initial_checkpoint"])
    # One worker decides (an upload may complete between two workers' looks) and tells the others.
    kind, uri = ray.train.collective.broadcast_from_rank_zero(choice) or (None, None)
    if kind == "registered":
        return ray.train.get_checkpoint()
    if kind == "path":
        fs, path = storage.filesystem(uri)
        return ray.train.Checkpoint(path, filesystem=fs)
    return None


def _update_early_stopping(job: JobConfig, loop: ckpt.LoopState, val_metrics: dict) -> None:
    rule = job.train.early_stopping
    if rule is None:
        return
    if rule.metric not in val_metrics:
        raise ValueError(f"train.early_stopping.metric {rule.metric!r} is not a validation metric; "
                         f"have {sorted(val_metrics)}")
    value = val_metrics[rule.metric]
    better = loop.best_metric is None or (
        value < loop.best_metric - rule.min_delta if rule.mode == "min" else value > loop.best_metric + rule.min_delta)
    if better:
        loop.best_metric, loop.evals_without_improvement = value, 0
    else:
        loop.evals_without_improvement += 1
        loop.stopped_early = loop.evals_without_improvement >= rule.patience_evals
