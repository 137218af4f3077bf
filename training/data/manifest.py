"""The record of prepared data, `manifest.json`: written last by the driver when the data is ready
(its presence means complete), read by the workers to open the data, and by a resumed run to find
the data it started on.

Two layouts (`Manifest.streamed`):
- shards this service wrote from a table in memory (digits, tinylm, plug-ins): `splits[s]["shards"]`,
  read whole or by index (training/data/shards.py);
- an index of Parquet files (read in place, or written by the `text` source or a `transform`):
  `splits[s]["files"]` with their row groups, streamed (training/data/stream.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from training import storage

PREP_FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")


@dataclass(frozen=True)
class Manifest:
    root: str
    source: str
    options: dict[str, Any]
    task: str
    spec: dict[str, int]
    # split -> {"rows": int, "shards": [{"path": relative path, "rows": int, "sha256": hex}]}, or
    # split -> {"rows": int, "files": [{"uri", "size", "mtime_ns", "partition", "row_groups"}]}
    splits: dict[str, dict[str, Any]]
    schema: str
    digest: str
    format_version: int = PREP_FORMAT_VERSION
    # Data prepared from other data (text tokenized, Parquet transformed): where it came from.
    origin: Optional[dict[str, Any]] = None

    def rows(self, split: str) -> int:
        return self.splits[split]["rows"]

    def split_rows(self) -> dict[str, int]:
        return {name: split["rows"] for name, split in self.splits.items()}

    @property
    def streamed(self) -> bool:
        """The training split is an index of Parquet files, streamed a row group at a time."""
        return "files" in self.splits["train"]

    def files(self) -> list[dict]:
        """Every indexed file of both splits (a streamed layout)."""
        return [f for split in self.splits.values() for f in split["files"]]

    def shard_uris(self, split: str) -> list[str]:
        return [storage.join(self.root, shard["path"]) for shard in self.splits[split]["shards"]]

    def to_json(self) -> str:
        body = asdict(self)
        body.pop("root")
        return json.dumps(body, indent=2, sort_keys=True)

    def write(self) -> None:
        storage.write_text(storage.join(self.root, MANIFEST), self.to_json())

    @classmethod
    def load(cls, root: str) -> "Manifest":
        body = json.loads(storage.read_text(storage.join(root, MANIFEST)))
        if body.get("format_version") != PREP_FORMAT_VERSION:
            raise ValueError(f"{root}: prepared data has format {body.get('format_version')}, "
                             f"expected {PREP_FORMAT_VERSION}")
        return cls(root=root, **body)


def dataset_key(source: str, options: Any, num_shards: int, content_digest: str) -> str:
    """A prepared dataset's key: its source's content, options and the shard layout."""
    ident = json.dumps({"source": source, "options": options, "num_shards": num_shards,
                        "format": PREP_FORMAT_VERSION, "content": content_digest}, sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def is_prepared(root: str) -> bool:
    return storage.exists(storage.join(root, MANIFEST))


def cached(root: str, check, log: Callable[[str], None], what: str) -> Optional[Manifest]:
    """The Manifest prepared earlier at `root` (checked, logged), or None if there is none."""
    if not is_prepared(root):
        return None
    manifest = Manifest.load(root)
    if check is not None:
        check(manifest.task, manifest.spec, manifest.split_rows())
    log(f"data: {what} at {root} (cached; {manifest.rows('train')} train, {manifest.rows('validation')} "
        "validation rows)")
    return manifest


def same_dataset(recorded_root: str, root: str) -> bool:
    """Whether a run's recorded dataset folder is the one its inputs give now (the same key)."""
    return recorded_root.rstrip("/").rsplit("/", 1)[-1] == root.rstrip("/").rsplit("/", 1)[-1]
