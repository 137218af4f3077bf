"""Strict settings, shared by every process: the base of each config section and options model,
the dotted-path setter behind `--set` and sweeps, and the one way a pydantic error becomes a
message that names the field.

It imports nothing from the project's components, so a component (a model, a data source) can
validate its options here without importing the job config that composes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Tag, ValidationError, field_serializer

from training.plugins import is_import_string


class Section(BaseModel):
    """A config section or an options model: unknown keys and non-finite floats (inf, nan) refused,
    values frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def printable(value: Optional[str]) -> Optional[str]:
    """A path or URI with a control character (NUL, a newline) is a typo no filesystem or server takes."""
    if value is not None and any(ord(char) < 32 or ord(char) == 127 for char in value):
        raise ValueError(f"{value!r} contains a control character; is it quoted or pasted wrongly?")
    return value


def storage_location(value: Optional[str]) -> Optional[str]:
    """A local path or a URI with a bucket or host: "" and "s3://" (which would be a local folder
    named "s3:") are refused here; a scheme pyarrow does not know, when the storage is first tried."""
    if value is None:
        return value
    if not value.strip():
        raise ValueError("must not be empty: a local path, or a URI such as s3://bucket/prefix")
    printable(value)
    scheme, sep, rest = value.partition("://")
    if sep and scheme != "file" and not rest.split("/", 1)[0]:
        raise ValueError(f"{value!r} names no bucket or host: write {scheme}://BUCKET/prefix")
    if sep and scheme == "file" and not rest:
        raise ValueError(f"{value!r} names no path: write file:///absolute/path, or the path alone")
    return value


class OptionsSection(Section):
    """A section whose `options` are its component's own typed model (each member of a chosen field
    declares its type): stored and shown as the user wrote them, defaults not filled in. That form
    is what a run's identity, a prepared dataset's key, the stored config and MLflow's params are
    made of, so a default that changes between versions does not make a run another run. (Each
    subclass declares `options` after its choosing key: the order a config is shown in.)"""

    @field_serializer("options", check_fields=False)
    def _as_written(self, options: Any):
        return options.model_dump(mode="json", exclude_unset=True) if isinstance(options, BaseModel) else options

    def options_as_written(self) -> Any:
        return self.model_dump(mode="json", include={"options"})["options"]


# The tag of a chosen field's plug-in member (an import string "package.module:function").
PLUGIN = "plugin"


@dataclass(frozen=True)
class Choice:
    """What a config field chosen by one of its keys (`data.source`, `model.name`) is made of: the
    members a registry hands it, by name, and the plug-in member for import strings. Kept in the
    field's type, so that an error message can name the field's own path and what is allowed."""

    key: str  # the key that chooses: "source", "name"
    noun: str  # what the key names, in messages: "source", "model"
    members: tuple[tuple[str, type], ...]  # (tag, section type), built-ins first, in the registry's order

    def member(self, tag: str) -> Optional[type]:
        return dict(self.members).get(tag)

    def unknown(self, name: Any) -> str:
        builtins = ", ".join(tag for tag, _ in self.members if tag != PLUGIN)
        return f"unknown {self.noun} {name!r}; built-in: {builtins}, or a plug-in 'package.module:function'"


def chosen_by(key: str, noun: str, default: str, members: dict[str, type[BaseModel]], plugin: type[BaseModel]):
    """The type of a config field that holds one of `members` (each a section whose `key` is its
    name), or `plugin` when `key` is an import string: a discriminated union, validated once."""

    def tag(value: Any) -> str:
        name = value.get(key, default) if isinstance(value, dict) else getattr(value, key, default)
        if isinstance(name, str) and is_import_string(name):
            return PLUGIN
        return name if isinstance(name, str) else repr(name)

    tagged = tuple(Annotated[member, Tag(name)] for name, member in {**members, PLUGIN: plugin}.items())
    return Annotated[Union[tagged], Discriminator(tag),
                     Choice(key, noun, tuple({**members, PLUGIN: plugin}.items()))]


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
    return "\n".join(f"  {path}: {message}" for path, message in validation_problems(error, prefix, root))


def validation_problems(error: ValidationError, prefix: str = "",
                        root: Optional[type[BaseModel]] = None) -> list[tuple[str, str]]:
    """(dotted path, what is wrong) per bad field, as `format_validation_error` shows them."""
    problems = []
    for item in error.errors():
        loc = [part for part in item["loc"] if not str(part).startswith("function-after")]
        parts, model, choice = _walk(loc, root)
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key"
            allowed = sorted(getattr(model, "model_fields", {})) if model is not None else []
            if allowed:
                message += f"; allowed: {', '.join(allowed)}"
        elif item["type"] == "union_tag_invalid" and choice is not None:
            parts, message = [*parts, choice.key], choice.unknown(item["ctx"]["tag"])
        elif item["type"] == "value_error":
            message = message.removeprefix("Value error, ")
        elif item["type"] == "literal_error":
            message = message.replace("Input should be", "must be")
        problems.append((".".join(filter(None, [prefix, *parts])) or "(top level)", message))
    return problems


def _walk(loc: list, root: Optional[type[BaseModel]]) -> tuple[list[str], Any, Optional[Choice]]:
    """The dotted parts of an error's location under `root`, without the tags pydantic adds for a
    chosen field's member; the model its last part is a key of (None if unknown); and the Choice
    of the chosen field the location ends at, if it ends at one."""
    parts: list[str] = []
    model: Any = root  # the model the next part is a key of
    owner, choice = root, None
    index = 0
    while index < len(loc):
        part = loc[index]
        index += 1
        parts.append(str(part))
        owner, choice = model, None
        field = getattr(model, "model_fields", {}).get(part) if isinstance(part, str) else None
        if field is None:
            model = None if isinstance(part, str) else model  # (a list index keeps the item's model)
            continue
        choice = next((meta for meta in field.metadata if isinstance(meta, Choice)), None)
        if choice is not None and index < len(loc):  # the member's tag, which the user never wrote
            model, choice = choice.member(loc[index]), None
            index += 1
        else:
            model = _model_in(field.annotation)
    return parts, owner, choice


def _model_in(annotation: Any) -> Any:
    """The model a field's values are (directly, optionally, or as list items)."""
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
        inner = getattr(candidate, "__args__", ())
        found = next((c for c in inner if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if found is not None:
            return found
    return None


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
