"""The Train controller's side of a run's status and notifications: progress.json (the last step
and metrics, restarts and preemptions so far) and the `restarted` / `preempted` posts.

Runs on the Ray Train controller, which sees every report and every state change of the worker
group. Ray Train hands reports to `UserCallback`s and state changes to `ControllerCallback`s, and a
callback that is both gets only the first: so two callbacks share one `RunEvents` (pickled together
in one RunConfig, the controller gets one copy of it). Posts go from a daemon thread: the controller
never waits on a webhook; at the end it waits a few seconds for posts still in flight.
"""

from __future__ import annotations

import time
from typing import Optional

import ray.train

from training import storage, topics
from training.adaptors.ray_private import controller_callback_base, controller_state_name
from training.metrics import KEY_METRICS
from training.observe.files import PROGRESS_FILE, write_json
from training.observe.notify import event_for_transition, run_message
from training.observe.webhook import Notifier

log = topics.logger(topics.STATUS, __name__)


class RunEvents:
    """What the controller knows of the run, written to progress.json when it changes."""

    def __init__(self, name: str, run_dir: str, notifier: Optional[Notifier] = None, *, restarts: int = 0,
                 preemptions: int = 0, mlflow_run_id: Optional[str] = None, mlflow_url: Optional[str] = None,
                 write_every_s: float = 5.0, end_wait_s: float = 10.0):
        self.name, self.run_dir, self.notifier = name, run_dir, notifier or Notifier([])
        self.restarts, self.preemptions = restarts, preemptions
        self.mlflow_run_id, self.mlflow_url = mlflow_run_id, mlflow_url
        self.write_every_s, self.end_wait_s = write_every_s, end_wait_s
        self.latest: dict = {}
        self.controller_state = "INITIALIZING"
        self._written_at = 0.0
        self._posts: list = []

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_posts"] = []
        return state

    def on_report(self, metrics: dict, checkpointed: bool) -> None:
        self.latest = metrics
        now = time.monotonic()
        if checkpointed or now - self._written_at >= self.write_every_s:
            self.write()

    def on_state(self, previous: str, current: str) -> None:
        self.controller_state = current
        event = event_for_transition(previous, current)
        if event == "restarted":
            self.restarts += 1
        elif event == "preempted":
            self.preemptions += 1
        self.write()
        if event is not None and self.notifier.wants(event):
            detail = {"restarted": f"worker group restart {self.restarts} (from the newest complete checkpoint)",
                      "preempted": "a node holding a worker is being preempted"}[event]
            body = run_message(event, self.name, step=self._step(), total_steps=self._total(),
                               metrics=self.latest, mlflow_run_id=self.mlflow_run_id, mlflow_url=self.mlflow_url,
                               restarts=self.restarts, detail=detail)
            self._posts.append(self.notifier.notify_in_background(event, body))

    def on_end(self) -> None:
        self.write()
        deadline = time.monotonic() + self.end_wait_s
        for thread in self._posts:
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))

    def progress(self) -> dict:
        return {"name": self.name, "step": self._step(), "total_steps": self._total(),
                "metrics": {k: v for k, v in self.latest.items() if k in KEY_METRICS or k in ("epoch", "lr")},
                "world_size": self.latest.get("world_size"), "restarts": self.restarts,
                "preemptions": self.preemptions, "controller_state": self.controller_state, "updated": time.time()}

    def write(self) -> None:
        try:
            write_json(storage.join(self.run_dir, PROGRESS_FILE), self.progress())
            self._written_at = time.monotonic()
        except Exception as exc:  # the status command lags; training goes on
            log.warning("could not write %s: %s", PROGRESS_FILE, exc)

    def _step(self) -> Optional[int]:
        return int(self.latest["step"]) if "step" in self.latest else None

    def _total(self) -> Optional[int]:
        return int(self.latest["total_steps"]) if "total_steps" in self.latest else None


class RunEventReports(ray.train.UserCallback):
    def __init__(self, events: RunEvents):
        self.events = events

    def after_report(self, run_context, metrics, checkpoint) -> None:
        self.events.on_report(metrics[0], checkpoint is not None)


class RunEventStates(controller_callback_base()):
    def __init__(self, events: RunEvents):
        self.events = events

    def after_controller_state_update(self, previous_state, current_state) -> None:
        self.events.on_state(controller_state_name(previous_state), controller_state_name(current_state))

    def after_controller_finish(self, result) -> None:
        self.events.on_end()

    def before_controller_abort(self) -> None:
        self.events.on_end()


def event_callbacks(events: RunEvents) -> list:
    return [RunEventReports(events), RunEventStates(events)]
