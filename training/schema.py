"""Strict settings, shared by every process: the base of each config section and options model,
the dotted-path setter behind `--set` and sweeps, and the one way a pydantic error becomes a
message that names the field.

It imports nothing from the project's components, so a component (a model, a data source) can
validate its options here without importing the job config that composes them.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, ValidationError


class Section(BaseModel):
    """A config section or an options model: unknown keys and non-finite floats (inf, nan) refused,
    values frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def set_path(raw: dict, dotted: str, value: Any) -> dict:
    """A copy of a raw (YAML) mapping with one dotted field set; the sections on the way are created.
    ValueError if a part of the path is a value rather than a section."""
    result = _deep_copy(raw)
    node = result
    parts = dotted.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"{'.'.join(parts[:depth + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value
    return result


def _deep_copy(value):
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def format_validation_error(error: ValidationError, prefix: str = "", root: Optional[type[BaseModel]] = None) -> str:
    """One line per bad field, `  dotted.path: what is wrong`; unknown keys list what is allowed
    (under `root`, the model the dotted paths start from)."""
    lines = []
    for item in error.errors():
        loc = [str(part) for part in item["loc"] if not str(part).startswith("function-after")]
        path = ".".join(filter(None, [prefix, *loc])) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key"
            allowed = _allowed_keys(loc, root) if root is not None else []
            if allowed:
                message += f"; allowed: {', '.join(allowed)}"
        elif item["type"] == "value_error":
            message = message.removeprefix("Value error, ")
        elif item["type"] == "literal_error":
            message = message.replace("Input should be", "must be")
        lines.append(f"  {path}: {message}")
    return "\n".join(lines)


def _allowed_keys(loc: list[str], root: type[BaseModel]) -> list[str]:
    model: Any = root
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        annotation = field.annotation
        for candidate in getattr(annotation, "__args__", (annotation,)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                model = candidate
                break
        else:
            return []
    return sorted(getattr(model, "model_fields", {}))
