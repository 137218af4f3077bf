"""Decoded row groups held for the streaming loader (on the workers: training/data/stream.py reads
through it), and the gather of a chunk's rows from them in their shuffled order."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import pyarrow as pa

from training.errors import DataError


def _empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An array in pyarrow's memory pool, as decoded row groups are: memory the pool keeps when a
    loader is closed, for the next (numpy's would go back to the system, and come again page by page)."""
    dtype = np.dtype(dtype)
    return np.frombuffer(pa.allocate_buffer(int(np.prod(shape)) * dtype.itemsize), dtype=dtype).reshape(shape)


class _Pending:
    """A row group's read in flight (on a background thread, `future`, or in the caller)."""

    future: Future | None = None


class RowGroupCache:
    """Decoded row groups by id, at most `capacity` of them, the least recently used dropped first;
    `load(id)` reads one. Row groups asked for ahead (`prefetch`) are read on background threads.

    Each row group's columns are copied as they arrive into a slot of one array per column
    (`slabs`: slots of `slot_rows` rows, the largest row group's): the rows of many row groups are
    then gathered by one `np.take` per column (`gather`), and the buffers a row group was decoded
    into are free for the next one at once. Only the rows written take memory. Row groups handed
    out by `get` are kept (not dropped, their slots not reused) until `release`."""

    def __init__(self, load: Callable[[int], dict[str, np.ndarray]], capacity: int, slot_rows: int,
                 threads: int = 1):
        self._load, self.capacity, self.slot_rows = load, max(1, capacity), max(1, slot_rows)
        self._cache: OrderedDict[int, int | _Pending] = OrderedDict()  # row group -> its slot, or its read
        self._slots = self.capacity
        self._free = list(range(self._slots))[::-1]  # (the last freed is used first: its pages are resident)
        self._held: set[int] = set()
        self.slabs: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="row-groups") if threads else None
        self.reads = 0

    def _read(self, group: int, pending: _Pending) -> int:
        """The row group read into a free slot, unless it was dropped meanwhile (-1)."""
        with self._lock:
            self.reads += 1
        try:
            columns = self._load(group)
        except BaseException:
            with self._lock:
                if self._cache.get(group) is pending and pending.future is None:
                    del self._cache[group]  # (read in the caller: the next get reads again)
            raise
        with self._lock:
            if self._cache.get(group) is not pending:
                return -1
            if not self._free:  # every slot held by a gather or a read: more of them, for now
                self._grow()
            slot = self._free.pop()
            self._store(group, slot, columns)
            self._cache[group] = slot
            return slot

    def _store(self, group: int, slot: int, columns: dict[str, np.ndarray]) -> None:
        for name, column in columns.items():
            if name not in self.slabs:
                self.slabs[name] = _empty((self._slots * self.slot_rows,) + column.shape[1:], column.dtype)
            slab = self.slabs[name]
            if column.shape[1:] != slab.shape[1:] or len(column) > self.slot_rows:
                raise DataError(f"row group {group}: column {name!r} has {len(column)} rows of shape "
                                f"{column.shape[1:]}, where the row groups before it had {slab.shape[1:]}")
            slab[slot * self.slot_rows:slot * self.slot_rows + len(column)] = column

    def _grow(self) -> None:
        for name, slab in self.slabs.items():
            grown = _empty((2 * len(slab),) + slab.shape[1:], slab.dtype)
            grown[:len(slab)] = slab  # (a gather under way keeps reading the old array)
            self.slabs[name] = grown
        self._free.extend(range(2 * self._slots - 1, self._slots - 1, -1))
        self._slots *= 2

    def prefetch(self, groups) -> None:
        if self._pool is None:
            return
        with self._lock:
            for group in groups:  # (those held already count as just used: wanted next, not dropped)
                if group in self._cache:
                    self._cache.move_to_end(group)
                else:
                    pending = self._cache[group] = _Pending()
                    pending.future = self._pool.submit(self._read, group, pending)
            self._trim()

    def _trim(self) -> None:
        excess = len(self._cache) - self.capacity
        for group in [g for g in self._cache if g not in self._held][:max(0, excess)]:
            entry = self._cache.pop(group)
            if isinstance(entry, int):
                self._free.append(entry)

    def get(self, group: int) -> int:
        """The row group's slot (read now, or waited for), held until `release`."""
        with self._lock:
            entry = self._cache.get(group)
            if entry is None:
                entry = self._cache[group] = _Pending()
            self._cache.move_to_end(group)
            self._held.add(group)
            self._trim()
        if isinstance(entry, int):
            return entry
        slot = entry.future.result() if entry.future is not None else self._read(group, entry)
        assert slot >= 0, "a held row group was dropped"
        return slot

    def columns(self) -> dict[str, np.ndarray]:
        with self._lock:
            return dict(self.slabs)

    def release(self) -> None:
        with self._lock:
            self._held.clear()
            self._trim()

    def close(self, wait: bool = False) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)


def distinct(groups: np.ndarray) -> np.ndarray:
    """The ids in `groups`, ascending, once each (counted, when they lie close together as a
    chunk's row groups mostly do)."""
    if not groups.size:
        return groups.ravel()
    low = int(groups.min())
    if int(groups.max()) - low < 2**16:
        return np.flatnonzero(np.bincount((groups - low).ravel())) + low
    return np.unique(groups)


def _take_rows(array: np.ndarray, index: np.ndarray) -> np.ndarray:
    """array[index] along the first axis; a row of many values is taken as one opaque item (a
    memcpy each, where numpy would walk its values). The index is in range by construction (a slot's
    first row plus a row within the group): numpy's default mode, which checks every index and
    raises, takes about 1.6x as long as "clip"."""
    rows = array.reshape(len(array), -1)
    if array.ndim == 1 or not rows.shape[1]:
        return np.take(array, index, axis=0, mode="clip")
    opaque = rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize))).reshape(-1)
    return np.take(opaque, index, mode="clip").view(array.dtype).reshape((len(index),) + array.shape[1:])


def gather(cache: RowGroupCache, groups: np.ndarray, rows: np.ndarray) -> dict[str, np.ndarray]:
    """The rows (group, row) in the given order, column by column: one `np.take` per column from
    the cache's slots, each row copied once."""
    unique = distinct(groups)
    wanted = unique.tolist()
    cache.prefetch(wanted)  # what is not read yet: on the background threads, at once
    try:
        first = np.array([cache.get(g) for g in wanted], dtype=np.int64) * cache.slot_rows  # held while taken
        if len(wanted) and wanted[-1] - wanted[0] < 2**16:  # (a table by id: a pass, where a search takes five)
            table = np.empty(wanted[-1] - wanted[0] + 1, dtype=np.int64)
            table[unique - wanted[0]] = first
            index = table[groups - wanted[0]]
        else:
            index = first[np.searchsorted(unique, groups)]
        index += rows  # (in place: each temporary of a chunk's size is new memory, faulted in page by page)
        return {name: _take_rows(slab, index) for name, slab in cache.columns().items()}
    finally:
        cache.release()
