"""Turn a data source into Parquet shards with a manifest, cached by digest.

Layout of one prepared dataset (local or s3://):
    <cache_root>/<source>-<key>/train/part-00000.parquet ...
    <cache_root>/<source>-<key>/validation/part-00000.parquet ...
    <cache_root>/<source>-<key>/manifest.json      written last: its presence means complete

`key` digests the source's content, its options and the shard layout, so a changed source or
option gives a new dataset and an unchanged one is reused without rewriting anything.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import numpy as np
import pyarrow.parquet as pq

from training import storage
from training.config import DataConfig
from training.data.sources import SPLITS, load_source

PREP_FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BLOCKS_PER_CPU = 2  # blocks of input files per CPU of the cluster, in the Ray Data pipeline
# run_on / tokenize_on auto: on the cluster once the files still to prepare hold this much.
CLUSTER_MIN_BYTES = 32 << 20


@dataclass(frozen=True)
class Manifest:
    root: str
    source: str
    options: dict[str, Any]
    task: str
    spec: dict[str, int]
    # split -> {"rows": int, "shards": [{"path": relative path, "rows": int, "sha256": hex}]}
    splits: dict[str, dict[str, Any]]
    schema: str
    digest: str
    format_version: int = PREP_FORMAT_VERSION
    # Data prepared from other data (text tokenized, Parquet transformed): where it came from.
    origin: Optional[dict[str, Any]] = None

    def rows(self, split: str) -> int:
        return self.splits[split]["rows"]

    def shard_uris(self, split: str) -> list[str]:
        return [storage.join(self.root, shard["path"]) for shard in self.splits[split]["shards"]]

    def to_json(self) -> str:
        body = asdict(self)
        body.pop("root")
        return json.dumps(body, indent=2, sort_keys=True)

    @classmethod
    def load(cls, root: str) -> "Manifest":
        body = json.loads(storage.read_text(storage.join(root, MANIFEST)))
        if body.get("format_version") != PREP_FORMAT_VERSION:
            raise ValueError(f"{root}: prepared data has format {body.get('format_version')}, "
                             f"expected {PREP_FORMAT_VERSION}")
        return cls(root=root, **body)


def dataset_key(data: DataConfig, content_digest: str) -> str:
    ident = json.dumps({"source": data.source, "options": data.options, "num_shards": data.num_shards,
                        "format": PREP_FORMAT_VERSION, "content": content_digest}, sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def prepare(data: DataConfig, cache_root: str, log=print, check=None, planned=None) -> Manifest:
    """Prepare `data` under `cache_root` unless an identical dataset is already there.

    `check(task, spec, rows)`, if given, runs on the loaded source before anything is written;
    `planned`: plan_input's plan of this data, if the caller has made it already."""
    if data.source == "parquet" and data.options.get("transform"):  # a plug-in's output, streamed like the input
        from training.data import transform

        return transform.prepare(data, cache_root, log, check, transform_plan=planned)
    if data.source == "parquet":  # read where it is: only an index is written
        from training.data import external

        return external.prepare(data, cache_root, log, check)
    if data.source == "text":  # tokenized into Parquet that is streamed like the parquet source's
        from training.data import text

        return text.prepare(data, cache_root, log, check, text_plan=planned)
    source = load_source(data.source, data.options)
    if check is not None:
        check(source.task, source.spec, {name: table.num_rows for name, table in source.splits.items()})
    name = re.sub(r"[^A-Za-z0-9_]+", "_", data.source.split(":")[-1])
    root = storage.join(cache_root, f"{name}-{dataset_key(data, source.content_digest)}")
    if storage.exists(storage.join(root, MANIFEST)):
        manifest = Manifest.load(root)
        log(f"data: {data.source} ready at {root} (cached; {manifest.rows('train')} train, "
            f"{manifest.rows('validation')} validation rows)")
        return manifest

    fs, base = storage.filesystem(root)
    splits: dict[str, dict[str, Any]] = {}
    for split in SPLITS:
        table = source.splits[split]
        shards = []
        bounds = np.linspace(0, table.num_rows, min(data.num_shards, max(table.num_rows, 1)) + 1).astype(int)
        fs.create_dir(f"{base}/{split}", recursive=True)
        for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
            buffer = io.BytesIO()
            pq.write_table(table.slice(start, stop - start), buffer, compression="zstd")
            payload = buffer.getvalue()
            relative = f"{split}/part-{index:05d}.parquet"
            with fs.open_output_stream(f"{base}/{relative}") as stream:
                stream.write(payload)
            shards.append({"path": relative, "rows": int(stop - start),
                           "sha256": hashlib.sha256(payload).hexdigest()})
        splits[split] = {"rows": table.num_rows, "shards": shards}
    digest = hashlib.sha256("".join(s["sha256"] for sp in splits.values() for s in sp["shards"]).encode())
    manifest = Manifest(root=root, source=data.source, options=dict(data.options), task=source.task,
                        spec=dict(source.spec), splits=splits,
                        schema=source.splits["train"].schema.to_string(), digest=digest.hexdigest())
    storage.write_text(storage.join(root, MANIFEST), manifest.to_json())
    log(f"data: prepared {data.source} at {root} ({splits['train']['rows']} train, "
        f"{splits['validation']['rows']} validation rows in {data.num_shards} shards each)")
    return manifest


def plan_input(data: DataConfig, cache_root: str):
    """The plan of a source whose input is prepared file by file (text to tokenize: text.TextPlan;
    Parquet to transform: transform.TransformPlan), or None for the others. Planning lists the
    input and makes every check of it that needs no Ray (UserError); a driver plans once and hands
    the plan to wants_cluster, the resume check and prepare."""
    if data.source == "text":
        from training.data import text

        return text.plan(data, cache_root)
    if data.source == "parquet" and data.options.get("transform"):
        from training.data import transform

        return transform.plan(data, cache_root)
    return None


def wants_cluster(planned) -> bool:
    """Whether preparing the planned input (plan_input) would run on a Ray cluster if one were up
    (enough of it not prepared yet): the driver then opens its Ray session before preparing."""
    if planned is None:
        return False
    from training.data import text, transform

    return (text.wants_cluster if isinstance(planned, text.TextPlan) else transform.wants_cluster)(planned)


def cached(root: str, check, log: Callable[[str], None], what: str) -> Optional[Manifest]:
    """The Manifest prepared earlier at `root` (checked, logged), or None if there is none."""
    if not storage.exists(storage.join(root, MANIFEST)):
        return None
    manifest = Manifest.load(root)
    if check is not None:
        check(manifest.task, manifest.spec, {name: split["rows"] for name, split in manifest.splits.items()})
    log(f"data: {what} ready at {root} (cached; {manifest.rows('train')} train, {manifest.rows('validation')} "
        "validation rows)")
    return manifest


def same_dataset(recorded_root: str, root: str) -> bool:
    """Whether a run's recorded dataset folder is the one its inputs give now (the same key)."""
    return recorded_root.rstrip("/").rsplit("/", 1)[-1] == root.rstrip("/").rsplit("/", 1)[-1]


def decide_where(run_on: str, pending_bytes: int, cluster_up: bool) -> str:
    """'cluster' (a Ray Data pipeline) or 'driver' (a file at a time, in this process)."""
    if run_on == "driver" or pending_bytes == 0:
        return "driver"
    if run_on == "cluster":
        return "cluster" if cluster_up else "driver"
    return "cluster" if cluster_up and pending_bytes >= CLUSTER_MIN_BYTES else "driver"


def pending_bytes(inputs: dict[str, list], tasks: list) -> int:
    sizes = {f.uri: f.size for files in inputs.values() for f in files}
    return sum(sizes[t.uri] for t in tasks)


@dataclass(frozen=True)
class FileWork:
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


def do_file_tasks(inputs: dict[str, list], tasks: list, run_on: str, verb: str, in_driver: Callable[[], list[dict]],
                  on_cluster: Callable[[dict[str, int]], list[dict]], log: Callable[[str], None]) -> FileWork:
    """Prepare the input files still to do (`tasks`, of `inputs`: split -> files) where `run_on`
    says: `on_cluster(sizes)` in this process's Ray session if one is up, else `in_driver()`."""
    import sys

    sizes = {f.uri: f.size for files in inputs.values() for f in files}
    pending = pending_bytes(inputs, tasks)
    cluster_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    where = decide_where(run_on, pending, cluster_up)
    if run_on == "cluster" and not cluster_up:
        log(f"data: no Ray cluster is up: {verb} in this process")
    started = time.monotonic()
    results = on_cluster(sizes) if where == "cluster" else in_driver()
    files = sum(len(f) for f in inputs.values())
    if len(tasks) < files:
        log(f"data: {files - len(tasks)} files prepared earlier were kept")
    return FileWork(results, where, time.monotonic() - started, pending, files)


def files_on_cluster(tasks: list, sizes: dict[str, int], work: Callable[[list], list[dict]]) -> list[dict]:
    """A Ray Data pipeline over a list of file tasks (each with `uri`, `fmt`, `folder`): blocks of
    files of about equal bytes (a few per CPU of the cluster), each block handed to `work` by one
    task on any node, which writes its files' output itself; only the files' counts (JSON-able
    dicts) come back to the driver. (One Ray task per file costs more than a small file's work.)"""
    import ray

    from training.data.tokenize import FileTask

    def run(batch: dict[str, Any]) -> dict[str, list]:
        block = [FileTask(uri, fmt, folder) for uri, fmt, folder in zip(batch["uri"], batch["fmt"], batch["folder"])]
        return {"result": [json.dumps(counts) for counts in work(block)]}

    blocks = min(len(tasks), BLOCKS_PER_CPU * max(1, int(ray.cluster_resources().get("CPU", 1))))
    largest_first = sorted(tasks, key=lambda t: -sizes[t.uri])
    dealt = [t for block in range(blocks) for t in largest_first[block::blocks]]  # contiguous blocks, even bytes
    items = [{"uri": t.uri, "fmt": t.fmt, "folder": t.folder} for t in dealt]
    dataset = ray.data.from_items(items, override_num_blocks=blocks).map_batches(run, batch_size=None, num_cpus=1)
    return [json.loads(row["result"]) for row in dataset.take_all()]
