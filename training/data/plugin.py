"""Data sources by import string (driver): `data.source: "package.module:function"`.

Plug-in contract: `def my_source(**options) -> {"train": table, "validation": table}` where each
table is a `pyarrow.Table` or a mapping of column name to array (numpy arrays work) in one of the
tasks' shapes (training/data/tables.py: `x` and `y`, or `tokens`). Options come from `data.options`
in the job config, passed as keyword arguments; `data.options.vocab_size`, if given, is also the
language model's vocabulary.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import Field

from training.data.manifest import SPLITS
from training.data.source import DataSection
from training.data.tables import SourceData, TableSource, classification_table, token_table
from training.errors import UserError
from training.plugins import call_plugin, load_callable
from training.tasks import CLASSIFICATION, LANGUAGE_MODEL


class PluginData(DataSection):
    source: str  # "package.module:function"
    # Keyword arguments of the plug-in (checked by the plug-in itself when it is called).
    options: dict[str, Any] = Field(default_factory=dict)


class PluginSource(TableSource):
    name = "plug-in"
    Config = PluginData

    def plugins(self, section: PluginData) -> list[str]:
        return [section.source]

    def load(self, section: PluginData) -> SourceData:
        source, options = section.source, section.options
        function = load_callable(source, "data.source")
        result = call_plugin(function, source, "data.source", "data.options", **options)
        if not isinstance(result, dict) or set(result) != set(SPLITS):
            raise UserError(f"data.source {source} must return a dict with keys 'train' and 'validation'")
        splits = {name: normalize_table(result[name], f"data.source {source}: split {name!r}") for name in SPLITS}
        task = _task_of(splits["train"])
        if _task_of(splits["validation"]) != task:
            raise UserError(f"data.source {source}: train and validation splits have different columns")
        for name in SPLITS:
            if splits[name].num_rows == 0:
                raise UserError(f"data.source {source}: split {name!r} has no rows")
        column = "x" if task == CLASSIFICATION.name else "tokens"
        widths = {name: splits[name].schema.field(column).type.list_size for name in SPLITS}
        if widths["train"] != widths["validation"]:
            what = "features per row" if task == CLASSIFICATION.name else "tokens per sequence"
            raise UserError(f"data.source {source}: the validation split has {widths['validation']} {what}, "
                            f"the train split {widths['train']}; both splits must have the same shape")
        hasher = hashlib.sha256()
        for name in SPLITS:
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, splits[name].schema) as writer:
                writer.write_table(splits[name])
            hasher.update(sink.getvalue().to_pybytes())
        if task == CLASSIFICATION.name:
            labels = pa.concat_arrays([splits[n].column("y").combine_chunks() for n in SPLITS]).to_numpy()
            spec = {"input_dim": widths["train"], "num_classes": int(labels.max()) + 1}
        else:
            spec = {"vocab_size": _vocab_size(source, options, splits), "seq_len": widths["train"] - 1}
        return SourceData(task, splits, spec, hasher.hexdigest())


def _vocab_size(source: str, options: dict, splits: dict[str, pa.Table]) -> int:
    """data.options.vocab_size, else the train split's largest id + 1; every id must be below it (an
    id outside the vocabulary fails the embedding lookup mid-run, at the first evaluation)."""
    largest = {name: int(pa.compute.max(splits[name].column("tokens").combine_chunks().flatten()).as_py())
               for name in SPLITS}
    given = options.get("vocab_size")
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, int) or given < 1:
            raise UserError(f"data.options.vocab_size: must be a positive int, got {given!r}")
        for name in SPLITS:
            if largest[name] >= given:
                raise UserError(f"data.source {source}: split {name!r} has token id {largest[name]}, outside "
                                f"data.options.vocab_size {given}; raise vocab_size or fix the data")
        return given
    if largest["validation"] > largest["train"]:
        raise UserError(f"data.source {source}: the validation split has token id {largest['validation']}, "
                        f"but the train split's vocabulary ends at {largest['train']}; set data.options.vocab_size "
                        "to the tokenizer's vocabulary size")
    return largest["train"] + 1


def _labels(column) -> np.ndarray:
    """Class labels as int64: whole numbers from 0 (a float column is accepted if every value is one)."""
    labels = np.asarray(column.to_numpy(zero_copy_only=False))
    if labels.ndim != 1 or labels.dtype.kind not in "iuf":
        raise ValueError(f"y must hold one integer class label per row, not {column.type}")
    if labels.dtype.kind == "f":
        bad = ~np.isfinite(labels) | (labels != np.round(labels))
        if bad.any():
            row = int(np.argmax(bad))
            raise ValueError(f"y must hold integer class labels; row {row} has {labels[row].item()!r}")
    if len(labels) and labels.min() < 0:
        row = int(np.argmin(labels))
        raise ValueError(f"y must hold class labels from 0; row {row} has {labels[row].item()!r}")
    return labels.astype(np.int64)


def _task_of(table: pa.Table) -> str:
    names = set(table.column_names)
    if names == {"x", "y"}:
        return CLASSIFICATION.name
    if names == {"tokens"}:
        return LANGUAGE_MODEL.name
    raise AssertionError(f"unexpected columns {names}")  # normalize_table guarantees one shape


def normalize_table(value: Any, what: str) -> pa.Table:
    """Accept a pyarrow Table or a mapping of columns; return one of the two fixed shapes."""
    try:
        table = value if isinstance(value, pa.Table) else pa.table(
            {k: (list(v) if isinstance(v, np.ndarray) and v.ndim > 1 else v) for k, v in dict(value).items()})
    except (TypeError, ValueError, pa.ArrowException) as exc:
        raise UserError(f"{what}: not a table or a mapping of columns ({exc})") from None
    names = set(table.column_names)
    try:
        if names == {"x", "y"}:
            x = np.array(table.column("x").to_pylist(), dtype=np.float32)
            if x.ndim != 2:
                raise ValueError("x must be a list of equal-length feature vectors")
            finite = np.isfinite(x).all(axis=1)
            if not finite.all():
                row = int(np.argmin(finite))
                raise ValueError(f"x must hold finite features; row {row} has NaN or infinity")
            return classification_table(x, _labels(table.column("y")))
        if names == {"tokens"}:
            tokens = np.array(table.column("tokens").to_pylist(), dtype=np.int64)
            if tokens.ndim != 2 or tokens.shape[1] < 2 or tokens.min() < 0:
                raise ValueError("tokens must be equal-length lists of at least 2 non-negative ids")
            return token_table(tokens)
    except (ValueError, TypeError, pa.ArrowException) as exc:
        raise UserError(f"{what}: {exc}") from None
    raise UserError(
        f"{what}: columns {sorted(names)} match no task; use ['x', 'y'] (classification) or ['tokens'] "
        "(language model)"
    )


SOURCE = PluginSource()
