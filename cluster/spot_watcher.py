"""Spot interruption watcher, one per worker node: poll IMDS for the spot instance-action and the
rebalance recommendation (EC2) or Scheduled Events for a Preempt event (Azure) and, on a notice,
drain this node's raylet with reason preemption and the notice's deadline. Ray Train then sees
`get_preemption_info()`, checkpoints just in time and restarts the worker group off the node; Ray
schedules nothing new there.

`SpotPolicy` decides (pure: a notice, the time, the deadline already requested -> `DrainDecision`);
`SpotWatcher` polls, asks the policy, drains through an injected function and, where the cloud
takes an acknowledgement (Azure), acknowledges a notice only after its drain was accepted and Ray
has released the node: acknowledging lets Azure evict at once, which must not cut short the
just-in-time checkpoint the drain asked for."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Callable

from cluster.azure_events import PREEMPT, ScheduledEventsClient
from cluster.imds import REBALANCE, SPOT_ACTIONS, ImdsClient, ImdsError, ImdsUnavailable, Notice

REBALANCE_POLICIES = ("ignore", "log", "drain")
log = logging.getLogger("cluster.spot_watcher")


def _iso(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class DrainDecision:
    drain: bool
    summary: str                          # one line for the log, drained or not
    deadline: datetime | None = None      # when the node goes away (never before `now`)
    deadline_remaining_s: float = 0.0     # from the decision's `now`
    reason_message: str = ""              # what `ray drain-node --reason-message` would carry

    @property
    def deadline_timestamp_ms(self) -> int:
        assert self.deadline is not None
        return int(self.deadline.timestamp() * 1000)


@dataclass(frozen=True)
class SpotPolicy:
    """What a notice means for this node.

    - A spot action (terminate, stop or hibernate; an unknown action is treated the same) drains
      with the notice's time as deadline, clamped to `now` when it is already past.
    - A rebalance recommendation (the instance is at elevated risk; no interruption time is given)
      per `on_rebalance`: "ignore"; "log" (the default: one line, nothing else); or "drain" with a
      deadline `rebalance_deadline_s` after now. Draining early costs a restart even if the instance
      is never interrupted, which is why it is opt-in.
    - Never a second drain unless it brings the deadline forward: Ray replaces a node's drain
      deadline with each request, so repeating a notice or a later rebalance must not extend it.
    """

    on_rebalance: str = "log"
    rebalance_deadline_s: float = 600.0

    def __post_init__(self):
        if self.on_rebalance not in REBALANCE_POLICIES:
            raise ValueError(f"on_rebalance must be one of {REBALANCE_POLICIES}, got {self.on_rebalance!r}")
        if self.rebalance_deadline_s < 0:
            raise ValueError(f"rebalance_deadline_s must be >= 0, got {self.rebalance_deadline_s}")

    def decide(self, notice: Notice, now: datetime, draining_until: datetime | None = None) -> DrainDecision:
        if notice.kind == REBALANCE:
            seen = f"rebalance recommendation issued {_iso(notice.time)}"
            if self.on_rebalance != "drain":
                return DrainDecision(False, f"{seen}: not draining (on_rebalance={self.on_rebalance})")
            deadline = now + timedelta(seconds=self.rebalance_deadline_s)
            message = f"EC2 rebalance recommendation ({_iso(notice.time)}): draining ahead of a likely interruption"
        elif notice.kind == PREEMPT:
            seen = f"Azure Scheduled Event Preempt {notice.event_id}: eviction not before {_iso(notice.time)}"
            deadline = max(notice.time, now)
            message = f"Azure spot eviction (Scheduled Event Preempt {notice.event_id}) not before {_iso(notice.time)}"
        else:
            kind = (notice.kind if notice.kind in SPOT_ACTIONS
                    else f"{notice.kind} (unknown action, treated as terminate)")
            seen = f"spot interruption notice: {kind} at {_iso(notice.time)}"
            deadline = max(notice.time, now)
            message = f"EC2 spot interruption notice: {notice.kind} at {_iso(notice.time)}"
        if draining_until is not None and draining_until <= deadline:
            return DrainDecision(False, f"{seen}: already draining with deadline {_iso(draining_until)}")
        remaining_s = (deadline - now).total_seconds()
        return DrainDecision(True, f"{seen}: draining, deadline in {remaining_s:.0f} s", deadline,
                             remaining_s, message)


class SpotWatcher:
    """Polls and executes. `drain(decision)` raises on failure (the next poll tries again);
    `acknowledge(notice)` (None: the cloud takes none) is called for each notice with an event id
    once a drain covers it and `released()` says Ray let the node go, and retried each poll until
    it succeeds; `clock` gives aware UTC datetimes, `sleep` waits: all injectable for tests."""

    def __init__(self, imds: ImdsClient | ScheduledEventsClient, policy: SpotPolicy,
                 drain: Callable[[DrainDecision], None],
                 interval_s: float = 5.0, max_backoff_s: float = 60.0,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                 sleep: Callable[[float], None] = time.sleep,
                 acknowledge: Callable[[Notice], None] | None = None, released: Callable[[], bool] = lambda: True):
        self.imds, self.policy, self._drain = imds, policy, drain
        self._acknowledge, self._released = acknowledge, released
        self.to_acknowledge: dict[str, Notice] = {}   # event id -> notice a drain covers, not yet acknowledged
        self.acknowledged: list[str] = []
        self.interval_s, self.max_backoff_s = interval_s, max(max_backoff_s, interval_s)
        self._clock, self._sleep = clock, sleep
        self.draining_until: datetime | None = None   # deadline of the last accepted drain
        self.drains: list[DrainDecision] = []
        self._logged: set[tuple[Notice, str]] = set()
        self._errors_logged: set[str] = set()

    def _once(self, notice: Notice, summary: str) -> None:
        """Log a summary once per notice (polls repeat the same notice every few seconds)."""
        if (notice, summary) not in self._logged:
            self._logged.add((notice, summary))
            log.info(summary)

    def poll_once(self) -> list[DrainDecision]:
        """One look at IMDS; the drains requested. Raises ImdsUnavailable / ImdsError."""
        requested = []
        for notice in self.imds.notices():
            decision = self.policy.decide(notice, self._clock(), self.draining_until)
            if not decision.drain:
                self._once(notice, decision.summary)
            else:
                log.info(decision.summary)
                self._drain(decision)
                log.info("drain accepted: deadline %s (%d ms)", _iso(decision.deadline), decision.deadline_timestamp_ms)
                self.draining_until = decision.deadline
                self.drains.append(decision)
                requested.append(decision)
            if self.draining_until is not None and notice.event_id and notice.event_id not in self.acknowledged:
                self.to_acknowledge.setdefault(notice.event_id, notice)
        self._acknowledge_released()
        return requested

    def _acknowledge_released(self) -> None:
        if self._acknowledge is None or not self.to_acknowledge:
            return
        try:
            if not self._released():
                return
        except Exception as error:  # the GCS is unreachable: the node is not known to be released
            log.warning("cannot tell whether Ray released the node (%s): not acknowledging yet", error)
            return
        for event_id, notice in list(self.to_acknowledge.items()):
            try:
                self._acknowledge(notice)
            except Exception as error:  # the metadata service hiccuped: the next poll tries again
                log.warning("acknowledging event %s failed: %s: %s", event_id, type(error).__name__, error)
                continue
            log.info("event %s acknowledged: Ray has released the node, the cloud may go ahead", event_id)
            del self.to_acknowledge[event_id]
            self.acknowledged.append(event_id)

    def run(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Poll until `stop()`. IMDS unreachable: one log line, then back off (doubling up to
        `max_backoff_s`) and keep trying; an unusable answer is logged once per kind; a failed drain is
        logged and retried next poll."""
        unavailable_since: datetime | None = None
        wait_s = self.interval_s
        while not stop():
            try:
                self.poll_once()
                if unavailable_since is not None:
                    log.info("IMDS reachable again at %s", self.imds.base_url)
                unavailable_since, wait_s = None, self.interval_s
            except ImdsUnavailable as error:
                if unavailable_since is None:
                    unavailable_since = self._clock()
                    log.warning("IMDS unreachable (%s): not on EC2, or metadata access is off. "
                                "Polling again with backoff up to %g s.", error, self.max_backoff_s)
                wait_s = min(wait_s * 2, self.max_backoff_s)
            except ImdsError as error:  # an answer it cannot use: say so once, keep polling
                if str(error) not in self._errors_logged:
                    self._errors_logged.add(str(error))
                    log.warning("IMDS: %s", error)
            except Exception as error:  # the drain failed (GCS away?): try again next poll
                log.error("drain failed: %s: %s", type(error).__name__, error)
            self._sleep(wait_s)
