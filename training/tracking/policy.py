"""When the tracker's sender thread does what (driver and Ray Train controller). `SendPolicy` holds
the settings and, from a snapshot of the sender's state, decides its one next step; the tracker
carries it out. Pure: no threads, no clock of its own, no MLflow."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from training.backoff import exponential_backoff_s


class SenderAction(enum.Enum):
    RELOAD = "reload"                      # queue this run's backlog file ahead of what is queued
    PERSIST = "persist"                    # write the queue to the backlog file (MLflow is away)
    SEND_METRICS = "send-metrics"          # one attempt at the oldest batch
    SEND_STATUS = "send-status"            # every metric is in: one attempt at the final status
    WAIT = "wait"                          # for the backoff to pass, or for something to change
    STOP = "stop"                          # told to stop, nothing left
    PERSIST_AND_STOP = "persist-and-stop"  # told to stop: what is left goes to the backlog file


@dataclass(frozen=True)
class SenderState:
    """What the sender knows when it decides (read under the tracker's lock)."""

    now_s: float                    # the tracker's monotonic clock
    pending: int = 0                # metrics queued and not yet delivered
    status_set: bool = False        # a final status waits to be sent after them
    stopping: bool = False          # close stopped waiting: stop now
    reload_requested: bool = False  # the backlog file may hold metrics that are not queued
    failures: int = 0               # failed attempts in a row: MLflow is away while > 0
    failed_at_s: float = 0.0        # when the last of them failed
    can_persist: bool = False       # the run has a directory, so a backlog file
    persisted_at_s: float = 0.0     # when the backlog file was last written
    changed: bool = False           # the queue changed since then
    checkpointed: bool = False      # a checkpoint was reported since the queue was last written or emptied


@dataclass(frozen=True)
class SenderDecision:
    action: SenderAction
    metrics: int = 0                # how many of the oldest queued metrics to send or write
    with_status: bool = False       # send or write the final status too
    wait_s: Optional[float] = None  # WAIT: how long; None: until the tracker is told something new


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
        return exponential_backoff_s(failures, self.first_backoff_s, self.max_backoff_s)

    def decide(self, state: SenderState) -> SenderDecision:
        has_work = state.pending > 0 or state.status_set
        if state.stopping:
            if has_work and state.can_persist:  # a crash-safe copy for a later run, final status included
                return SenderDecision(SenderAction.PERSIST_AND_STOP, state.pending, state.status_set)
            return SenderDecision(SenderAction.STOP)
        if state.reload_requested:
            return SenderDecision(SenderAction.RELOAD)
        if self._persist_due(state):  # the metrics only: the final status is written when stopping
            return SenderDecision(SenderAction.PERSIST, state.pending)
        if not has_work:
            return SenderDecision(SenderAction.WAIT)
        retry_at_s = state.failed_at_s + self.backoff_s(state.failures) if state.failures else state.now_s
        if state.now_s < retry_at_s:
            return SenderDecision(SenderAction.WAIT, wait_s=max(0.01, retry_at_s - state.now_s))
        if state.pending:
            return SenderDecision(SenderAction.SEND_METRICS, min(state.pending, self.batch_size))
        return SenderDecision(SenderAction.SEND_STATUS, with_status=True)

    def _persist_due(self, state: SenderState) -> bool:
        # Only while MLflow is away; a checkpoint's request stays until the queue is written or emptied.
        if not (state.can_persist and state.failures and state.pending):
            return False
        # A checkpoint at once: a resume starts after it and never reports those metrics again.
        return state.checkpointed or (state.changed and state.now_s - state.persisted_at_s >= self.persist_every_s)
