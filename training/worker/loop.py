"""The per-worker training loop, run by Ray Train on every worker.

build -> restore the latest checkpoint if there is one -> for each step: this worker's part of the
global batch, forward, backward, optimizer step; then the step policy (training/worker/policy.py)
says whether to report, evaluate, checkpoint or hold, and the loop does it. Resume is the normal
path: a fresh run is a resume from step 0.

`failure.mode: continue`: this worker is a torchft replica group (training/worker/replica_group.py).
Each step starts with a quorum of the groups alive and commits only if the quorum agrees; a step
taken by fewer groups is recorded in the ledger (training/worker/replicas.py); reports happen only
at steps every group took, and restore, metrics and evaluation need no collective across workers.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import ray
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
from training.observe.system import SystemSampler
from training.models import build_model
from training.tasks import forward_loss, units_per_sample
from training.worker import parallel
from training.worker.evaluate import evaluate, update_early_stopping
from training.worker.optim import build_optimizer, lr_factor, total_steps_of
from training.worker.policy import Preemption, StepDue, StepPolicy
from training.worker.profile import StepProfiler
from training.worker.progress import Progress, RunFacts
from training.worker.replicas import NOTHING_DUE, ReplicaLedger, ReportGate, carried_after
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
    continuous = job.failure.mode == "continue"
    # this node's system metrics and this worker's memory, sent with the reports
    sampler = SystemSampler.for_worker(job.tracking.system_metrics_interval_s, ray.get_runtime_context().get_node_id(),
                                       rank)

    plan = BatchPlan(job.train.global_batch_size, world_size, rank, job.train.micro_batch_size)
    train_data = train_batches(manifest, plan, job.seed)
    # continue: every group evaluates all of the validation split (no collective across groups)
    val_rows = validation_part(manifest, 1, 0) if continuous else validation_part(manifest, world_size, rank)
    total_steps = total_steps_of(job, train_data.steps_per_epoch)
    # Each worker's loss is scaled so that DDP's average over workers is the exact mean over the
    # global batch, however unevenly it is divided: the same gradient at any world size.
    loss_scale = world_size / (job.train.global_batch_size * units_per_sample(task, manifest.spec))

    torch.manual_seed(job.seed)  # the same initial weights on every worker
    model = build_model(job.model.name, job.model.options, spec).to(device)
    group = gate = None
    if continuous:  # torchft's DDP: gradients averaged over the replica groups in each step's quorum
        from training.worker.replica_group import ReplicaGroup

        group = ReplicaGroup(rank, world_size, job.train.global_batch_size, device)
        gate = ReportGate(world_size)
        train_model = group.wrap(model)
    else:  # DDP wraps the model (train_model); FSDP shards it in place (train_model is model).
        train_model = parallel.wrap(model, job.parallel, device, compile=job.train.compile)
    sharded = parallel.shards_parameters(job.parallel)
    optimizer = build_optimizer(job.optim, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(job.optim, total_steps))
    loop = resume(loop_config, model, optimizer, scheduler, sharded, agree=not continuous)
    ledger = ReplicaLedger(world_size, job.train.global_batch_size)
    if group:  # what a healing peer takes from this group
        if loop.replicas:
            ledger.load(loop.replicas)
        group.share("model", model.state_dict, model.load_state_dict)
        group.share("optimizer", optimizer.state_dict, optimizer.load_state_dict)
        group.share("scheduler", scheduler.state_dict, scheduler.load_state_dict)
        group.share("loop", lambda: _loop_fields(loop), lambda fields: _set_loop_fields(loop, fields))
        group.share("ledger", ledger.state, ledger.load)

    policy = StepPolicy.of(job.train, job.checkpoint, total_steps)
    progress = Progress(RunFacts(
        job.train.global_batch_size, train_data.steps_per_epoch, total_steps, world_size, start_step=loop.step,
        worker_start_s=worker_start_s, seq_len=manifest.spec["seq_len"] if task == "language_model" else None,
        flops_per_token=model.flops_per_token() if hasattr(model, "flops_per_token") else None,
        peak_flops_per_s=parallel.peak_flops_per_s(device)),
        # continue: each group's window is its own (no reduce across groups), timed by its own clock
        0 if continuous else rank, device)
    reporter = CheckpointReporter(job, loop_config["run_dir"], model=model, optimizer=optimizer, scheduler=scheduler,
                                  sharded=sharded, rank=rank, steps_per_epoch=train_data.steps_per_epoch,
                                  world_size=world_size)
    profiler = StepProfiler(job.train.profile, rank, device, loop_config["run_dir"])
    val_metrics: dict = {}
    preemption: Preemption | None = None
    # continue: the reports due at steps that not every group took, carried to the next full step
    # (a healing peer takes them too: both must make the same reports)
    carried = {"due": NOTHING_DUE}
    if group:
        group.share("carried", lambda: asdict(carried["due"]), lambda due: carried.update(due=StepDue(**due)))

    # continue: a group that finished while a report is still carried (its last steps were short)
    # waits for the replaced group in "sync rounds" (a step whose update is thrown away) until the
    # newcomer has healed and both can make the last report together.
    while (loop.step < total_steps and not loop.stopped_early) or carried["due"].any:
        profiler.before_step(loop.step + 1)
        if group:
            group.start_step(loop.step)
            window = progress.snapshot()
        fetch_s = time.perf_counter()
        data_step = min(loop.step, total_steps - 1)
        batch = {k: v.to(device, non_blocking=True) for k, v in train_data.batch(data_step).items()}
        if not group:  # (the data digest is restart mode's: in continue mode groups skip samples by design)
            progress.add_samples(loop.step, train_data.sample_ids(data_step))
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
        if group:
            committed, replicas, samples_used = group.finish_step(batch_rows(batch))
            if not committed:  # a peer failed mid-step: the step is taken again in a new quorum
                optimizer.zero_grad(set_to_none=True)
                progress.rewind(window)
                continue
        sync_round = group is not None and (group.step > total_steps or loop.stopped_early)
        if sync_round:  # nothing is learned: the quorum only brings a replaced group in
            optimizer.zero_grad(set_to_none=True)
            progress.rewind(window)
            ledger.observe(loop.step, replicas, time.time())
            due = NOTHING_DUE
        else:
            if job.optim.grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), job.optim.grad_clip_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            progress.phase_done("optimizer", optimize)
            if group:
                loop.step = group.step  # after healing from a peer: the peer's step
                ledger.record(loop.step, replicas, samples_used, time.time())
            else:
                loop.step += 1
            progress.step_done()
            profiler.after_step(loop.step)
            due = policy.due(loop.step)

        if group:
            # Reports only at steps every group took, every one that is due (no min interval: each
            # group's own clock would make the groups report different numbers of times).
            decision = gate.decide(due, carried["due"], replicas)
            carried["due"], due = carried_after(decision), decision.due
            if not decision.report:
                if sync_round:
                    time.sleep(SYNC_ROUND_PAUSE_S)
                continue
            totals = progress.reduce(False)
            fresh = None  # (Ray Train does not watch for preemptions with replica groups)
        else:
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

        metrics = progress.metrics(loop.step, totals, scheduler.get_last_lr()[0],
                                   None if group else loop.data_digest)
        if group:
            metrics.update(ledger.report_metrics())
            loop.replicas = ledger.state()  # (after the drain: a checkpoint holds the counts only)
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
                        deadline_s=preemption.deadline_s if decision.preemption_save and preemption else None,
                        system=sampler.take() if sampler else None)
        if fresh is not None and rank == 0:  # rank 0's clock decides when the final save is due
            preemption.plan_final_save(reporter.cost["checkpoint_blocking_s"])
            print(preemption.notice_line(loop.step), flush=True)
        if decision.hold:
            if rank == 0:
                print(f"preemption deadline near: checkpoint saved at step {loop.step}; waiting for the restart",
                      flush=True)
            preemption.hold()
        progress.next_window()
    if hasattr(train_data, "close"):  # a streamed split's read-ahead threads
        train_data.close()
    if group:
        group.shutdown()
    if sampler:
        sampler.stop()


# continue: the pause between two sync rounds while a finished group waits for a replaced one
SYNC_ROUND_PAUSE_S = 0.2


def batch_rows(batch: dict) -> int:
    return next(iter(batch.values())).shape[0]


def _loop_fields(loop) -> dict:
    return {"step": loop.step, "best_metric": loop.best_metric,
            "evals_without_improvement": loop.evals_without_improvement, "stopped_early": loop.stopped_early}


def _set_loop_fields(loop, fields: dict) -> None:
    for name, value in fields.items():
        setattr(loop, name, value)
