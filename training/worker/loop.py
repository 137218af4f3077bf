"""The per-worker training loop, run by Ray Train on every worker.

build and restore (training/worker/setup.py) -> for each step: this worker's part of the global
batch, forward, backward, the optimizer step as the failure mode commits it (training/failure/),
then the step policy says whether to report, evaluate or checkpoint (training/worker/policy.py),
and the loop does it (`state`: the loop's state, what a checkpoint restores). Resume is the normal
path: a fresh run is a resume from step 0.
"""

from __future__ import annotations

from training.adaptors.ray_private import quiet_report_logs
from training.failure.mode import Outcome
from training.worker import parallel
from training.worker.config import WorkerConfig
from training.worker.evaluate import update_early_stopping
from training.worker.policy import NOTHING_DUE
from training.worker.setup import Worker, start_worker


def train_loop_per_worker(config: WorkerConfig) -> None:
    quiet_report_logs()
    run(start_worker(config))


def run(w: Worker) -> None:
    state, mode, progress = w.state, w.mode, w.progress
    val_metrics: dict = {}
    while mode.more_steps(state, w.total_steps):
        w.profiler.before_step(state.step + 1)
        mode.begin_step(state.step)
        batch = w.batch(state.step)
        compute = progress.mark()
        w.seed(state.step)  # dropout: a function of the step
        for part, sync in w.micro_batches(batch):
            with parallel.gradient_sync(w.train_model, sync), w.autocast:
                loss_sum, units, _ = w.task.forward_loss(w.train_model, part)
            loss_sum.backward(w.loss_scale)
            progress.add(loss_sum, units)
        optimize = progress.phase_done("forward_backward", compute)
        outcome = mode.commit_step(state, batch, w.optimizer_step)
        if outcome is Outcome.RETRY:
            continue
        due = NOTHING_DUE
        if outcome is Outcome.TAKEN:
            progress.phase_done("optimizer", optimize)
            progress.step_done()
            w.profiler.after_step(state.step)
            due = w.policy.due(state.step)

        report = mode.plan_report(due, state, have_val_metrics=bool(val_metrics))
        if report is None:
            continue
        decision = report.decision
        metrics = {**progress.metrics(state.step, report.totals, w.lr(), report.data_digest),
                   **mode.report_metrics(state)}
        if decision.evaluate:
            val_metrics = w.evaluate()
            update_early_stopping(w.config.train.early_stopping, state, val_metrics)
            decision = decision.after_evaluation(state.stopped_early)
        if decision.reports_val_metrics:
            metrics.update(val_metrics)
        if decision.preemption_save:
            metrics["preemption_checkpoint_step"] = state.step
        w.reporter.report(metrics, state, checkpoint=decision.checkpoint, synchronous=decision.preemption_save,
                          deadline_s=mode.upload_deadline_s(decision), system=w.system_samples())
        mode.after_report(decision, state.step, w.reporter.cost)
        progress.next_window()
    w.close()
