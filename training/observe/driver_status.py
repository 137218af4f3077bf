"""The driver's status.json (the driver): `running` with a heartbeat while the run goes on, then
`finished`, `failed` (with the error's line) or `interrupted` (Ctrl-C, SIGTERM: "interrupted by
SIGINT"); a sweep rewrites a trial its scheduler ended as `scheduler_stopped` (training/observe/state.py).
A storage that refuses a write costs a warning, never the run."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable, Optional

from training import storage, topics
from training.observe.files import STATUS_FILE, read_status, write_json
from training.redaction import redact

log = logging.getLogger(__name__)

HEARTBEAT_EVERY_S = 10.0


class DriverStatus:
    """One driver's record of its run; `beat` from a daemon thread every heartbeat_every_s."""

    def __init__(self, run_dir: str, name: str, heartbeat_every_s: float = HEARTBEAT_EVERY_S,
                 warn: Callable[[str], None] = log.warning, clock: Callable[[], float] = time.time):
        self.uri = storage.join(run_dir, STATUS_FILE)
        self.heartbeat_every_s, self._warn, self._clock = heartbeat_every_s, warn, clock
        earlier = read_status(run_dir) or {}
        now = clock()
        self.record = {"name": name, "state": "running", "started": now, "heartbeat": now,
                       "heartbeat_every_s": heartbeat_every_s, "host": socket.gethostname(), "pid": os.getpid(),
                       "attempt": (earlier.get("attempt") or 0) + 1,
                       "first_started": earlier.get("first_started") or now, "error": None, "ended": None,
                       "mlflow_run_id": earlier.get("mlflow_run_id"), "mlflow_url": earlier.get("mlflow_url"),
                       "tracking_uri": earlier.get("tracking_uri")}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._failing = False

    def start(self, **fields) -> "DriverStatus":
        self.update(**fields)
        self._thread = threading.Thread(target=self._beat_until_stopped, name="status-heartbeat", daemon=True)
        self._thread.start()
        return self

    def update(self, **fields) -> None:
        with self._lock:
            if "tracking_uri" in fields and fields["tracking_uri"]:
                fields["tracking_uri"] = redact(fields["tracking_uri"])
            self.record.update(fields)
            self._write()

    def end(self, state: str, error: Optional[str] = None) -> None:
        """The last word: finished, failed, interrupted (or a sweep's scheduler_stopped). The heartbeat
        stops first."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            now = self._clock()
            self.record.update(state=state, error=redact(error) if error else None, ended=now, heartbeat=now)
            self._write()

    def _beat_until_stopped(self) -> None:
        while not self._stop.wait(self.heartbeat_every_s):
            with self._lock:
                if self._stop.is_set():
                    return
                self.record["heartbeat"] = self._clock()
                self._write()

    def _write(self) -> None:  # with self._lock held
        try:
            write_json(self.uri, self.record)
            if self._failing:
                self._failing = False
                self._warn(topics.line(topics.STATUS, f"{redact(self.uri)} is written again"))
        except Exception as exc:
            if not self._failing:
                self._failing = True
                self._warn(topics.line(topics.STATUS, f"could not write {redact(self.uri)} ({type(exc).__name__}: "
                           f"{redact(str(exc))[:200]}); training goes on, `python -m training status` may lag"))
