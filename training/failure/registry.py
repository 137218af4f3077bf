"""Every failure mode by name: adding one is a module (see training/failure/mode.py) and a line here."""

from __future__ import annotations

from training.failure import continuous, restart
from training.failure.mode import FailureMode

FAILURE_MODES: dict[str, FailureMode] = {mode.name: mode for mode in (
    restart.MODE,
    continuous.MODE,
)}
