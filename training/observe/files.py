"""The two files that say how a run is doing, next to its checkpoints (any process reads them):

    status.json    written by the driver: its state (running, finished, failed, stopped), a
                   heartbeat while it runs, the error line of a failure, the MLflow run
    progress.json  written by the Train controller: the last step and metrics, worker-group
                   restarts and preemptions so far

One writer each, so neither overwrites the other's news. Both are rewritten whole (storage.write_text).
"""

from __future__ import annotations

import json
from typing import Optional

import pyarrow.fs as pafs

from training import storage

STATUS_FILE = "status.json"
PROGRESS_FILE = "progress.json"


def read_json(uri: str) -> Optional[dict]:
    """A small JSON file, or None if it is not there or not whole (a reader never fails on it)."""
    try:
        if not storage.exists(uri):
            return None
        value = json.loads(storage.read_text(uri))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_json(uri: str, value: dict) -> None:
    storage.write_text(uri, json.dumps(value, indent=2, default=str))


def read_status(run_dir: str) -> Optional[dict]:
    return read_json(storage.join(run_dir, STATUS_FILE))


def read_progress(run_dir: str) -> Optional[dict]:
    return read_json(storage.join(run_dir, PROGRESS_FILE))


def checkpoints(run_dir: str) -> list[dict]:
    """Every checkpoint directory of a run, newest first: {name, step, complete}."""
    from training.checkpoint import format as ckpt  # (lazy: torch)

    fs, base = storage.filesystem(run_dir)
    try:
        entries = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    except OSError:
        return []
    found = sorted(((ckpt.step_of(e.base_name), e) for e in entries
                    if e.type == pafs.FileType.Directory and ckpt.step_of(e.base_name) is not None),
                   key=lambda pair: pair[0], reverse=True)
    return [{"name": e.base_name, "step": step, "complete": ckpt.is_complete(fs, e.path)} for step, e in found]


def runs_in(storage_path: str) -> list[str]:
    """The names of the runs in a storage (directories holding a run.json), sorted."""
    fs, base = storage.filesystem(storage_path)
    entries = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    names = [e.base_name for e in entries if e.type == pafs.FileType.Directory]
    return sorted(n for n in names if storage.exists(storage.join(storage_path, n, "run.json")))
