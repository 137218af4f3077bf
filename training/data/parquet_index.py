"""The index of Parquet files read where they are, and reading their row groups (the `parquet` and
`text` sources, and a transform's output). The driver builds the index from the files' footers
(which files, their row groups and row counts, the schema, column statistics); the workers read row
groups by the index (training/data/stream.py orders them).

Columns, by task: classification reads `features` (numeric columns, or one list column) and `label`;
a language model one list column of token ids, every row the same length (`Columns`).
"""

from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from training import storage
from training.backoff import RetryPolicy
from training.data.files import DataFile, Listing, changed, digest, list_splits
from training.data.manifest import Manifest
from training.data.stream import RowGroup
from training.errors import DataError, UserError, first_line
from training.redaction import redact
from training.retry import Retrier
from training.tasks import CLASSIFICATION, LANGUAGE_MODEL

FOOTER_THREADS = 16
# a row group's read during training: a storage outage of up to about two minutes is waited out
READ_RETRY = RetryPolicy(attempts=8, first_delay_s=1.0, max_delay_s=30.0, budget_s=120.0)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Columns:
    """Which columns of the files the task's columns come from: `tokens` (a language model), or
    `features` and `label` (classification)."""

    tokens: Optional[str] = None
    features: tuple[str, ...] = ()
    label: Optional[str] = None

    @property
    def task(self) -> str:
        return LANGUAGE_MODEL.name if self.tokens else CLASSIFICATION.name

    def read(self) -> list[str]:
        """The files' columns to read."""
        return [self.tokens] if self.tokens else [*self.features, self.label]

    def arrays(self, table: pa.Table) -> dict[str, np.ndarray]:
        """Decoded columns of a row group in the task's shape: x (float32) and y (int64), or tokens."""
        if self.tokens:
            return {"tokens": _list_matrix(table.column(self.tokens), np.int64, self.tokens)}
        names = list(self.features)
        if len(names) == 1 and _is_list(table.schema.field(names[0]).type):
            x = _list_matrix(table.column(names[0]), np.float32, names[0])
        else:
            x = np.stack([table.column(n).to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
                          for n in names], axis=1)
        return {"x": x, "y": table.column(self.label).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)}


def read_footer(file: DataFile, columns: list[str]) -> dict[str, Any]:
    fs, path = storage.filesystem(file.uri)
    try:
        with fs.open_input_file(path) as handle:
            meta = pq.ParquetFile(handle).metadata
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{file.uri} is not a readable Parquet file: {exc}") from None
    schema = meta.schema.to_arrow_schema()
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise DataError(f"{file.uri} has no column {missing[0]!r} (it has: {', '.join(schema.names)})")
    stats = {}
    for i in range(meta.num_columns):
        leaf = meta.schema.column(i)
        top = leaf.path.split(".")[0]
        if top not in columns:
            continue
        low, high = math.inf, -math.inf
        for g in range(meta.num_row_groups):
            s = meta.row_group(g).column(i).statistics
            if s is None or not s.has_min_max:
                low, high = None, None
                break
            low, high = min(low, float(s.min)), max(high, float(s.max))
        stats[top] = (low, high)
    return {"uri": file.uri, "size": file.size, "mtime_ns": file.mtime_ns, "partition": file.partition,
            "row_groups": [meta.row_group(g).num_rows for g in range(meta.num_row_groups)],
            "schema": schema, "stats": stats}


def read_footers(files: list[DataFile], columns: list[str]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=min(FOOTER_THREADS, len(files))) as pool:
        return list(pool.map(lambda f: read_footer(f, columns), files))


def row_groups(split: dict[str, Any]) -> list[RowGroup]:
    return [RowGroup(f, g, rows) for f, file in enumerate(split["files"]) for g, rows in enumerate(file["row_groups"])
            if rows > 0]


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _list_matrix(column: pa.ChunkedArray, dtype, name: str) -> np.ndarray:
    column = column.combine_chunks()
    values = column.flatten().to_numpy(zero_copy_only=False)
    if len(column) == 0:
        return values.reshape(0, 0).astype(dtype)
    width, remainder = divmod(len(values), len(column))
    if remainder or (not pa.types.is_fixed_size_list(column.type)
                     and not np.all(np.diff(column.offsets.to_numpy()) == width)):
        raise DataError(f"column {name!r}: rows of different lengths; every row must have the same length")
    return values.reshape(len(column), width).astype(dtype, copy=False)


class FileReader:
    """Reads row groups of one split's files by row-group id (see `row_groups`).

    During a run the files must stay as they were indexed: a file that is gone, or whose size is not
    the indexed one, fails the read with a DataError naming it (never a silent skip; a resume then
    names it too: see the parquet source's check_unchanged). Any other storage error (a dropped connection, a
    throttled request, an endpoint restarting) is retried with backoff and logged, within `retry`
    for each row group's read, with the file opened again."""

    def __init__(self, split: dict[str, Any], columns: Columns, retry: RetryPolicy = READ_RETRY):
        self.files, self.columns, self.retry = split["files"], columns, retry
        self.groups = row_groups(split)
        self._local = threading.local()  # open files, per thread: the background readers read at once
        self._closed = threading.Event()

    def close(self) -> None:
        """Reads waiting to retry give up at once (a closed loader's read-ahead threads end)."""
        self._closed.set()

    def _file(self, index: int) -> pq.ParquetFile:
        handles = self._local.__dict__.setdefault("handles", {})
        if index not in handles:
            entry = self.files[index]
            fs, path = storage.filesystem(entry["uri"])
            info = fs.get_file_info(path)
            if info.type == pafs.FileType.NotFound:
                raise FileNotFoundError(path)
            if entry.get("size") is not None and info.size != entry["size"]:
                raise DataError(f"{redact(entry['uri'])} changed during the run (size {entry['size']} -> "
                                f"{info.size} bytes): "
                                "training data must stay as it was when the run started; restore the file, or "
                                "start a new run (--name) on the data as it is now")
            handles[index] = pq.ParquetFile(fs.open_input_file(path))
        return handles[index]

    def load(self, group_id: int) -> dict[str, np.ndarray]:
        group = self.groups[group_id]
        uri = redact(self.files[group.file]["uri"])  # (for messages: a URI may carry a key)

        def read() -> pa.Table:
            try:
                return self._file(group.file).read_row_group(group.index, columns=self.columns.read())
            except FileNotFoundError:
                raise DataError(f"{uri} is gone: deleted or moved during the run. Training data must stay where "
                                "it was when the run started; restore it and resume the run (the same --name), "
                                "or start a new run on the data as it is now") from None
            except OSError:
                self._local.__dict__.get("handles", {}).pop(group.file, None)  # opened again on the next try
                raise

        def give_up(what: str, failures: int, elapsed_s: float, exc: BaseException) -> DataError:
            return DataError(f"{what} failed {failures} times in {elapsed_s:.0f} s; giving up: {first_line(exc, 200)}")

        def wait(seconds: float) -> None:
            if self._closed.wait(seconds):
                raise DataError(f"reading {uri}: the loader was closed while the read waited to retry")

        table = Retrier(self.retry, give_up, log, sleep=wait).run(read, f"reading {uri} (row group {group.index})")
        return self.columns.arrays(table)

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Rows by position in the split (files in order, row groups in order)."""
        starts = np.cumsum([0] + [g.rows for g in self.groups])
        slots = np.searchsorted(starts, indices, side="right") - 1
        out: dict[str, np.ndarray] = {}
        for slot in np.unique(slots):
            mask = slots == slot
            columns = self.load(int(slot))
            for name, column in columns.items():
                if name not in out:
                    out[name] = np.empty((len(indices),) + column.shape[1:], dtype=column.dtype)
                out[name][mask] = column[np.asarray(indices)[mask] - starts[slot]]
        return out


def build_index(listing: Listing, columns: Columns, num_classes: Optional[int] = None,
                vocab_size: Optional[int] = None) -> dict[str, Any]:
    """The index of both splits from the files' footers: {task, spec, splits, schema, digest}. Checks
    that every file has the columns, the same schema for them, and (where the files carry
    statistics) labels and token ids that are non-negative. `num_classes`, `vocab_size`: when the
    files carry no statistics for the label or the tokens."""
    train, validation = listing.splits["train"], listing.splits["validation"]
    names = columns.read()
    footers = read_footers(train + validation, names)
    schemas = {c: footers[0]["schema"].field(c).type for c in names}
    for footer in footers[1:]:
        for c in names:
            if footer["schema"].field(c).type != schemas[c]:
                raise DataError(f"{footer['uri']}: column {c!r} is {footer['schema'].field(c).type}, "
                                f"but {footers[0]['uri']} has {schemas[c]}")
    splits = {"train": footers[:len(train)], "validation": footers[len(train):]}
    rows = {name: sum(sum(f["row_groups"]) for f in files) for name, files in splits.items()}
    for name, count in rows.items():
        if count == 0:
            raise DataError(f"the {name} split has no rows ({len(splits[name])} files)")
    spec = _spec(columns, footers, num_classes, vocab_size)
    body = {name: {"rows": rows[name],
                   "files": [{k: f[k] for k in ("uri", "size", "mtime_ns", "partition", "row_groups")} for f in files]}
            for name, files in splits.items()}
    return {"task": columns.task, "spec": spec, "splits": body,
            "schema": ", ".join(f"{c}: {t}" for c, t in schemas.items()), "digest": digest(train + validation)}


def _max_stat(footers, column: str) -> Optional[float]:
    highs, lows = [], []
    for footer in footers:
        low, high = footer["stats"].get(column, (None, None))
        if high is None:
            return None
        highs.append(high)
        lows.append(low)
    if min(lows) < 0:
        raise DataError(f"column {column!r} has negative values (min {min(lows):g}): labels and token ids "
                        "count from 0")
    return max(highs)


def _spec(columns: Columns, footers, num_classes: Optional[int], vocab_size: Optional[int]) -> dict[str, int]:
    sample = FileReader({"files": [{k: footers[0][k] for k in ("uri", "size", "row_groups")}]}, columns)
    first = next((i for i, g in enumerate(sample.groups) if g.rows), None)
    arrays = sample.load(first)
    if columns.tokens:
        high = _max_stat(footers, columns.tokens)
        vocab = vocab_size or (int(high) + 1 if high is not None else None)
        if vocab is None:
            raise DataError(f"the files carry no statistics for {columns.tokens!r}: set data.options.vocab_size")
        return {"vocab_size": vocab, "seq_len": int(arrays["tokens"].shape[1]) - 1}
    high = _max_stat(footers, columns.label)
    classes = num_classes or (int(high) + 1 if high is not None else None)
    if classes is None:
        raise DataError(f"the files carry no statistics for {columns.label!r}: set data.options.num_classes")
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
