"""Pretrained Hugging Face weights onto the Train workers (and, for its checks, the driver): a remote
folder copied once per node into a local cache (`node_local_folder`), and a model sharded with FSDP2
filled from the folder's safetensors files, each rank reading only its own shards (`load_sharded`).
torch is imported inside `load_sharded` only: the driver's checks stay torch-free."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path

import pyarrow.fs as pafs

from training import storage
from training.errors import DataError, StorageUnavailable, UserError, first_line, last_line

OPTION = "model.options.pretrained"
HUB = "hf://"  # a model on the Hugging Face Hub: hf://ORG/NAME, or hf://ORG/NAME@REVISION
MANIFEST = ".complete.json"  # in the cache folder: {file: [size, etag]} of each file fully copied and checked
CHUNK_BYTES = 16 << 20
_MIB = 1 << 20
# Part sizes of the usual S3 uploaders (aws cli and boto3 8 MiB, pyarrow 10 MiB, s5cmd 50 MiB): a
# multipart ETag is the MD5 of the parts' MD5s, checkable only once the part size is known.
_PART_SIZES = tuple(n * _MIB for n in (8, 16, 10, 5, 32, 50, 64, 100))

log = logging.getLogger(__name__)


def default_cache_root() -> str:
    """Per node, kept across runs and Ray sessions: $TRAINING_HF_CACHE, else ~/.cache/training/hf."""
    return os.environ.get("TRAINING_HF_CACHE") or os.path.expanduser("~/.cache/training/hf")


def hub_folder(uri: str) -> str:
    """A Hub model's folder in huggingface_hub's own cache ($HF_HUB_CACHE, else $HF_HOME/hub: what
    `from_pretrained` would download, shared with it), downloaded once per node (huggingface_hub
    locks each file) and only its config, weights, tokenizer and processor files. HF_HUB_OFFLINE=1:
    the cache alone. Not found, gated, or offline and not cached: UserError; the Hub unreachable:
    StorageUnavailable (retried as any storage outage)."""
    from huggingface_hub import constants, errors, snapshot_download  # (lazy: Hub ids only)

    repo, _, revision = uri.removeprefix(HUB).partition("@")
    try:
        return snapshot_download(
            repo, revision=revision or None,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"])
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.GatedRepoError) as exc:
        raise UserError(f"{OPTION}: {uri}: {first_line(exc)}") from None
    except errors.LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise UserError(f"{OPTION}: {uri} is not in the Hugging Face cache "
                            f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set: download it "
                            "where the Hub is reachable, or give a folder (local or s3://)") from None
        raise StorageUnavailable(f"{OPTION}: {uri}: the Hugging Face Hub cannot be reached") from None


def node_local_folder(uri: str, cache_root: str | None = None) -> str:
    """A local folder holding the pretrained folder `uri`: the folder itself when local; a remote one
    (s3:// or any pyarrow URI) copied into `cache_root/<digest of uri>` once per node. The workers of
    a node take a file lock: the first copies, the others wait and find the copy made. A copy cut
    short resumes where it stopped (each file is written under a `.partial` name, then renamed);
    each file is checked against the remote's size and, on S3, its ETag."""
    if not storage.is_remote(uri):
        folder = os.path.abspath(os.path.expanduser(storage.local_path(uri)))
        if not os.path.isdir(folder):
            raise UserError(f"{OPTION}: {uri} is not a folder")
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise UserError(f"{OPTION}: {uri} has no config.json (a folder written by save_pretrained)")
        return folder
    fs, root = storage.filesystem(uri)
    sizes = remote_files(fs, root, uri)
    cache = Path(cache_root or default_cache_root()) / hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:20]
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache.with_name(cache.name + ".lock")):
        _sync(fs, root, sizes, cache, uri)
    return str(cache)


def remote_files(fs: pafs.FileSystem, root: str, uri: str) -> dict[str, int]:
    """{path under the folder: size} of a remote pretrained folder; a UserError naming the option when
    it cannot be listed (no bucket, no credentials) or holds no config.json."""
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    except FileNotFoundError as exc:
        raise UserError(f"{OPTION}: {uri} does not exist") from exc
    except OSError as exc:  # no bucket, no credentials, access denied
        raise UserError(f"{OPTION}: {uri} cannot be read ({first_line(exc, 200)})") from exc
    sizes = {info.path[len(root):].lstrip("/"): info.size for info in infos if info.type == pafs.FileType.File}
    if "config.json" not in sizes:
        found = "holds no files" if not sizes else "has no config.json (a folder written by save_pretrained)"
        raise UserError(f"{OPTION}: {uri} {found}")
    return sizes


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock between the processes of a node (released by the kernel if one dies)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sync(fs: pafs.FileSystem, root: str, sizes: dict[str, int], cache: Path, uri: str) -> None:
    """Copy each file the cache lacks or holds in another version; the manifest, rewritten after each
    file, is what makes a file count as copied."""
    manifest_path = cache / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    for name, size in sorted(sizes.items()):
        target, remote = cache / name, f"{uri.rstrip('/')}/{name}"
        with _remote_read(remote):
            source = fs.open_input_file(f"{root}/{name}")  # S3: a HEAD, no bytes read yet
        with source:
            etag = _etag(source)
            if manifest.get(name) == [size, etag] and target.is_file() and target.stat().st_size == size:
                continue
            _fetch(source, size, etag, target, remote)
        manifest[name] = [size, etag]
        tmp = manifest_path.with_name(f"{MANIFEST}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, manifest_path)


@contextlib.contextmanager
def _remote_read(remote: str):
    """A remote read that fails after the folder was listed is the store's failure, not the config's:
    StorageUnavailable, which Ray Train retries (and the retry resumes the copy)."""
    try:
        yield
    except OSError as exc:
        raise StorageUnavailable(f"{OPTION}: reading {remote} failed ({first_line(exc, 200)})") from exc


def _etag(source) -> str | None:
    """The object's ETag, from the HEAD pyarrow makes when it opens an S3 file; None elsewhere."""
    value = (source.metadata() or {}).get("ETag")
    return value.decode().strip('"') if value else None


def _fetch(source, size: int, etag: str | None, target: Path, name: str) -> None:
    """Copy one file to `target` through `target.partial`, resuming a partial copy of the same
    version (the ETag it came from is kept beside it); checked by size, and by content where the
    ETag is an MD5. A content mismatch is copied once more; a second one is kept with a warning (the
    ETag of an object encrypted with KMS is not an MD5 of its bytes)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial, stamp = target.with_name(target.name + ".partial"), target.with_name(target.name + ".partial-etag")
    for attempt in range(2):
        same_version = stamp.is_file() and stamp.read_text() == str(etag)
        have = partial.stat().st_size if partial.is_file() and same_version else 0
        if have > size:
            have = 0
        stamp.write_text(str(etag))
        with open(partial, "r+b" if have else "wb") as out:
            out.seek(have)
            out.truncate()
            while have < size:
                with _remote_read(name):
                    chunk = source.read_at(min(CHUNK_BYTES, size - have), have)
                if not chunk:
                    raise StorageUnavailable(f"{OPTION}: {name} ended at {have} of {size} bytes")
                out.write(chunk)
                have += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        if partial.stat().st_size != size:
            raise StorageUnavailable(f"{OPTION}: {name}: copied {partial.stat().st_size} bytes, "
                                     f"the listing says {size}")
        if etag is None or _matches_etag(partial, size, etag) is not False:
            break
        if attempt == 0:
            partial.unlink()
        else:
            log.warning("%s: its content's MD5 does not match the ETag %s twice; kept (an encrypted object's "
                        "ETag is not an MD5)", name, etag)
    os.replace(partial, target)
    stamp.unlink(missing_ok=True)


def _matches_etag(path: Path, size: int, etag: str) -> bool | None:
    """Whether the file's MD5 (single-part upload) or MD5 of part MD5s (multipart, `<md5>-<parts>`)
    equals the ETag; None when no usual part size gives the ETag's part count (cannot tell)."""
    digest, _, parts_text = etag.partition("-")
    if not parts_text:
        return _md5_parts(path, max(size, 1))[0].hexdigest() == digest
    parts = int(parts_text)
    low = -(-size // parts)  # the part size must give exactly `parts` parts
    high = -(-size // (parts - 1)) - 1 if parts > 1 else max(size, low)
    candidates = [part for part in _PART_SIZES if low <= part <= high] or ([low] if parts == 1 else [])
    for part in candidates:
        combined = hashlib.md5(b"".join(h.digest() for h in _md5_parts(path, part)))
        if combined.hexdigest() == digest:
            return True
    return False if parts == 1 else None


def _md5_parts(path: Path, part_bytes: int) -> list:
    """The MD5 of each `part_bytes` part of a file, read in chunks of at most CHUNK_BYTES."""
    hashes, left = [hashlib.md5()], part_bytes
    with open(path, "rb") as handle:
        while data := handle.read(min(CHUNK_BYTES, left)):
            hashes[-1].update(data)
            left -= len(data)
            if not left:
                hashes.append(hashlib.md5())
                left = part_bytes
    return hashes[:-1] if left == part_bytes and len(hashes) > 1 else hashes


def load_sharded(model, folder: str, file_key=None) -> None:
    """Fill `model` from the safetensors files in `folder`, each rank reading only its own shards.
    `model` is a transformers PreTrainedModel built on the meta device, sharded with FSDP2
    (`fully_shard` on each decoder layer, then the root) and given storage with `to_empty`.
    Non-persistent buffers (rotary `inv_freq`, BERT's `position_ids`), in no file, are computed
    again by the model's own initializer; a weight tied to another (`lm_head.weight` to the
    embeddings), which the file holds once, is read once; the file's dtype is cast to the model's.
    A base model's folder (names without the task model's `base_model_prefix`) fills the base of a
    task model; a task head the folder lacks (or holds in another shape: other labels) is drawn
    fresh (`_init_fresh_head`), as `from_pretrained` does. The files are read with DCP's
    HuggingFaceStorageReader's plan, each rank's rows by `pread` (training/models/hf_read.py): a
    rank's memory grows by its shard, not by the file's pages. `file_key`: a state-dict name of the
    model -> the name its files hold it under, None for one no file holds (an adapter's weights:
    training/models/hf_adapter.py)."""
    import torch  # (lazy: torch)
    import torch.distributed.checkpoint as dcp  # (lazy: torch)

    _init_non_persistent_buffers(model)
    state = model.state_dict()
    model_name = {}  # the files' names -> the model's, where file_key renames
    if file_key is not None:  # the model's names -> the files' (None: in no file, an adapter's)
        model_name = {key: name for name in state if (key := file_key(name)) is not None}
        state = {key: state[name] for key, name in model_name.items()}
    from training.models.hf_read import PreadHuggingFaceReader  # (lazy: torch)

    reader = PreadHuggingFaceReader(folder)
    try:
        stored = reader.read_metadata().state_dict_metadata
    except Exception as exc:
        raise DataError(f"{OPTION}: no safetensors weights readable in {folder} ({first_line(exc, 200)})") from exc
    prefix = getattr(model, "base_model_prefix", "") or ""
    in_base = (lambda name: name.startswith(prefix + ".")) if prefix else (lambda name: True)
    base_only = bool(prefix) and any(map(in_base, state)) and not any(map(in_base, stored))
    in_file = (lambda name: name.removeprefix(prefix + ".")) if base_only else (lambda name: name)
    for names in _tied_names(model):  # one tensor, one file entry: read it through a key the file holds
        keep = next((name for name in names if in_file(name) in stored), names[0])
        for name in names:
            if name != keep:
                state.pop(name, None)
    fresh = [key for key in state if not in_base(key) and (in_file(key) not in stored or tuple(
        stored[in_file(key)].size) != tuple(state[key].shape))]
    state = {in_file(key): value for key, value in state.items() if key not in fresh}
    missing = sorted(key for key in state if key not in stored)
    wrong = sorted(key for key in state if key in stored and tuple(stored[key].size) != tuple(state[key].shape))
    if missing or wrong:
        shapes = [f"{key} {tuple(stored[key].size)} in the file, {tuple(state[key].shape)} in the model"
                  for key in wrong[:3]]
        what = "; ".join(([f"missing {', '.join(missing[:5])}"] if missing else []) + shapes)
        raise DataError(f"{OPTION}: the weights in {folder} do not match the model's config: {what}")
    try:
        with torch.no_grad():
            dcp.load(state, storage_reader=reader)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise DataError(f"{OPTION}: reading the weights in {folder} failed ({last_line(exc, 300)})") from exc
    _init_fresh_head(model, [model_name.get(key, key) for key in fresh])


def _init_fresh_head(model, names: list[str]) -> None:
    """Draw the parameters `names` (a task head no file holds) with the model's own initializer, the
    same on every rank whatever the world size: each owning module's parameters are drawn whole, on
    the CPU, from the seed this process last set (the worker's `torch.manual_seed(seed)` before it
    built the model), and each rank keeps its own shard. (`to_empty` left them as garbage; DTensor's
    random ops on a CPU mesh would draw each shard from the rank's own generator instead.)"""
    import torch  # (lazy: torch)
    from torch.distributed.tensor import DTensor, distribute_tensor  # (lazy: torch)

    owners: dict[str, list[str]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owners.setdefault(parent, []).append(leaf)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(torch.initial_seed())
        for parent, leaves in owners.items():
            module = model.get_submodule(parent)
            kept = {leaf: module._parameters[leaf] for leaf in leaves}
            whole = {leaf: torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype)) for leaf, p in kept.items()}
            module._parameters.update(whole)  # (swapped back before anything runs the module)
            try:
                model._init_weights(module)
            finally:
                module._parameters.update(kept)
            for leaf, param in kept.items():
                if isinstance(param, DTensor):
                    part = distribute_tensor(whole[leaf].data, param.device_mesh, param.placements, src_data_rank=None)
                    param.to_local().copy_(part.to_local())
                else:
                    param.copy_(whole[leaf].data)


def _tied_names(model) -> list[list[str]]:
    """The names of each parameter reachable under more than one name (tied embeddings): the state
    dict of a sharded model holds a copy per name, so identity is read from the parameters."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _init_non_persistent_buffers(model) -> None:
    """Buffers that no checkpoint holds, left as `to_empty` garbage on a meta-built model: recomputed
    by the model's own `_init_weights`, which in transformers 5 sets them (a meta-device build is how
    transformers itself loads). Done before the weights are read: it may also draw random weights in
    the same module, which the read then replaces."""
    import torch  # (lazy: torch)

    owners = {}
    for name, _ in model.named_buffers():
        parent, _, buffer = name.rpartition(".")
        module = model.get_submodule(parent)
        if buffer in module._non_persistent_buffers_set:
            owners[parent] = module
    with torch.no_grad():
        for module in owners.values():
            model._init_weights(module)
