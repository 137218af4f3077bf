"""The Train controller's side of a run: progress lines and tracking, once per report.

Runs on the Ray Train controller (not on the workers), so there is exactly one writer to the
MLflow run however many workers there are and however often they restart.
"""

from __future__ import annotations

import datetime
import time

import ray.train

from training.tracking import NullTracker

_SKIP = {"step", "total_steps", "worker_start_time", "first_step_time"}


def progress_line(metrics: dict, eta_s: float | None) -> str:
    step, total = int(metrics["step"]), int(metrics.get("total_steps", 0))
    parts = [f"step {step}/{total} ({100 * step / max(total, 1):.0f}%)", f"loss {metrics['train_loss']:.4f}"]
    for key, fmt in (("val_loss", "val_loss {:.4f}"), ("val_accuracy", "val_acc {:.3f}"),
                     ("val_perplexity", "val_ppl {:.2f}")):
        if key in metrics:
            parts.append(fmt.format(metrics[key]))
    parts.append(f"{metrics['samples_per_s']:.0f} samples/s")
    parts.append(f"{int(metrics['world_size'])} workers")
    if eta_s is not None:
        parts.append(f"ETA {datetime.timedelta(seconds=round(eta_s))}")
    return " | ".join(parts)


class RunCallback(ray.train.UserCallback):
    def __init__(self, tracker=None):
        self.tracker = tracker or NullTracker()
        self._last: tuple[float, int] | None = None

    def after_report(self, run_context, metrics, checkpoint) -> None:
        latest = metrics[0]  # rank 0's: every metric is already reduced across workers
        step = int(latest["step"])
        now = time.monotonic()
        eta = None
        if self._last is not None and step > self._last[1]:
            seconds_per_step = (now - self._last[0]) / (step - self._last[1])
            eta = seconds_per_step * (int(latest.get("total_steps", step)) - step)
        self._last = (now, step)
        self.tracker.log_metrics({k: v for k, v in latest.items() if k not in _SKIP}, step)
        line = progress_line(latest, eta)
        if checkpoint is not None:
            line += " | checkpoint saved"
        print(line, flush=True)

    def after_exception(self, run_context, worker_exceptions) -> None:
        ranks = ", ".join(f"rank {rank}: {type(exc).__name__}" for rank, exc in sorted(worker_exceptions.items()))
        print(f"worker failure ({ranks}); Ray Train restarts from the latest checkpoint if the failure "
              "budget allows", flush=True)
        self._last = None
