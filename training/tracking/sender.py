"""The tracker's sender thread (driver and Ray Train controller): the queue of metrics and the final
status, shared with the tracker's callers under one condition variable, and a thread that asks
`SendPolicy.decide` for its next step and carries it out with the transport and the backlog file.
A failed attempt is counted (the policy backs off); one that MLflow refuses is dropped with a
warning, since sending it again cannot help."""

from __future__ import annotations

import threading
import time
from typing import Optional

from training import topics
from training.redaction import redact
from training.tracking import backlog
from training.tracking.policy import SenderAction, SenderState, SendPolicy
from training.tracking.transport import MlflowTransport, is_rejected, short_reason

log = topics.logger(topics.TRACKING, __name__)


class Sender:
    """One MLflow run's queue and its thread, started on demand and stopped by `stop`."""

    def __init__(self, run_id: Optional[str], run_dir: Optional[str], transport: MlflowTransport,
                 policy: SendPolicy):
        self.run_id, self.policy, self.transport = run_id, policy, transport
        self.backlog_uri = backlog.backlog_uri(run_dir) if run_dir else None
        self._cond = threading.Condition()  # guards everything below; notified whenever it changes
        self._thread: Optional[threading.Thread] = None
        self._pending: list = []  # mlflow.entities.Metric, oldest first
        self._status: Optional[tuple[str, int]] = None  # final status to set once the metrics are in
        self._reload = True  # the first thread picks up a backlog file left earlier
        self._stopping = self._checkpointed = self._changed = False
        self._failures, self._failed_at, self._down_since = 0, 0.0, 0.0
        self._persisted_at = 0.0
        self._on_disk = False  # a backlog file this sender loaded or wrote exists

    # --- for the tracker: none of these waits on MLflow except drain, and stop for an attempt in flight

    @property
    def running(self) -> bool:
        return self._thread is not None

    def queue(self, metrics: list) -> None:
        with self._cond:
            self._pending += metrics
            self._changed = True
            self._wake()

    def on_checkpoint(self) -> None:
        with self._cond:  # does not start a thread: this only matters to one that has failed attempts
            self._checkpointed = True
            self._cond.notify_all()

    def request(self, status: Optional[tuple[str, int]] = None) -> None:
        """Reload this run's backlog file ahead of the queue, and send `status` (status, end_time_ms)
        once every metric is in."""
        with self._cond:
            self._reload = True
            if status is not None:
                self._status = status
            self._wake()

    def drain(self, wait_s: float) -> bool:
        """Wait up to wait_s until a requested reload is done and everything queued is delivered."""
        with self._cond:
            return self._cond.wait_for(lambda: not (self._reload or self._has_work()), wait_s)

    def stop(self) -> None:
        """Stop the thread; it writes what is undelivered to the backlog file first."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        thread.join(self.policy.attempt_timeout_s + 30)  # an attempt in flight, then the file
        with self._cond:
            self._thread = None

    def undelivered(self) -> tuple[int, Optional[tuple[str, int]]]:
        """How many metrics are undelivered, and the final status if that is too."""
        with self._cond:
            return len(self._pending), self._status

    def _has_work(self) -> bool:  # with self._cond held
        return bool(self._pending) or self._status is not None

    def _wake(self) -> None:  # with self._cond held
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="mlflow-sender", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    # --- the thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                decision = self.policy.decide(self._state())
                if decision.action is SenderAction.WAIT:
                    self._cond.wait(decision.wait_s)
                    continue
                metrics = self._pending[:decision.metrics]
                status = self._status if decision.with_status else None
                if decision.action in (SenderAction.PERSIST, SenderAction.PERSIST_AND_STOP):
                    self._changed = False  # changes from now on are for the next write
            if decision.action is SenderAction.RELOAD:
                self._reload_backlog()
            elif decision.action in (SenderAction.PERSIST, SenderAction.PERSIST_AND_STOP):
                self._persist(metrics, status)
            elif decision.action in (SenderAction.SEND_METRICS, SenderAction.SEND_STATUS):
                self._send(metrics, status)
            if decision.action in (SenderAction.STOP, SenderAction.PERSIST_AND_STOP):
                with self._cond:
                    self._cond.notify_all()
                return

    def _state(self) -> SenderState:  # with self._cond held
        return SenderState(
            now_s=time.monotonic(), pending=len(self._pending), status_set=self._status is not None,
            stopping=self._stopping, reload_requested=self._reload, failures=self._failures,
            failed_at_s=self._failed_at, can_persist=self.backlog_uri is not None,
            persisted_at_s=self._persisted_at, changed=self._changed, checkpointed=self._checkpointed)

    def _send(self, metrics: list, status: Optional[tuple[str, int]]) -> None:
        try:
            if metrics:
                self.transport.send_metrics(self.run_id, metrics)
            else:
                self.transport.send_status(self.run_id, *status)
        except Exception as exc:  # an outage must never stop training: keep, back off, retry
            if not is_rejected(exc):
                self._failed(exc)
                return
            log.warning("MLflow at %s refused %s for run %s: %s", redact(self.transport.tracking_uri),
                        f"{len(metrics)} metrics" if metrics else f"the status {status[0]}", self.run_id,
                        redact(str(exc)))
        self._delivered(len(metrics), status is not None)

    def _failed(self, exc: Exception) -> None:
        with self._cond:
            self._failures += 1
            self._failed_at = time.monotonic()
            if self._failures == 1:
                self._down_since = self._failed_at
                log.warning("MLflow at %s is unreachable (%s); training continues, %d metrics are kept "
                            "and sent when it answers again%s", redact(self.transport.tracking_uri),
                            redact(short_reason(exc, self.transport.timeout_s)), len(self._pending),
                            f" (meanwhile also written to {self.backlog_uri})" if self.backlog_uri else "")

    def _delivered(self, count: int, status_sent: bool) -> None:
        with self._cond:
            del self._pending[:count]
            if status_sent:
                self._status = None
            self._changed = True
            if self._failures:
                log.warning("MLflow at %s answers again after %.0f s; sending the %d metrics kept "
                            "meanwhile", redact(self.transport.tracking_uri), time.monotonic() - self._down_since,
                            len(self._pending) + count)
                self._failures = 0
            drained = not self._has_work()
            if drained:
                self._checkpointed = False
            self._cond.notify_all()
        if drained and self._on_disk and backlog.remove_backlog(self.backlog_uri):
            with self._cond:
                self._on_disk = False

    def _reload_backlog(self) -> None:
        """Queue the metrics of this run's backlog file (those not queued already), before newer ones."""
        found = backlog.read_backlog(self.backlog_uri) if self.backlog_uri else None
        with self._cond:
            self._reload = False
            if found is not None:
                queued = {(m.key, m.timestamp, m.step, m.value) for m in self._pending}
                self._pending[:0] = [m for m in found[1] if (m.key, m.timestamp, m.step, m.value) not in queued]
                self._changed = self._on_disk = True
            self._cond.notify_all()

    def _persist(self, metrics: list, status: Optional[tuple[str, int]]) -> None:
        written = backlog.write_backlog(self.backlog_uri, self.run_id, self.transport.tracking_uri, metrics, status)
        with self._cond:
            self._on_disk = self._on_disk or written
            self._persisted_at, self._checkpointed = time.monotonic(), False
