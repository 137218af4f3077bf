"""Ctrl-C (SIGINT) and SIGTERM on the driver (the driver's main thread): either stops the run at
once, as a KeyboardInterrupt, leaving it resumable (training/run/driver.py records `interrupted by
SIGINT|SIGTERM`; the command exits 130 or 143).

Ray's own handlers are not used: Ray Train's SIGINT handler waits on its controller's abort (a
minute and more while the worker group waits for placement, since the controller is busy), then
ends the driver with SystemExit(1); `ray.init`'s SIGTERM handler raises SystemExit(15) wherever the
driver happens to be. ray_session puts these handlers back after `ray.init`, and the trainer does
not install its own (training/adaptors/ray_private.py).

A signal is process-wide, so the record of the one received is too: a KeyboardInterrupt raised
inside `ray.get` reaches the driver as a new, plain KeyboardInterrupt, and the record says which
signal it was.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A third signal while the run is being stopped (its status written, its MLflow run ended, its
# local Ray stopped) ends the process at once.
FORCE_AFTER = 3

_received: list[int] = []


def received() -> Optional[signal.Signals]:
    """The first stop signal this process received while the handlers were installed, if any."""
    return signal.Signals(_received[0]) if _received else None


def reason(exc: BaseException) -> str:
    """The status line of an interrupted run: `interrupted by SIGINT` or `... SIGTERM`."""
    sig = received()
    return f"interrupted by {sig.name if sig else 'SIGINT'}"  # (a KeyboardInterrupt without ours: Python's SIGINT)


def exit_code() -> int:
    """The shell's convention: 128 + the signal (130 for SIGINT, 143 for SIGTERM)."""
    sig = received()
    return 128 + int(sig or signal.SIGINT)


def _stop(signum: int, frame) -> None:
    _received.append(signum)
    if len(_received) >= FORCE_AFTER:
        os._exit(128 + _received[0])
    if len(_received) == 1:
        raise KeyboardInterrupt  # later ones, while the run is being stopped, let the stopping finish


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread for the `with` block (no-op in
    another thread: a sweep's trial runs its driver there, and Tune stops it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    before = {sig: signal.signal(sig, _stop) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextmanager
def keep_handlers() -> Iterator[None]:
    """The SIGINT and SIGTERM handlers as they were before the `with` block (around `ray.init`,
    which installs its own)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            if handler is not None:
                signal.signal(sig, handler)
