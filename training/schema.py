"""Strict settings, shared by every process: the base of each config section and options model,
the dotted-path setter behind `--set` and sweeps, and the one way a pydantic error becomes a
message that names the field.

It imports nothing from the project's components, so a component (a model, a data source) can
validate its options here without importing the job config that composes them.
"""

from __future__ import annotations

from typing import Any, Optional

import yaml
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


# A config file is small: a document that expands (through YAML aliases) past this many values is
# refused before it is built. (A ~600-byte file of nested aliases can expand to 10^7 values.)
MAX_YAML_VALUES = 100_000


def load_yaml(data: bytes | str, source: str) -> Any:
    """One YAML document, parsed strictly: UTF-8 text, no duplicate keys (YAML's last-one-wins
    would drop a setting without a word), no alias that refers to itself, at most MAX_YAML_VALUES
    values once aliases are expanded. ValueError naming `source` and what is wrong otherwise."""

    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{source} is not UTF-8 text (an undecodable byte at offset {exc.start}); "
                             "is it the right file?") from None
    try:
        loader = _StrictLoader(data)  # (refuses a control character such as NUL here, before parsing)
    except yaml.YAMLError as exc:
        raise ValueError(f"{source} is not valid YAML: {exc}") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, {}, set(), source)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ValueError(f"{source} is not valid YAML: {exc}") from None
    except RecursionError:
        raise ValueError(f"{source} is nested too deeply to be a config") from None
    finally:
        loader.dispose()


def _expanded_size(node, sizes: dict, path: set, source: str) -> int:
    """Values in `node` with every alias expanded (each node counted once per reference, computed
    once per node), refusing a node that contains itself."""

    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in path:
        mark = node.start_mark
        raise ValueError(f"{source}: a YAML alias refers to a value that contains it (line {mark.line + 1}); "
                         "a config cannot be infinite")
    path.add(key)
    total = 1
    if isinstance(node, yaml.SequenceNode):
        total += sum(_expanded_size(child, sizes, path, source) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        total += sum(_expanded_size(k, sizes, path, source) + _expanded_size(v, sizes, path, source)
                     for k, v in node.value)
    path.discard(key)
    if total > MAX_YAML_VALUES:
        raise ValueError(f"{source}: expands to more than {MAX_YAML_VALUES} values through YAML aliases; "
                         "a config is not that large")
    sizes[key] = total
    return total


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` and then a key of its own overrides the base, as YAML means
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:
                    continue  # an unhashable key: SafeLoader refuses it below
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first at line {seen[key] + 1}): remove one",
                        key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)
