"""The Train controller's side of a run: progress lines and tracking, once per report.

Runs on the Ray Train controller (not on the workers), so there is exactly one writer to the
MLflow run however many workers there are and however often they restart. The tracker only queues
metrics here (it sends them from its own thread), so an MLflow outage never stalls the controller;
when the run ends, `TrackingShutdown` gives MLflow a last chance and leaves the rest in the run's
storage for the driver.
"""

from __future__ import annotations

import datetime
import time

import ray.train

from training.adaptors.ray_private import controller_callback_base
from training.observe.system import mlflow_rows
from training.run.console import worker_count
from training.tracking.tracker import NullTracker

_SKIP = {"step", "total_steps"}


def replica_history(metrics: dict) -> list[tuple[int, dict, float | None]]:
    """failure.mode continue: the steps since the last report that fewer than all replica groups
    took, and the losses and rejoins of groups, as (step, metrics, timestamp_s) to log at their
    own steps: `replicas` per short step, `replica_lost` / `replica_rejoined` (the replica count)
    per event, at the time it happened."""
    rows: list[tuple[int, dict, float | None]] = []
    for short in metrics.get("replica_steps") or ():
        rows.append((short["step"], {"replicas": short["replicas"], "samples_used": short["samples_used"]}, None))
    for event in metrics.get("replica_events") or ():
        rows.append((event["step"], {event["kind"]: event["replicas"]}, event["time_s"]))
    return rows


def progress_line(metrics: dict, eta_s: float | None) -> str:
    step, total = int(metrics["step"]), int(metrics.get("total_steps", 0))
    parts = [f"step {step}/{total} ({100 * step / max(total, 1):.0f}%)", f"loss {metrics['train_loss']:.4f}"]
    for key, fmt in (("val_loss", "val_loss {:.4f}"), ("val_accuracy", "val_acc {:.3f}"),
                     ("val_perplexity", "val_ppl {:.2f}")):
        if key in metrics:
            parts.append(fmt.format(metrics[key]))
    parts.append(f"{metrics['samples_per_s']:.0f} samples/s")
    parts.append(worker_count(int(metrics["world_size"])))
    if eta_s is not None:
        parts.append(f"ETA {datetime.timedelta(seconds=round(eta_s))}")
    return " | ".join(parts)


def failure_line(worker_exceptions: dict, checkpoint_step: int | None) -> str:
    """The console's one line on a worker group's failure (the tracebacks are in the run's log)."""
    ranks = ", ".join(f"rank {rank}: {type(exc).__name__}" for rank, exc in sorted(worker_exceptions.items()))
    where = f"step {checkpoint_step}" if checkpoint_step is not None else "its latest checkpoint"
    return f"worker failure ({ranks}); the group restarts from {where} if the failure budget allows"


class RunCallback(ray.train.UserCallback):
    def __init__(self, tracker=None, logged_through_step: int = -1):
        self.tracker = tracker or NullTracker()
        self._last: tuple[float, int] | None = None
        self.checkpoint_step: int | None = None  # the newest checkpoint's: where a restarted group resumes
        # Steps redone after a restart were logged already: MLflow gets each step once.
        self.logged_through_step = logged_through_step

    def after_report(self, run_context, metrics, checkpoint) -> None:
        # rank 0's: every metric is already reduced across workers. failure.mode continue: each
        # worker's window is its own, and a worker that has just replaced another may have trained
        # nothing in it (no loss): then the first worker that did.
        latest = next((m for m in metrics if m.get("train_loss") == m.get("train_loss")), metrics[0])
        step = int(latest["step"])
        now = time.monotonic()
        eta = None
        if self._last is not None and step > self._last[1]:
            seconds_per_step = (now - self._last[0]) / (step - self._last[1])
            eta = seconds_per_step * (int(latest.get("total_steps", step)) - step)
        self._last = (now, step)
        if step > self.logged_through_step:
            for at_step, values, timestamp_s in replica_history(latest):
                self.tracker.log_metrics(values, at_step, timestamp_s)
            self.tracker.log_metrics({k: v for k, v in latest.items() if k not in _SKIP}, step)
            self.logged_through_step = step
        for values, timestamp_s in mlflow_rows(metrics):  # every worker's: new samples, even on steps redone
            self.tracker.log_metrics(values, step, timestamp_s)
        if checkpoint is not None:
            self.tracker.on_checkpoint()
            self.checkpoint_step = step
        line = progress_line(latest, eta)
        if checkpoint is not None:
            line += " | checkpoint saved"
        print(line, flush=True)

    def after_exception(self, run_context, worker_exceptions) -> None:
        print(failure_line(worker_exceptions, self.checkpoint_step), flush=True)
        self._last = None


class TrackingShutdown(controller_callback_base()):
    """When the run ends (finished, failed or aborted), before the controller exits: deliver the
    metrics still queued, waiting a little for MLflow; what it does not take goes to the run's
    backlog file, which the driver's tracker picks up."""

    def __init__(self, tracker):
        self.tracker = tracker

    def after_controller_finish(self, result) -> None:
        # Long enough for a batch in flight; if MLflow is away, the driver waits for it instead.
        self.tracker.close(self.tracker.policy.attempt_timeout_s)

    def before_controller_abort(self) -> None:
        self.tracker.close(0.0)


def run_callbacks(tracker=None, logged_through_step: int = -1) -> list:
    """The callbacks of a run's RunConfig. They share one tracker (pickled together, so the
    controller gets one copy of it)."""
    tracker = tracker or NullTracker()
    return [RunCallback(tracker, logged_through_step), TrackingShutdown(tracker)]
