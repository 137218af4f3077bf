"""Every data source by name (driver and workers): adding one is a module (see training/data/source.py)
and a line here. The job config's `data` section is the union of their sections, chosen by
`data.source`; an import string names a plug-in (training/data/plugin.py)."""

from __future__ import annotations

from typing import Callable, Optional

from training.data import digits, parquet, plugin, text, tinylm
from training.data.manifest import Manifest
from training.data.source import DataCheck, DataSection, DataSource
from training.registry import Registry

SOURCES: Registry[DataSource] = Registry("data", "source", "source", [
    digits.SOURCE,
    tinylm.SOURCE,
    parquet.SOURCE,
    text.SOURCE,
], plugin.SOURCE)

DataConfig = SOURCES.union


def source_of(name: str) -> DataSource:
    """The source a section's (or a manifest's) `source` names."""
    return SOURCES[name]


def data_section(raw: dict) -> DataSection:
    """A `data` section from its mapping (ConfigError naming the bad field's dotted path)."""
    return SOURCES.section(raw)


def prepare(section: DataSection, cache_root: str, log: Callable[[str], None] = print,
            check: Optional[DataCheck] = None) -> Manifest:
    """Plan and prepare a section's data in one call (cached: an unchanged dataset is reused)."""
    return source_of(section.source).plan(section, cache_root).prepare(check, log)
