"""What `python -m training` shows on the console, and the run's log file behind it (the driver).

The console opens with one line (`opening_line`), shows the Train controller's progress lines
without Ray's `(TrainController pid=...)` prefix, and keeps what is not the user's to act on (Ray's
own actors' chatter, warnings raised inside Ray and MLflow, a worker's traceback) in the run's log
file, which also gets everything the console shows. During a worker failure the console reads one
line each: the raylet's "a worker died" (condensed), the controller's "the group restarts from step
N", the worker's "resumed from step N". Ray's colour codes go nowhere: the console may be a file.
`ConsoleRouter.route` decides a line's place (no I/O; it remembers which worker is in the middle of a
traceback, and the lines each worker just showed); `console_log` installs it on stdout and stderr and
on Python's warnings for the length of a run.
"""

from __future__ import annotations

import enum
import io
import logging
import re
import sys
import warnings
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, TextIO

from training import topics
from training.adaptors.mlflow_private import written_by_mlflow_stream
from training.redaction import redact
from training.topics import TOPICS

# Ray prefixes each line it forwards from a worker process: "(<actor or task> pid=N[, ip=A]) ",
# in colour codes unless RAY_COLOR_PREFIX=0 (see ray._private.worker.print_worker_logs).
_COLOUR = r"(?:\x1b\[[0-9;]*m)?"
RAY_PREFIX = re.compile(rf"^{_COLOUR}\((?P<source>[^()]*?)\s*(?P<pid>pid=[0-9]+)(?:, ip=[^)]*)?\){_COLOUR} ?")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# The raylet's own lines come as "(raylet[, ip=A]) ..."; this one, one long line, is how a killed or
# crashed worker process shows (the controller's line after it says what Ray Train does about it).
_RAYLET_PREFIX = re.compile(rf"^{_COLOUR}\(raylet(?:, ip=(?P<ip>[^)]*))?\){_COLOUR} ?")
_WORKER_DIED = "A worker died or was killed"
# A worker's traceback, as Ray Train logs it ("Error in training function:" and Python's lines) or
# as Python prints it: kept in the log file; the controller says on the console what failed.
_TRACEBACK_START = ("Error in training function:", "Traceback (most recent call last):")
_TRACEBACK_BODY = re.compile(r"^(?:\s|Traceback \(most recent call last\):|During handling of the above"
                             r"|The above exception was the direct cause|$)")
# Ray Train's and Ray's own actors: what they print is Ray's business, kept in the log file.
RAY_INTERNAL_SOURCES = ("PreemptionWatcher", "PlacementGroupCleaner", "SynchronizationActor",
                        "_AutoscalingCoordinatorActor", "DatasetManager", "LighthouseServerActor")
# Warnings from inside these packages are about their internals, not the user's job.
THIRD_PARTY_PACKAGES = ("ray", "mlflow", "torch", "pydantic", "google", "opentelemetry")
# Lines of the driver's own Ray and MLflow logs that say nothing the user can act on (the last two:
# MLflow's registry printing what the run's summary says again).
NOISE = ("Failed to query Ray Train Controller actor state", "Successfully registered model '", "Created version '",
         "already exists. Creating a new version of this model")
# This project's own warnings, which the Train controller writes to its stderr (training/tracking,
# training/observe), each starting with its topic: the user's to act on, so shown.
OWN_WARNINGS = tuple(topics.line(topic, "") for topic in TOPICS)
# Ray's and MLflow's own log records below ERROR, in their formats ("2026-12-03 07:09:30,458\tWARNING
# node.py:438 -- ...", "2026/12/03 07:08:58 WARNING mlflow.pytorch: ..."): their internals, in the log file.
_LIBRARY_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(?:DEBUG|INFO|WARNING) \S+\.py:\d+ -- "
                             r"|^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d (?:DEBUG|INFO|WARNING) mlflow[.:]")
# MLflow's own events (training/adaptors/mlflow_private.py: written_by_mlflow_stream): only its errors shown.
_MLFLOW_SHOWN = re.compile(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d (?:ERROR|CRITICAL) ")


class Place(enum.Enum):
    CONSOLE = "console"  # and the log file
    LOG = "log"          # the log file only


@dataclass(frozen=True)
class Routed:
    place: Place
    text: str


class ConsoleRouter:
    """Where a line goes, and how it reads there. Lines come one at a time from stdout and stderr."""

    RECENT = 8  # lines each worker process showed lately: one printed again is not shown twice

    def __init__(self):
        self._in_traceback: set[str] = set()  # processes ("pid=N") in the middle of a traceback
        self._recent: dict[str, deque] = {}

    def route(self, line: str, is_err: bool = False) -> Routed:
        """`is_err`: the line came on stderr (Ray forwards a process's stderr to the driver's)."""
        match = RAY_PREFIX.match(line)
        if match:
            source = match.group("source").split(".")[0].strip()
            if source == "TrainController":
                # Its stdout is this run's progress lines (training/tracking/callback.py), shown as the
                # run's own; its stderr is Ray Train's logging, but for this project's own warnings.
                text = ANSI.sub("", line[match.end():])
                if not is_err or text.startswith(OWN_WARNINGS):
                    return Routed(Place.CONSOLE, text)
                return Routed(Place.LOG, line)
            if source in RAY_INTERNAL_SOURCES or any(noise in line for noise in NOISE):
                return Routed(Place.LOG, line)
            return self._worker_line(match.group("pid"), ANSI.sub("", line), ANSI.sub("", line[match.end():]))
        raylet = _RAYLET_PREFIX.match(line)
        if raylet and _WORKER_DIED in line:
            return Routed(Place.CONSOLE, worker_died_line(ANSI.sub("", line[raylet.end():]), raylet.group("ip")))
        if any(noise in line for noise in NOISE) or _LIBRARY_RECORD.match(line):
            return Routed(Place.LOG, line)
        return Routed(Place.CONSOLE, ANSI.sub("", line))

    @staticmethod
    def mlflow_event(text: str) -> Place:
        """One of MLflow's own events (mlflow_private.written_by_mlflow_stream), all its lines: only its
        errors are the user's to see; its progress and warnings go to the log file."""
        return Place.CONSOLE if _MLFLOW_SHOWN.match(ANSI.sub("", text)) else Place.LOG

    def _worker_line(self, process: str, line: str, text: str) -> Routed:
        """A worker's own output (a plug-in's print, this project's lines): shown once (Ray Train's
        print on a worker goes both to stdout and to its logger, which Ray forwards on stderr); its
        tracebacks to the log file."""
        if process in self._in_traceback:
            if _TRACEBACK_BODY.match(text):
                return Routed(Place.LOG, line)
            self._in_traceback.discard(process)  # the exception's own line ends it
            return Routed(Place.LOG, line)
        if not text.strip():  # (the blank line that ends a logged traceback, among others)
            return Routed(Place.LOG, line)
        if text.startswith(_TRACEBACK_START):
            self._in_traceback.add(process)
            return Routed(Place.LOG, line)
        recent = self._recent.setdefault(process, deque(maxlen=self.RECENT))
        if text in recent:
            return Routed(Place.LOG, line)
        recent.append(text)
        return Routed(Place.CONSOLE, line)


def worker_died_line(text: str, ip: str | None = None) -> str:
    """The raylet's long "A worker died or was killed ..." as one short line."""
    found = {key: re.search(rf"Worker {key}: (\S+)", text) for key in ("PID", "IP address", "exit type")}
    pid, address, exit_type = (m.group(1) if m else None for m in found.values())
    where = f" on {address or ip}" if (address or ip) else ""
    how = f" ({exit_type})" if exit_type else ""
    return f"a worker process{f' (pid {pid})' if pid else ''}{where} died{how}; its message is in the run's log"


def warning_place(filename: str) -> Place:
    """A Python warning raised inside a third-party package goes to the log file."""
    parts = Path(filename).parts
    if "site-packages" in parts or "dist-packages" in parts:
        index = max(i for i, p in enumerate(parts) if p in ("site-packages", "dist-packages"))
        if index + 1 < len(parts) and parts[index + 1].split(".")[0] in THIRD_PARTY_PACKAGES:
            return Place.LOG
    return Place.CONSOLE


def worker_count(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


def opening_line(name: str, config_path: str, workers, storage_dir: str, tracking_uri: Optional[str]) -> str:
    count = worker_count(workers) if isinstance(workers, int) else f"{workers[0]}-{workers[1]} workers"
    return redact(f"run {name} | config {config_path} | {count} | storage {storage_dir} | "
                  f"MLflow {tracking_uri or 'off'}")


class RunLog:
    """The run's log file, opened once the run has started (`start`): before that (the checks of
    bad input, which write nothing) lines wait in memory, and are dropped if the run never starts."""

    MAX_WAITING = 10_000

    def __init__(self, path: Path):
        self.path = path
        self._file: Optional[TextIO] = None
        self._waiting: list[str] = []

    def start(self) -> None:
        if self._file is not None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8", buffering=1)
        except OSError:
            self._waiting = []
            return
        self._file.write("".join(self._waiting))
        self._waiting = []

    @property
    def started(self) -> bool:
        return self._file is not None

    def write(self, text: str) -> None:
        text = redact(text)
        if self._file is not None:
            try:
                self._file.write(text)
            except (OSError, ValueError):
                pass
        elif len(self._waiting) < self.MAX_WAITING:
            self._waiting.append(text)

    def flush(self) -> None:
        if self._file is not None:
            try:
                self._file.flush()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class _RoutedStream(io.TextIOBase):
    """A text stream that sends each complete line where the router says."""

    def __init__(self, console: TextIO, log: RunLog, router: ConsoleRouter, is_err: bool):
        self.console, self.log, self.router, self.is_err = console, log, router, is_err
        self._partial = ""
        self._mlflow_event = ""  # MLflow's event being written (print writes its text, then the newline)

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if written_by_mlflow_stream(sys._getframe(1)):
            self._mlflow_event += text
            if self._mlflow_event.endswith("\n"):
                self._emit_mlflow_event()
            return len(text)
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            self._emit(line)
        return len(text)

    def _emit(self, line: str) -> None:
        routed = self.router.route(line, self.is_err)
        self.log.write(ANSI.sub("", line) + "\n")
        if routed.place is Place.CONSOLE:
            self.console.write(routed.text + "\n")

    def _emit_mlflow_event(self) -> None:
        event, self._mlflow_event = ANSI.sub("", self._mlflow_event), ""
        self.log.write(event if event.endswith("\n") else event + "\n")
        if self.router.mlflow_event(event) is Place.CONSOLE:
            self.console.write(event if event.endswith("\n") else event + "\n")

    def flush(self) -> None:
        if self._mlflow_event:
            self._emit_mlflow_event()
        if self._partial:
            line, self._partial = self._partial, ""
            self._emit(line)
        self.console.flush()
        self.log.flush()

    def isatty(self) -> bool:
        return self.console.isatty()

    def fileno(self) -> int:
        return self.console.fileno()


@contextmanager
def console_log(log: RunLog, router: Optional[ConsoleRouter] = None) -> Iterator[RunLog]:
    """For the `with` block: stdout and stderr routed (everything also into the run's log), warnings
    raised inside third-party packages into the log only."""
    router = router or ConsoleRouter()
    old_out, old_err, old_show = sys.stdout, sys.stderr, warnings.showwarning
    sys.stdout = _RoutedStream(old_out, log, router, is_err=False)
    sys.stderr = _RoutedStream(old_err, log, router, is_err=True)
    # Handlers that Ray and MLflow attached to the console when imported hold the old streams.
    moved = _move_handlers({id(old_out): sys.stdout, id(old_err): sys.stderr})

    def show(message, category, filename, lineno, file=None, line=None):
        text = warnings.formatwarning(message, category, filename, lineno, line)
        if warning_place(filename) is Place.LOG:
            log.write(text)
        else:
            sys.stderr.write(text)

    warnings.showwarning = show
    try:
        yield log
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr, warnings.showwarning = old_out, old_err, old_show
        for handler, stream in moved:
            handler.setStream(stream)
        log.close()


def _move_handlers(new_stream_for: dict) -> list:
    """Point every logging StreamHandler on one of the old streams (by id) at its new stream; returns
    (handler, old stream) to put back. Handlers added later find sys.stdout/sys.stderr as they are."""

    loggers = [logging.getLogger()] + [value for value in logging.Logger.manager.loggerDict.values()
                                       if isinstance(value, logging.Logger)]
    moved = []
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in new_stream_for:
                moved.append((handler, handler.setStream(new_stream_for[id(handler.stream)])))
    return moved
