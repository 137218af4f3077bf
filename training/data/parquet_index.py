"""The index of Parquet files read where they are, and reading their row groups (the `parquet` and
`text` sources, and a transform's output). The driver builds the index from the files' footers
(which files, their row groups and row counts, the schema, column statistics); the workers read row
groups by the index (training/data/stream.py orders them).

Columns, by task: classification reads `features` (numeric columns, or one list column) and `label`;
a language model one list column of token ids, every row the same length (`Columns`).
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from training import storage
from training.backoff import RetryPolicy
from training.data import image
from training.data.files import DataFile, Listing, changed, digest, list_splits
from training.data.manifest import Manifest
from training.data.parquet_checks import (
    MAX_CLASSES,
    ColumnError,
    check_types,
    checked_columns,
    facts_from_footer,
    facts_from_rows,
    is_broken_file,
    is_list,
)
from training.errors import DataError, UserError, first_line
from training.redaction import redact
from training.retry import Retrier
from training.tasks import CLASSIFICATION, IMAGE_CLASSIFICATION, LANGUAGE_MODEL

T = TypeVar("T")
FOOTER_THREADS = 16
# a footer's read on the driver: a short storage outage is waited out (a broken file is not retried)
FOOTER_RETRY = RetryPolicy(attempts=4, first_delay_s=1.0, max_delay_s=8.0, budget_s=30.0)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Columns:
    """Which columns of the files the task's columns come from: `tokens` (a language model), or
    `features` and `label` (classification), or `image` and `label` (image classification: encoded
    images decoded by `image_processor`, its resolved settings as JSON; training/data/image.py)."""

    tokens: Optional[str] = None
    features: tuple[str, ...] = ()
    label: Optional[str] = None
    image: Optional[str] = None
    image_processor: Optional[str] = None
    channels: int = 3
    image_shape: Optional[tuple[int, ...]] = None  # (the data's [C, H, W], once known: every row group's)

    @property
    def task(self) -> str:
        if self.image:
            return IMAGE_CLASSIFICATION.name
        return LANGUAGE_MODEL.name if self.tokens else CLASSIFICATION.name

    def read(self) -> list[str]:
        """The files' columns to read."""
        if self.image:
            return [self.image, self.label]
        return [self.tokens] if self.tokens else [*self.features, self.label]

    def option_of(self, column: str) -> str:
        """The option that names a column (for messages)."""
        return next((f"data.options.{o}" for o in ("image", "label", "tokens") if getattr(self, o) == column),
                    "data.options.features")

    def arrays(self, table: pa.Table) -> dict[str, np.ndarray]:
        """Decoded columns of a row group in the task's shape: x (float32) and y (int64), or tokens,
        or pixel_values and label. DataError naming the column where the rows do not fit (the reader
        adds the file and row group)."""
        for name in self.read():
            if table.column(name).null_count:
                raise ColumnError(f"column {name!r} has null values; every row needs a value", self.option_of(name))
        if self.tokens:
            return {"tokens": _list_matrix(table.column(self.tokens), np.int64, self.tokens)}
        if self.image:
            pixels = image.decode(table.column(self.image), self.image, self.image_processor, self.channels,
                                  self.image_shape)
            return {"pixel_values": pixels, "label": _numbers(table.column(self.label), np.int64, self.label)}
        names = list(self.features)
        if len(names) == 1 and is_list(table.schema.field(names[0]).type):
            x = _list_matrix(table.column(names[0]), np.float32, names[0])
        else:
            x = np.stack([_numbers(table.column(n), np.float32, n) for n in names], axis=1)
        return {"x": x, "y": _numbers(table.column(self.label), np.int64, self.label)}


def _numbers(column: pa.ChunkedArray, dtype, name: str) -> np.ndarray:
    try:
        return column.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    except (ValueError, TypeError, pa.ArrowException) as exc:
        raise DataError(f"column {name!r} ({column.type}) does not read as numbers: {first_line(exc, 120)}") from None


def _list_matrix(column: pa.ChunkedArray, dtype, name: str) -> np.ndarray:
    column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()  # (one chunk: no copy)
    if pa.types.is_fixed_size_list(column.type) and not column.null_count:  # (arrays() refused null rows)
        size = column.type.list_size  # its values as they lie: flatten() finds the same slice, 2-4x as slowly
        flat = column.values.slice(column.offset * size, len(column) * size)
    else:
        flat = column.flatten()
    if flat.null_count:
        raise DataError(f"column {name!r} has null values in its lists; every value must be there")
    values = _numbers(pa.chunked_array([flat]), dtype, name)
    if len(column) == 0:
        return values.reshape(0, 0)
    width, remainder = divmod(len(values), len(column))
    if remainder or (not pa.types.is_fixed_size_list(column.type)
                     and not np.all(np.diff(column.offsets.to_numpy()) == width)):
        raise DataError(f"column {name!r}: rows of different lengths; every row must have the same length")
    return values.reshape(len(column), width)


def _on_driver(where: str, action: Callable[[], T], what: str) -> T:
    """`action` reading a file on the driver: a broken file fails at once (DataError naming it, never
    retried: its bytes fail the same way each time); another storage error is retried, and logged."""
    def attempt() -> T:
        try:
            return action()
        except (pa.ArrowException, OSError) as exc:
            if is_broken_file(exc):
                raise DataError(f"{where} is not a readable Parquet file ({what}): {first_line(exc, 200)}") from None
            raise

    def give_up(what: str, failures: int, elapsed_s: float, exc: BaseException) -> DataError:
        return DataError(f"{what} failed {failures} times in {elapsed_s:.0f} s; giving up: {first_line(exc, 200)}")

    return Retrier(FOOTER_RETRY, give_up, log).run(attempt, f"{where}: {what}")


def read_footer(file: DataFile, columns: Columns) -> dict[str, Any]:
    """A file's entry in the index from its footer, checked: its columns and their types, and
    (statistics) nulls, negative labels or token ids, list widths; where the statistics lack
    something, the first row group they lack it for is read and checked instead. A file with no
    rows (Spark writes empty part files) adds no rows and is not checked."""
    fs, path = storage.filesystem(file.uri)
    where = redact(file.uri)

    def read() -> dict[str, Any]:
        with fs.open_input_file(path) as handle:
            reader = pq.ParquetFile(handle)
            meta = reader.metadata
            entry = {"uri": file.uri, "size": file.size, "mtime_ns": file.mtime_ns, "partition": file.partition,
                     "row_groups": [meta.row_group(g).num_rows for g in range(meta.num_row_groups)],
                     "schema": None, "facts": {}}
            if not sum(entry["row_groups"]):
                return entry
            schema = reader.schema_arrow
            missing = [c for c in columns.read() if c not in schema.names]
            if missing:
                raise ColumnError(f"{where} has no column {missing[0]!r} (it has: {', '.join(schema.names)})",
                                  columns.option_of(missing[0]))
            check_types(schema, columns, where)
            facts, unstated = facts_from_footer(meta, schema, columns, where)
            if unstated:
                group = unstated[0]
                table = reader.read_row_group(group, columns=list(checked_columns(columns)))
                facts_from_rows(table, group, columns, where, facts)
            entry.update(schema=schema, facts=facts)
            return entry

    return _on_driver(where, read, "its footer")


def read_footers(files: list[DataFile], columns: Columns) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=min(FOOTER_THREADS, len(files))) as pool:
        return list(pool.map(lambda f: read_footer(f, columns), files))


def build_index(listing: Listing, columns: Columns, num_classes: Optional[int] = None,
                vocab_size: Optional[int] = None) -> dict[str, Any]:
    """The index of both splits from the files' footers: {task, spec, splits, schema, digest}. Checks
    (see read_footer) every file, that the files with rows agree on the columns' types and list
    widths, and labels and token ids against `num_classes` / `vocab_size` (needed when the files
    carry no statistics for the label or the tokens); then reads the first rows for the shapes."""
    train, validation = listing.splits["train"], listing.splits["validation"]
    names = columns.read()
    footers = read_footers(train + validation, columns)
    splits = {"train": footers[:len(train)], "validation": footers[len(train):]}
    rows = {name: sum(sum(f["row_groups"]) for f in files) for name, files in splits.items()}
    for name, count in rows.items():
        if count == 0:
            raise DataError(f"the {name} split has no rows ({len(splits[name])} files)")
    full = [f for f in footers if f["schema"] is not None]
    schemas = {c: full[0]["schema"].field(c).type for c in names}
    for footer in full[1:]:
        for c in names:
            if footer["schema"].field(c).type != schemas[c]:
                raise DataError(f"{redact(footer['uri'])}: column {c!r} is {footer['schema'].field(c).type}, "
                                f"but {redact(full[0]['uri'])} has {schemas[c]}")
    _check_widths(full, columns)
    spec = _spec(columns, full, num_classes, vocab_size)
    body = {name: {"rows": rows[name],
                   "files": [{k: f[k] for k in ("uri", "size", "mtime_ns", "partition", "row_groups")} for f in files]}
            for name, files in splits.items()}
    return {"task": columns.task, "spec": spec, "splits": body,
            "schema": ", ".join(f"{c}: {t}" for c, t in schemas.items()), "digest": digest(train + validation)}


def _check_widths(footers, columns: Columns) -> None:
    """Every file's list rows of the same width (a batch stacks rows of many files)."""
    for name, option in checked_columns(columns).items():
        widths = [(f["uri"], f["facts"][name].width) for f in footers if f["facts"][name].width is not None]
        other = next(((uri, w) for uri, w in widths if w != widths[0][1]), None) if widths else None
        if other is not None:
            raise ColumnError(f"column {name!r} has rows of {widths[0][1]} values in {redact(widths[0][0])} but "
                              f"{other[1]} in {redact(other[0])}; every row of every file must have the same length",
                              option)


def _first_rows(footer: dict[str, Any], columns: Columns) -> dict[str, np.ndarray]:
    """The decoded first non-empty row group of a file (the shapes of the task's inputs)."""
    fs, path = storage.filesystem(footer["uri"])
    where = redact(footer["uri"])
    group = next(g for g, rows in enumerate(footer["row_groups"]) if rows)

    def read() -> pa.Table:
        with fs.open_input_file(path) as handle:
            return pq.ParquetFile(handle).read_row_group(group, columns=columns.read())

    table = _on_driver(where, read, f"row group {group}")
    try:
        return columns.arrays(table)
    except DataError as exc:  # (the option a column's problem names, kept: data.options.image, ...)
        raise ColumnError(f"{where} row group {group}: {exc}", getattr(exc, "option", "data.options.path")) from None


def _count(footers, column: str, given: Optional[int], option: str, what: str) -> Optional[int]:
    """The count of classes or tokens: `given`, checked against the files' largest value, or that
    largest value + 1 when every file's statistics say it (None: they do not)."""
    seen = [(f["uri"], f["facts"][column]) for f in footers if f["facts"][column].high is not None]
    uri, top = max(seen, key=lambda pair: pair[1].high, default=(None, None))
    if given is not None:
        if top is not None and top.high >= given:
            raise ColumnError(f"{redact(uri)} holds {what} {top.high:g} in column {column!r}, but {option} is "
                              f"{given}: they count from 0, so it must be at least {top.high + 1:g}", option)
        return given
    if top is None or not all(f["facts"][column].exact for f in footers):
        return None
    return int(top.high) + 1


def _spec(columns: Columns, footers, num_classes: Optional[int], vocab_size: Optional[int]) -> dict[str, int]:
    arrays = _first_rows(footers[0], columns)
    if columns.tokens:
        vocab = _count(footers, columns.tokens, vocab_size, "data.options.vocab_size", "token id")
        if vocab is None:
            raise DataError(f"the files carry no statistics for {columns.tokens!r}: set data.options.vocab_size")
        return {"vocab_size": vocab, "seq_len": int(arrays["tokens"].shape[1]) - 1}
    classes = _count(footers, columns.label, num_classes, "data.options.num_classes", "label")
    if classes is None:
        raise DataError(f"the files carry no statistics for {columns.label!r}: set data.options.num_classes")
    if classes > MAX_CLASSES:
        raise ColumnError(f"column {columns.label!r} holds class ids up to {classes - 1:,}: {classes:,} classes is "
                          f"more than {MAX_CLASSES:,}; a label is a class id counted from 0 (is this column an id, "
                          "a hash or a time?)", "data.options.label")
    if columns.image:
        channels, height, width = (int(n) for n in arrays["pixel_values"].shape[1:])
        return {"num_classes": classes, "channels": channels, "height": height, "width": width,
                "image_processor": json.loads(columns.image_processor)}
    return {"input_dim": int(arrays["x"].shape[1]), "num_classes": classes}


def check_index_unchanged(recorded_root: Optional[str], listing: Optional[Listing] = None) -> None:
    """A resumed run's indexed files must be the files it started on (UserError naming one that
    changed): `listing`, the files as listed now, or listed again from the index's own paths (the
    output of a preparation). A run whose data is not an index, or whose index is gone, passes."""
    if not recorded_root:
        return
    try:
        manifest = Manifest.load(recorded_root)
    except (OSError, ValueError):
        return
    if not manifest.streamed:
        return
    if listing is None:
        options = manifest.options
        try:
            listing = list_splits(options["path"], options.get("validation_path"), options.get("validation_fraction"),
                                  options.get("filter"))
        except DataError as exc:
            raise UserError(f"data.options.path: {exc}; the run was started on other data") from None
    difference = changed(manifest.files(), listing.listed)
    if difference:
        raise UserError(f"data.options.path: the data changed since the run started: {difference}. Resuming would "
                        "not read what the run would have read: restore the data, or start a new run (--name)")
