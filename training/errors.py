"""Errors the command line maps to exit codes: 2 for what the user can fix, 1 for a failed run."""

import sys
from typing import Callable


class UserError(Exception):
    """Bad input: a config, a path, a plug-in. Exit code 2; nothing has been started."""


class ConfigError(UserError):
    """The job config is invalid; the message names the dotted path of each bad field."""


class RunFailed(Exception):
    """The training run started and failed. Exit code 1."""


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
