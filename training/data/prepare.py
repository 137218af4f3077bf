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
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from training import storage
from training.config import DataConfig
from training.data.sources import SPLITS, load_source

PREP_FORMAT_VERSION = 1
MANIFEST = "manifest.json"


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


def prepare(data: DataConfig, cache_root: str, log=print, check=None) -> Manifest:
    """Prepare `data` under `cache_root` unless an identical dataset is already there.

    `check(task, spec, rows)`, if given, runs on the loaded source before anything is written."""
    if data.source == "parquet":  # read where it is: only an index is written
        from training.data import external

        return external.prepare(data, cache_root, log, check)
    if data.source == "text":  # tokenized into Parquet that is streamed like the parquet source's
        from training.data import text

        return text.prepare(data, cache_root, log, check)
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
