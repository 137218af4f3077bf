"""Data read where it lives (the `parquet` source): its prepared form is only an index.

`prepare` writes `<cache_root>/parquet-<key>/manifest.json` holding the index of both splits (files,
row groups, sizes, modification times), keyed by the files' digest and the options, so an unchanged
dataset is listed again but its footers are not re-read. Workers stream the training split through
`training.data.stream` and read their validation rows by position.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional

import numpy as np
import torch
from pydantic import ValidationError

from training import storage
from training.config import DataConfig
from training.data import parquet
from training.data.stream import StreamingShard
from training.errors import ConfigError, UserError
from training.schema import format_validation_error

SOURCE = "parquet"
INDEX_FORMAT = 1


def is_external(manifest) -> bool:
    return "files" in manifest.splits["train"]


def options_of(data: DataConfig) -> parquet.ParquetOptions:
    try:
        return parquet.ParquetOptions.model_validate(data.options)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, "data.options")) from None


def recorded_files(manifest) -> list[dict]:
    return [f for split in manifest.splits.values() for f in split["files"]]


def prepare(data: DataConfig, cache_root: str, log: Callable[[str], None], check=None):
    """The manifest of a Parquet dataset read in place (see the module's docstring)."""
    from training.data.prepare import MANIFEST, Manifest, dataset_key

    options = options_of(data)
    try:
        listing = parquet.list_files(options.path, options.filter)
        if options.validation_path is not None:
            listing += parquet.list_files(options.validation_path, options.filter)
        key = dataset_key(data, hashlib.sha256(f"{INDEX_FORMAT}:{parquet.digest(listing)}".encode()).hexdigest())
        root = storage.join(cache_root, f"{SOURCE}-{key}")
        if storage.exists(storage.join(root, MANIFEST)):
            manifest = Manifest.load(root)
            _check(check, manifest.task, manifest.spec, manifest.splits)
            log(f"data: {_where(options)} indexed at {root} (cached; {manifest.rows('train')} train, "
                f"{manifest.rows('validation')} validation rows)")
            return manifest
        index = parquet.build_index(options)
    except parquet.DataError as exc:
        raise UserError(f"data.options.path: {exc}") from None
    except OSError as exc:
        raise UserError(f"data.options.path: {str(exc).splitlines()[0][:300]}") from None
    _check(check, index["task"], index["spec"], index["splits"])
    manifest = Manifest(root=root, source=data.source, options=dict(data.options), task=index["task"],
                        spec=index["spec"], splits=index["splits"], schema=index["schema"], digest=index["digest"])
    storage.write_text(storage.join(root, MANIFEST), manifest.to_json())
    files = sum(len(s["files"]) for s in index["splits"].values())
    groups = sum(len(f["row_groups"]) for s in index["splits"].values() for f in s["files"])
    log(f"data: {_where(options)} indexed at {root} ({manifest.rows('train')} train, {manifest.rows('validation')} "
        f"validation rows; {files} files, {groups} row groups; read in place)")
    return manifest


def _check(check, task, spec, splits) -> None:
    if check is not None:
        check(task, spec, {name: split["rows"] for name, split in splits.items()})


def _where(options: parquet.ParquetOptions) -> str:
    return ", ".join(parquet._as_list(options.path))


def check_unchanged(manifest_root: Optional[str], options: dict[str, Any]) -> None:
    """A resumed run's data must be the data it started on: exit 2 naming a file that changed."""
    if not manifest_root:
        return
    from training.data.prepare import Manifest

    try:
        manifest = Manifest.load(manifest_root)
    except (OSError, ValueError):
        return
    if not is_external(manifest):
        return
    # (data tokenized by the `text` source or written by a transform: its index names the files
    # written, as options; their inputs are checked by text.check_unchanged, transform.check_unchanged)
    opts = parquet.ParquetOptions.model_validate(options if manifest.source == SOURCE and manifest.origin is None
                                                  else manifest.options)
    try:
        listing = parquet.list_files(opts.path, opts.filter)
        if opts.validation_path is not None:
            listing += parquet.list_files(opts.validation_path, opts.filter)
    except parquet.DataError as exc:
        raise UserError(f"data.options.path: {exc}; the run was started on other data") from None
    difference = parquet.changed(recorded_files(manifest), listing)
    if difference:
        raise UserError(f"data.options.path: the data changed since the run started: {difference}. Resuming would "
                        "not read what the run would have read: restore the data, or start a new run (--name)")


def _tensors(columns: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.ascontiguousarray(column)) for name, column in columns.items()}


class ExternalSplit:
    """Rows of one split by position (validation, a sample for the model's signature)."""

    def __init__(self, manifest, split: str):
        self._reader = parquet.FileReader(manifest.splits[split], parquet.ParquetOptions.model_validate(manifest.options))
        self.num_rows = manifest.rows(split)

    def take(self, indices) -> dict[str, torch.Tensor]:
        return _tensors(self._reader.take(np.asarray(indices, dtype=np.int64)))


def train_stream(manifest, plan, seed: int) -> StreamingShard:
    options = parquet.ParquetOptions.model_validate(manifest.options)
    reader = parquet.FileReader(manifest.splits["train"], options)
    return StreamingShard(reader.groups, reader.load, plan, seed=seed, partitions=options.partitions,
                          window=options.shuffle_window, read_ahead=options.read_ahead,
                          read_threads=options.read_threads, to_tensors=_tensors, on_close=reader.close)
