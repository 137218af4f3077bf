"""Exponential backoff between retries: one pure formula, imported wherever this project retries
(the tracking sender on the driver and the Ray Train controller, checkpoint uploads, data reads),
and the budget of one action's retries (pure: the tracking policy imports it, see training/retry.py
for the loop that sleeps and logs)."""

from dataclasses import dataclass, replace
from typing import Optional


def exponential_backoff_s(failures: int, first_s: float, max_s: float) -> float:
    """Seconds to wait after `failures` failed attempts in a row: first_s, doubling each time, at most max_s."""
    # (the exponent is capped: 2.0 ** 1024 overflows, and a long outage counts that many failures)
    return min(max_s, first_s * 2.0 ** min(max(failures - 1, 0), 64))


@dataclass(frozen=True)
class RetryPolicy:
    """How long one action (a whole checkpoint upload, one read of data) may keep trying:
    `attempts` failures at most, and at most `budget_s` seconds spent waiting between attempts, all
    waits together. The budget bounds how long a storage outage is waited out, not how long the
    action's own work takes: a large checkpoint that uploads for minutes still gets its retries when
    one request fails near the end. `deadline_s`, when set (a preemption's), bounds wall-clock time
    as well: no wait ends past that many seconds after the action began, however long its work took."""

    attempts: int = 6
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    budget_s: float = 120.0
    deadline_s: Optional[float] = None

    def within(self, deadline_s: Optional[float]) -> "RetryPolicy":
        """This policy ending at most `deadline_s` seconds after the action began, its work
        included (None: unchanged)."""
        if deadline_s is None:
            return self
        deadline_s = max(0.0, deadline_s if self.deadline_s is None else min(self.deadline_s, deadline_s))
        return replace(self, budget_s=min(self.budget_s, deadline_s), deadline_s=deadline_s)

    def delay_s(self, failures: int, *, waited_s: float, elapsed_s: float) -> Optional[float]:
        """The wait before the next attempt after `failures` failures, having waited `waited_s` in
        all and `elapsed_s` into the action; None: give up (no attempts left, the wait would pass
        the waiting budget, or it would end past the deadline)."""
        if failures >= self.attempts:
            return None
        delay = exponential_backoff_s(failures, self.first_delay_s, self.max_delay_s)
        if waited_s + delay >= self.budget_s:
            return None
        if self.deadline_s is not None and elapsed_s + delay >= self.deadline_s:
            return None
        return delay
