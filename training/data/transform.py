"""The `parquet` source's `transform` (the driver, and Ray Data tasks on any node): a plug-in of the
user's run over the input files before training, each file's output written as Parquet by the
file-by-file pipeline (training/data/file_work.py) and streamed exactly as Parquet read in place.

Each input file is read a row group at a time: each row group's output is one row group of the
output file (the input's layout, which the streaming loader partitions, is kept). The dataset's key
digests the inputs' listing (paths, sizes, modification times), the options and the source of the
plug-in's module, so a changed input or function gives a new dataset. Memory: one row group and
its output, whatever the file's size.

`plan` makes every check a user can fail (paths, options, the function, the columns of its output
on the first rows) without Ray and without writing anything; `TransformPlan.prepare` does the work.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from training import storage
from training.data.file_work import (
    FilePlan,
    FileTask,
    check_cache_dir,
    do_file_tasks,
    done_paths,
    files_on_cluster,
    index_output,
    output_manifest,
    temporary_path,
)
from training.data.files import DataFile, digest, listed_for
from training.data.manifest import Manifest, cached
from training.data.parquet_index import Columns
from training.data.source import DataCheck
from training.errors import DataError, UserError, first_line, one_line
from training.plugins import load_callable, plugin_module_paths
from training.schema import Section

FIELD = "data.options.transform.function"
TRANSFORM_FORMAT = 1
PREFIX = "transform"
CHECK_ROWS = 64  # rows of the first input file the function is tried on before anything is written


class TransformOptions(Section):
    # A plug-in "package.module:function" run on the input before training: per batch, it takes a
    # pyarrow.Table (one row group of a file, with the file's Hive partition values as string
    # columns) and returns a pyarrow.Table, a pandas DataFrame or a dict of columns; per row, it
    # takes a dict and returns a dict, or None to leave the row out.
    function: str
    per: Literal["batch", "row"] = "batch"
    # Keyword arguments to the function.
    options: dict[str, Any] = Field(default_factory=dict)
    # The input columns the function reads (default: all).
    columns: Optional[list[str]] = None
    # Where it runs: a Ray Data pipeline on the cluster (auto: once the files to transform hold
    # 32 MB), or the driver a file at a time.
    run_on: Literal["auto", "cluster", "driver"] = "auto"


class TransformError(DataError):
    """The function failed on, or returned something unusable for, a named file, or the file is not
    what the options say (what to do); `field`: the option to name."""

    def __init__(self, message: str, field: str = FIELD):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class TransformPlan(FilePlan):
    options: Any  # the source's ParquetOptions (its transform set)
    columns: Columns  # what the task reads of the function's output

    @property
    def transform(self) -> TransformOptions:
        return self.options.transform

    @property
    def task(self) -> str:
        return self.columns.task

    @property
    def batch_partitions(self) -> int:
        return self.options.partitions

    def partitions(self) -> dict[str, dict[str, str]]:
        return {f.uri: f.partition for files in self.inputs.values() for f in files}

    changed_message = ("the input data or the transform's module changed since the run started (a file new, "
                       "gone, or with another size or modification time; other code in the function's module): "
                       "resuming would train on other rows; restore them, or start a new run (--name)")

    def prepare(self, check: Optional[DataCheck], log: Callable[[str], None]) -> Manifest:
        """The Manifest of the transformed data (cached by key; resumed file by file if interrupted)."""
        manifest = cached(self.root, check, log, "transformed data ready")
        if manifest is not None:
            return manifest
        tasks = self.tasks()
        work = do_file_tasks(self, tasks, "transforming", in_driver=lambda: transform_in_driver(tasks, self),
                             on_cluster=lambda sizes: transform_on_cluster(tasks, sizes, self), log=log)
        if work.error:
            raise UserError(f"{work.error.get('field', FIELD)}: {work.error['error']}")
        if tasks:
            rows_in, rows = sum(r["rows_in"] for r in work.results), sum(r["rows"] for r in work.results)
            log(f"data: transformed {len(tasks)} of {work.files} files ({work.pending_bytes / 1e6:.1f} MB) with "
                f"{self.transform.function} in {work.elapsed_s:.1f} s {work.how}: {rows_in} rows in, {rows} out "
                f"({rows_in / max(work.elapsed_s, 1e-9):.0f} rows/s)")
        index = index_output(self, self.columns, lambda split: UserError(
            f"{FIELD}: its output for the {split} split has no row ({len(self.inputs[split])} files in); a function "
            "that leaves every row out trains on nothing"), lambda problem: f"{FIELD}: its output: {problem}")
        if check is not None:
            check(index["task"], index["spec"], {name: split["rows"] for name, split in index["splits"].items()})
        index_options = self.options.model_copy(update={
            "path": self.folder("train"), "filter": {}, "transform": None, "validation_path": self.folder("validation"),
            "validation_fraction": None})
        manifest = output_manifest(self, "parquet", index, index_options.model_dump(mode="json"), origin={
            "path": self.options.path, "validation_path": self.options.validation_path,
            "validation_fraction": self.options.validation_fraction, "filter": self.options.filter,
            "transform": self.transform.function,
            "inputs": digest(self.inputs["train"] + self.inputs["validation"])})
        log(f"data: transformed data prepared at {self.root} ({manifest.rows('train')} train, "
            f"{manifest.rows('validation')} validation rows)")
        return manifest


def code_digest(spec: str) -> str:
    """The digest of the function's module source (a changed function gives a new dataset)."""
    module = sys.modules.get(spec.split(":")[0])
    try:
        source = inspect.getsource(module) if module is not None else spec
    except (OSError, TypeError):
        source = spec
    return hashlib.sha256(source.encode()).hexdigest()


def plan_transform(options, columns: Columns, cache_root: str) -> TransformPlan:
    """Every check a user can fail, without Ray and without writing anything; where the data goes.
    `options`: the parquet source's options, with a transform."""
    function = load_callable(options.transform.function, FIELD)
    inputs = listed_for("data.options.path", options.listing).splits
    try:
        first, out = try_on_first_rows(inputs["train"], options.transform, function)
        check_output(out, columns.read(), first.uri)
    except TransformError as exc:
        raise UserError(f"{exc.field}: {exc}") from None
    ident = json.dumps({"format": TRANSFORM_FORMAT,
                        "options": options.model_dump(mode="json", exclude={"transform": {"run_on"}}),
                        "code": code_digest(options.transform.function), "train": digest(inputs["train"]),
                        "validation": digest(inputs["validation"])}, sort_keys=True)
    root = storage.join(cache_root, f"{PREFIX}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}")
    check_cache_dir(cache_root, root)
    return TransformPlan(inputs, root, options.transform.run_on, options, columns)


def try_on_first_rows(files: list[DataFile], transform: TransformOptions,
                      function: Callable) -> tuple[DataFile, pa.Table]:
    """The first of `files` with rows (empty files, as Spark writes them, are passed over) and the
    function's output on its first rows (a bad file or function: TransformError)."""
    for file in files:
        with _open(file.uri) as handle:
            reader = _parquet_file(handle, file.uri)
            group = next((g for g in range(reader.num_row_groups) if reader.metadata.row_group(g).num_rows), None)
            if group is None:
                continue
            table = _read_group(reader, group, transform, file.uri).slice(0, CHECK_ROWS)
        return file, apply(function, with_partition(table, file.partition), transform, f"{file.uri} (its first rows)")
    raise TransformError(f"none of the {len(files)} training files has rows to try the function on",
                         "data.options.path")


def check_output(table: pa.Table, columns: list[str], where: str) -> None:
    """The output has the columns the task reads (features and label, or tokens)."""
    missing = [c for c in columns if c not in table.schema.names]
    if missing:
        raise TransformError(f"its output on {where} has no column {missing[0]!r} (it has: "
                             f"{', '.join(table.schema.names) or 'none'}); data.options.features, label and tokens "
                             "name the columns the function returns")


def with_partition(table: pa.Table, partition: dict[str, str]) -> pa.Table:
    """The file's Hive partition values (key=value folders) as string columns the file lacks (Spark
    leaves them out of the files)."""
    for key, value in partition.items():
        if key not in table.schema.names:
            table = table.append_column(key, pa.array([value] * table.num_rows, pa.string()))
    return table


def apply(function: Callable, table: pa.Table, transform: TransformOptions, where: str) -> pa.Table:
    """The function on one batch (or on each of its rows), as a pyarrow.Table."""
    try:
        if transform.per == "row":
            rows = [function(row, **transform.options) for row in table.to_pylist()]
            kept = [row for row in rows if row is not None]
            if any(not isinstance(row, dict) for row in kept):
                raise TransformError(f"returned {type(next(r for r in kept if not isinstance(r, dict))).__name__} "
                                     f"for a row of {where}; per row, return a dict (or None to leave the row out)")
            return pa.Table.from_pylist(kept) if kept else pa.table({})
        out = function(table, **transform.options)
    except TransformError:
        raise
    except TypeError as exc:  # most often options the function does not take
        raise TransformError(f"{transform.function} failed on {where}: {one_line(exc)}"
                             + (f" (data.options.transform.options, passed as keyword arguments: {transform.options})"
                                if transform.options else "")) from None
    except (Exception, SystemExit) as exc:
        raise TransformError(f"{transform.function} failed on {where}: {one_line(exc)}") from None
    return as_table(out, where)


def as_table(out: Any, where: str) -> pa.Table:
    if isinstance(out, pa.Table):
        return out
    if isinstance(out, pa.RecordBatch):
        return pa.Table.from_batches([out])
    try:
        if isinstance(out, dict):
            return pa.table(out)
        if type(out).__name__ == "DataFrame" and hasattr(out, "to_dict"):  # pandas, without importing it
            return pa.Table.from_pandas(out, preserve_index=False)
    except (pa.ArrowException, ValueError, TypeError) as exc:
        raise TransformError(f"its output on {where} is not a table: {one_line(exc)}") from None
    raise TransformError(f"returned {type(out).__name__} for {where}; per batch, return a pyarrow.Table, a pandas "
                         "DataFrame or a dict of columns")


def _open(uri: str):
    fs, path = storage.filesystem(uri)
    return fs.open_input_file(path)


def _parquet_file(handle, uri: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(handle)
    except (pa.ArrowInvalid, OSError) as exc:
        raise TransformError(f"{uri} is not a readable Parquet file: {first_line(exc, 200)}",
                             "data.options.path") from None


def _read_group(reader: pq.ParquetFile, group: int, transform: TransformOptions, uri: str) -> pa.Table:
    missing = [c for c in transform.columns or [] if c not in reader.schema_arrow.names]
    if missing:
        raise TransformError(f"{uri} has no column {missing[0]!r} (it has: {', '.join(reader.schema_arrow.names)})",
                             "data.options.transform.columns")
    return reader.read_row_group(group, columns=transform.columns)


def transform_file(task: FileTask, partition: dict[str, str], transform: TransformOptions, columns: list[str],
                   function: Callable) -> dict:
    """Transform one file a row group at a time with `function` and write it; its counts, or
    {"error": message} (nothing of this file is left behind then)."""
    final, empty = done_paths(task.folder, task.uri)
    fs, _ = storage.filesystem(final)
    _, tmp_path = storage.filesystem(temporary_path(task.folder, task.uri))
    fs.create_dir(storage.filesystem(task.folder)[1], recursive=True)
    counts = {"uri": task.uri, "rows_in": 0, "rows": 0, "row_groups": 0}
    writer = None
    try:
        with _open(task.uri) as handle:
            reader = _parquet_file(handle, task.uri)
            for group in range(reader.num_row_groups):
                table = _read_group(reader, group, transform, task.uri)
                counts["rows_in"] += table.num_rows
                out = apply(function, with_partition(table, partition), transform, f"{task.uri} row group {group}")
                if not out.num_rows:
                    continue
                if writer is None:
                    check_output(out, columns, f"{task.uri} row group {group}")
                    writer = pq.ParquetWriter(tmp_path, out.schema, filesystem=fs, compression="zstd")
                elif out.schema != writer.schema:
                    out = _conform(out, writer.schema, f"{task.uri} row group {group}")
                writer.write_table(out, row_group_size=max(out.num_rows, 1))
                counts["rows"] += out.num_rows
                counts["row_groups"] += 1
        if writer is None:  # no row out of this file: marked done, empty
            with fs.open_output_stream(tmp_path):
                pass
        else:
            writer.close()
            writer = None
        fs.move(tmp_path, storage.filesystem(final if counts["rows"] else empty)[1])
    except TransformError as exc:
        return {"uri": task.uri, "error": str(exc), "field": exc.field}
    finally:
        if writer is not None:
            writer.close()
            fs.delete_file(tmp_path)
    return counts


def _conform(out: pa.Table, schema: pa.Schema, where: str) -> pa.Table:
    """A batch's output in the schema of the file's first output (a row function's inferred types
    may differ between batches: an int column whose values all happen to be null, say)."""
    try:
        if sorted(out.schema.names) != sorted(schema.names):
            raise KeyError(f"columns {', '.join(out.schema.names)}, not {', '.join(schema.names)}")
        return out.select(schema.names).cast(schema)
    except (KeyError, pa.ArrowException, ValueError) as exc:
        raise TransformError(f"its output on {where} has other columns or types than on the file's first rows "
                             f"({one_line(exc)}); return the same columns for every batch") from None


def transform_in_driver(tasks: list[FileTask], plan_: TransformPlan) -> list[dict]:
    function = load_callable(plan_.transform.function, FIELD)
    partitions, columns = plan_.partitions(), plan_.columns.read()
    results = []
    for task in tasks:
        results.append(transform_file(task, partitions[task.uri], plan_.transform, columns, function))
        if "error" in results[-1]:
            break
    return results


def transform_on_cluster(tasks: list[FileTask], sizes: dict[str, int], plan_: TransformPlan) -> list[dict]:
    """Each file transformed by a Ray Data task on any node (see file_work.files_on_cluster)."""
    partitions, transform, columns = plan_.partitions(), plan_.transform, plan_.columns.read()
    function = load_callable(transform.function, FIELD)

    def work(block: list[FileTask]) -> list[dict]:
        return [transform_file(task, partitions[task.uri], transform, columns, function) for task in block]

    # The function travels with the tasks by value when its module is local source (not installed):
    # the tasks then need nothing shipped, whoever opened this Ray session (the run ships its
    # plug-ins when it starts Ray; a session opened before, by a notebook or a test, may not have).
    from ray import cloudpickle  # (Ray: only once a cluster is up to transform on)

    module = sys.modules[function.__module__]
    by_value = bool(plugin_module_paths(transform.function)) and function.__module__ != "__main__"
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return files_on_cluster(tasks, sizes, work)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)
