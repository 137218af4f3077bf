"""Errors the command line maps to exit codes: 2 for what the user can fix, 1 for a failed run."""


class UserError(Exception):
    """Bad input: a config, a path, a plug-in. Exit code 2; nothing has been started."""


class ConfigError(UserError):
    """The job config is invalid; the message names the dotted path of each bad field."""


class RunFailed(Exception):
    """The training run started and failed. Exit code 1."""
