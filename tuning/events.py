"""The sweep's trial events (the sweep's driver, inside Tune's loop): one console line per trial
started, evaluated, stopped by the scheduler, finished or failed, and the status.json of a training
run that the scheduler stopped.

The lines go to the `tuning.events` logger: Tune unpickles the callbacks of a resumed sweep, so the
callback holds no stream, and whoever runs the sweep decides where its lines go (the CLI: the
console, tuning/console.py). A trial that the scheduler stops is recognised the way Tune marks it:
Tune sets `done` on the result its scheduler answered STOP to, and hands that result to the
callbacks; a trial that ends by itself reports no result with `done` (Tune adds it to a copy that
callbacks never see).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from ray import tune

from training import storage
from training.errors import last_line
from training.observe.files import read_status, write_json

log = logging.getLogger("tuning.events")

SCHEDULER_STOPPED = "scheduler_stopped"  # a training run's status.json state (contract with `training status`)
STOPPED_BY_TAG = "tune.stopped_by"  # the MLflow tag of a trial's child run that its scheduler stopped
SCHEDULER_LABELS = {"asha": "ASHA", "pbt": "PBT", "fifo": "FIFO"}


def stop_reason(scheduler: str, step: int, metric: str, value: Optional[float]) -> str:
    """One line: which scheduler, at which step, on which metric value ("ASHA at step 40 (val_accuracy 0.4121)")."""
    shown = "-" if value is None else f"{value:.4f}"
    return f"{SCHEDULER_LABELS.get(scheduler, scheduler)} at step {step} ({metric} {shown})"


def params_text(params: dict) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def mark_scheduler_stopped(run_dir: str, reason: str, ended_s: float) -> None:
    """Rewrite a training run's status.json as stopped by the sweep's scheduler (its driver, the
    trial's actor, was ended by Tune and wrote nothing more)."""
    record = read_status(run_dir) or {}
    record.update(state=SCHEDULER_STOPPED, error=reason, ended=ended_s, heartbeat=ended_s)
    write_json(storage.join(run_dir, "status.json"), record)


def _value(result: dict, metric: str) -> Optional[float]:
    value = result.get(metric)
    return float(value) if isinstance(value, (int, float)) and value == value else None


def trial_error_line(trial) -> str:
    """The last line of a failed trial's error (Tune keeps it with the trial)."""
    try:
        error = trial.get_pickled_error()
        if error is not None:
            return last_line(error, 300)
        if trial.error_file:
            with open(trial.error_file, encoding="utf-8") as handle:
                return last_line(Exception(handle.read()), 300)
    except Exception:  # (a line is a nicety; the error itself is in the sweep's log and Tune's files)
        pass
    return "see the sweep's log"


class SweepEvents(tune.Callback):
    """Trial events as console lines; status.json of the runs the scheduler stops."""

    def __init__(self, metric: str, scheduler: str, storage_path: str):
        self.metric, self.scheduler, self.storage_path = metric, scheduler, storage_path
        self._stopped: set[str] = set()

    def on_trial_start(self, iteration, trials, trial, **info):
        log.info("trial %s started: %s", trial.trial_id, params_text(trial.config))

    def on_trial_result(self, iteration, trials, trial, result, **info):
        step, value = int(result.get("step", 0)), _value(result, self.metric)
        if result.get("done"):
            reason = stop_reason(self.scheduler, step, self.metric, value)
            self._stopped.add(trial.trial_id)
            log.info("trial %s stopped by %s", trial.trial_id, reason)
            run = result.get("training_run")
            if run:
                try:
                    mark_scheduler_stopped(storage.join(self.storage_path, run), reason, time.time())
                except Exception as exc:  # (written again when the sweep ends)
                    log.info("trial %s: could not write its status.json yet (%s)", trial.trial_id, exc)
        elif value is not None:
            log.info("trial %s step %d: %s %.4f", trial.trial_id, step, self.metric, value)

    def on_trial_complete(self, iteration, trials, trial, **info):
        if trial.trial_id in self._stopped:
            return
        result = trial.last_result or {}
        value = _value(result, self.metric)
        log.info("trial %s finished at step %d: %s %s", trial.trial_id, int(result.get("step", 0)), self.metric,
                 "-" if value is None else f"{value:.4f}")

    def on_trial_recover(self, iteration, trials, trial, **info):
        log.info("trial %s failed (%s); it restarts from its last checkpoint", trial.trial_id,
                 trial_error_line(trial))

    def on_trial_error(self, iteration, trials, trial, **info):
        log.info("trial %s failed: %s", trial.trial_id, trial_error_line(trial))
