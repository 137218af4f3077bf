"""What the sources whose data is a table in memory share (the built-in digits and tinylm sets, and
plug-ins): a source loads a train and a validation table in one of the tasks' shapes, and the
driver writes them as Parquet shards with a manifest, cached by digest; the workers read the shards
(training/data/shards.py). Runs on the driver, and in the workers for reading.

The tables' shapes (the task, training/tasks.py):
- classification: column `x` (a fixed-length list of float32 features) and `y` (int64 label);
- language_model: column `tokens` (a fixed-length list of int32 token ids, seq_len + 1 long).

`key` digests the source's content, its options and the shard layout, so a changed source or
option gives a new dataset and an unchanged one is reused without rewriting anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import pyarrow as pa

from training import storage
from training.data.manifest import Manifest, cached, dataset_key
from training.data.order import BatchPlan
from training.data.shards import SplitReader, TrainShard, shards_digest, write_shards
from training.data.source import DataCheck, DataSection


@dataclass(frozen=True)
class SourceData:
    task: str
    splits: dict[str, pa.Table]
    # What the model needs to know about the data: input_dim, num_classes, vocab_size, seq_len.
    spec: dict[str, int]
    # Digest of the source's content: prepared data is rebuilt only when it changes.
    content_digest: str


@dataclass(frozen=True)
class TablePlan:
    """A table source's data to prepare: nothing is listed (the content is digested when loaded)."""

    source: "TableSource"
    section: DataSection
    cache_root: str

    @property
    def task(self) -> Optional[str]:
        return self.source.task

    @property
    def batch_partitions(self) -> None:
        return None

    def check_unchanged(self, recorded_root: Optional[str]) -> None:
        """(Content that changed gives another dataset key: a resumed run prepares it anew.)"""

    def wants_cluster(self) -> bool:
        return False

    def prepare(self, check: Optional[DataCheck], log: Callable[[str], None]) -> Manifest:
        section = self.section
        data = self.source.load(section)
        if check is not None:
            check(data.task, data.spec, {name: table.num_rows for name, table in data.splits.items()})
        options = section.options_as_written()
        name = re.sub(r"[^A-Za-z0-9_]+", "_", section.source.split(":")[-1])
        key = dataset_key(section.source, options, section.num_shards, data.content_digest)
        root = storage.join(self.cache_root, f"{name}-{key}")
        manifest = cached(root, None, log, f"{section.source} ready")
        if manifest is not None:
            return manifest
        splits = write_shards(data.splits, root, section.num_shards)
        manifest = Manifest(root=root, source=section.source, options=options, task=data.task, spec=dict(data.spec),
                            splits=splits, schema=data.splits["train"].schema.to_string(), digest=shards_digest(splits))
        manifest.write()
        log(f"data: prepared {section.source} at {root} ({splits['train']['rows']} train, "
            f"{splits['validation']['rows']} validation rows in {section.num_shards} shards each)")
        return manifest


class TableSource:
    """A source that gives its data as tables (`load`); the rest of the seam is shared."""

    name: str
    Config: type[DataSection]
    task: Optional[str] = None  # the task of every table it loads, when it is always the same

    def load(self, section: DataSection) -> SourceData:
        raise NotImplementedError

    def plan(self, section: DataSection, cache_root: str) -> TablePlan:
        return TablePlan(self, section, cache_root)

    def plugins(self, section: DataSection) -> list[str]:
        return []

    def track(self, tracker, manifest: Manifest, log: Callable[[str], None]) -> None:
        """(Nothing beyond the datasets.)"""

    def open(self, manifest: Manifest, plan: BatchPlan, seed: int) -> TrainShard:
        return TrainShard(SplitReader(manifest, "train"), plan, seed)

    def rows(self, manifest: Manifest, split: str) -> SplitReader:
        return SplitReader(manifest, split)


def classification_table(features: np.ndarray, labels: np.ndarray) -> pa.Table:
    features = np.ascontiguousarray(features, dtype=np.float32)
    x = pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), features.shape[1])
    return pa.table({"x": x, "y": pa.array(np.asarray(labels, dtype=np.int64))})


def token_table(tokens: np.ndarray) -> pa.Table:
    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    return pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), tokens.shape[1])})

