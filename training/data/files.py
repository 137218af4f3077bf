"""Listing data files where they are (the driver): a folder (read recursively), a glob, a file, or a
list of them, on a local or shared disk (a path or a `file://` URI), `s3://` or any URI pyarrow
opens. The one way the Parquet and text sources (and a transform's input) find their files and
split them into train and validation.

In a glob, `*` and `?` match within one folder's name (`<root>/*.parquet` takes the files directly
in `<root>`, not those in its subfolders), `[abc]` one of the characters, and `**` any depth of
folders (`<root>/**/*.parquet`, `<root>/**` takes every file below `<root>`).

Hive partitioning as Spark and Hive write it (`key=value/` folders) is understood and can be
filtered; bookkeeping that writers leave beside the data (`_SUCCESS`, `_committed_*`, `_started_*`,
`_temporary/`, `.crc` files, hidden files) is skipped. A listing is digested from each file's
path, size and modification time, so a dataset that changed under a run is found by listing it
again.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
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
    # the path below the folder (or the glob's folder) it was listed from: what the validation
    # split is chosen by, so a dataset split the same wherever it lies
    relative: str = ""

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


def glob_regex(pattern: str) -> re.Pattern:
    """A glob as a regular expression over whole paths: `*`, `?` and `[..]` within one folder's name,
    `**` across folders (see the module's docstring)."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            negate = body[:1] in ("!", "^")
            out.append("(?!/)[" + ("^" if negate else "") + (body[1:] if negate else body).replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def list_files(paths, filters: Optional[dict] = None) -> list[DataFile]:
    """Every data file under `paths`, sorted, bookkeeping skipped, Hive filter applied."""
    wanted = {k: {str(v) for v in as_list(vals) if v is not None} if isinstance(vals, list) else {str(vals)}
              for k, vals in (filters or {}).items()}
    found: dict[str, DataFile] = {}
    for spec in as_list(paths):
        fs, path = storage.filesystem(spec)
        pattern = None
        if any(c in path for c in "*?["):
            cut = min(path.index(c) for c in "*?[" if c in path)
            root, pattern = path[:cut].rsplit("/", 1)[0] if "/" in path[:cut] else "", glob_regex(path)
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
            if _skipped(relative) or (pattern is not None and not pattern.match(entry.path)):
                continue
            partition = hive_partition(entry.path)  # (the given path's own key=value folders count too)
            if any(partition.get(k) not in vals for k, vals in wanted.items()):
                continue
            uri = storage.uri_at(spec, entry.path)
            found[uri] = DataFile(uri, int(entry.size), int(entry.mtime_ns or 0), partition, relative)
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


def _unit_hash(text: str) -> float:
    """A number in [0, 1) fixed by `text`."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16) / 16 ** 15


def validation_files(files: list[DataFile], fraction: float) -> set[str]:
    """The files of the validation split: each file whose path below the dataset's folder hashes
    below `fraction` (about that fraction of the files). A file's side depends on its own path only:
    the same files whatever the listing order or where the dataset lies, and adding files never
    moves a file already listed. With so few files that none hashes below, the one with the smallest
    hash is taken (and if all do, the largest is left to train)."""
    if len(files) < 2:
        raise DataError(f"validation_fraction needs at least 2 files; found {len(files)}: give validation_path")
    # (salted: other choices by a hash of the path, as text's max_bytes, must not pick the same files)
    score = {f.uri: _unit_hash(f"validation:{f.relative or f.uri}") for f in files}
    chosen = {uri for uri, value in score.items() if value < fraction} or {min(score, key=score.get)}
    if len(chosen) == len(files):
        chosen.discard(max(score, key=score.get))
    return chosen


@dataclass(frozen=True)
class Listing:
    """The files of a dataset as listed once: all of them in listing order (what the key digests),
    and each split's."""

    listed: list[DataFile]
    splits: dict[str, list[DataFile]]

    @property
    def digest(self) -> str:
        return digest(self.listed)


def check_apart(train: list[DataFile], validation: list[DataFile]) -> None:
    """Validation files that are also training files (the same path, a folder inside the other)
    would score the model on rows it trained on: UserError naming both options."""
    listed = {storage.local_path(f.uri) for f in train}
    both = [f.uri for f in validation if storage.local_path(f.uri) in listed]
    if both:
        raise UserError(f"data.options.validation_path: {len(both)} of its {len(validation)} files are also listed by "
                        f"data.options.path (such as {both[0]}): validation would score rows the model trains on; "
                        "give validation_path files apart from path's, or validation_fraction instead")


def split_listing(train: list[DataFile], validation: Optional[list[DataFile]], fraction: Optional[float]) -> Listing:
    """Train and validation files: the validation files given, or a fraction of the train files."""
    if validation is not None:
        check_apart(train, validation)
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
