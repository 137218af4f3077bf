"""Tracking in one place: one MLflow run per training run, written from the driver and the Train
controller (never from the workers), and a null tracker with the same interface.

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
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from training import storage
from training.adaptors import mlflow_private

log = logging.getLogger(__name__)

RUN_NAME_TAG = "training.run_name"
BACKLOG_FILE = "tracking_backlog.jsonl"


@contextmanager
def fluent_mlflow(tracking_uri: str):
    """MLflow's fluent API (log_model, register_model) pointed at tracking_uri for a moment.
    mlflow.set_tracking_uri also exports MLFLOW_TRACKING_URI to this process's environment, where
    it would outlive the run: the next run in this process, and every process started from it
    (a Ray head, a job), would track there. Both are put back afterwards."""
    import mlflow

    previous = os.environ.get("MLFLOW_TRACKING_URI")  # what set_tracking_uri last set, if anything
    mlflow.set_tracking_uri(tracking_uri)
    try:
        yield mlflow
    finally:
        mlflow.set_tracking_uri(previous)  # None unsets both


class NullTracker:
    run_id: Optional[str] = None
    tracking_uri: Optional[str] = None
    policy: "SendPolicy"

    def log_metrics(self, metrics: dict, step: int) -> None:
        pass

    def on_checkpoint(self) -> None:
        pass

    def catch_up(self, wait_s: Optional[float] = None) -> bool:
        return False

    def close(self, wait_s: Optional[float] = None) -> bool:
        return True

    def finish(self, status: str) -> None:
        pass

    def last_step(self, key: str) -> int:
        return -1


@dataclass(frozen=True)
class SendPolicy:
    """How a tracker talks to MLflow: short attempts, its own backoff, bounded waits at the end."""

    attempt_timeout_s: float = 5.0   # one HTTP request, connect + read, no retries inside
    first_backoff_s: float = 0.5     # after the first failed attempt; doubles up to max_backoff_s
    max_backoff_s: float = 5.0
    persist_every_s: float = 10.0    # while MLflow is unreachable: how often the backlog file is rewritten
    end_wait_s: float = 15.0         # at the end of a run: how long to wait for MLflow to answer
    batch_size: int = 1000           # MLflow's limit for metrics in one log-batch request

    def backoff_s(self, failures: int) -> float:
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** max(failures - 1, 0))


class MlflowTracker:
    def __init__(self, tracking_uri: str, run_id: Optional[str], run_dir: Optional[str] = None,
                 policy: SendPolicy = SendPolicy()):
        self.tracking_uri, self.run_id, self.run_dir, self.policy = tracking_uri, run_id, run_dir, policy
        self.delivered = 0  # metrics this tracker delivered (its own and those of a backlog file)
        self._client = None
        self._cond = threading.Condition()
        self._pending: list = []         # mlflow.entities.Metric, oldest first
        self._status: Optional[tuple[str, int]] = None  # final status to set once the metrics are in
        self._thread: Optional[threading.Thread] = None
        self._closing = self._abandon = self._reload = self._checkpointed = False
        self._failures = 0
        self._down_since: Optional[float] = None
        self._version = self._persisted_version = 0  # changes of the queue, and the one last written
        self._persisted_at = 0.0
        self._on_disk = False  # a backlog file this tracker loaded or wrote exists
        self._backlog_checked = False  # the first sender picks up a backlog file left earlier
        self._gave_up = False  # a catch_up found MLflow away: finish does not wait as long again

    def __getstate__(self):
        return {"tracking_uri": self.tracking_uri, "run_id": self.run_id, "run_dir": self.run_dir,
                "policy": asdict(self.policy)}

    def __setstate__(self, state):
        self.__init__(state["tracking_uri"], state["run_id"], state["run_dir"], SendPolicy(**state["policy"]))

    @property
    def client(self):
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(self.tracking_uri)
        return self._client

    def last_step(self, key: str) -> int:
        """The last step at which `key` was logged (-1 if none or MLflow does not answer)."""
        try:
            return max((m.step for m in self.client.get_metric_history(self.run_id, key)), default=-1)
        except Exception:
            return -1

    @property
    def backlog_uri(self) -> Optional[str]:
        return storage.join(self.run_dir, BACKLOG_FILE) if self.run_dir else None

    @classmethod
    def start(cls, tracking_uri: str, experiment: str, run_name: str, run_id: Optional[str],
              tags: dict[str, str], params: dict[str, str], artifact_location: Optional[str] = None,
              run_dir: Optional[str] = None, policy: SendPolicy = SendPolicy()) -> "MlflowTracker":
        """Continue the run `run_id` if given (a resumed training run), else create one. Raises
        at once (one short attempt) if MLflow does not answer."""
        from mlflow.entities import Param, RunTag

        tracker = cls(tracking_uri, run_id, run_dir, policy)
        tracker.check_reachable()
        client = tracker.client
        if run_id is not None:
            client.update_run(run_id, status="RUNNING")
            existing = client.get_run(run_id).data.params
        else:
            found = client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else client.create_experiment(
                experiment, artifact_location=artifact_location)
            tracker.run_id = client.create_run(experiment_id, run_name=run_name,
                                               tags={RUN_NAME_TAG: run_name}).info.run_id
            existing = {}
        fresh = [Param(k, v[:6000]) for k, v in params.items() if k not in existing]
        for start in range(0, len(fresh), 100):
            client.log_batch(tracker.run_id, params=fresh[start:start + 100])
        client.log_batch(tracker.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        return tracker

    # --- what callers use; none of these waits on MLflow except catch_up, close and finish ----------

    def log_metrics(self, metrics: dict, step: int) -> None:
        """Queue numeric metrics for the sender thread; returns at once."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, int(step)) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
        with self._cond:
            self._pending += batch
            self._version += 1
            self._ensure_sender()
            self._cond.notify_all()

    def on_checkpoint(self) -> None:
        """A checkpoint was reported: while MLflow is away, write the backlog now, so that a crash
        loses none of the metrics up to it (a resume starts after them and never reports them again)."""
        with self._cond:
            self._checkpointed = True
            self._cond.notify_all()

    def catch_up(self, wait_s: Optional[float] = None) -> bool:
        """Deliver what is queued, and the backlog file left in the run's storage (by the Train
        controller, or an earlier part of this run); wait up to wait_s (default policy.end_wait_s).
        True if everything is delivered and MLflow answers."""
        deadline = time.monotonic() + (self.policy.end_wait_s if wait_s is None else wait_s)
        with self._cond:
            self._reload = True
            self._ensure_sender()
            self._cond.notify_all()
            while (self._reload or self._has_work()) and time.monotonic() < deadline:
                self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            if self._reload or self._has_work():
                self._gave_up = True
                return False
        self._gave_up = not self.reachable()
        return not self._gave_up

    def close(self, wait_s: Optional[float] = None) -> bool:
        """Deliver what is queued, waiting up to wait_s (default policy.end_wait_s); then stop the sender. Whatever is still
        undelivered is written to the backlog file (with the final status, if finish set one) and
        a warning names the file. True if everything was delivered."""
        with self._cond:
            if self._thread is None:
                return not self._has_work()
            self._closing = True
            self._cond.notify_all()
            deadline = time.monotonic() + (self.policy.end_wait_s if wait_s is None else wait_s)
            while self._has_work() and time.monotonic() < deadline:
                self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            self._abandon = True
            self._cond.notify_all()
            thread = self._thread
        thread.join(self.policy.attempt_timeout_s + 30)  # an attempt in flight, then the file
        with self._cond:
            self._thread = None
            left, status = len(self._pending), self._status
        if left == 0 and status is None:
            return True
        what = f"{left} metrics" + (f" and the final status {status[0]}" if status else "")
        if self.run_dir:
            log.warning("tracking: MLflow at %s is unreachable; %s of MLflow run %s are kept in %s and will be "
                        "sent when this run is resumed, or another run in the same storage starts, with MLflow "
                        "reachable", self.tracking_uri, what, self.run_id, self.backlog_uri)
        else:
            log.warning("tracking: MLflow at %s is unreachable; %s of MLflow run %s are lost",
                        self.tracking_uri, what, self.run_id)
        return False

    def finish(self, status: str, end_time_ms: Optional[int] = None) -> None:
        """Deliver everything (this run's backlog file included), then set the run's final status;
        what MLflow does not take within policy.end_wait_s stays in the backlog file."""
        with self._cond:
            self._status = (status, end_time_ms or int(time.time() * 1000))
            self._reload = True
            self._ensure_sender()
            self._cond.notify_all()
        self.close(self.policy.attempt_timeout_s if self._gave_up else self.policy.end_wait_s)

    def reachable(self) -> bool:
        try:
            self.check_reachable()
            return True
        except Exception:
            return False

    def check_reachable(self) -> None:
        """One short request that any MLflow tracking server answers; raises if it does not."""
        if self._host_creds() is not None:
            self._rest("GET", "/api/2.0/mlflow/experiments/search", params={"max_results": 1})
        else:
            self.client.search_experiments(max_results=1)

    # --- the sender thread ----------------------------------------------------------------------

    def _ensure_sender(self) -> None:  # with self._cond held
        if self._thread is None:
            self._closing = self._abandon = False
            self._reload = self._reload or not self._backlog_checked
            self._thread = threading.Thread(target=self._run, name="mlflow-sender", daemon=True)
            self._thread.start()

    def _has_work(self) -> bool:
        return bool(self._pending) or self._status is not None

    def _run(self) -> None:
        retry_at = 0.0
        while True:
            with self._cond:
                if self._abandon:
                    break
                if self._closing and not self._has_work() and not self._reload:
                    self._cond.notify_all()
                    return
                reload = self._reload
                persist = self._persist_due()
                send = self._has_work() and time.monotonic() >= retry_at
                if not (reload or persist or send):
                    self._cond.wait(max(0.01, retry_at - time.monotonic()) if self._has_work() else None)
                    continue
                snapshot, status = list(self._pending), self._status
                version = self._version
                batch = snapshot[:self.policy.batch_size]
            if reload:
                self._load_backlog()
                continue
            if persist:
                self._write_backlog(snapshot, None, version)
                continue
            try:
                if batch:
                    self._send_metrics(batch)
                else:
                    self._send_status(*status)
            except Exception as exc:  # an outage must never stop training: keep, back off, retry
                if not _rejected(exc):
                    self._failed(exc)
                    retry_at = time.monotonic() + self.policy.backoff_s(self._failures)
                    continue
                # MLflow answered and refused (a bad value, a deleted run): sending again cannot help.
                log.warning("tracking: MLflow at %s refused %s for run %s: %s", self.tracking_uri,
                            f"{len(batch)} metrics" if batch else f"the status {status[0]}", self.run_id, exc)
            self._delivered(batch, status)
        # Abandoned: what is left goes to the backlog file (a crash-safe copy for a later run).
        with self._cond:
            snapshot, status, version = list(self._pending), self._status, self._version
        if snapshot or status:
            self._write_backlog(snapshot, status, version)
        with self._cond:
            self._cond.notify_all()

    def _persist_due(self) -> bool:  # with self._cond held
        if not (self.run_dir and self._failures and self._pending):
            return False  # (a checkpoint's request stays until the queue is delivered or written)
        if self._checkpointed:
            return True
        return (self._version != self._persisted_version
                and time.monotonic() - self._persisted_at >= self.policy.persist_every_s)

    def _failed(self, exc: Exception) -> None:
        with self._cond:
            self._failures += 1
            if self._failures == 1:
                self._down_since = time.monotonic()
                reason = _reason(exc, self.policy.attempt_timeout_s)
                log.warning("tracking: MLflow at %s is unreachable (%s); training continues, %d metrics are kept "
                            "and sent when it answers again%s", self.tracking_uri, reason, len(self._pending),
                            f" (meanwhile also written to {self.backlog_uri})" if self.run_dir else "")

    def _delivered(self, batch: list, status) -> None:
        with self._cond:
            del self._pending[:len(batch)]
            self.delivered += len(batch)
            if not batch:
                self._status = None
            self._version += 1
            if self._failures:
                log.warning("tracking: MLflow at %s answers again after %.0f s; sending the %d metrics kept "
                            "meanwhile", self.tracking_uri, time.monotonic() - self._down_since,
                            len(self._pending) + len(batch))
                self._failures = 0
            drained = not self._has_work()
            if drained:
                self._checkpointed = False
            self._cond.notify_all()
        if drained and self._on_disk:
            self._remove_backlog()

    # --- MLflow calls: one attempt each, short timeout --------------------------------------------

    def _host_creds(self):
        """The REST store's credentials, or None for a local store (sqlite), which cannot hang."""
        return mlflow_private.host_creds(self.client)

    def _rest(self, method: str, endpoint: str, message=None, params=None):
        """One request without MLflow's retry-with-backoff (that can block for minutes)."""
        return mlflow_private.rest_once(self._host_creds(), method, endpoint, self.policy.attempt_timeout_s,
                                        message=message, params=params)

    def _send_metrics(self, batch: list) -> None:
        if self._host_creds() is None:
            self.client.log_batch(self.run_id, metrics=batch)
            return
        self._rest("POST", "/api/2.0/mlflow/runs/log-batch", mlflow_private.log_batch_message(self.run_id, batch))

    def _send_status(self, status: str, end_time_ms: int) -> None:
        if self._host_creds() is None:
            self.client.set_terminated(self.run_id, status=status, end_time=end_time_ms)
            return
        self._rest("POST", "/api/2.0/mlflow/runs/update",
                   mlflow_private.update_run_message(self.run_id, status, end_time_ms))

    # --- the backlog file -------------------------------------------------------------------------

    def _load_backlog(self) -> None:
        """Queue the metrics of this run's backlog file (those not queued already), before newer ones."""
        found = read_backlog(self.backlog_uri) if self.backlog_uri else None
        with self._cond:
            self._reload = False
            self._backlog_checked = True
            if found is not None:
                _, metrics = found
                queued = {(m.key, m.timestamp, m.step, m.value) for m in self._pending}
                fresh = [m for m in metrics if (m.key, m.timestamp, m.step, m.value) not in queued]
                self._pending[:0] = fresh
                self._version += 1
                self._on_disk = True
            self._cond.notify_all()

    def _write_backlog(self, metrics: list, status, version: int) -> None:
        header = {"run_id": self.run_id, "tracking_uri": self.tracking_uri, "status": status[0] if status else None,
                  "end_time_ms": status[1] if status else None, "written": time.time()}
        lines = [json.dumps(header)] + [json.dumps({"key": m.key, "value": m.value, "timestamp": m.timestamp,
                                                    "step": m.step}) for m in metrics]
        try:
            storage.write_text(self.backlog_uri, "\n".join(lines) + "\n")
        except Exception as exc:
            log.warning("tracking: could not write %s: %s", self.backlog_uri, exc)
        else:
            with self._cond:
                self._on_disk = True
        with self._cond:
            self._persisted_version, self._persisted_at, self._checkpointed = version, time.monotonic(), False

    def _remove_backlog(self) -> None:
        try:
            fs, path = storage.filesystem(self.backlog_uri)
            fs.delete_file(path)
        except FileNotFoundError:
            pass
        except Exception as exc:  # replaying it later is harmless: the store keeps one copy of each metric
            log.warning("tracking: could not remove %s: %s", self.backlog_uri, exc)
            return
        with self._cond:
            self._on_disk = False


NullTracker.policy = SendPolicy()


def _reason(exc: Exception, timeout_s: float) -> str:
    text = str(exc)
    if "Connection refused" in text or "NewConnectionError" in text:
        return "connection refused"
    if "timeout" in text.lower() or "timed out" in text.lower():
        return f"no answer within {timeout_s:g} s"
    return (text.strip().splitlines() or [type(exc).__name__])[0][:200]


def _rejected(exc: Exception) -> bool:
    """MLflow answered with a client error (not a timeout, a refused connection, a 5xx or a 429)."""
    from mlflow.exceptions import MlflowException

    if not isinstance(exc, MlflowException):
        return False
    code = exc.get_http_status_code()
    return 400 <= code < 500 and code != 429


def read_backlog(uri: str) -> Optional[tuple[dict, list]]:
    """(header, metrics) of a backlog file, or None if there is none."""
    from mlflow.entities import Metric

    if not storage.exists(uri):
        return None
    lines = [line for line in storage.read_text(uri).splitlines() if line.strip()]
    if not lines:
        return None
    rows = [json.loads(line) for line in lines[1:]]
    return json.loads(lines[0]), [Metric(r["key"], r["value"], r["timestamp"], r["step"]) for r in rows]


def replay_backlogs(storage_path: str, tracker: MlflowTracker, log_line: Callable[[str], None] = print) -> None:
    """At the start of a run, with MLflow reachable: deliver the backlog files of runs in the same
    storage tracked at the same MLflow. This run's own (a resumed run) gets its metrics; another run's
    only once it has ended (its file holds a final status), which is then set too."""
    import pyarrow.fs as pafs

    fs, root = storage.filesystem(storage_path)
    try:
        entries = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except OSError:
        return
    for entry in sorted(entries, key=lambda e: e.base_name):
        if entry.type != pafs.FileType.Directory:
            continue
        run_dir = storage.join(storage_path, entry.base_name)
        uri = storage.join(run_dir, BACKLOG_FILE)
        try:
            found = read_backlog(uri)
        except Exception as exc:
            log.warning("tracking: cannot read %s: %s", uri, exc)
            continue
        if found is None or found[0].get("tracking_uri") != tracker.tracking_uri:
            continue
        header, metrics = found
        own = run_dir == tracker.run_dir
        if not own and header.get("status") is None:
            continue  # that run may still be going; it delivers its own backlog, or its resume does
        replay = MlflowTracker(tracker.tracking_uri, header["run_id"], run_dir, tracker.policy)
        if own:
            done = replay.catch_up()
            done = replay.close(0.0) and done
        else:
            replay.finish(header["status"], header.get("end_time_ms"))
            done = not storage.exists(uri)
        if done:
            log_line(f"tracking: sent {len(metrics)} metrics kept in {uri} to MLflow run {header['run_id']}"
                     + ("" if own else f" and marked it {header['status']}"))
