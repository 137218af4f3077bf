"""Streaming order for data that does not fit in memory: global batches drawn from a fixed number of
data partitions, read a row group at a time, with a bounded shuffle window.

The order is a pure function of (the row-group index, seed, epoch, number of partitions, window),
never of the world size, so every guarantee of the in-memory path holds:

1. Each epoch, the row groups are shuffled (seeded) and dealt to `P` partitions, each to the one
   with the fewest rows so far: partitions end up within one row group of each other in size.
2. A partition's stream is its row groups in dealt order, cut into windows of `window` row groups;
   the rows of each window are permuted (seeded). Position i of a stream is therefore known from
   the row counts alone, without reading any data.
3. Global batch j takes positions [j * b_p, (j + 1) * b_p) of every partition p's stream, where
   b_p are the near-equal parts of the global batch size B over P, and concatenates them in
   partition order. A worker of rank r in W takes the r-th of W near-equal contiguous parts of
   that, as the in-memory path does; when W divides P (and P divides B) that is exactly the
   streams of P / W partitions, so each worker reads 1/W of the epoch; otherwise it also reads the
   row groups of the partitions cut at its part's two ends.
4. Every epoch has the same number of steps, known from the index: dealt to the smallest,
   no partition has fewer than (rows / P - the largest row group) rows, and an epoch takes that
   many (rounded down to whole batches) from each. What is left of each partition (at most about
   one row group and a batch) is not read that epoch; the next epoch's deal differs.

A step's rows are known from the index alone, so a resume at any step reads exactly what it would
have read, and a resize changes which worker reads a row, never which global batch it is in.
Memory per worker: the windows of the partitions it reads, plus `prefetch` row groups ahead.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class RowGroup:
    file: int  # index into the split's file list
    index: int  # row group number within the file
    rows: int


def deal(row_groups: Sequence[RowGroup], seed: int, epoch: int, partitions: int) -> list[list[int]]:
    """Row group ids (positions in `row_groups`) of each partition for this epoch, in stream order."""
    order = np.random.default_rng([seed, epoch, 0xDEA1]).permutation(len(row_groups))
    dealt: list[list[int]] = [[] for _ in range(partitions)]
    sizes = np.zeros(partitions, dtype=np.int64)
    for group in order:
        target = int(np.argmin(sizes))  # the first of the smallest: deterministic
        dealt[target].append(int(group))
        sizes[target] += row_groups[group].rows
    return dealt


def batch_parts(global_batch_size: int, partitions: int) -> np.ndarray:
    """How many rows of each partition one global batch takes."""
    return np.array([len(p) for p in np.array_split(np.arange(global_batch_size), partitions)], dtype=np.int64)


class PartitionStream:
    """One partition's rows for one epoch: position -> (row group id, row within it)."""

    def __init__(self, groups: list[int], row_groups: Sequence[RowGroup], seed: int, epoch: int, partition: int,
                 window: int):
        self.groups = groups
        counts = np.array([row_groups[g].rows for g in groups], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])  # first position of each row group
        self.rows = int(self.starts[-1])
        self.window, self.seed, self.epoch, self.partition = window, seed, epoch, partition
        self._perms: dict[int, np.ndarray] = {}

    def _window_bounds(self, w: int) -> tuple[int, int]:
        first, last = w * self.window, min((w + 1) * self.window, len(self.groups))
        return int(self.starts[first]), int(self.starts[last])

    def _perm(self, w: int) -> np.ndarray:
        if w not in self._perms:
            lo, hi = self._window_bounds(w)
            rng = np.random.default_rng([self.seed, self.epoch, self.partition, w, 0x5EED])
            if len(self._perms) >= 2:  # the current window and the next (prefetch looks ahead)
                self._perms.pop(min(self._perms))
            self._perms[w] = rng.permutation(hi - lo)
        return self._perms[w]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row group id, row within the group) for each stream position."""
        group_slot = np.searchsorted(self.starts, positions, side="right") - 1
        windows = group_slot // self.window
        flat = np.empty(len(positions), dtype=np.int64)
        for w in np.unique(windows):
            lo, _ = self._window_bounds(int(w))
            mask = windows == w
            flat[mask] = lo + self._perm(int(w))[positions[mask] - lo]
        slots = np.searchsorted(self.starts, flat, side="right") - 1
        return np.asarray(self.groups, dtype=np.int64)[slots], flat - self.starts[slots]


class EpochPlan:
    """Where every row of every global batch of one epoch comes from."""

    def __init__(self, row_groups: Sequence[RowGroup], seed: int, epoch: int, partitions: int, window: int,
                 global_batch_size: int):
        self.parts = batch_parts(global_batch_size, partitions)
        dealt = deal(row_groups, seed, epoch, partitions)
        self.streams = [PartitionStream(g, row_groups, seed, epoch, p, window) for p, g in enumerate(dealt)]
        self.offsets = np.concatenate([[0], np.cumsum(self.parts)])  # partition p's slice of a batch

    def rows_of(self, position: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(row group ids, rows within them) of rows lo..hi of global batch `position`."""
        groups, rows = [], []
        for p, stream in enumerate(self.streams):
            a, b = max(lo, int(self.offsets[p])), min(hi, int(self.offsets[p + 1]))
            if a >= b:
                continue
            base = position * int(self.parts[p]) - int(self.offsets[p])
            g, r = stream.locate(np.arange(base + a, base + b, dtype=np.int64))
            groups.append(g)
            rows.append(r)
        if not groups:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return np.concatenate(groups), np.concatenate(rows)


def steps_per_epoch(row_groups: Sequence[RowGroup], partitions: int, global_batch_size: int) -> int:
    """Steps of every epoch: whole batches that the smallest possible partition holds."""
    if not row_groups:
        return 0
    total, largest = sum(g.rows for g in row_groups), max(g.rows for g in row_groups)
    smallest = total // partitions - largest
    return max(0, smallest // int(batch_parts(global_batch_size, partitions).max()))


class RowGroupCache:
    """Decoded row groups by id, the least recently used dropped past `capacity`; `load(id)`
    reads one. Row groups asked for ahead (`prefetch`) are read on a background thread."""

    def __init__(self, load: Callable[[int], dict[str, np.ndarray]], capacity: int, threads: int = 1):
        self._load, self.capacity = load, max(1, capacity)
        self._cache: OrderedDict[int, dict[str, np.ndarray] | Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="row-groups") if threads else None
        self.reads = 0

    def _read(self, group: int) -> dict[str, np.ndarray]:
        self.reads += 1
        return self._load(group)

    def prefetch(self, groups) -> None:
        if self._pool is None:
            return
        with self._lock:
            for group in groups:
                if group not in self._cache:
                    self._cache[group] = self._pool.submit(self._read, group)
            self._trim()

    def _trim(self) -> None:
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)

    def get(self, group: int) -> dict[str, np.ndarray]:
        with self._lock:
            entry = self._cache.get(group)
            if entry is not None:
                self._cache.move_to_end(group)
        if entry is None:
            value = self._read(group)
        elif isinstance(entry, Future):
            value = entry.result()
        else:
            return entry
        with self._lock:
            self._cache[group] = value
            self._cache.move_to_end(group)
            self._trim()
        return value

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def gather(cache: RowGroupCache, groups: np.ndarray, rows: np.ndarray) -> dict[str, np.ndarray]:
    """The rows (group, row) in the given order, column by column."""
    out: dict[str, np.ndarray] = {}
    unique = list(dict.fromkeys(groups.tolist()))
    for group in unique:
        cache.get(group)  # touch every group this batch needs before any can be dropped
    for group in unique:
        mask = groups == group
        columns = cache.get(group)
        for name, column in columns.items():
            if name not in out:
                out[name] = np.empty((len(groups),) + column.shape[1:], dtype=column.dtype)
            out[name][mask] = column[rows[mask]]
    return out


class StreamingShard:
    """One worker's part of each global batch, read row group by row group (the streaming
    counterpart of `loader.TrainShard`: the same `steps_per_epoch` and `batch(step)`)."""

    def __init__(self, row_groups: Sequence[RowGroup], load: Callable[[int], dict[str, np.ndarray]], plan,
                 seed: int, partitions: int, window: int, prefetch: int = 2, to_tensors=None):
        self.row_groups, self.plan, self.seed = list(row_groups), plan, seed
        self.partitions, self.window, self.prefetch_steps = partitions, window, prefetch
        self._to_tensors = to_tensors or (lambda columns: columns)
        self._epochs: dict[int, EpochPlan] = {}
        self._located: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # the steps being read and read ahead
        if partitions > plan.global_batch_size:
            raise ValueError(f"data.options.partitions {partitions} is more than train.global_batch_size "
                             f"{plan.global_batch_size}: every partition gives at least one row to each batch")
        self.steps_per_epoch = steps_per_epoch(self.row_groups, partitions, plan.global_batch_size)
        if self.steps_per_epoch < 1:
            raise ValueError(f"train.global_batch_size {plan.global_batch_size} is too large for the training rows "
                             f"over {partitions} partitions ({len(self.row_groups)} row groups): fewer partitions, "
                             "smaller row groups or a smaller batch")
        bounds = np.cumsum([0] + [len(p) for p in np.array_split(np.arange(plan.global_batch_size), plan.world_size)])
        self._lo, self._hi = int(bounds[plan.rank]), int(bounds[plan.rank + 1])
        # the windows of every partition this rank reads, and the next ones being prefetched
        touched = int(np.searchsorted(self._epoch(0).offsets, self._hi, side="left")
                      - np.searchsorted(self._epoch(0).offsets, self._lo, side="right") + 1)
        self.cache = RowGroupCache(load, capacity=max(1, touched) * window * 2 + prefetch)

    def _epoch(self, epoch: int) -> EpochPlan:
        if epoch not in self._epochs:
            plan = EpochPlan(self.row_groups, self.seed, epoch, self.partitions, self.window,
                             self.plan.global_batch_size)
            self._epochs = {k: v for k, v in self._epochs.items() if k >= epoch - 1}
            self._epochs[epoch] = plan
        return self._epochs[epoch]

    def locate(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(row group ids, rows within them) of this worker's part of global batch `step`."""
        if step not in self._located:
            epoch, position = divmod(step, self.steps_per_epoch)
            self._located = {k: v for k, v in self._located.items() if step - k <= 0 or k > step - 2}
            self._located[step] = self._epoch(epoch).rows_of(position, self._lo, self._hi)
        return self._located[step]

    def batch(self, step: int):
        """This worker's part of global batch number `step` (counted from the start of the run); the
        row groups of the next `prefetch` steps are read meanwhile."""
        groups, rows = self.locate(step)
        columns = gather(self.cache, groups, rows)
        ahead: dict[int, None] = {}
        for later in range(step + 1, step + 1 + self.prefetch_steps):
            ahead.update(dict.fromkeys(self.locate(later)[0].tolist()))
        self.cache.prefetch(ahead)
        return self._to_tensors(columns)
