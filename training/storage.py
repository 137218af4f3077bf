"""Paths that may be local or s3://, through pyarrow filesystems.

An S3-compatible endpoint (an emulator, MinIO) is picked up by pyarrow from AWS_ENDPOINT_URL.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.fs as pafs


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def local_path(uri: str) -> str:
    """A local path as written, or as a `file://` URI (file:///data/x is /data/x)."""
    return uri[len("file://"):] if uri.startswith("file://") else uri


def absolute(uri: str, base_dir: str | Path) -> str:
    """Remote URIs as they are; local paths made absolute against base_dir."""
    if is_remote(uri):
        return uri
    path = Path(os.path.expanduser(local_path(uri)))
    return str(path if path.is_absolute() else (Path(base_dir) / path).resolve())


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    if is_remote(uri):
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(local_path(uri))


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def read_text(uri: str) -> str:
    fs, path = filesystem(uri)
    with fs.open_input_stream(path) as stream:
        return stream.read().decode()


def write_text(uri: str, text: str) -> None:
    """Write a small file whole: to a temporary name then renamed where the filesystem can."""
    fs, path = filesystem(uri)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    if isinstance(fs, pafs.LocalFileSystem):
        tmp = f"{path}.tmp-{os.getpid()}"
        with fs.open_output_stream(tmp) as stream:
            stream.write(text.encode())
        fs.move(tmp, path)
    else:  # object stores write an object whole or not at all
        with fs.open_output_stream(path) as stream:
            stream.write(text.encode())
