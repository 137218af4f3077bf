"""Parquet shards this service writes from a table in memory (the digits, tinylm and plug-in
sources), and their reading: by the driver (writing, checking a shard against its manifest) and
by the workers (a split by index, a worker's rows of each global batch).

Layout of one prepared dataset (local or s3://):
    <cache_root>/<source>-<key>/train/part-00000.parquet ...
    <cache_root>/<source>-<key>/validation/part-00000.parquet ...
    <cache_root>/<source>-<key>/manifest.json      written last: its presence means complete
"""

from __future__ import annotations

import hashlib
import io
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from training import storage
from training.data.manifest import SPLITS, Manifest
from training.data.order import BatchPlan, batch_digests, epoch_order
from training.errors import first_line
from training.tasks import TASKS

# A split whose decoded rows fit in this many bytes is read once and kept in memory: a small
# dataset's epochs are then cut from memory, as a hand-written loop would (digits: 4% of step time
# went to re-reading its Parquet every 22 steps). Larger splits are read epoch by epoch.
IN_MEMORY_LIMIT_BYTES = 256 << 20


def write_shards(tables: dict[str, pa.Table], root: str, num_shards: int) -> dict[str, dict[str, Any]]:
    """Each split's table as up to `num_shards` Parquet files under `root`; the manifest's splits."""
    fs, base = storage.filesystem(root)
    splits: dict[str, dict[str, Any]] = {}
    for split in SPLITS:
        table = tables[split]
        shards = []
        bounds = np.linspace(0, table.num_rows, min(num_shards, max(table.num_rows, 1)) + 1).astype(int)
        fs.create_dir(f"{base}/{split}", recursive=True)
        for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
            buffer = io.BytesIO()
            pq.write_table(table.slice(start, stop - start), buffer, compression="zstd")
            payload = buffer.getvalue()
            relative = f"{split}/part-{index:05d}.parquet"
            with fs.open_output_stream(f"{base}/{relative}") as stream:
                stream.write(payload)
            shards.append({"path": relative, "rows": int(stop - start), "sha256": hashlib.sha256(payload).hexdigest()})
        splits[split] = {"rows": table.num_rows, "shards": shards}
    return splits


def shards_digest(splits: dict[str, dict[str, Any]]) -> str:
    return hashlib.sha256("".join(s["sha256"] for sp in splits.values() for s in sp["shards"]).encode()).hexdigest()


def row_bytes(schema: pa.Schema) -> int | None:
    """Decoded bytes per row for fixed-width columns (None when a column has no fixed width)."""
    total = 0
    for field in schema:
        kind, count = field.type, 1
        if pa.types.is_fixed_size_list(kind):
            kind, count = kind.value_type, kind.list_size
        try:
            total += count * kind.bit_width // 8
        except ValueError:
            return None
    return total


def table_columns(table: pa.Table, columns: tuple[tuple[str, str], ...]) -> dict[str, np.ndarray]:
    """A table's columns as numpy arrays of the task's dtypes: a fixed-size list column becomes a
    matrix of one row per table row."""
    out = {}
    for name, dtype in columns:
        column = table.column(name).combine_chunks()
        if pa.types.is_fixed_size_list(column.type):
            values = column.flatten().to_numpy(zero_copy_only=False).reshape(-1, column.type.list_size)
        else:
            values = column.to_numpy(zero_copy_only=False)
        out[name] = values.astype(dtype)  # (a copy: the columns outlive the table's buffers)
    return out


class SplitReader:
    """Reads rows of one split by index from its Parquet shards (local or s3://); a small split
    is read whole, once (see IN_MEMORY_LIMIT_BYTES)."""

    def __init__(self, manifest: Manifest, split: str, in_memory_limit_bytes: int = IN_MEMORY_LIMIT_BYTES):
        import pyarrow.dataset as pads  # (it imports pandas: 0.2 s the config path does without)

        fs, _ = storage.filesystem(manifest.root)
        paths = [storage.filesystem(uri)[1] for uri in manifest.shard_uris(split)]
        self.dataset = pads.dataset(paths, filesystem=fs, format="parquet")
        self.columns = TASKS[manifest.task].columns
        self.num_rows = manifest.rows(split)
        width = row_bytes(self.dataset.schema)
        small = width is not None and width * self.num_rows <= in_memory_limit_bytes
        # (decoded once: an epoch of a small split is then a numpy gather, not a read and a decode)
        self._columns = table_columns(self.dataset.to_table(), self.columns) if small else None

    @property
    def in_memory(self) -> bool:
        return self._columns is not None

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64)
        if self._columns is not None:
            return {name: column[indices] for name, column in self._columns.items()}
        return table_columns(self.dataset.take(indices), self.columns)


class TrainShard:
    """One worker's rows for one epoch, read once, handed out step by step."""

    def __init__(self, reader: SplitReader, plan: BatchPlan, seed: int):
        self.reader, self.plan, self.seed = reader, plan, seed
        self.steps_per_epoch = plan.steps_per_epoch(reader.num_rows)
        self._epoch: int | None = None

    def _load_epoch(self, epoch: int, first_position: int) -> None:
        order = epoch_order(self.seed, epoch, self.reader.num_rows)
        B = self.plan.global_batch_size
        parts = [self.plan.rank_part(order[j * B:(j + 1) * B]) for j in range(first_position, self.steps_per_epoch)]
        offsets = np.cumsum([0] + [len(p) for p in parts])
        rows = self.reader.take(np.concatenate(parts))
        # each step's part, cut once (a step then only looks its part up)
        self._batches = [{name: column[start:stop] for name, column in rows.items()}
                         for start, stop in zip(offsets[:-1], offsets[1:])]
        self._parts = parts
        self._digests = batch_digests(epoch * self.steps_per_epoch + np.arange(first_position, self.steps_per_epoch),
                                      np.stack(parts)).tolist()  # (a rank's part is the same length at every step)
        self._epoch, self._first = epoch, first_position

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This worker's part of global batch number `step` (counted from the start of the run)."""
        epoch, position = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch or position < self._first:
            self._load_epoch(epoch, position)
        return self._batches[position - self._first]

    def sample_ids(self, step: int) -> np.ndarray:
        """The split's row numbers in this worker's part of global batch `step` (after `batch(step)`)."""
        return self._parts[step % self.steps_per_epoch - self._first]

    def digest(self, step: int) -> int:
        return self._digests[step % self.steps_per_epoch - self._first]

    def close(self) -> None:
        """(Nothing is read ahead.)"""


def changed_shard(manifest: Manifest, chunk_bytes: int = 8 << 20) -> Optional[str]:
    """Why a shard of a prepared dataset is not what its manifest recorded, or None when every one
    is. Run once by the driver when it takes a prepared dataset (not per epoch, not per worker):
    the cheap checks first (the file is there, its size when recorded, the row count in its
    Parquet footer), then the SHA-256 of its bytes. Data read in place (no shards) is not checked."""
    fs, _ = storage.filesystem(manifest.root)
    shards = [(split, shard) for split, body in manifest.splits.items() for shard in body.get("shards", ())]
    paths = [storage.filesystem(storage.join(manifest.root, shard["path"]))[1] for _, shard in shards]
    infos = fs.get_file_info(paths) if paths else []
    for (split, shard), path, info in zip(shards, paths, infos):
        if info.type != pafs.FileType.File:
            return f"shard {shard['path']} is missing"
        if shard.get("bytes") is not None and info.size != shard["bytes"]:
            return f"shard {shard['path']} has {info.size} bytes, {shard['bytes']} when it was prepared"
    for (split, shard), path in zip(shards, paths):
        try:
            rows = pq.ParquetFile(fs.open_input_file(path)).metadata.num_rows
        except (OSError, ValueError, pa.ArrowException) as exc:
            return f"shard {shard['path']} is not a readable Parquet file ({first_line(exc, 120)})"
        if rows != shard["rows"]:
            return f"shard {shard['path']} has {rows} rows, {shard['rows']} when it was prepared"
    for (split, shard), path in zip(shards, paths):
        digest = hashlib.sha256()
        with fs.open_input_stream(path) as stream:
            while chunk := stream.read(chunk_bytes):
                digest.update(chunk)
        if digest.hexdigest() != shard["sha256"]:
            return (f"shard {shard['path']} has SHA-256 {digest.hexdigest()[:12]}..., "
                    f"{shard['sha256'][:12]}... when it was prepared")
    return None
