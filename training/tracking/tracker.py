"""The MLflow tracker (driver and Ray Train controller, never the workers): one MLflow run per
training run, and a null tracker with the same interface.

A tracker is picklable: the driver creates the MLflow run, then hands the tracker to the controller
through Ray Train callbacks.

A tracking outage never stops or stalls training. `log_metrics` only queues; a sender thread
delivers the queue in batches, one short attempt at a time (MLflow's own client retries back off
for minutes), waiting its own backoff between failed attempts, and a warning says when MLflow stops
and starts answering. While MLflow is unreachable the queue is also written to the run's storage,
`<run dir>/tracking_backlog.jsonl` (after failed attempts at most every `persist_every_s`, and at
once when a checkpoint is reported), so a crash loses nothing that a resume would not report again.
What is still undelivered at the end of the run stays in that file with the run's final status; it
is replayed into the MLflow run the next time this run (same name) or any run in the same storage
starts with MLflow reachable, and the file is then removed.

Sending a metric twice is harmless with a database-backed MLflow store (sqlite, a tracking server
on a database): it keeps one row per (key, step, timestamp, value), and a queued metric keeps the
timestamp it was logged with. So a batch whose answer was lost, or a backlog replayed twice, is
never counted twice.

The pieces: `SendPolicy` (policy.py) decides the sender's next step, sender.py carries it out
with the one-shot MLflow calls of transport.py and the backlog file of backlog.py.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import asdict
from typing import Optional

from training import topics
from training.metrics import mlflow_name
from training.redaction import redact
from training.tracking.policy import SendPolicy
from training.tracking.sender import Sender
from training.tracking.transport import MlflowTransport, keep_password_out_of_mlflow_output

log = topics.logger(topics.TRACKING, __name__)

RUN_NAME_TAG = "training.run_name"


@contextmanager
def fluent_mlflow(tracking_uri: str):
    """MLflow's fluent API (log_model, register_model) pointed at tracking_uri for a moment.
    mlflow.set_tracking_uri also exports MLFLOW_TRACKING_URI to this process's environment, where
    it would outlive the run: the next run in this process, and every process started from it
    (a Ray head, a job), would track there. Both are put back afterwards."""
    import mlflow  # (lazy: mlflow)

    previous = os.environ.get("MLFLOW_TRACKING_URI")  # what set_tracking_uri last set, if anything
    keep_password_out_of_mlflow_output(tracking_uri)
    mlflow.set_tracking_uri(tracking_uri)
    try:
        yield mlflow
    finally:
        mlflow.set_tracking_uri(previous)  # None unsets both


class NullTracker:
    """Tracking turned off: the tracker's interface, doing nothing."""

    run_id: Optional[str] = None
    tracking_uri: Optional[str] = None
    policy = SendPolicy()

    def log_metrics(self, metrics: dict, step: int, timestamp_s: Optional[float] = None) -> None:
        pass

    def on_checkpoint(self) -> None:
        pass

    def catch_up(self, wait_s: Optional[float] = None) -> bool:
        return False

    def close(self, wait_s: Optional[float] = None) -> bool:
        return True

    def finish(self, status: str, end_time_ms: Optional[int] = None) -> None:
        pass

    def last_step(self, key: str) -> int:
        return -1


class MlflowTracker:
    """One MLflow run: set up by `start` on the driver, fed by `log_metrics` (driver and controller),
    ended by `finish` on the driver. `transport` is the one `start` checked MLflow with."""

    def __init__(self, tracking_uri: str, run_id: Optional[str], run_dir: Optional[str] = None,
                 policy: SendPolicy = SendPolicy(), transport: Optional[MlflowTransport] = None):
        self.tracking_uri, self.run_id, self.run_dir, self.policy = tracking_uri, run_id, run_dir, policy
        self._transport = transport or MlflowTransport(tracking_uri, policy.attempt_timeout_s)
        self._sender = Sender(run_id, run_dir, self._transport, policy)
        self._gave_up = False  # a catch_up found MLflow away: finish does not wait as long again

    def __getstate__(self):
        return {"tracking_uri": self.tracking_uri, "run_id": self.run_id, "run_dir": self.run_dir,
                "policy": asdict(self.policy)}

    def __setstate__(self, state):
        self.__init__(state["tracking_uri"], state["run_id"], state["run_dir"], SendPolicy(**state["policy"]))

    @property
    def client(self):
        """MLflow's own client (it retries for minutes): for calls that may wait on MLflow."""
        return self._transport.client

    @classmethod
    def start(cls, tracking_uri: str, experiment: str, run_name: str, run_id: Optional[str],
              tags: dict[str, str], params: dict[str, str], artifact_location: Optional[str] = None,
              run_dir: Optional[str] = None, policy: SendPolicy = SendPolicy()) -> "MlflowTracker":
        """Continue the run `run_id` if given (a resumed training run), else create one. Raises
        at once (one short attempt) if MLflow does not answer."""
        from mlflow.entities import Param, RunTag  # (lazy: mlflow)

        transport = MlflowTransport(tracking_uri, policy.attempt_timeout_s)
        transport.check_reachable()
        client = transport.client
        if run_id is not None:
            client.update_run(run_id, status="RUNNING")
            existing = client.get_run(run_id).data.params
        else:
            found = client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else client.create_experiment(
                experiment, artifact_location=artifact_location)
            run_id = client.create_run(experiment_id, run_name=run_name, tags={RUN_NAME_TAG: run_name}).info.run_id
            existing = {}
        fresh = [Param(k, v[:6000]) for k, v in params.items() if k not in existing]
        for start in range(0, len(fresh), 100):
            client.log_batch(run_id, params=fresh[start:start + 100])
        client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        return cls(tracking_uri, run_id, run_dir, policy, transport)

    def last_step(self, key: str) -> int:
        """The last step at which the run's metric `key` was logged (-1 if none or MLflow does not answer)."""
        try:
            return max((m.step for m in self.client.get_metric_history(self.run_id, mlflow_name(key))), default=-1)
        except Exception:
            return -1

    # --- the sender's side: only catch_up, close and finish wait, each for at most its wait_s -------

    def log_metrics(self, metrics: dict, step: int, timestamp_s: Optional[float] = None) -> None:
        """Queue numeric metrics for the sender thread, under their MLflow names (training/metrics.py);
        returns at once. `timestamp_s`: when they were measured (time.time()), if not now."""
        from mlflow.entities import Metric  # (lazy: mlflow)

        now = int((time.time() if timestamp_s is None else timestamp_s) * 1000)
        self._sender.queue([Metric(mlflow_name(k), float(v), now, int(step)) for k, v in metrics.items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool)])

    def on_checkpoint(self) -> None:
        """A checkpoint was reported: while MLflow is away, write the backlog now, so that a crash
        loses none of the metrics up to it (a resume starts after them and never reports them again)."""
        self._sender.on_checkpoint()

    def catch_up(self, wait_s: Optional[float] = None) -> bool:
        """Wait up to wait_s (default policy.end_wait_s) until what is queued and this run's backlog
        file (left by the Train controller, or an earlier part of this run) are delivered; the sender
        keeps running. True if they are and MLflow answers."""
        self._sender.request()
        self._gave_up = not (self._sender.drain(self._wait_s(wait_s)) and self._transport.reachable())
        return not self._gave_up

    def close(self, wait_s: Optional[float] = None) -> bool:
        """Wait up to wait_s (default policy.end_wait_s) until what is queued (and a backlog file that
        catch_up or finish asked for) is delivered, then stop the sender; what is still undelivered
        (with the final status, if finish set one) is written to the backlog file and a warning names
        it. True if everything was delivered."""
        if not self._sender.running:
            return self._sender.undelivered() == (0, None)
        self._sender.drain(self._wait_s(wait_s))
        self._sender.stop()
        return self._warn_undelivered()

    def finish(self, status: str, end_time_ms: Optional[int] = None) -> None:
        """Send the run's final status after everything queued and this run's backlog file: close,
        waiting policy.end_wait_s for them (attempt_timeout_s if a catch_up found MLflow away)."""
        self._sender.request((status, end_time_ms or int(time.time() * 1000)))
        self.close(self.policy.attempt_timeout_s if self._gave_up else self.policy.end_wait_s)

    def _wait_s(self, wait_s: Optional[float]) -> float:
        return self.policy.end_wait_s if wait_s is None else wait_s

    def _warn_undelivered(self) -> bool:
        left, status = self._sender.undelivered()
        if left == 0 and status is None:
            return True
        what = f"{left} metrics" + (f" and the final status {status[0]}" if status else "")
        if self.run_dir:
            log.warning("MLflow at %s is unreachable; %s of MLflow run %s are kept in %s and will be "
                        "sent when this run is resumed, or another run in the same storage starts, with MLflow "
                        "reachable", redact(self.tracking_uri), what, self.run_id, self._sender.backlog_uri)
        else:
            log.warning("MLflow at %s is unreachable; %s of MLflow run %s are lost",
                        redact(self.tracking_uri), what, self.run_id)
        return False
