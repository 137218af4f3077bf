"""Reading a cluster YAML: the file, then Ray's own schema check (the one adapter around Ray's
private launcher API). Everything here raises ConfigError for bad input (CLI exit code 2)."""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any

import yaml

DEFAULT_CLUSTER_FILE = "cluster.yaml"


class ConfigError(ValueError):
    """The cluster file cannot be used at all: missing, not YAML, or rejected by Ray's schema."""


def load_cluster_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """The file's YAML as a dict, or ConfigError saying what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text (an undecodable byte at offset {error.start}); "
                          "is it the right file?") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def ray_prepare_and_validate(raw: dict[str, Any]) -> dict[str, Any]:
    """Ray's own view of a cluster config: defaults filled in exactly as `ray up` fills them
    (default commands included), then Ray's JSON schema and launcher rules applied.

    This is the only place that touches `ray.autoscaler._private`: a private API that may move
    between Ray releases (checked against 2.60)."""

    from ray.autoscaler._private.util import prepare_config, validate_config  # (lazy: ray)

    # Ray logs each default it fills in ("setting max workers for head node type to 0") at INFO.
    logging.getLogger("ray.autoscaler._private.util").setLevel(logging.WARNING)

    if "provider" not in raw or not isinstance(raw.get("provider"), dict):
        raise ConfigError("Ray rejects the config: `provider` (a mapping with `type`) is required")
    try:
        prepared = prepare_config(copy.deepcopy(raw))
        validate_config(prepared)
    except SystemExit as error:  # Ray's cli_logger.abort exits on some local-provider errors
        raise ConfigError(f"Ray rejects the config: {error}") from None
    except Exception as error:  # jsonschema.ValidationError, ValueError, KeyError, click errors
        message = getattr(error, "message", None) or str(error) or type(error).__name__
        where = "/".join(str(part) for part in getattr(error, "absolute_path", []) or [])
        raise ConfigError(f"Ray rejects the config{' at ' + where if where else ''}: {message}") from None
    return prepared


def load_and_prepare(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """(raw, prepared): what the user wrote, and what Ray will actually run."""
    raw = load_cluster_yaml(path)
    return raw, ray_prepare_and_validate(raw)
