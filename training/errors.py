"""Errors the command line maps to exit codes (2 for what the user can fix, 1 for a failed run), and
the one way an error is shown in a line."""

import sys
from typing import Callable

from training.redaction import redact


class UserError(Exception):
    """Bad input: a config, a path, a plug-in. Exit code 2; nothing has been started."""


class ConfigError(UserError):
    """The job config is invalid; the message names the dotted path of each bad field."""


class DataError(ValueError):
    """The data, not the config, is wrong: the message names the file (and the row group or line
    where it applies) and what to do. Raised where data is read; the driver turns it into a
    UserError naming the option that points at the data."""


class StorageUnavailable(Exception):
    """Storage that kept failing past its retries (an outage longer than the retry budget). Unlike a
    DataError it may pass: Ray Train restarts the group from the newest checkpoint, within
    failure.max_failures."""


class RunFailed(Exception):
    """The training run started and failed. Exit code 1."""


def first_line(error: BaseException | str, limit: int = 300) -> str:
    """The first line of an error's message (or of a text), at most `limit` characters, passwords in
    URIs masked; the error's type when it has no message."""
    text = str(error).strip()
    if not text:
        return type(error).__name__ if isinstance(error, BaseException) else ""
    return redact(text.splitlines()[0][:limit])


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, the way a plug-in's failure is shown (no traceback)."""
    return f"{type(exc).__name__}: {first_line(exc)}" if str(exc).strip() else type(exc).__name__


def last_line(exc: BaseException, limit: int = 500) -> str:
    """The last line of a failure's text: what went wrong, without the wrapping of the layers it
    passed through (Ray's)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return redact(lines[-1][:limit]) if lines else type(exc).__name__


def exit_code(action: Callable[[], object], interrupted: str) -> int:
    """Run a command's action and map the outcome to its exit code, with one clear message."""
    try:
        action()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted; {interrupted}", file=sys.stderr)
        return 130
    return 0
