"""Input files prepared one at a time into Parquet that workers stream: the `text` source tokenizes
each file, a `parquet` source's `transform` runs a plug-in on each; both go through this pipeline.
Runs in the driver, and in Ray Data tasks on any node.

Layout (local or s3://):
    <cache_root>/<prefix>-<key>/{train,validation}/<input file's name>-<digest>.parquet
    <cache_root>/<prefix>-<key>/manifest.json      written last: its presence means complete

Each input file is one unit of work, written under a temporary name and renamed when complete, so a
file that is there is finished and an interrupted preparation resumes with the files not yet
written; a file with no row out is still marked done, as an empty `_<name>.parquet` (skipped by
the listing, like Spark's `_SUCCESS`). Large inputs are prepared by a Ray Data pipeline on the
cluster (blocks of files, each written by the task that reads it; only counts come back to the
driver), small ones in the driver, a file at a time. The output is then indexed like Parquet read
in place.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from training import storage
from training.data.files import DataFile, Listing, list_files
from training.data.manifest import SPLITS, Manifest, is_prepared, same_dataset
from training.data.parquet_index import Columns, build_index, check_index_unchanged
from training.errors import DataError, UserError, first_line

BLOCKS_PER_CPU = 2  # blocks of input files per CPU of the cluster, in the Ray Data pipeline
# run_on / tokenize_on auto: on the cluster once the files still to prepare hold this much.
CLUSTER_MIN_BYTES = 32 << 20


@dataclass(frozen=True)
class FileTask:
    uri: str
    fmt: str
    folder: str  # where the output goes (the split's folder)


def output_name(uri: str) -> str:
    """A name derived from the input file, unique within the dataset (the path's digest)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", posixpath.basename(uri.rstrip("/")))[:80].lstrip("._") or "file"
    return f"{stem}-{hashlib.sha256(uri.encode()).hexdigest()[:10]}.parquet"


def done_paths(folder: str, uri: str) -> tuple[str, str]:
    """Where the output of `uri` lies when finished: with rows, or empty (no row out)."""
    name = output_name(uri)
    return storage.join(folder, name), storage.join(folder, f"_{name}")


def temporary_path(folder: str, uri: str) -> str:
    return storage.join(folder, f".{output_name(uri)}.tmp")


def is_done(folder: str, uri: str) -> bool:
    return any(storage.exists(p) for p in done_paths(folder, uri))


@dataclass(frozen=True)
class FilePlan:
    """Input files to prepare under `root`: split -> files, and where the work runs (`run_on`:
    auto, cluster or driver)."""

    inputs: dict[str, list[DataFile]]
    root: str
    run_on: str

    def folder(self, split: str) -> str:
        return storage.join(self.root, split)

    def fmt(self, uri: str) -> str:
        """The format a file is read in."""
        return "parquet"

    def tasks(self) -> list[FileTask]:
        """The files not yet prepared."""
        return [FileTask(f.uri, self.fmt(f.uri), self.folder(split))
                for split, files in self.inputs.items() for f in files if not is_done(self.folder(split), f.uri)]

    def prepared(self) -> bool:
        return is_prepared(self.root)

    def pending_bytes(self, tasks: list[FileTask]) -> int:
        sizes = {f.uri: f.size for files in self.inputs.values() for f in files}
        return sum(sizes[t.uri] for t in tasks)

    def wants_cluster(self) -> bool:
        """Whether preparing would run on a Ray cluster if one were up (the driver then opens its Ray
        session before preparing)."""
        if self.prepared():
            return False
        return decide_where(self.run_on, self.pending_bytes(self.tasks()), cluster_up=True) == "cluster"

    # What a resume on other input is refused with (after "data.options.path: ").
    changed_message = "the input changed since the run started"

    def check_unchanged(self, recorded_root: Optional[str]) -> None:
        """A resumed run's input must be what it started on: the prepared output as written (the rows it
        trained on), and the same inputs give the same key (preparing changed input again would
        silently train the rest of the run on other rows)."""
        if not recorded_root:
            return
        check_index_unchanged(recorded_root)
        if not same_dataset(recorded_root, self.root):
            raise UserError(f"data.options.path: {self.changed_message}")

    def split_of(self, uri: str) -> str:
        return next(split for split, files in self.inputs.items() if any(f.uri == uri for f in files))


def check_cache_dir(cache_root: str, root: str) -> None:
    """UserError naming data.cache_dir when the data is still to prepare and its folder cannot be
    written (under a file, read-only, not this user's), found when planning: a directory is made
    and removed at once in the deepest part of the path that exists. A dataset prepared there
    already is only read. (An object store's rights show on its first write.)"""
    if storage.is_remote(cache_root):
        return
    try:
        if is_prepared(root):
            return
        existing = os.path.abspath(storage.filesystem(cache_root)[1])
        while not os.path.exists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise NotADirectoryError(f"{existing} is not a folder")
        os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=existing))
    except OSError as exc:
        raise UserError(f"data.cache_dir: {cache_root} cannot be written ({first_line(exc, 200)}); set data.cache_dir "
                        "(default: <checkpoint.storage_path>/datasets) to a folder this process can write") from None


def decide_where(run_on: str, pending_bytes: int, cluster_up: bool) -> str:
    """'cluster' (a Ray Data pipeline) or 'driver' (a file at a time, in this process)."""
    if run_on == "driver" or pending_bytes == 0:
        return "driver"
    if run_on == "cluster":
        return "cluster" if cluster_up else "driver"
    return "cluster" if cluster_up and pending_bytes >= CLUSTER_MIN_BYTES else "driver"


@dataclass(frozen=True)
class WorkDone:
    """What preparing the input files a file at a time did (see `do_file_tasks`)."""
    results: list[dict]
    where: str
    elapsed_s: float
    pending_bytes: int
    files: int

    @property
    def how(self) -> str:
        return "on the cluster (Ray Data)" if self.where == "cluster" else "in this process"

    @property
    def error(self) -> Optional[dict]:
        return next((r for r in self.results if "error" in r), None)


def do_file_tasks(plan: FilePlan, tasks: list[FileTask], verb: str, in_driver: Callable[[], list[dict]],
                  on_cluster: Callable[[dict[str, int]], list[dict]], log: Callable[[str], None]) -> WorkDone:
    """Prepare the input files still to do (`tasks`) where the plan says: `on_cluster(sizes)` in this
    process's Ray session if one is up, else `in_driver()`."""
    sizes = {f.uri: f.size for files in plan.inputs.values() for f in files}
    pending = plan.pending_bytes(tasks)
    cluster_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()  # (never starts Ray itself)
    where = decide_where(plan.run_on, pending, cluster_up)
    if plan.run_on == "cluster" and not cluster_up:
        log(f"data: no Ray cluster is up: {verb} in this process")
    started = time.monotonic()
    results = on_cluster(sizes) if where == "cluster" else in_driver()
    files = sum(len(f) for f in plan.inputs.values())
    if len(tasks) < files:
        log(f"data: {files - len(tasks)} files prepared earlier were kept")
    return WorkDone(results, where, time.monotonic() - started, pending, files)


def files_on_cluster(tasks: list[FileTask], sizes: dict[str, int], work: Callable[[list], list[dict]]) -> list[dict]:
    """A Ray Data pipeline over a list of file tasks: blocks of files of about equal bytes (a few per
    CPU of the cluster), each block handed to `work` by one task on any node, which writes its
    files' output itself; only the files' counts (JSON-able dicts) come back to the driver. (One
    Ray task per file costs more than a small file's work.)"""
    import ray  # (Ray: only once a cluster is up to prepare on)

    def run(batch: dict[str, Any]) -> dict[str, list]:
        block = [FileTask(uri, fmt, folder) for uri, fmt, folder in zip(batch["uri"], batch["fmt"], batch["folder"])]
        return {"result": [json.dumps(counts) for counts in work(block)]}

    blocks = min(len(tasks), BLOCKS_PER_CPU * max(1, int(ray.cluster_resources().get("CPU", 1))))
    largest_first = sorted(tasks, key=lambda t: -sizes[t.uri])
    dealt = [t for block in range(blocks) for t in largest_first[block::blocks]]  # contiguous blocks, even bytes
    items = [{"uri": t.uri, "fmt": t.fmt, "folder": t.folder} for t in dealt]
    dataset = ray.data.from_items(items, override_num_blocks=blocks).map_batches(run, batch_size=None, num_cpus=1)
    return [json.loads(row["result"]) for row in dataset.take_all()]


def index_output(plan: FilePlan, columns: Columns, empty: Callable[[str], UserError], bad_output: Callable[[str], str],
                 vocab_size: Optional[int] = None) -> dict[str, Any]:
    """The index of the prepared output (as Parquet read in place); `empty(split)` is raised for a
    split with no row out, `bad_output(problem)` names what is wrong with the output otherwise."""
    listed = {}
    for split in SPLITS:
        try:
            listed[split] = list_files(plan.folder(split))
        except DataError:
            raise empty(split) from None
    try:
        return build_index(Listing(listed["train"] + listed["validation"], listed), columns, vocab_size=vocab_size)
    except DataError as exc:
        raise UserError(bad_output(str(exc))) from None


def output_manifest(plan: FilePlan, source: str, index: dict[str, Any], index_options: dict, origin: dict) -> Manifest:
    """The Manifest of prepared output, written (it makes the dataset complete)."""
    manifest = Manifest(root=plan.root, source=source, options=index_options, task=index["task"], spec=index["spec"],
                        splits=index["splits"], schema=index["schema"], digest=index["digest"], origin=origin)
    manifest.write()
    return manifest
