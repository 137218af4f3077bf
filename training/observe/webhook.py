"""Posting notifications to webhooks (the driver, and the Train controller for restarts and
preemptions). A webhook that fails is retried briefly and logged; it never fails a run.

`PostPolicy` decides (pure, tested without a network); `Notifier` posts with urllib, one JSON
request per attempt, and logs each target by its field and host, never its URL.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Optional

from training import topics
from training.observe.notify import Target, scrub

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PostPolicy:
    attempts: int = 3          # one post and two retries
    timeout_s: float = 5.0     # each attempt: connect and answer
    backoff_s: float = 1.0     # before the second attempt; doubles after that

    def retry_after_s(self, attempt: int, status: Optional[int]) -> Optional[float]:
        """After failed attempt number `attempt` (1-based) with HTTP `status` (None: no answer): how
        long to wait before the next one, or None to give up. A 4xx other than 408/429 is the
        request's fault (a wrong URL, a revoked hook): sending it again cannot help."""
        if attempt >= self.attempts:
            return None
        if status is not None and 400 <= status < 500 and status not in (408, 429):
            return None
        return self.backoff_s * 2 ** (attempt - 1)


def _finite_or_none(value):
    """JSON has no NaN or infinity: Python writes them as bare `NaN` / `Infinity`, which a strict
    receiver refuses (400, not retried: the notification is lost). They go as null, as
    JavaScript's JSON.stringify sends them: a metric field stays a number or nothing, which a
    receiver typed for numbers accepts where it would refuse a string; the `text` line still shows
    "nan" for a person."""
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return float(value) if math.isfinite(value) else None
    return value


def body_json(body: dict) -> bytes:
    """A notification's body as strict JSON (non-finite numbers as null, anything else not JSON as its text)."""
    return json.dumps(_finite_or_none(body), default=str, allow_nan=False).encode()


@dataclass(frozen=True)
class Delivery:
    target: str        # the target's field (tracking.notify.0)
    delivered: bool
    attempts: int
    problem: Optional[str] = None


class Notifier:
    """The run's (or sweep's) targets; posts an event to those subscribed to it."""

    def __init__(self, targets: list[Target], policy: PostPolicy = PostPolicy(),
                 warn: Optional[Callable[[str], None]] = None, sleep: Callable[[float], None] = time.sleep):
        self.targets, self.policy, self._sleep = list(targets), policy, sleep
        self._warn = warn or log.warning

    def __repr__(self) -> str:
        return f"Notifier({self.targets!r})"

    def __getstate__(self):  # (the warn function of a driver may not pickle; the controller logs)
        return {"targets": self.targets, "policy": self.policy}

    def __setstate__(self, state):
        self.__init__(state["targets"], state["policy"])

    def wants(self, event: str) -> bool:
        return any(event in target.events for target in self.targets)

    def notify(self, event: str, body: dict) -> list[Delivery]:
        """Post `body` to every target subscribed to `event`, each retried per the policy; returns
        what happened to each. Never raises."""
        return [self._post(target, body) for target in self.targets if event in target.events]

    def notify_in_background(self, event: str, body: dict) -> Optional[threading.Thread]:
        """The same from a daemon thread (the Train controller must not wait on a webhook)."""
        if not self.wants(event):
            return None
        thread = threading.Thread(target=self.notify, args=(event, body), name=f"notify-{event}", daemon=True)
        thread.start()
        return thread

    def _post(self, target: Target, body: dict) -> Delivery:
        data = body_json(body)
        attempt = 0
        while True:
            attempt += 1
            status, problem = self._attempt(target, data)
            if problem is None:
                return Delivery(target.field, True, attempt)
            wait_s = self.policy.retry_after_s(attempt, status)
            if wait_s is None:
                self._warn(topics.line(topics.NOTIFY, f"{target.field} ({target.host}) did not take the "
                           f"{body.get('event')} notification after {attempt} attempt(s): {problem}; the run goes on"))
                return Delivery(target.field, False, attempt, problem)
            self._sleep(wait_s)

    def _attempt(self, target: Target, data: bytes) -> tuple[Optional[int], Optional[str]]:
        request = urllib.request.Request(target.url, data=data, method="POST",
                                         headers={"Content-Type": "application/json",
                                                  "User-Agent": "raytrain-notify"})
        try:
            with urllib.request.urlopen(request, timeout=self.policy.timeout_s) as answer:
                answer.read(65536)
                return answer.status, None
        except urllib.error.HTTPError as exc:
            return exc.code, f"HTTP {exc.code}"
        except Exception as exc:  # refused, timed out, DNS, TLS: all the webhook's, none the run's
            reason = getattr(exc, "reason", exc)
            return None, scrub(f"{type(exc).__name__}: {reason}"[:300], [target])
