"""What the driver does so that a run can be watched (the driver): its status.json with a heartbeat,
the Train controller's callbacks (progress.json, `restarted` / `preempted` posts), and the
`finished` / `failed` post when the run ends."""

from __future__ import annotations

from typing import Optional

from training.observe.callback import RunEvents, event_callbacks
from training.observe.driver_status import DriverStatus
from training.observe.files import read_progress
from training.observe.notify import mlflow_run_url, run_message
from training.observe.webhook import Notifier


class RunWatch:
    """What the driver does so that a run can be watched: its status.json with a heartbeat, the
    controller's callbacks (progress.json, restarted/preempted posts), and the finished/failed post."""

    def __init__(self, name, paths, status, events, notifier, log):
        (self.name, self.paths, self.status,
         self.events, self.notifier, self.log) = name, paths, status, events, notifier, log

    @classmethod
    def start(cls, name: str, paths, tracker, targets, log) -> "RunWatch":
        mlflow_url = None
        if tracker.run_id is not None:
            try:
                experiment_id = tracker.client.get_run(tracker.run_id).info.experiment_id
                mlflow_url = mlflow_run_url(paths.tracking_uri, experiment_id, tracker.run_id)
            except Exception:  # a link is a nicety: MLflow answered a moment ago, and will be asked again
                pass
        earlier = read_progress(paths.run_dir) or {}  # a resumed run counts its restarts on
        status = DriverStatus(paths.run_dir, name, warn=log).start(
            mlflow_run_id=tracker.run_id, mlflow_url=mlflow_url, tracking_uri=paths.tracking_uri)
        notifier = Notifier(targets, warn=log)
        events = RunEvents(name, paths.run_dir, notifier, restarts=int(earlier.get("restarts") or 0),
                           preemptions=int(earlier.get("preemptions") or 0), mlflow_run_id=tracker.run_id,
                           mlflow_url=mlflow_url)
        return cls(name, paths, status, events, notifier, log)

    def callbacks(self) -> list:
        return event_callbacks(self.events)

    def end(self, state: str, error: Optional[str] = None, metrics: Optional[dict] = None) -> None:
        """Record the end, then post it (`stopped`, an interrupt, is not posted: the user did it)."""
        self.status.end(state, error)
        if state not in ("finished", "failed") or not self.notifier.wants(state):
            return
        progress = read_progress(self.paths.run_dir) or {}
        metrics = metrics or progress.get("metrics") or {}
        step = metrics.get("step", progress.get("step"))
        total = metrics.get("total_steps", progress.get("total_steps"))
        body = run_message(state, self.name, step=int(step) if step is not None else None,
                           total_steps=int(total) if total is not None else None, metrics=metrics,
                           mlflow_run_id=self.events.mlflow_run_id, mlflow_url=self.events.mlflow_url,
                           error=error, restarts=int(progress.get("restarts") or 0))
        self.notifier.notify(state, body)
