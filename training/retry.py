"""Storage actions retried with backoff and logged: checkpoint uploads (training/checkpoint/upload.py)
and row-group reads of training data (training/data/parquet.py), each under a `RetryPolicy`."""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

from training.backoff import RetryPolicy
from training.errors import first_line

T = TypeVar("T")


class Retrier:
    """Storage actions retried on OSError (pyarrow's storage errors) under one policy and clock:
    one `Retrier` per budget (a whole checkpoint upload, every file of it; one read of data). Each
    retry is logged on `log`; past the policy, `give_up(what, failures, elapsed_s, error)` makes the
    exception raised."""

    def __init__(self, policy: RetryPolicy, give_up: Callable[[str, int, float, BaseException], Exception],
                 log: logging.Logger, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] = time.sleep):
        self.policy, self.give_up, self.log, self.clock, self.sleep = policy, give_up, log, clock, sleep
        self.started_s, self.failures, self.waited_s = clock(), 0, 0.0

    def run(self, action: Callable[[], T], what: str) -> T:
        while True:
            try:
                return action()
            except OSError as exc:
                self.failures += 1
                elapsed = self.clock() - self.started_s
                delay = self.policy.delay_s(self.failures, waited_s=self.waited_s, elapsed_s=elapsed)
                if delay is None:
                    raise self.give_up(what, self.failures, elapsed, exc) from exc
                self.log.warning("%s failed (%s); retry %d of at most %d in %.0f s (%.0f s of %.0f s of waiting "
                                 "used)", what, first_line(exc, 200), self.failures, self.policy.attempts - 1, delay,
                                 self.waited_s, self.policy.budget_s)
                self.sleep(delay)
                self.waited_s += delay
