"""Exponential backoff between retries: one pure formula, imported wherever this project retries
(the tracking sender on the driver and the Ray Train controller, checkpoint uploads)."""


def exponential_backoff_s(failures: int, first_s: float, max_s: float) -> float:
    """Seconds to wait after `failures` failed attempts in a row: first_s, doubling each time, at most max_s."""
    # (the exponent is capped: 2.0 ** 1024 overflows, and a long outage counts that many failures)
    return min(max_s, first_s * 2.0 ** min(max(failures - 1, 0), 64))
