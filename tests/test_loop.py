"""The training loop (training/worker/loop.py) without Ray: a worker of real parts (digits, the MLP, the
optimizer, the step policy, restart mode), with the report recorded instead of sent to Ray Train.
What the loop does at each step is the failure mode's to decide; these check that it does it."""

import time

import numpy as np
import torch
from conftest import CONFIGS

from training import config as config_lib
from training.checkpoint.format import LoopState
from training.data.order import DIGEST_MODULUS, BatchPlan, batch_digest
from training.data.registry import prepare, source_of
from training.data.shards import TrainShard
from training.data.source import validation_part
from training.failure.mode import Outcome, WorkerContext
from training.failure.restart import MODE as RESTART
from training.models.registry import build_model
from training.tasks import TASKS
from training.worker import parallel
from training.worker.config import WorkerConfig
from training.worker.loop import run
from training.worker.optim import build_optimizer, lr_factor
from training.worker.policy import StepPolicy
from training.worker.profile import StepProfiler
from training.worker.progress import Progress, RunFacts
from training.worker.seeding import StepSeeder
from training.worker.setup import Worker, tensors


class Reports:
    """Stands in for the CheckpointReporter: what would have gone to `ray.train.report`."""

    def __init__(self):
        self.made, self.cost = [], {}

    def report(self, metrics, state, *, checkpoint, synchronous, deadline_s=None, system=None):
        self.made.append((state.step, checkpoint, dict(metrics)))


def a_worker(tmp_path, steps: int, mode=None, overrides=()) -> Worker:
    job = config_lib.load(CONFIGS / "digits.yaml", [f"train.max_steps={steps}", "train.log_every_n_steps=5",
                                                    "train.eval_every_n_steps=20", "checkpoint.every_n_steps=20",
                                                    "train.min_report_interval_s=0", *overrides])
    manifest = prepare(job.data, str(tmp_path), log=lambda _: None)
    source, device = source_of(manifest.source), torch.device("cpu")
    plan = BatchPlan(job.train.global_batch_size, 1, 0)
    data = source.open(manifest, plan, job.seed)
    torch.manual_seed(job.seed)
    model = build_model(job.model, {"task": manifest.task, **manifest.spec})
    policy = StepPolicy.of(job.train, job.checkpoint, steps)
    mode = mode or RESTART.worker(WorkerContext(0, 1, plan.global_batch_size, steps, device, policy, lambda m: m,
                                                lambda: None))
    optimizer = build_optimizer(job.optim, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(job.optim, steps))
    state = LoopState()
    progress = Progress(RunFacts(plan.global_batch_size, data.steps_per_epoch, steps, 1, 0, time.time()), 0, device)
    mode.start(state, model, optimizer, scheduler, progress)
    val_rows = tensors(validation_part(source.rows(manifest, "validation"), 1, 0))
    return Worker(WorkerConfig.of(job, manifest.root, str(tmp_path / "run")), 0, device, TASKS[manifest.task], plan,
                  data, val_rows, steps, torch.tensor(1 / plan.global_batch_size), parallel.autocast("auto", device),
                  model, model, optimizer, scheduler, False, mode, state, policy, progress, Reports(),
                  StepProfiler(None, 0, device, str(tmp_path)), None, keeps_digest=True,
                  seed=StepSeeder(job.seed, 0, device))


def test_the_loop_steps_reports_evaluates_and_checkpoints_when_due(tmp_path):
    w = a_worker(tmp_path, 40)
    run(w)
    assert w.state.step == 40
    steps = [step for step, _, _ in w.reporter.made]
    assert steps == list(range(5, 41, 5))  # every log step (no minimum interval here)
    checkpoints = [step for step, checkpoint, _ in w.reporter.made if checkpoint]
    assert checkpoints == [20, 40]
    last = w.reporter.made[-1][2]
    assert last["step"] == 40 and "val_accuracy" in last and last["train_loss"] < 2.3  # learned something
    # the data digest the loop reports is the digest of the global batches it trained on
    expected, shard = 0, TrainShard(w.data.reader, BatchPlan(64, 1, 0), w.config.seed)
    for step in range(40):
        shard.batch(step)
        expected = (expected + batch_digest(step, shard.sample_ids(step))) % DIGEST_MODULUS
    assert last["data_digest"] == expected == w.state.data_digest


def test_a_step_the_mode_does_not_commit_is_taken_again(tmp_path):
    class OnceRetried:
        """Restart mode, but the 3rd step does not commit the first time (as a replica group's step
        does when a peer dies in it): the loop takes it again, and its window holds it once."""

        def __init__(self, inner):
            self.inner, self.retried, self.windows = inner, False, []

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def begin_step(self, step):
            self.windows.append(self.inner.progress.snapshot())

        def commit_step(self, state, batch, step_fn):
            if state.step == 2 and not self.retried:  # (as continue mode does: the step's gradients go)
                self.retried = True
                w.optimizer.zero_grad(set_to_none=True)
                self.inner.progress.rewind(self.windows[-1])
                return Outcome.RETRY
            return self.inner.commit_step(state, batch, step_fn)

    w = a_worker(tmp_path, 10)
    steady = a_worker(tmp_path, 10)
    w.mode = OnceRetried(w.mode)
    run(w)
    run(steady)
    assert w.mode.retried and w.state.step == 10
    # the retried step trained once: the same weights as a run without the retry (its dropout draws
    # are seeded by the step, so the step taken again draws the same)
    for a, b in zip(w.model.parameters(), steady.model.parameters()):
        assert torch.equal(a, b)


def test_quiet_steps_skip_asking_until_the_report_interval_can_have_passed():
    policy = StepPolicy(total_steps=10_000, log_every_n_steps=10, eval_every_n_steps=1000,
                        checkpoint_every_n_steps=1000, min_report_interval_s=1.0)
    assert policy.quiet_steps(elapsed_s=0.1, window_steps=100) == 720  # 0.9 s left at 1000 steps/s, 80% of it
    assert policy.quiet_steps(elapsed_s=1.5, window_steps=100) == 0  # due now
    assert policy.quiet_steps(elapsed_s=0.0, window_steps=0) == 0
    assert StepPolicy(10, 1, 5, 5, 0.0).quiet_steps(0.1, 10) == 0  # no minimum interval: ask every time


def test_the_loop_stops_early_when_the_metric_stops_improving(tmp_path):
    w = a_worker(tmp_path, 200, overrides=["train.early_stopping={metric: val_loss, patience_evals: 1, min_delta: 10}"])
    run(w)
    assert w.state.stopped_early and w.state.step == 40  # the first evaluation sets the best, the second stops
    assert w.reporter.made[-1][1]  # the evaluation that stopped it is checkpointed
    assert np.isfinite(w.reporter.made[-1][2]["val_loss"])
