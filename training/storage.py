"""Paths that may be local, s3:// or on Azure Blob (abfs://, az://), through pyarrow filesystems; used
by the driver, the Train controller and the workers alike.

An S3-compatible endpoint (an emulator, MinIO) is picked up by pyarrow from AWS_ENDPOINT_URL.
Azure Blob URIs are `abfs://CONTAINER@ACCOUNT/path` (`az://` and `abfss://` the same; the account may
be written as ACCOUNT.dfs.core.windows.net or ACCOUNT.blob.core.windows.net). pyarrow's own URI
parsing reads `abfs://a@b` the other way round (account a, container b), so the filesystem is built
here. Credentials: the account key from AZURE_STORAGE_KEY where it is set (an emulator, a laptop),
else Azure's default chain (a cluster node's managed identity); AZURE_STORAGE_BLOB_ENDPOINT
(http://127.0.0.1:10000) points at an emulator such as Azurite instead of ACCOUNT.blob.core.windows.net.
Neither is ever part of a URI, a config or a message.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

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


AZURE_SCHEMES = ("abfs", "abfss", "az")
AZURE_KEY_ENV = "AZURE_STORAGE_KEY"
AZURE_ENDPOINT_ENV = "AZURE_STORAGE_BLOB_ENDPOINT"
_AZURE_HOSTS = (".dfs.core.windows.net", ".blob.core.windows.net")


def is_azure(uri: str) -> bool:
    return uri.partition("://")[0].lower() in AZURE_SCHEMES


def azure_location(uri: str) -> tuple[str, str, str]:
    """(account, container, path inside the container) of an Azure Blob URI; ValueError naming the
    expected form for one without both a container and an account."""
    rest = uri.split("://", 1)[1]
    authority, _, path = rest.partition("/")
    container, at, account = authority.partition("@")
    for suffix in _AZURE_HOSTS:
        account = account.removesuffix(suffix)
    if not (at and container and account) or "." in account or ":" in container:
        raise ValueError(f"{uri} is not an Azure Blob URI of the form "
                         f"{uri.split('://')[0]}://CONTAINER@ACCOUNT/path")
    return account, container, path.strip("/")


def azure_filesystem(account: str) -> pafs.FileSystem:
    """The account's Blob storage: keyed from the environment, else the default credential chain."""
    options = {"account_name": account}
    if os.environ.get(AZURE_KEY_ENV):
        options["account_key"] = os.environ[AZURE_KEY_ENV]
    endpoint = os.environ.get(AZURE_ENDPOINT_ENV)
    if endpoint:  # an emulator: its host serves every account under /ACCOUNT (path style)
        scheme, _, authority = endpoint.rstrip("/").rpartition("://")
        for kind in ("blob", "dfs"):
            options[f"{kind}_storage_authority"] = authority
            options[f"{kind}_storage_scheme"] = scheme or "https"
    return pafs.AzureFileSystem(**options)


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    if is_azure(uri):
        account, container, path = azure_location(uri)
        return azure_filesystem(account), "/".join(filter(None, [container, path]))
    if is_remote(uri):
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(local_path(uri))


def object_path(uri: str) -> str:
    """A remote URI's path on its filesystem (bucket/key, container/path), without making the filesystem."""
    if is_azure(uri):
        account, container, path = azure_location(uri)
        return "/".join(filter(None, [container, path]))
    return uri.split("://", 1)[1]


def uri_at(base_uri: str, fs_path: str) -> str:
    """The URI of `fs_path` on the filesystem of `base_uri` (a path listed there): what `filesystem`
    turns back into that path."""
    if not is_remote(base_uri):
        return fs_path
    scheme = base_uri.split("://", 1)[0]
    if is_azure(base_uri):
        container, _, path = fs_path.partition("/")
        return f"{scheme}://{container}@{azure_location(base_uri)[0]}/{path}"
    return f"{scheme}://{fs_path}"


def for_ray_train(uri: str) -> tuple[str, Optional[pafs.FileSystem]]:
    """RunConfig's (storage_path, storage_filesystem): Ray Train resolves a URI with pyarrow, which
    misreads Azure's, so Azure storage goes to it as a filesystem and a path on it."""
    if is_azure(uri):
        fs, path = filesystem(uri)
        return path, fs
    return uri, None


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
