"""Streaming order for data that does not fit in memory (on the workers): global batches drawn from a fixed number of
data partitions, read a row group at a time, with a bounded shuffle window.

The order is a pure function of (the row-group index, seed, epoch, number of partitions, window),
never of the world size, so every guarantee of the in-memory path holds:

1. Each epoch, the row groups are shuffled (seeded), laid end to end, and cut into `P` partitions of
   equal rows (to one row): a partition is a list of segments, each a run of rows of one row group;
   a row group at a cut is shared by the two partitions on either side of it.
2. A partition's stream is its segments in order, cut into windows of `window` segments; the rows
   of each window are permuted (seeded). Position i of a stream is therefore known from the row
   counts alone, without reading any data.
3. Global batch j takes positions [j * b_p, (j + 1) * b_p) of every partition p's stream, where
   b_p are the near-equal parts of the global batch size B over P, and concatenates them in
   partition order. A worker of rank r in W takes the r-th of W near-equal contiguous parts of
   that, as the in-memory path does; when W divides P (and P divides B) that is exactly the
   streams of P / W partitions, so each worker reads 1/W of the epoch (and the row groups cut at
   its partitions' two ends); otherwise it also reads the row groups of the partitions cut at its
   part's two ends.
4. Every epoch has the same number of steps, known from the row count alone: each partition holds
   at least rows // P rows, and an epoch takes (rows // P) // max(b_p) batches' worth from each.
   What is left of each partition (less than a batch's part) is not read that epoch; the next
   epoch's order differs.

A step's rows are known from the index alone, so a resume at any step reads exactly what it would
have read, and a resize changes which worker reads a row, never which global batch it is in.
Memory per worker: about three windows of each partition it reads (the one being read, the one a
chunk of steps reaches into, the next one read ahead), whatever the dataset's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from training.data.order import batch_digests, part_bounds
from training.data.row_group_cache import RowGroupCache, distinct, gather

# The rows a worker gathers at once, in bytes: the costs of a chunk (locating its rows, a call per
# row group and column) spread over many steps, for two chunks' memory (the one read, the one used).
CHUNK_BYTES = 8 * 2**20


@dataclass(frozen=True)
class RowGroup:
    file: int  # index into the split's file list
    index: int  # row group number within the file
    rows: int


def deal(row_groups: Sequence[RowGroup], seed: int, epoch: int, partitions: int) -> list[list[tuple[int, int, int]]]:
    """Each partition's segments for this epoch, in stream order: (row group id, first row, rows)."""
    order = np.random.default_rng([seed, epoch, 0xDEA1]).permutation(len(row_groups))
    sizes = np.array([row_groups[g].rows for g in order], dtype=np.int64)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    total = int(ends[-1]) if len(ends) else 0
    cuts = [p * total // partitions for p in range(partitions + 1)]
    dealt: list[list[tuple[int, int, int]]] = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        first, last = int(np.searchsorted(ends, lo, side="right")), int(np.searchsorted(starts, hi, side="left"))
        dealt.append([(int(order[i]), max(lo, int(starts[i])) - int(starts[i]),
                       min(hi, int(ends[i])) - max(lo, int(starts[i])))
                      for i in range(first, last) if min(hi, int(ends[i])) > max(lo, int(starts[i]))])
    return dealt


def batch_parts(global_batch_size: int, partitions: int) -> np.ndarray:
    """How many rows of each partition one global batch takes."""
    return np.diff([part_bounds(global_batch_size, partitions, p)[0] for p in range(partitions + 1)]).astype(np.int64)


class PartitionStream:
    """One partition's rows for one epoch: position -> (row group id, row within it)."""

    def __init__(self, segments: list[tuple[int, int, int]], seed: int, epoch: int, partition: int, window: int):
        self.groups = np.array([g for g, _, _ in segments], dtype=np.int64)
        self.first_rows = np.array([first for _, first, _ in segments], dtype=np.int64)
        self.counts = np.array([n for _, _, n in segments], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)])  # first position of each segment
        self._shift = self.first_rows - self.starts[:-1]  # a position's row in its group, less the position
        self.rows = int(self.starts[-1])
        self.window, self.seed, self.epoch, self.partition = window, seed, epoch, partition
        self._windows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        largest = max(int(self.groups.max(initial=0)), int((self.first_rows + self.counts).max(initial=0)))
        self._table_type = np.int32 if largest < 2**31 else np.int64  # (a window's tables: 8 bytes a row)

    def _window_bounds(self, w: int) -> tuple[int, int]:
        first, last = w * self.window, min((w + 1) * self.window, len(self.groups))
        return int(self.starts[first]), int(self.starts[last])

    def _window(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        """(row group id, row within it) of each position of window w, from its first: the window's
        rows permuted (seeded), worked out once for the chunks that read the window."""
        if w not in self._windows:
            lo, hi = self._window_bounds(w)
            flat = np.random.default_rng([self.seed, self.epoch, self.partition, w, 0x5EED]).permutation(hi - lo)
            first, last = w * self.window, min((w + 1) * self.window, len(self.groups))
            slots = np.repeat(np.arange(first, last), self.counts[first:last])[flat]  # each row's segment
            flat += lo
            if len(self._windows) >= 3:  # a chunk's windows and the next chunk's (read ahead)
                self._windows.pop(min(self._windows))
            self._windows[w] = (self.groups[slots].astype(self._table_type),
                                np.add(self._shift[slots], flat, dtype=self._table_type))
        return self._windows[w]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row group id, row within the group) for each stream position, the positions ascending
        (as a chunk's are: each window's positions are then one slice)."""
        groups, rows = np.empty(len(positions), dtype=np.int64), np.empty(len(positions), dtype=np.int64)
        if len(positions):
            first, last = (np.searchsorted(self.starts, positions[[0, -1]], side="right") - 1) // self.window
            for w in range(int(first), int(last) + 1):
                lo, hi = self._window_bounds(w)
                a, b = np.searchsorted(positions, (lo, hi))
                window_groups, window_rows = self._window(w)
                if b > a and positions[b - 1] - positions[a] == b - a - 1:  # a run of positions: a slice
                    at = slice(int(positions[a]) - lo, int(positions[b - 1]) - lo + 1)
                else:
                    at = positions[a:b] - lo
                groups[a:b], rows[a:b] = window_groups[at], window_rows[at]
        return groups, rows

    def locate_run(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """`locate` of positions start..stop: slices of the windows' tables."""
        assert 0 <= start <= stop <= self.rows, f"positions {start}..{stop} outside a stream of {self.rows} rows"
        groups, rows = np.empty(stop - start, dtype=np.int64), np.empty(stop - start, dtype=np.int64)
        w = int(np.searchsorted(self.starts, start, side="right") - 1) // self.window
        position = start
        while position < stop:
            lo, hi = self._window_bounds(w)
            end = min(stop, hi)
            window_groups, window_rows = self._window(w)
            groups[position - start:end - start] = window_groups[position - lo:end - lo]
            rows[position - start:end - start] = window_rows[position - lo:end - lo]
            position, w = end, w + 1
        return groups, rows


class EpochPlan:
    """Where every row of every global batch of one epoch comes from."""

    def __init__(self, row_groups: Sequence[RowGroup], seed: int, epoch: int, partitions: int, window: int,
                 global_batch_size: int):
        self.parts = batch_parts(global_batch_size, partitions)
        dealt = deal(row_groups, seed, epoch, partitions)
        self.streams = [PartitionStream(segments, seed, epoch, p, window) for p, segments in enumerate(dealt)]
        self.offsets = np.concatenate([[0], np.cumsum(self.parts)])  # partition p's slice of a batch

    def rows_of(self, first: int, count: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(row group ids, rows within them) of rows lo..hi of global batches first..first+count,
        batch after batch, each in partition order: shape (count, hi - lo)."""
        groups, rows = np.empty((count, hi - lo), np.int64), np.empty((count, hi - lo), np.int64)
        for p, stream in enumerate(self.streams):
            a, b = max(lo, int(self.offsets[p])), min(hi, int(self.offsets[p + 1]))
            if a >= b:
                continue
            part = int(self.parts[p])
            if b - a == part:  # the partition's whole part of each batch: a run of its stream
                g, r = stream.locate_run(first * part, (first + count) * part)
            else:
                steps = np.arange(first, first + count, dtype=np.int64)[:, None]
                positions = steps * part + np.arange(a - int(self.offsets[p]), b - int(self.offsets[p]))
                g, r = stream.locate(positions.ravel())
            groups[:, a - lo:b - lo], rows[:, a - lo:b - lo] = g.reshape(count, -1), r.reshape(count, -1)
        return groups, rows

    def groups_ahead(self, step: int, lo: int, hi: int) -> list[int]:
        """Row group ids of the window after the one that global batch `step` reads, in each partition
        that rows lo..hi of a batch come from: what to read ahead of time (a window is wanted all at
        once, since its rows are permuted across its row groups)."""
        ahead: list[int] = []
        for p, stream in enumerate(self.streams):
            a, b = max(lo, int(self.offsets[p])), min(hi, int(self.offsets[p + 1]))
            if a >= b:
                continue
            position = min(step * int(self.parts[p]), stream.rows - 1)
            window = int(np.searchsorted(stream.starts, position, side="right") - 1) // stream.window
            ahead.extend(stream.groups[(window + 1) * stream.window:(window + 2) * stream.window].tolist())
        return ahead


def steps_per_epoch(row_groups: Sequence[RowGroup], partitions: int, global_batch_size: int) -> int:
    """Steps of every epoch: whole batches that the smallest partition holds (rows // P rows)."""
    total = sum(g.rows for g in row_groups)
    return (total // partitions) // int(batch_parts(global_batch_size, partitions).max())


class StreamingShard:
    """One worker's part of each global batch, read row group by row group (the streaming
    counterpart of `shards.TrainShard`: the same `steps_per_epoch` and `batch(step)`).

    Steps are located and gathered a chunk at a time (a vectorised pass over as many steps as fit in
    a window's rows), and, with `read_ahead`, the next chunk's row groups are read on a background
    thread while this chunk trains (`read_threads` of them, each reading a row group at a time)."""

    def __init__(self, row_groups: Sequence[RowGroup], load: Callable[[int], dict[str, np.ndarray]], plan,
                 seed: int, partitions: int, window: int, read_ahead: bool = True, read_threads: int = 2,
                 on_close: Callable[[], None] | None = None):
        self.row_groups, self.plan, self.seed = list(row_groups), plan, seed
        self._on_close = on_close
        self.partitions, self.window, self.read_ahead = partitions, window, read_ahead
        self._epochs: dict[int, EpochPlan] = {}
        if partitions > plan.global_batch_size:
            raise ValueError(f"data.options.partitions {partitions} is more than train.global_batch_size "
                             f"{plan.global_batch_size}: every partition gives at least one row to each batch")
        self.steps_per_epoch = steps_per_epoch(self.row_groups, partitions, plan.global_batch_size)
        if self.steps_per_epoch < 1:
            raise ValueError(f"train.global_batch_size {plan.global_batch_size} is too large for the training rows "
                             f"over {partitions} partitions ({len(self.row_groups)} row groups): fewer partitions, "
                             "smaller row groups or a smaller batch")
        self._lo, self._hi = plan.bounds
        # A chunk takes at most a window's rows of each partition (the smallest row groups counted),
        # and about CHUNK_BYTES of rows once their size is known (at most 64 steps until then).
        smallest = min(g.rows for g in self.row_groups)
        self._window_steps = max(1, window * smallest // int(batch_parts(plan.global_batch_size, partitions).max()))
        self.chunk_steps = min(self._window_steps, 64)
        # the rank's partitions: the windows a chunk reads, the ones a chunk reaches into, the next ones
        touched = int(np.searchsorted(self._epoch(0).offsets, self._hi, side="left")
                      - np.searchsorted(self._epoch(0).offsets, self._lo, side="right") + 1)
        self.cache = RowGroupCache(load, capacity=max(1, touched) * window * 3,
                                   slot_rows=max(g.rows for g in self.row_groups),
                                   threads=read_threads if read_ahead else 0)
        self._group_start = np.cumsum([0] + [g.rows for g in self.row_groups])  # sample id = start + row
        self._chunk: tuple[int, int, dict[str, np.ndarray]] | None = None  # (first step, steps, columns)
        self._chunk_ids: np.ndarray | None = None  # (steps, rows of this worker's part)
        self._next: tuple[int, int, np.ndarray, np.ndarray] | None = None  # the located chunk after it

    def _epoch(self, epoch: int) -> EpochPlan:
        if epoch not in self._epochs:
            plan = EpochPlan(self.row_groups, self.seed, epoch, self.partitions, self.window,
                             self.plan.global_batch_size)
            self._epochs = {k: v for k, v in self._epochs.items() if k >= epoch - 1}
            self._epochs[epoch] = plan
        return self._epochs[epoch]

    def _locate_chunk(self, step: int) -> tuple[int, int, np.ndarray, np.ndarray]:
        """The chunk starting at `step` (never across an epoch's end): (step, steps, groups, rows)."""
        if self._next is not None and self._next[0] == step:
            return self._next
        epoch, position = divmod(step, self.steps_per_epoch)
        count = min(self.chunk_steps, self.steps_per_epoch - position)
        groups, rows = self._epoch(epoch).rows_of(position, count, self._lo, self._hi)
        return step, count, groups, rows

    def locate(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(row group ids, rows within them) of this worker's part of global batch `step`."""
        epoch, position = divmod(step, self.steps_per_epoch)
        groups, rows = self._epoch(epoch).rows_of(position, 1, self._lo, self._hi)
        return groups[0], rows[0]

    def batch(self, step: int):
        """This worker's part of global batch number `step` (counted from the start of the run)."""
        if self._chunk is None or not self._chunk[0] <= step < self._chunk[0] + self._chunk[1]:
            first, count, groups, rows = self._locate_chunk(step)
            columns = gather(self.cache, groups.ravel(), rows.ravel())
            step_bytes = sum(v.nbytes for v in columns.values()) // count
            self.chunk_steps = int(np.clip(CHUNK_BYTES // max(1, step_bytes), 1, self._window_steps))
            self._chunk = (first, count, {k: v.reshape((count, -1) + v.shape[1:]) for k, v in columns.items()})
            self._chunk_ids = self._group_start[groups]
            self._chunk_ids += rows
            self._chunk_digests = batch_digests(np.arange(first, first + count), self._chunk_ids)
            if self.read_ahead:
                self._next = self._locate_chunk(first + count)
                epoch, position = divmod(first + count - 1, self.steps_per_epoch)
                self.cache.prefetch(dict.fromkeys(distinct(self._next[2]).tolist()
                                                  + self._epoch(epoch).groups_ahead(position, self._lo, self._hi)))
        first, _, columns = self._chunk
        return {k: v[step - first] for k, v in columns.items()}

    def sample_ids(self, step: int) -> np.ndarray:
        """The split's row numbers (in index order) in this worker's part of global batch `step`
        (after `batch(step)`)."""
        return self._chunk_ids[step - self._chunk[0]]

    def digest(self, step: int) -> int:
        """This worker's part of global batch `step`'s data digest (after `batch(step)`)."""
        return int(self._chunk_digests[step - self._chunk[0]])

    def close(self, wait: bool = False) -> None:
        """Stops reading ahead; `wait`: until the read threads have ended (a read in flight ends
        first: those waiting to retry give up at once)."""
        if self._on_close is not None:
            self._on_close()  # (before the pool's shutdown: a read waiting to retry ends now)
        self.cache.close(wait)
