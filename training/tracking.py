"""Tracking in one place: one MLflow run per training run, written from the driver and the Train
controller (never from the workers), and a null tracker with the same interface.

A tracker is picklable: the driver creates the MLflow run, then hands the tracker to the controller
through a Ray Train callback. A tracking outage never stops training: metrics that fail to send are
kept and sent with the next batch, and a warning says so.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

log = logging.getLogger(__name__)

RUN_NAME_TAG = "training.run_name"


class NullTracker:
    run_id: Optional[str] = None
    tracking_uri: Optional[str] = None

    def log_metrics(self, metrics: dict, step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def finish(self, status: str) -> None:
        pass


class MlflowTracker:
    def __init__(self, tracking_uri: str, run_id: str):
        self.tracking_uri, self.run_id = tracking_uri, run_id
        self._client = None
        self._pending: list = []
        self._warned = False

    def __getstate__(self):
        return {"tracking_uri": self.tracking_uri, "run_id": self.run_id}

    def __setstate__(self, state):
        self.__init__(state["tracking_uri"], state["run_id"])

    @property
    def client(self):
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(self.tracking_uri)
        return self._client

    @classmethod
    def start(cls, tracking_uri: str, experiment: str, run_name: str, run_id: Optional[str],
              tags: dict[str, str], params: dict[str, str],
              artifact_location: Optional[str] = None) -> "MlflowTracker":
        """Continue the run `run_id` if given (a resumed training run), else create one."""
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri)
        if run_id is not None:
            client.update_run(run_id, status="RUNNING")
            existing = client.get_run(run_id).data.params
        else:
            found = client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else client.create_experiment(
                experiment, artifact_location=artifact_location)
            run_id = client.create_run(experiment_id, run_name=run_name, tags={RUN_NAME_TAG: run_name}).info.run_id
            existing = {}
        from mlflow.entities import Param, RunTag

        fresh = [Param(k, v[:6000]) for k, v in params.items() if k not in existing]
        for start in range(0, len(fresh), 100):
            client.log_batch(run_id, params=fresh[start:start + 100])
        client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        tracker = cls(tracking_uri, run_id)
        tracker._client = client
        return tracker

    def log_metrics(self, metrics: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending += [Metric(k, float(v), now, step) for k, v in metrics.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)]
        self.flush()

    def flush(self) -> None:
        while self._pending:
            batch = self._pending[:1000]
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except Exception as exc:  # an outage must never stop training
                if not self._warned:
                    log.warning("MLflow at %s is unreachable (%s); keeping %d metrics to send later",
                                self.tracking_uri, exc, len(self._pending))
                    self._warned = True
                return
            del self._pending[:len(batch)]
            self._warned = False

    def finish(self, status: str) -> None:
        self.flush()
        try:
            self.client.set_terminated(self.run_id, status=status)
        except Exception as exc:
            log.warning("could not mark MLflow run %s %s: %s", self.run_id, status, exc)
