"""Reading row groups of indexed Parquet files by row-group id (on the workers, for the streaming
loader that training/data/stream.py orders; on the driver, a first row group and validation rows).

A read's failure is one of two kinds (`read_failure`): storage that failed for a while (a dropped
connection, a throttled request, an endpoint restarting), retried with backoff; or one that reads
the same the next time (a corrupt page, bytes that are not Parquet, a file gone or changed, the
process out of file descriptors), a DataError at once: retrying it only delays the same failure."""

from __future__ import annotations

import errno
import logging
import re
import resource
import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from training import storage
from training.backoff import RetryPolicy
from training.data.parquet_index import Columns
from training.data.stream import RowGroup
from training.errors import DataError, StorageUnavailable, first_line
from training.redaction import redact
from training.retry import Retrier

# a row group's read during training: a storage outage of up to about two minutes is waited out
READ_RETRY = RetryPolicy(attempts=8, first_delay_s=1.0, max_delay_s=30.0, budget_s=120.0)
# Files a reader keeps open, all its read threads together. Row groups are read in a shuffled order,
# so a file's next row group is rarely close behind; a few open files spare most reopenings of a
# window's files, and the limit keeps a dataset of any number of files within the descriptor limit.
MAX_OPEN_FILES = 16

# pyarrow reports undecodable bytes as an OSError, like a storage failure: these are its messages
# for a page, a footer or compressed data that does not decode (the same bytes fail the same way).
_UNDECODABLE = re.compile(r"deserialize thrift|page header|magic bytes|unexpected end of (stream|file)|codec failed|"
                          r"corrupt|decompress|codec|checksum|not a parquet|parquet file size", re.IGNORECASE)

# what pyarrow raises for bytes that decode to something the schema does not allow
_DECODING = (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, pa.ArrowIndexError, pa.ArrowKeyError,
             pa.ArrowSerializationError, pa.ArrowCapacityError)

log = logging.getLogger(__name__)


def read_failure(exc: BaseException) -> Optional[str]:
    """"transient" (retry: the storage may answer the next time), "deterministic" (the same read
    fails the same way: stop), or None (not a read's failure, e.g. out of memory: raised as it is)."""
    if isinstance(exc, OSError):
        if exc.errno in (errno.EMFILE, errno.ENFILE) or _UNDECODABLE.search(str(exc)):
            return "deterministic"
        return "transient"
    if isinstance(exc, _DECODING):
        return "deterministic"
    return None


def row_groups(split: dict[str, Any]) -> list[RowGroup]:
    return [RowGroup(f, g, rows) for f, file in enumerate(split["files"]) for g, rows in enumerate(file["row_groups"])
            if rows > 0]


class OpenFile:
    """A file open for reading: its handle, and its Parquet reader over it (footer read)."""

    def __init__(self, handle: pa.NativeFile, pre_buffer: bool):
        try:
            self.file = pq.ParquetFile(handle, pre_buffer=pre_buffer)
        except BaseException:
            handle.close()
            raise
        self.handle = handle


class OpenFiles:
    """The files of one split open for reading, shared by the read threads: a file is read by one
    thread at a time (a second read of it at once opens it again), and at most `capacity` stay
    open between reads, the least recently used closed first. `close` closes every one (those in
    use when their reads end)."""

    def __init__(self, opener, capacity: int = MAX_OPEN_FILES):
        self._opener, self.capacity = opener, max(1, capacity)
        self._lock = threading.Lock()
        self._idle: OrderedDict[int, OpenFile] = OrderedDict()
        self._closed = False

    @contextmanager
    def use(self, index: int) -> Iterator[pq.ParquetFile]:
        """The file, open for this read alone; on an OSError it is closed (opened again next time)."""
        with self._lock:
            entry = self._idle.pop(index, None)
        if entry is None:
            entry = self._opener(index)  # (outside the lock: storage round trips)
        keep = True
        try:
            yield entry.file
        except OSError:
            keep = False
            raise
        finally:
            self._release(index, entry, keep)

    def _release(self, index: int, entry: OpenFile, keep: bool) -> None:
        with self._lock:
            if keep and not self._closed and index not in self._idle:
                self._idle[index] = entry
                entry = None
            while len(self._idle) > self.capacity:
                self._idle.popitem(last=False)[1].handle.close()
        if entry is not None:
            entry.handle.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle.values()), OrderedDict()
        for entry in idle:
            entry.handle.close()


class FileReader:
    """Reads row groups of one split's files by row-group id (see `row_groups`).

    During a run the files must stay as they were indexed: a file that is gone, or whose size is not
    the indexed one, fails the read with a DataError naming it (never a silent skip; a resume then
    names it too: see the parquet source's check_unchanged), and so does a row group that does not
    decode. A storage error (a dropped connection, a throttled request, an endpoint restarting) is
    retried with backoff and logged, within `retry` for each row group's read, with the file opened
    again. At most `max_open_files` files are open at once (`OpenFiles`); `close` closes them."""

    def __init__(self, split: dict[str, Any], columns: Columns, retry: RetryPolicy = READ_RETRY,
                 max_open_files: int = MAX_OPEN_FILES):
        self.files, self.columns, self.retry = split["files"], columns, retry
        self.groups = row_groups(split)
        self.open_files = OpenFiles(self._open, max_open_files)
        self._closed = threading.Event()
        self._filesystems: dict[str, pafs.FileSystem] = {}
        self._paths: dict[int, tuple[pafs.FileSystem, str]] = {}

    def close(self) -> None:
        """Closes the open files; reads waiting to retry give up at once (a closed loader's
        read-ahead threads end)."""
        self._closed.set()
        self.open_files.close()

    def _check(self, index: int) -> None:
        """The file is there, at its indexed size: checked at every read, the file open or not (an
        open local file stays readable when deleted or rewritten, an open object on S3 does not)."""
        entry = self.files[index]
        fs, path = self._path(index)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(path)
        if entry.get("size") is not None and info.size != entry["size"]:
            raise DataError(f"{redact(entry['uri'])} changed during the run (size {entry['size']} -> "
                            f"{info.size} bytes): "
                            "training data must stay as it was when the run started; restore the file, or "
                            "start a new run (--name) on the data as it is now")

    def _open(self, index: int) -> OpenFile:
        fs, path = self._path(index)
        # Object stores: a row group's column chunks fetched in a few coalesced requests, on pyarrow's
        # I/O threads; a local file is read in place, on this thread, without the hand-offs.
        return OpenFile(fs.open_input_file(path), pre_buffer=storage.is_remote(self.files[index]["uri"]))

    def _path(self, index: int) -> tuple[pafs.FileSystem, str]:
        """The file's filesystem and path there, worked out at its first read (each read checks it)."""
        if index not in self._paths:
            self._paths[index] = self._resolve(index)
        return self._paths[index]

    def _resolve(self, index: int) -> tuple[pafs.FileSystem, str]:
        """One filesystem per bucket (an S3 client is costly to make, and each keeps its connections)."""
        uri = self.files[index]["uri"]
        if not storage.is_remote(uri) or "?" in uri:  # (options in the URI: pyarrow reads them)
            return storage.filesystem(uri)
        bucket = "/".join(uri.split("/", 3)[:3])  # scheme://bucket
        if bucket not in self._filesystems:
            self._filesystems[bucket] = storage.filesystem(uri)[0]
        return self._filesystems[bucket], storage.object_path(uri)  # (an object store's path: bucket/key)

    def load(self, group_id: int) -> dict[str, np.ndarray]:
        group = self.groups[group_id]
        uri = redact(self.files[group.file]["uri"])  # (for messages: a URI may carry a key)
        where = f"{uri} (row group {group.index})"

        def read() -> pa.Table:
            try:
                self._check(group.file)
                with self.open_files.use(group.file) as file:
                    # (one thread decodes each row group: the loader's read threads are the parallelism)
                    return file.read_row_group(group.index, columns=self.columns.read(), use_threads=False)
            except FileNotFoundError:
                raise DataError(f"{uri} is gone: deleted or moved during the run. Training data must stay where "
                                "it was when the run started; restore it and resume the run (the same --name), "
                                "or start a new run on the data as it is now") from None
            except DataError:
                raise
            except Exception as exc:
                if read_failure(exc) != "deterministic":
                    raise
                raise _data_error(where, exc) from None

        def give_up(what: str, failures: int, elapsed_s: float, exc: BaseException) -> StorageUnavailable:
            return StorageUnavailable(f"{what} failed {failures} times in {elapsed_s:.0f} s; giving up: "
                                      f"{first_line(exc, 200)}")

        def wait(seconds: float) -> None:
            if self._closed.wait(seconds):
                raise StorageUnavailable(f"reading {uri}: the loader was closed while the read waited to retry")

        table = Retrier(self.retry, give_up, log, sleep=wait).run(read, f"reading {where}")
        try:
            return self.columns.arrays(table)
        except DataError as exc:
            raise (exc if uri in str(exc) else DataError(f"{where}: {exc}")) from None

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Rows by position in the split (files in order, row groups in order)."""
        starts = np.cumsum([0] + [g.rows for g in self.groups])
        slots = np.searchsorted(starts, indices, side="right") - 1
        out: dict[str, np.ndarray] = {}
        for slot in np.unique(slots):
            mask = slots == slot
            columns = self.load(int(slot))
            for name, column in columns.items():
                if name not in out:
                    out[name] = np.empty((len(indices),) + column.shape[1:], dtype=column.dtype)
                out[name][mask] = column[np.asarray(indices)[mask] - starts[slot]]
        return out


def _data_error(where: str, exc: BaseException) -> DataError:
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return DataError(f"reading {where}: this process has too many files open (its limit, ulimit -n, is "
                         f"{limit}): raise the limit, or read fewer files at once (data.options.read_threads)")
    return DataError(f"{where} cannot be read: {first_line(exc, 200)}. The file is corrupt, or not the Parquet "
                     "file that was indexed: replace it and resume the run, or start a new run (--name) without it")
