"""Each worker's share of each global batch, in an order that is a pure function of (seed, epoch).

The sample order never depends on the world size: global batch `j` of epoch `e` is always
`epoch_order(seed, e, n)[j * B:(j + 1) * B]`. A worker of rank r in a group of W takes the r-th of
W near-equal contiguous parts of it. So a run that shrinks from 4 workers to 2 still sees the same
sequence of global batches, and a run resumed at step s reads exactly what it would have read.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from training import storage
from training.data.prepare import Manifest


def epoch_order(seed: int, epoch: int, num_rows: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 0x5EED]).permutation(num_rows)


# The data digest: a running sum over steps of a hash of (step, sample id) for every sample of every
# global batch, kept below 2**40 (exact as a float64 metric, and as a float64 sum over 8192
# workers). Order-free within a step, so each worker hashes its own part and the parts add up to
# the global batch's; two runs with equal digests at a step saw the same global batches up to it,
# whatever their world sizes, restarts or resizes.
DIGEST_MODULUS = 1 << 40


def batch_digest(step: int, sample_ids: np.ndarray) -> int:
    """This part of global batch `step`'s contribution to the data digest (splitmix64 of each id)."""
    with np.errstate(over="ignore"):
        z = (np.asarray(sample_ids, dtype=np.uint64) + np.uint64(step) * np.uint64(0x9E3779B97F4A7C15))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return int(np.sum(z >> np.uint64(24), dtype=np.uint64)) % DIGEST_MODULUS


@dataclass(frozen=True)
class BatchPlan:
    """How one global batch is divided across workers and micro-batches."""

    global_batch_size: int
    world_size: int
    rank: int
    micro_batch_size: int | None = None

    def rank_part(self, global_batch: np.ndarray) -> np.ndarray:
        return np.array_split(global_batch, self.world_size)[self.rank]

    def micro_batches(self, part_size: int) -> list[slice]:
        size = self.micro_batch_size or max(part_size, 1)
        return [slice(start, min(start + size, part_size)) for start in range(0, part_size, size)]

    def steps_per_epoch(self, num_rows: int) -> int:
        steps = num_rows // self.global_batch_size
        if steps < 1:
            raise ValueError(f"train.global_batch_size {self.global_batch_size} is larger than the "
                             f"{num_rows} training rows")
        return steps


# A split whose decoded rows fit in this many bytes is read once and kept in memory: a small
# dataset's epochs are then cut from memory, as a hand-written loop would (digits: 4% of step time
# went to re-reading its Parquet every 22 steps). Larger splits are read epoch by epoch.
IN_MEMORY_LIMIT_BYTES = 256 << 20


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


class SplitReader:
    """Reads rows of one split by index from its Parquet shards (local or s3://); a small split
    is read whole, once (see IN_MEMORY_LIMIT_BYTES)."""

    def __init__(self, manifest: Manifest, split: str, in_memory_limit_bytes: int = IN_MEMORY_LIMIT_BYTES):
        fs, _ = storage.filesystem(manifest.root)
        paths = [storage.filesystem(uri)[1] for uri in manifest.shard_uris(split)]
        self.dataset = pads.dataset(paths, filesystem=fs, format="parquet")
        self.task = manifest.task
        self.num_rows = manifest.rows(split)
        width = row_bytes(self.dataset.schema)
        small = width is not None and width * self.num_rows <= in_memory_limit_bytes
        self._table = self.dataset.to_table() if small else None

    def take(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        indices = np.asarray(indices, dtype=np.int64)
        table = self._table.take(indices) if self._table is not None else self.dataset.take(indices)
        if self.task == "classification":
            column = table.column("x").combine_chunks()
            width = column.type.list_size
            x = column.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)
            return {"x": torch.from_numpy(np.array(x, dtype=np.float32)),
                    "y": torch.from_numpy(table.column("y").to_numpy().astype(np.int64))}
        column = table.column("tokens").combine_chunks()
        tokens = column.flatten().to_numpy(zero_copy_only=False).reshape(-1, column.type.list_size)
        return {"tokens": torch.from_numpy(tokens.astype(np.int64))}


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
        self._offsets = np.cumsum([0] + [len(p) for p in parts])
        self._rows = self.reader.take(np.concatenate(parts))
        self._parts = parts
        self._epoch, self._first = epoch, first_position

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """This worker's part of global batch number `step` (counted from the start of the run)."""
        epoch, position = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch or position < self._first:
            self._load_epoch(epoch, position)
        k = position - self._first
        start, stop = self._offsets[k], self._offsets[k + 1]
        return {name: column[start:stop] for name, column in self._rows.items()}

    def sample_ids(self, step: int) -> np.ndarray:
        """The split's row numbers in this worker's part of global batch `step` (after `batch(step)`)."""
        return self._parts[step % self.steps_per_epoch - self._first]


def validation_part(reader: SplitReader, world_size: int, rank: int) -> dict[str, torch.Tensor]:
    indices = np.array_split(np.arange(reader.num_rows), world_size)[rank]
    return reader.take(indices)


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
            return f"shard {shard['path']} is not a readable Parquet file ({str(exc).splitlines()[0][:120]})"
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
