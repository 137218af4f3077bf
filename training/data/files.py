"""Listing data files where they are (the driver): a folder (read recursively), a glob, a file, or a
list of them, on a local or shared disk, `s3://` or any URI pyarrow opens. The one way the Parquet
and text sources (and a transform's input) find their files and split them into train and
validation.

Hive partitioning as Spark and Hive write it (`key=value/` folders) is understood and can be
filtered; bookkeeping that writers leave beside the data (`_SUCCESS`, `_committed_*`, `_started_*`,
`_temporary/`, `.crc` files, hidden files) is skipped. A listing is digested from each file's
path, size and modification time, so a dataset that changed under a run is found by listing it
again.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import posixpath
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

import pyarrow.fs as pafs

from training import storage
from training.errors import DataError, UserError, first_line

T = TypeVar("T")

SKIPPED_PREFIXES = ("_", ".")
SKIPPED_SUFFIXES = (".crc", ".tmp", ".inprogress")


@dataclass(frozen=True)
class DataFile:
    uri: str
    size: int
    mtime_ns: int
    partition: dict[str, str]

    def stamp(self) -> str:
        return f"{self.uri}\t{self.size}\t{self.mtime_ns}"


def as_list(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def hive_partition(relative: str) -> dict[str, str]:
    parts = {}
    for folder in posixpath.dirname(relative).split("/"):
        if "=" in folder:
            key, _, value = folder.partition("=")
            parts[key] = value
    return parts


def _skipped(relative: str) -> bool:
    names = relative.split("/")
    return any(n.startswith(SKIPPED_PREFIXES) for n in names) or names[-1].endswith(SKIPPED_SUFFIXES)


def list_files(paths, filters: Optional[dict] = None) -> list[DataFile]:
    """Every data file under `paths`, sorted, bookkeeping skipped, Hive filter applied."""
    wanted = {k: {str(v) for v in as_list(vals) if v is not None} if isinstance(vals, list) else {str(vals)}
              for k, vals in (filters or {}).items()}
    found: dict[str, DataFile] = {}
    for spec in as_list(paths):
        fs, path = storage.filesystem(spec)
        scheme = spec[:spec.index("://") + 3] if "://" in spec else ""
        pattern = None
        if any(c in path for c in "*?["):
            cut = min(path.index(c) for c in "*?[" if c in path)
            root, pattern = path[:cut].rsplit("/", 1)[0] if "/" in path[:cut] else "", path
        else:
            root = path
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            raise DataError(f"{spec} does not exist")
        if info.type == pafs.FileType.File and pattern is None:
            entries, root = [info], posixpath.dirname(root)
        else:
            entries = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        for entry in entries:
            if entry.type != pafs.FileType.File:
                continue
            relative = entry.path[len(root):].lstrip("/") if root else entry.path
            if _skipped(relative) or (pattern is not None and not fnmatch.fnmatch(entry.path, pattern)):
                continue
            partition = hive_partition(entry.path)  # (the given path's own key=value folders count too)
            if any(partition.get(k) not in vals for k, vals in wanted.items()):
                continue
            uri = scheme + entry.path if scheme else entry.path
            found[uri] = DataFile(uri, int(entry.size), int(entry.mtime_ns or 0), partition)
    if not found:
        raise DataError(f"no data files under {', '.join(as_list(paths))}"
                        + (f" matching filter {filters}" if filters else ""))
    return [found[uri] for uri in sorted(found)]


def digest(files: list[DataFile]) -> str:
    return hashlib.sha256("\n".join(f.stamp() for f in files).encode()).hexdigest()


def changed(recorded: list[dict], files: list[DataFile]) -> Optional[str]:
    """The first file that differs between a recorded index and a new listing (None: unchanged)."""
    now = {f.uri: f for f in files}
    for entry in recorded:
        file = now.pop(entry["uri"], None)
        if file is None:
            return f"{entry['uri']} is gone"
        if (file.size, file.mtime_ns) != (entry["size"], entry["mtime_ns"]):
            return f"{entry['uri']} changed (size {entry['size']} -> {file.size}, modified since)"
    if now:
        return f"{next(iter(now))} is new"
    return None


def validation_files(files: list[DataFile], fraction: float) -> set[str]:
    """The files of the validation split, chosen by a hash of each file's path: the same files
    whatever the listing order, and stable when files are added."""
    ranked = sorted(files, key=lambda f: hashlib.sha256(f.uri.rsplit("/", 1)[-1].encode()
                                                        + f.uri.encode()).hexdigest())
    count = min(max(1, math.ceil(len(files) * fraction)), len(files) - 1)
    if count < 1:
        raise DataError(f"validation_fraction needs at least 2 files; found {len(files)}: give validation_path")
    return {f.uri for f in ranked[:count]}


@dataclass(frozen=True)
class Listing:
    """The files of a dataset as listed once: all of them in listing order (what the key digests),
    and each split's."""

    listed: list[DataFile]
    splits: dict[str, list[DataFile]]

    @property
    def digest(self) -> str:
        return digest(self.listed)


def split_listing(train: list[DataFile], validation: Optional[list[DataFile]], fraction: Optional[float]) -> Listing:
    """Train and validation files: the validation files given, or a fraction of the train files."""
    if validation is not None:
        return Listing(train + validation, {"train": train, "validation": validation})
    chosen = validation_files(train, fraction)
    return Listing(train, {"train": [f for f in train if f.uri not in chosen],
                           "validation": [f for f in train if f.uri in chosen]})


def list_splits(path, validation_path, validation_fraction: Optional[float], filters: Optional[dict] = None) -> Listing:
    """List a dataset's files once (DataError if there are none)."""
    train = list_files(path, filters)
    validation = list_files(validation_path, filters) if validation_path is not None else None
    return split_listing(train, validation, validation_fraction)


def listed_for(option: str, listing: Callable[[], T]) -> T:
    """A listing of the files an option names; UserError naming the option if it fails."""
    try:
        return listing()
    except DataError as exc:
        raise UserError(f"{option}: {exc}") from None
    except OSError as exc:
        raise UserError(f"{option}: {first_line(exc)}") from None
