"""Exponential backoff between retries: one pure formula, imported wherever this project retries
(the tracking sender on the driver and the Ray Train controller, checkpoint uploads, data reads),
and the budget of one action's retries (pure: the tracking policy imports it, see training/retry.py
for the loop that sleeps and logs)."""

from dataclasses import dataclass
from typing import Optional


def exponential_backoff_s(failures: int, first_s: float, max_s: float) -> float:
    """Seconds to wait after `failures` failed attempts in a row: first_s, doubling each time, at most max_s."""
    # (the exponent is capped: 2.0 ** 1024 overflows, and a long outage counts that many failures)
    return min(max_s, first_s * 2.0 ** min(max(failures - 1, 0), 64))


@dataclass(frozen=True)
class RetryPolicy:
    """How long one action (a whole checkpoint upload, one read of data) may keep trying:
    `attempts` failures at most, and never a wait that would end past `budget_s` seconds after it
    began."""

    attempts: int = 6
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    budget_s: float = 120.0

    def within(self, budget_s: Optional[float]) -> "RetryPolicy":
        """This policy with at most `budget_s` seconds (None: unchanged)."""
        if budget_s is None:
            return self
        return RetryPolicy(self.attempts, self.first_delay_s, self.max_delay_s, max(0.0, min(self.budget_s, budget_s)))

    def delay_s(self, failures: int, elapsed_s: float) -> Optional[float]:
        """The wait before the next attempt after `failures` failures, `elapsed_s` into the action;
        None: give up (no attempts left, or the wait would end past the budget)."""
        if failures >= self.attempts:
            return None
        delay = exponential_backoff_s(failures, self.first_delay_s, self.max_delay_s)
        return delay if elapsed_s + delay < self.budget_s else None

