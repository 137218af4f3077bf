"""Data sources: the built-in `digits` and `tinylm`, and user plug-ins by import string.

A source yields a train and a validation split as Arrow tables in one of two shapes (the task):
- classification: column `x` (a fixed-length list of float32 features) and `y` (int64 label);
- language_model: column `tokens` (a fixed-length list of int32 token ids, seq_len + 1 long).

Plug-in contract: `def my_source(**options) -> {"train": table, "validation": table}` where each
table is a `pyarrow.Table` or a mapping of column name to array (numpy arrays work) in one of the
shapes above. Options come from `data.options` in the job config.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, ValidationError

from training.errors import ConfigError, UserError
from training.plugins import call_plugin, is_import_string, load_callable
from training.schema import Section, format_validation_error

Task = Literal["classification", "language_model"]
SPLITS = ("train", "validation")


@dataclass(frozen=True)
class SourceData:
    task: Task
    splits: dict[str, pa.Table]
    # What the model needs to know about the data: input_dim, num_classes, vocab_size, seq_len.
    spec: dict[str, int]
    # Digest of the source's content: prepared data is rebuilt only when it changes.
    content_digest: str


class DigitsOptions(Section):
    val_fraction: float = Field(0.2, gt=0, lt=1)
    # Seeds the train/validation split (numpy's generator takes seeds from 0).
    split_seed: int = Field(0, ge=0, lt=2 ** 32)


class TinyLMOptions(Section):
    # Tokens per training sequence (bytes: the tokenizer is byte-level, vocabulary 256).
    seq_len: int = Field(128, ge=8, le=8192)
    # How much of the standard library's source to use, in bytes.
    max_bytes: int = Field(1_000_000, ge=10_000)
    # One file in every `val_every_n_files` goes to validation (split by file: no leakage).
    val_every_n_files: int = Field(20, ge=2)
    file_order_seed: int = 0


def _digits(options: DigitsOptions) -> SourceData:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    features = (bunch.data / 16.0).astype(np.float32)
    labels = bunch.target.astype(np.int64)
    order = np.random.default_rng(options.split_seed).permutation(len(labels))
    n_val = int(round(len(labels) * options.val_fraction))
    parts = {"validation": order[:n_val], "train": order[n_val:]}
    splits = {name: classification_table(features[idx], labels[idx]) for name, idx in parts.items()}
    digest = hashlib.sha256(features.tobytes() + labels.tobytes()).hexdigest()
    spec = {"input_dim": features.shape[1], "num_classes": int(labels.max()) + 1}
    return SourceData("classification", splits, spec, digest)


def stdlib_source_files() -> list[Path]:
    """The standard library's .py files, found at run time, site-packages left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _tinylm(options: TinyLMOptions) -> SourceData:
    files = stdlib_source_files()
    random.Random(options.file_order_seed).shuffle(files)
    streams: dict[str, list[bytes]] = {"train": [], "validation": []}
    hasher = hashlib.sha256()
    total = 0
    for index, path in enumerate(files):
        if total >= options.max_bytes:
            break
        try:
            content = path.read_bytes()
        except OSError:
            continue
        content = content[: options.max_bytes - total]
        hasher.update(path.name.encode() + b"\0" + content)
        split = "validation" if index % options.val_every_n_files == options.val_every_n_files - 1 else "train"
        streams[split].append(content + b"\n\n")
        total += len(content)
    if not streams["train"]:
        raise UserError(f"tinylm found no Python source files under {sysconfig.get_paths()['stdlib']}")
    width = options.seq_len + 1
    splits = {}
    for name, chunks in streams.items():
        data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
        rows = max(len(data) // width, 1 if name == "validation" else 0)
        if len(data) < width:  # a tiny validation stream: pad by repeating
            data = np.resize(data, width)
        splits[name] = token_table(data[: rows * width].reshape(rows, width).astype(np.int32))
    spec = {"vocab_size": 256, "seq_len": options.seq_len}
    return SourceData("language_model", splits, spec, hasher.hexdigest())


BUILTIN_SOURCES = {"digits": (DigitsOptions, _digits), "tinylm": (TinyLMOptions, _tinylm)}


def validate_builtin_source_options(source: str, options: dict) -> None:
    if is_import_string(source):
        return
    if source == "parquet":  # read in place, not loaded here: training/data/external.py
        from training.data.parquet import ParquetOptions

        options_type = ParquetOptions
    elif source == "text":  # tokenized during preparation: training/data/text.py
        from training.data.text import TextOptions

        options_type = TextOptions
    elif source not in BUILTIN_SOURCES:
        raise ConfigError(
            f"data.source: unknown source {source!r}; built-in: {', '.join(BUILTIN_SOURCES)}, parquet, text, "
            "or a plug-in 'package.module:function'"
        )
    else:
        options_type, _ = BUILTIN_SOURCES[source]
    try:
        options_type.model_validate(options)
    except ValidationError as exc:

        raise ConfigError(format_validation_error(exc, "data.options", options_type).strip()) from None


def load_source(source: str, options: dict) -> SourceData:
    if not is_import_string(source):
        options_type, build = BUILTIN_SOURCES[source]
        return build(options_type.model_validate(options))
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
    column = "x" if task == "classification" else "tokens"
    widths = {name: splits[name].schema.field(column).type.list_size for name in SPLITS}
    if widths["train"] != widths["validation"]:
        what = "features per row" if task == "classification" else "tokens per sequence"
        raise UserError(f"data.source {source}: the validation split has {widths['validation']} {what}, "
                        f"the train split {widths['train']}; both splits must have the same shape")
    hasher = hashlib.sha256()
    for name in SPLITS:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, splits[name].schema) as writer:
            writer.write_table(splits[name])
        hasher.update(sink.getvalue().to_pybytes())
    if task == "classification":
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


def _task_of(table: pa.Table) -> Task:
    names = set(table.column_names)
    if names == {"x", "y"}:
        return "classification"
    if names == {"tokens"}:
        return "language_model"
    raise AssertionError(f"unexpected columns {names}")  # normalize_table guarantees one shape


def classification_table(features: np.ndarray, labels: np.ndarray) -> pa.Table:
    features = np.ascontiguousarray(features, dtype=np.float32)
    x = pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), features.shape[1])
    return pa.table({"x": x, "y": pa.array(np.asarray(labels, dtype=np.int64))})


def token_table(tokens: np.ndarray) -> pa.Table:
    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    return pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), tokens.shape[1])})


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
