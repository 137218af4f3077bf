"""What `python -m tuning` shows on the console (the sweep's driver): the sweep's own lines and its
trial events (tuning/events.py), one line each. Everything else printed while the sweep runs goes
to the sweep's log file only: Tune's progress tables, Ray's and Ray Train's chatter, and what each
trial's training run prints (its progress lines, its workers'), which are many runs at once. This
project's own warnings (an MLflow outage, a storage that refuses writes) are shown, from wherever
they come.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

from training.run.console import ANSI, OWN_WARNINGS, RAY_PREFIX, ConsoleRouter, Place, Routed, RunLog, console_log

# The trial events' logger (tuning/events.py), by name: importing that module imports Ray, which a
# sweep refused for bad input never starts.
events_log = logging.getLogger("tuning.events")


class SweepRouter(ConsoleRouter):
    """Where a line printed during a sweep goes: the log file, but this project's warnings (MLflow's
    own events as in a training run's console)."""

    def route(self, line: str, is_err: bool = False) -> Routed:
        prefix = RAY_PREFIX.match(line)
        text = ANSI.sub("", line[prefix.end():] if prefix else line)
        if text.startswith(OWN_WARNINGS):
            return Routed(Place.CONSOLE, text)
        return Routed(Place.LOG, line)


class _Say(logging.Handler):
    def __init__(self, say: Callable[[str], None]):
        super().__init__(logging.INFO)
        self.say = say

    def emit(self, record: logging.LogRecord) -> None:
        self.say(record.getMessage())


@contextmanager
def sweep_console(log: RunLog) -> Iterator[Callable[[str], None]]:
    """For the `with` block: stdout and stderr into the log file (but this project's warnings), and
    a `say` for the console lines (each also in the log), which the trial events use too."""
    console = sys.stdout

    def say(line: str) -> None:
        log.write(line + "\n")
        console.write(line + "\n")
        console.flush()

    handler, propagate, level = _Say(say), events_log.propagate, events_log.level
    events_log.addHandler(handler)
    events_log.propagate = False
    events_log.setLevel(logging.INFO)
    try:
        with console_log(log, SweepRouter()):
            yield say
    finally:
        events_log.removeHandler(handler)
        events_log.propagate, events_log.level = propagate, level
