"""The per-worker training loop, run by Ray Train on every worker.

build -> restore the latest checkpoint if there is one -> for each step: this worker's part of the
global batch, forward, backward, optimizer step; then the step policy (training/worker/policy.py)
says whether to report, evaluate, checkpoint or hold, and the loop does it. Resume is the normal
path: a fresh run is a resume from step 0.
"""

from __future__ import annotations

import time

import ray.train
import ray.train.torch
import torch

from training.adaptors.ray_private import quiet_report_logs
from training.checkpoint.report import CheckpointReporter
from training.checkpoint.restore import resume
from training.config import JobConfig
from training.data.loader import DIGEST_MODULUS, BatchPlan
from training.data.readers import train_batches, validation_part
from training.data.prepare import Manifest
from training.models import build_model
from training.tasks import forward_loss, units_per_sample
from training.worker import parallel
from training.worker.evaluate import evaluate, update_early_stopping
from training.worker.optim import build_optimizer, lr_factor, total_steps_of
from training.worker.policy import Preemption, StepPolicy
from training.worker.profile import StepProfiler
from training.worker.progress import Progress, RunFacts
from training.worker.seeding import seed_all, step_seed


def train_loop_per_worker(loop_config: dict) -> None:
    quiet_report_logs()
    worker_start_s = time.time()
    job = JobConfig.model_validate(loop_config["job"])
    manifest = Manifest.load(loop_config["manifest_root"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    torch.set_num_threads(job.train.torch_threads or max(1, int(job.scaling.cpus_per_worker)))
    autocast = parallel.autocast(job.train.precision, device)
    task, spec = manifest.task, {"task": manifest.task, **manifest.spec}

    plan = BatchPlan(job.train.global_batch_size, world_size, rank, job.train.micro_batch_size)
    train_data = train_batches(manifest, plan, job.seed)
    val_rows = validation_part(manifest, world_size, rank)
    total_steps = total_steps_of(job, train_data.steps_per_epoch)
    # Each worker's loss is scaled so that DDP's average over workers is the exact mean over the
    # global batch, however unevenly it is divided: the same gradient at any world size.
    loss_scale = world_size / (job.train.global_batch_size * units_per_sample(task, manifest.spec))

    torch.manual_seed(job.seed)  # the same initial weights on every worker
    model = build_model(job.model.name, job.model.options, spec).to(device)
    # DDP wraps the model (train_model); FSDP shards it in place (train_model is model).
    train_model = parallel.wrap(model, job.parallel, device, compile=job.train.compile)
    sharded = parallel.shards_parameters(job.parallel)
    optimizer = build_optimizer(job.optim, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(job.optim, total_steps))
    loop = resume(loop_config, model, optimizer, scheduler, sharded)

    policy = StepPolicy.of(job.train, job.checkpoint, total_steps)
    progress = Progress(RunFacts(
        job.train.global_batch_size, train_data.steps_per_epoch, total_steps, world_size, start_step=loop.step,
        worker_start_s=worker_start_s, seq_len=manifest.spec["seq_len"] if task == "language_model" else None,
        flops_per_token=model.flops_per_token() if hasattr(model, "flops_per_token") else None,
        peak_flops_per_s=parallel.peak_flops_per_s(device)), rank, device)
    reporter = CheckpointReporter(job, loop_config["run_dir"], model=model, optimizer=optimizer, scheduler=scheduler,
                                  sharded=sharded, rank=rank, steps_per_epoch=train_data.steps_per_epoch,
                                  world_size=world_size)
    profiler = StepProfiler(job.train.profile, rank, device, loop_config["run_dir"])
    val_metrics: dict = {}
    preemption: Preemption | None = None

    while loop.step < total_steps and not loop.stopped_early:
        profiler.before_step(loop.step + 1)
        fetch_s = time.perf_counter()
        batch = {k: v.to(device, non_blocking=True) for k, v in train_data.batch(loop.step).items()}
        progress.add_samples(loop.step, train_data.sample_ids(loop.step))
        progress.waited_for_data(time.perf_counter() - fetch_s)
        compute = progress.mark()
        seed_all(step_seed(job.seed, loop.step, rank), device)  # dropout: a function of the step
        micro_batches = plan.micro_batches(next(iter(batch.values())).shape[0])
        for index, part in enumerate(micro_batches):
            sync = index == len(micro_batches) - 1
            with parallel.gradient_sync(train_model, sync), autocast:
                loss_sum, units, _ = forward_loss(task, train_model, {k: v[part] for k, v in batch.items()})
            (loss_sum * loss_scale).backward()
            progress.add(loss_sum, units)
        optimize = progress.phase_done("forward_backward", compute)
        if job.optim.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), job.optim.grad_clip_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        progress.phase_done("optimizer", optimize)
        loop.step += 1
        progress.step_done()
        profiler.after_step(loop.step)

        due = policy.due(loop.step)
        if not due.any:
            continue  # no report at this step, and so no collective
        # Rank 0's clock decides for all (Progress.reduce), so every rank makes the same choice.
        final_save_wanted = rank == 0 and preemption is not None and preemption.final_save_due(time.time())
        totals = progress.reduce(final_save_wanted)
        loop.data_digest = (loop.data_digest + totals.data_digest) % DIGEST_MODULUS
        if not policy.reports(due, totals.elapsed_s, totals.final_save):
            continue  # too soon after the last report: the window goes on
        # A node holding a worker is being drained for preemption: checkpoint now rather than at
        # the next interval, and once more just before the deadline. Every worker asks at every
        # report: it is a collective.
        fresh = Preemption.fresh(ray.train.get_preemption_info(), preemption)
        preemption = fresh or preemption
        decision = policy.decide(due, final_save=totals.final_save, notice_fresh=fresh is not None,
                                 have_val_metrics=bool(val_metrics))

        metrics = progress.metrics(loop.step, totals, scheduler.get_last_lr()[0], loop.data_digest)
        if decision.evaluate:
            val_metrics = evaluate(model, task, val_rows, job.train.micro_batch_size or 256, device, autocast,
                                   lockstep=sharded)
            update_early_stopping(job, loop, val_metrics)
            decision = decision.after_evaluation(loop.stopped_early)
        if decision.reports_val_metrics:
            metrics.update(val_metrics)
        if decision.preemption_save:
            metrics["preemption_checkpoint_step"] = loop.step
        reporter.report(metrics, loop, checkpoint=decision.checkpoint, synchronous=decision.preemption_save,
                        deadline_s=preemption.deadline_s if decision.preemption_save and preemption else None)
        if fresh is not None and rank == 0:  # rank 0's clock decides when the final save is due
            preemption.plan_final_save(reporter.cost["checkpoint_blocking_s"])
            print(preemption.notice_line(loop.step), flush=True)
        if decision.hold:
            if rank == 0:
                print(f"preemption deadline near: checkpoint saved at step {loop.step}; waiting for the restart",
                      flush=True)
            preemption.hold()
        progress.next_window()
