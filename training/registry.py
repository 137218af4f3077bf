"""Components registered by name, the shape of each of the service's seams (any process): the data
sources (training/data/registry.py) and the model families (training/models/registry.py). A member
has a `name` and a `Config`, its section of the job config; an import string names the plug-in
member. The registry makes the union of the members' sections, chosen by their key (`data.source`,
`model.name`), which the job config composes: validated once, passed on typed."""

from __future__ import annotations

from typing import Generic, Iterator, TypeVar

from pydantic import ValidationError, create_model

from training.errors import ConfigError
from training.plugins import is_import_string
from training.schema import Section, chosen_by, format_validation_error

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, field: str, key: str, noun: str, members: list[T], plugin: T):
        """`field`: the job config's section ("data"); `key`: the key that chooses ("source");
        `noun`: what it names, in messages; the first member is the default."""
        self.field = field
        self._members = {member.name: member for member in members}
        self.plugin = plugin
        self.union = chosen_by(key, noun, members[0].name, {name: m.Config for name, m in self._members.items()},
                               plugin.Config)
        self._holder = create_model(f"_{field.title()}Holder", __base__=Section, **{field: (self.union, ...)})

    def __getitem__(self, name: str) -> T:
        """The member a section's (or a manifest's) name names: a built-in, or the plug-in member."""
        return self.plugin if is_import_string(name) else self._members[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._members)

    def values(self):
        return self._members.values()

    def section(self, raw: dict) -> Section:
        """A section from its mapping (ConfigError naming the bad field's dotted path)."""
        try:
            return getattr(self._holder.model_validate({self.field: raw}), self.field)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, root=self._holder).strip()) from None
