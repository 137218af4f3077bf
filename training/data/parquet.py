"""The built-in `parquet` source: Parquet files read where they are (a local or shared folder,
`s3://`, any URI pyarrow opens), never copied.

Only the files' footers are read before training: which files, their row groups and row counts,
the schema and column statistics. That index is digested from each file's path, size and
modification time, so a dataset that changed under a run is found by listing it again.

Layouts: a folder (read recursively), a glob, or a list of either. Hive partitioning as Spark and
Hive write it (`key=value/` folders) is understood and can be filtered; bookkeeping that writers
leave beside the data (`_SUCCESS`, `_committed_*`, `_started_*`, `_temporary/`, `.crc` files,
hidden files) is skipped.

Columns, by task:
- classification: `features` (a list of numeric columns, or one list column) and `label`;
- language_model: `tokens` (one list column of token ids, every row the same length).

With a `transform`, a plug-in's output is trained on instead: see training/data/transform.py.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import math
import posixpath
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pydantic import Field, model_validator

from training import storage
from training.backoff import RetryPolicy
from training.retry import Retrier, first_line
from training.redaction import redact
from training.data.stream import RowGroup
from training.schema import Section

SKIPPED_PREFIXES = ("_", ".")
SKIPPED_SUFFIXES = (".crc", ".tmp", ".inprogress")
FOOTER_THREADS = 16
# a row group's read during training: a storage outage of up to about two minutes is waited out
READ_RETRY = RetryPolicy(attempts=8, first_delay_s=1.0, max_delay_s=30.0, budget_s=120.0)

log = logging.getLogger(__name__)


class TransformOptions(Section):
    # A plug-in "package.module:function" run on the input before training (training/data/transform.py):
    # per batch, it takes a pyarrow.Table (one row group of a file, with the file's Hive partition
    # values as string columns) and returns a pyarrow.Table, a pandas DataFrame or a dict of columns;
    # per row, it takes a dict and returns a dict, or None to leave the row out.
    function: str
    per: Literal["batch", "row"] = "batch"
    # Keyword arguments to the function.
    options: dict[str, Any] = Field(default_factory=dict)
    # The input columns the function reads (default: all).
    columns: Optional[list[str]] = None
    # Where it runs: a Ray Data pipeline on the cluster (auto: once the files to transform hold
    # 32 MB), or the driver a file at a time.
    run_on: Literal["auto", "cluster", "driver"] = "auto"


class ParquetOptions(Section):
    # A folder, a glob or a list of them: local paths, s3://bucket/prefix, or any pyarrow URI.
    path: Union[str, list[str]]
    # The validation split: its own path, or a fraction of the files (chosen by a hash of each
    # file's path: the same files whatever the listing order, and stable when files are added).
    validation_path: Optional[Union[str, list[str]]] = None
    validation_fraction: Optional[float] = Field(None, gt=0, lt=1)
    # classification: the feature columns (or one list column) and the label column
    features: Optional[Union[str, list[str]]] = None
    label: Optional[str] = None
    # language_model: a list column of token ids
    tokens: Optional[str] = None
    # Hive partitions to read: {key: value or [values]}; the others are not even listed for reading.
    filter: dict[str, Union[str, int, list[Union[str, int]]]] = Field(default_factory=dict)
    # The order is a pure function of the data, the seed and this number, never of the world size:
    # each worker reads about 1/W of an epoch (exactly when W divides it). At most the batch size.
    partitions: int = Field(16, ge=1, le=65536)
    # Rows are shuffled within windows of this many row groups of a partition (memory: about
    # 2 * window row groups per partition a worker reads).
    shuffle_window: int = Field(2, ge=1, le=1024)
    # Read the next steps' row groups in the background while these steps train, on this many
    # threads (each decodes a row group at a time; more for object storage, whose reads wait on the
    # network).
    read_ahead: bool = True
    read_threads: int = Field(2, ge=1, le=64)
    # When the files carry no statistics for them: classes of the label / the token vocabulary.
    num_classes: Optional[int] = Field(None, ge=2)
    vocab_size: Optional[int] = Field(None, ge=2)
    # Prepare the data with a plug-in first (features, label and tokens then name its output's columns).
    transform: Optional[TransformOptions] = None

    @model_validator(mode="after")
    def _task_columns(self):
        if self.tokens is None and (self.features is None or self.label is None):
            raise ValueError("set either tokens (language data) or features and label (classification)")
        if self.tokens is not None and (self.features is not None or self.label is not None):
            raise ValueError("tokens is for language data; features and label for classification: not both")
        if self.validation_path is None and self.validation_fraction is None:
            raise ValueError("set validation_path or validation_fraction")
        if self.validation_path is not None and self.validation_fraction is not None:
            raise ValueError("set validation_path or validation_fraction, not both")
        return self

    @property
    def task(self) -> str:
        return "language_model" if self.tokens else "classification"

    @property
    def feature_columns(self) -> list[str]:
        return [self.features] if isinstance(self.features, str) else list(self.features or [])

    def columns(self) -> list[str]:
        return [self.tokens] if self.tokens else [*self.feature_columns, self.label]


@dataclass(frozen=True)
class DataFile:
    uri: str
    size: int
    mtime_ns: int
    partition: dict[str, str]

    def stamp(self) -> str:
        return f"{self.uri}\t{self.size}\t{self.mtime_ns}"


class DataError(ValueError):
    """The data, not the config, is wrong (named file, what to do)."""


def _as_list(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def hive_partition(relative: str) -> dict[str, str]:
    parts = {}
    for folder in posixpath.dirname(relative).split("/"):
        if "=" in folder:
            key, _, value = folder.partition("=")
            parts[key] = value
    return parts


def _skipped(relative: str) -> bool:
    names = relative.split("/")
    return any(n.startswith(SKIPPED_PREFIXES) for n in names) or names[-1].endswith(SKIPPED_SUFFIXES)


def list_files(paths, filters: Optional[dict] = None) -> list[DataFile]:
    """Every data file under `paths`, sorted, bookkeeping skipped, Hive filter applied."""
    wanted = {k: {str(v) for v in _as_list(vals) if v is not None} if isinstance(vals, list) else {str(vals)}
              for k, vals in (filters or {}).items()}
    found: dict[str, DataFile] = {}
    for spec in _as_list(paths):
        fs, path = storage.filesystem(spec)
        scheme = spec[:spec.index("://") + 3] if "://" in spec else ""
        pattern = None
        if any(c in path for c in "*?["):
            cut = min(path.index(c) for c in "*?[" if c in path)
            root, pattern = path[:cut].rsplit("/", 1)[0] if "/" in path[:cut] else "", path
        else:
            root = path
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            raise DataError(f"{spec} does not exist")
        if info.type == pafs.FileType.File and pattern is None:
            entries, root = [info], posixpath.dirname(root)
        else:
            entries = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        for entry in entries:
            if entry.type != pafs.FileType.File:
                continue
            relative = entry.path[len(root):].lstrip("/") if root else entry.path
            if _skipped(relative) or (pattern is not None and not fnmatch.fnmatch(entry.path, pattern)):
                continue
            partition = hive_partition(entry.path)  # (the given path's own key=value folders count too)
            if any(partition.get(k) not in vals for k, vals in wanted.items()):
                continue
            uri = scheme + entry.path if scheme else entry.path
            found[uri] = DataFile(uri, int(entry.size), int(entry.mtime_ns or 0), partition)
    if not found:
        raise DataError(f"no data files under {', '.join(_as_list(paths))}"
                        + (f" matching filter {filters}" if filters else ""))
    return [found[uri] for uri in sorted(found)]


def digest(files: list[DataFile]) -> str:
    return hashlib.sha256("\n".join(f.stamp() for f in files).encode()).hexdigest()


def changed(recorded: list[dict], files: list[DataFile]) -> Optional[str]:
    """The first file that differs between a recorded index and a new listing (None: unchanged)."""
    now = {f.uri: f for f in files}
    for entry in recorded:
        file = now.pop(entry["uri"], None)
        if file is None:
            return f"{entry['uri']} is gone"
        if (file.size, file.mtime_ns) != (entry["size"], entry["mtime_ns"]):
            return f"{entry['uri']} changed (size {entry['size']} -> {file.size}, modified since)"
    if now:
        return f"{next(iter(now))} is new"
    return None


def validation_files(files: list[DataFile], fraction: float) -> set[str]:
    ranked = sorted(files, key=lambda f: hashlib.sha256(f.uri.rsplit("/", 1)[-1].encode()
                                                        + f.uri.encode()).hexdigest())
    count = min(max(1, math.ceil(len(files) * fraction)), len(files) - 1)
    if count < 1:
        raise DataError(f"validation_fraction needs at least 2 files; found {len(files)}: give validation_path")
    return {f.uri for f in ranked[:count]}


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


def columns_to_arrays(table: pa.Table, options: ParquetOptions) -> dict[str, np.ndarray]:
    """Decoded columns of a row group in the task's shape: x (float32) and y (int64), or tokens."""
    if options.tokens:
        return {"tokens": _list_matrix(table.column(options.tokens), np.int64, options.tokens)}
    names = options.feature_columns
    if len(names) == 1 and _is_list(table.schema.field(names[0]).type):
        x = _list_matrix(table.column(names[0]), np.float32, names[0])
    else:
        x = np.stack([table.column(n).to_numpy(zero_copy_only=False).astype(np.float32, copy=False) for n in names],
                     axis=1)
    return {"x": x, "y": table.column(options.label).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)}


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
    names it too, see external.check_unchanged). Any other storage error (a dropped connection, a
    throttled request, an endpoint restarting) is retried with backoff and logged, within `retry`
    for each row group's read, with the file opened again."""

    def __init__(self, split: dict[str, Any], options: ParquetOptions, retry: RetryPolicy = READ_RETRY):
        self.files, self.options, self.retry = split["files"], options, retry
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
                raise DataError(f"{redact(entry['uri'])} changed during the run (size {entry['size']} -> {info.size} bytes): "
                                "training data must stay as it was when the run started; restore the file, or "
                                "start a new run (--name) on the data as it is now")
            handles[index] = pq.ParquetFile(fs.open_input_file(path))
        return handles[index]

    def load(self, group_id: int) -> dict[str, np.ndarray]:
        group = self.groups[group_id]
        uri = redact(self.files[group.file]["uri"])  # (for messages: a URI may carry a key)

        def read() -> pa.Table:
            try:
                return self._file(group.file).read_row_group(group.index, columns=self.options.columns())
            except FileNotFoundError:
                raise DataError(f"{uri} is gone: deleted or moved during the run. Training data must stay where "
                                "it was when the run started; restore it and resume the run (the same --name), "
                                "or start a new run on the data as it is now") from None
            except OSError:
                self._local.__dict__.get("handles", {}).pop(group.file, None)  # opened again on the next try
                raise

        def give_up(what: str, failures: int, elapsed_s: float, exc: BaseException) -> DataError:
            return DataError(f"{what} failed {failures} times in {elapsed_s:.0f} s; giving up: {first_line(exc)}")

        def wait(seconds: float) -> None:
            if self._closed.wait(seconds):
                raise DataError(f"reading {uri}: the loader was closed while the read waited to retry")

        table = Retrier(self.retry, give_up, log, sleep=wait).run(read, f"reading {uri} (row group {group.index})")
        return columns_to_arrays(table, self.options)

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


def build_index(options: ParquetOptions) -> dict[str, Any]:
    """The index of both splits from the files' footers: {task, spec, splits, digest}. Checks that
    every file has the columns, the same schema for them, and (where the files carry statistics)
    labels and token ids that are non-negative."""
    train = list_files(options.path, options.filter)
    if options.validation_path is not None:
        validation = list_files(options.validation_path, options.filter)
    else:
        chosen = validation_files(train, options.validation_fraction)
        validation, train = [f for f in train if f.uri in chosen], [f for f in train if f.uri not in chosen]
    columns = options.columns()
    footers = read_footers(train + validation, columns)
    schemas = {c: footers[0]["schema"].field(c).type for c in columns}
    for footer in footers[1:]:
        for c in columns:
            if footer["schema"].field(c).type != schemas[c]:
                raise DataError(f"{footer['uri']}: column {c!r} is {footer['schema'].field(c).type}, "
                                f"but {footers[0]['uri']} has {schemas[c]}")
    splits = {"train": footers[:len(train)], "validation": footers[len(train):]}
    rows = {name: sum(sum(f["row_groups"]) for f in files) for name, files in splits.items()}
    for name, count in rows.items():
        if count == 0:
            raise DataError(f"the {name} split has no rows ({len(splits[name])} files)")
    spec = _spec(options, footers, schemas)
    body = {name: {"rows": rows[name],
                   "files": [{k: f[k] for k in ("uri", "size", "mtime_ns", "partition", "row_groups")} for f in files]}
            for name, files in splits.items()}
    return {"task": options.task, "spec": spec, "splits": body, "schema": ", ".join(f"{c}: {t}" for c, t in schemas.items()),
            "digest": digest(train + validation)}


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


def _spec(options: ParquetOptions, footers, schemas) -> dict[str, int]:
    sample = FileReader({"files": [{k: footers[0][k] for k in ("uri", "size", "row_groups")}]}, options)
    first = next((i for i, g in enumerate(sample.groups) if g.rows), None)
    arrays = sample.load(first)
    if options.tokens:
        high = _max_stat(footers, options.tokens)
        vocab = options.vocab_size or (int(high) + 1 if high is not None else None)
        if vocab is None:
            raise DataError(f"the files carry no statistics for {options.tokens!r}: set data.options.vocab_size")
        return {"vocab_size": vocab, "seq_len": int(arrays["tokens"].shape[1]) - 1}
    high = _max_stat(footers, options.label)
    classes = options.num_classes or (int(high) + 1 if high is not None else None)
    if classes is None:
        raise DataError(f"the files carry no statistics for {options.label!r}: set data.options.num_classes")
    return {"input_dim": int(arrays["x"].shape[1]), "num_classes": classes}
