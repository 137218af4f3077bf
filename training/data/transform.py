"""Runs in the driver, or in a Ray Data task on any node: the `parquet` source's `transform`, a
plug-in of the user's run over the input files before training; its output is written as Parquet
that workers stream exactly as they stream Parquet read in place.

Layout (local or s3://):
    <cache_root>/transform-<key>/{train,validation}/<input file's name>-<digest>.parquet
    <cache_root>/transform-<key>/manifest.json      written last: its presence means complete

`key` digests the inputs' listing (paths, sizes, modification times), the options and the source
of the plug-in's module, so a changed input or function gives a new dataset. Each input file is
one unit of work, read a row group at a time: each row group's output is one row group of the
output file (the input's layout, which the streaming loader partitions, is kept), written under a
temporary name and renamed when complete, so an interrupted preparation resumes with the files not
yet written. Large inputs are transformed by a Ray Data pipeline on the cluster (blocks of files,
each written by the task that reads it; only counts come back to the driver), small ones in the
driver. Memory: one row group and its output, whatever the file's size.

`plan` makes every check a user can fail (paths, options, the function, the columns of its output
on the first rows) without Ray and without writing anything; `prepare` does the work.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from training import storage
from training.config import DataConfig
from training.data import parquet
from training.data.parquet import ParquetOptions, TransformOptions
from training.data.tokenize import FileTask, done_paths, is_done
from training.errors import UserError
from training.plugins import load_callable, one_line, plugin_module_paths

FIELD = "data.options.transform.function"
TRANSFORM_FORMAT = 1
PREFIX = "transform"
CHECK_ROWS = 64  # rows of the first input file the function is tried on before anything is written


class TransformError(ValueError):
    """The function failed on, or returned something unusable for, a named file, or the file is not
    what the options say (what to do); `field`: the option to name."""

    def __init__(self, message: str, field: str = FIELD):
        super().__init__(message)
        self.field = field


def plugin_specs(data: DataConfig) -> list[str]:
    """The transform's function, for the plug-ins shipped to the cluster (none: no transform)."""
    transform = (data.options or {}).get("transform") if data.source == "parquet" else None
    return [transform["function"]] if isinstance(transform, dict) and transform.get("function") else []


@dataclass(frozen=True)
class TransformPlan:
    options: ParquetOptions
    inputs: dict[str, list[parquet.DataFile]]  # split -> input files
    root: str

    @property
    def transform(self) -> TransformOptions:
        return self.options.transform

    def folder(self, split: str) -> str:
        return storage.join(self.root, split)

    def tasks(self) -> list[FileTask]:
        """The files not yet transformed."""
        return [FileTask(f.uri, "parquet", self.folder(split)) for split, files in self.inputs.items() for f in files
                if not is_done(self.folder(split), f.uri)]

    def partitions(self) -> dict[str, dict[str, str]]:
        return {f.uri: f.partition for files in self.inputs.values() for f in files}

    def prepared(self) -> bool:
        from training.data.prepare import MANIFEST

        return storage.exists(storage.join(self.root, MANIFEST))


def _listing(options: ParquetOptions) -> dict[str, list[parquet.DataFile]]:
    try:
        train = parquet.list_files(options.path, options.filter)
        if options.validation_path is not None:
            return {"train": train, "validation": parquet.list_files(options.validation_path, options.filter)}
        chosen = parquet.validation_files(train, options.validation_fraction)
    except parquet.DataError as exc:
        raise UserError(f"data.options.path: {exc}") from None
    except OSError as exc:
        raise UserError(f"data.options.path: {str(exc).splitlines()[0][:300]}") from None
    return {"train": [f for f in train if f.uri not in chosen], "validation": [f for f in train if f.uri in chosen]}


def code_digest(spec: str) -> str:
    """The digest of the function's module source (a changed function gives a new dataset)."""
    module = sys.modules.get(spec.split(":")[0])
    try:
        source = inspect.getsource(module) if module is not None else spec
    except (OSError, TypeError):
        source = spec
    return hashlib.sha256(source.encode()).hexdigest()


def plan(data: DataConfig, cache_root: str) -> TransformPlan:
    """Every check a user can fail, without Ray and without writing anything; where the data goes."""
    from training.data.external import options_of

    options = options_of(data)
    function = load_callable(options.transform.function, FIELD)
    inputs = _listing(options)
    first = next((f for f in inputs["train"] if f.size), inputs["train"][0])
    try:
        check_output(try_on_first_rows(first, options.transform, function), options.columns(), first.uri)
    except TransformError as exc:
        raise UserError(f"{exc.field}: {exc}") from None
    ident = json.dumps({"format": TRANSFORM_FORMAT, "options": options.model_dump(mode="json", exclude={"transform": {"run_on"}}),
                        "code": code_digest(options.transform.function), "train": parquet.digest(inputs["train"]),
                        "validation": parquet.digest(inputs["validation"])}, sort_keys=True)
    root = storage.join(cache_root, f"{PREFIX}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}")
    return TransformPlan(options, inputs, root)


def try_on_first_rows(file: parquet.DataFile, transform: TransformOptions, function: Callable) -> pa.Table:
    """The function's output on the first rows of `file` (a bad file or function: TransformError)."""
    with _open(file.uri) as handle:
        reader = _parquet_file(handle, file.uri)
        group = next((g for g in range(reader.num_row_groups) if reader.metadata.row_group(g).num_rows), None)
        if group is None:
            raise TransformError(f"{file.uri} has no rows to try the function on")
        table = _read_group(reader, group, transform, file.uri).slice(0, CHECK_ROWS)
    return apply(function, with_partition(table, file.partition), transform, f"{file.uri} (its first rows)")


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
        raise TransformError(f"{uri} is not a readable Parquet file: {str(exc).splitlines()[0][:200]}",
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
    _, tmp_path = storage.filesystem(storage.join(task.folder, "." + final.rsplit("/", 1)[-1] + ".tmp"))
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
    partitions, columns = plan_.partitions(), plan_.options.columns()
    results = []
    for task in tasks:
        results.append(transform_file(task, partitions[task.uri], plan_.transform, columns, function))
        if "error" in results[-1]:
            break
    return results


def transform_on_cluster(tasks: list[FileTask], sizes: dict[str, int], plan_: TransformPlan) -> list[dict]:
    """Each file transformed by a Ray Data task on any node (see prepare.files_on_cluster)."""
    from training.data.prepare import files_on_cluster

    partitions, transform, columns = plan_.partitions(), plan_.transform, plan_.options.columns()

    function = load_callable(transform.function, FIELD)

    def work(block: list[FileTask]) -> list[dict]:
        return [transform_file(task, partitions[task.uri], transform, columns, function) for task in block]

    # The function travels with the tasks by value when its module is local source (not installed):
    # the tasks then need nothing shipped, whoever opened this Ray session (the run ships its
    # plug-ins when it starts Ray; a session opened before, by a notebook or a test, may not have).
    from ray import cloudpickle

    module = sys.modules[function.__module__]
    by_value = bool(plugin_module_paths(transform.function)) and function.__module__ != "__main__"
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return files_on_cluster(tasks, sizes, work)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


def wants_cluster(plan_: TransformPlan) -> bool:
    from training.data.prepare import decide_where, pending_bytes

    if plan_.prepared():
        return False
    return decide_where(plan_.transform.run_on, pending_bytes(plan_.inputs, plan_.tasks()), cluster_up=True) == "cluster"


def check_unchanged(recorded_root: Optional[str], data: DataConfig, cache_root: str,
                    transform_plan: Optional[TransformPlan] = None) -> None:
    """A resumed run's input and function must be those it started with: they give the same key."""
    if not recorded_root:
        return
    from training.data.prepare import same_dataset

    if not same_dataset(recorded_root, (transform_plan or plan(data, cache_root)).root):
        raise UserError("data.options.path: the input data or the transform's module changed since the run started (a file "
                        "new, gone, or with another size or modification time; other code in the function's module): "
                        "resuming would train on other rows; restore them, or start a new run (--name)")


def prepare(data: DataConfig, cache_root: str, log: Callable[[str], None] = print, check=None,
            transform_plan: Optional[TransformPlan] = None):
    """The Manifest of the transformed data (cached by key; resumed file by file if interrupted)."""
    from training.data.external import SOURCE
    from training.data.prepare import MANIFEST, Manifest, cached, do_file_tasks

    transform_plan = transform_plan or plan(data, cache_root)
    options = transform_plan.options
    manifest = cached(transform_plan.root, check, log, "transformed data")
    if manifest is not None:
        return manifest
    tasks = transform_plan.tasks()
    work = do_file_tasks(transform_plan.inputs, tasks, options.transform.run_on, "transforming",
                         in_driver=lambda: transform_in_driver(tasks, transform_plan),
                         on_cluster=lambda sizes: transform_on_cluster(tasks, sizes, transform_plan), log=log)
    if work.error:
        raise UserError(f"{work.error.get('field', FIELD)}: {work.error['error']}")
    if tasks:
        rows_in, rows = sum(r["rows_in"] for r in work.results), sum(r["rows"] for r in work.results)
        log(f"data: transformed {len(tasks)} of {work.files} files ({work.pending_bytes / 1e6:.1f} MB) with "
            f"{options.transform.function} in {work.elapsed_s:.1f} s {work.how}: {rows_in} rows in, {rows} out "
            f"({rows_in / max(work.elapsed_s, 1e-9):.0f} rows/s)")
    index_options = options.model_copy(update={"path": transform_plan.folder("train"), "filter": {}, "transform": None,
                                               "validation_path": transform_plan.folder("validation"),
                                               "validation_fraction": None})
    for split in ("train", "validation"):
        try:
            parquet.list_files(transform_plan.folder(split))
        except parquet.DataError:
            raise UserError(f"{FIELD}: its output for the {split} split has no row ({len(transform_plan.inputs[split])} "
                            "files in); a function that leaves every row out trains on nothing") from None
    try:
        index = parquet.build_index(index_options)
    except parquet.DataError as exc:
        raise UserError(f"{FIELD}: its output: {exc}") from None
    if check is not None:
        check(index["task"], index["spec"], {name: split["rows"] for name, split in index["splits"].items()})
    manifest = Manifest(root=transform_plan.root, source=SOURCE, options=index_options.model_dump(mode="json"),
                        task=index["task"], spec=index["spec"], splits=index["splits"], schema=index["schema"],
                        digest=index["digest"],
                        origin={"path": options.path, "validation_path": options.validation_path,
                                "transform": options.transform.function, "inputs": parquet.digest(
                                    transform_plan.inputs["train"] + transform_plan.inputs["validation"])})
    storage.write_text(storage.join(transform_plan.root, MANIFEST), manifest.to_json())
    log(f"data: transformed data prepared at {transform_plan.root} ({manifest.rows('train')} train, "
        f"{manifest.rows('validation')} validation rows)")
    return manifest

