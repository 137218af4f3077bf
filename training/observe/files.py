"""The two files that say how a run is doing, next to its checkpoints (any process reads them):

    status.json    written by the driver: its state (running, finished, failed, interrupted,
                   scheduler_stopped: training/observe/state.py), a
                   heartbeat while it runs, the error line of a failure, the MLflow run
    progress.json  written by the Train controller: the last step and metrics, worker-group
                   restarts and preemptions so far

One writer each, so neither overwrites the other's news. Both are rewritten whole (storage.write_text).
A file that parses but holds a field of the wrong type (edited by hand, written by something else)
is unreadable: `status` says so, naming the file and the field; the writers start it afresh.
"""

from __future__ import annotations

import json
from typing import Optional

import pyarrow.fs as pafs

from training import storage
from training.metrics import KEY_METRICS

STATUS_FILE = "status.json"
PROGRESS_FILE = "progress.json"
SUMMARY_FILE = "summary.json"
RECORD_FILE = "run.json"

_NUMBER = (int, float)
# The fields a reader uses, and the JSON types their writers give them (null: not known yet).
FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    STATUS_FILE: {"state": (str,), "heartbeat": _NUMBER, "updated": _NUMBER, "heartbeat_every_s": _NUMBER,
                  "attempt": (int,), "first_started": _NUMBER, "host": (str,), "error": (str,),
                  "mlflow_run_id": (str,), "mlflow_url": (str,), "tracking_uri": (str,)},
    PROGRESS_FILE: {"step": (int,), "total_steps": (int,), "metrics": (dict,), "updated": _NUMBER,
                    "restarts": (int,), "preemptions": (int,)},
    SUMMARY_FILE: {"steps": (int,), "metrics": (dict,)},
    RECORD_FILE: {"mlflow_run_id": (str,), "tracking_uri": (str,)},
}


class UnreadableFile(ValueError):
    """A run's file that parses but is not what its writer writes; the message names the file and field."""


def read_json(uri: str) -> Optional[dict]:
    """One of the run's small JSON files, None if it is not there or not whole; UnreadableFile if it
    is JSON but not the object its writer writes (the fields in FIELDS, by the file's name)."""
    try:
        if not storage.exists(uri):
            return None
        value = json.loads(storage.read_text(uri))
    except (OSError, ValueError):  # (cut short: a writer died mid-write on a store without renames)
        return None
    if not isinstance(value, dict):
        raise UnreadableFile(f"{uri} holds {_a(_json_type(value))} ({_short(value)}), not a JSON object")
    for key, types in FIELDS.get(uri.rsplit("/", 1)[-1], {}).items():
        field = value.get(key)
        if field is not None and (isinstance(field, bool) or not isinstance(field, types)):
            wanted = "number" if types == _NUMBER else _json_type(types[0]())
            raise UnreadableFile(f"{uri}: {key!r} is {_a(_json_type(field))} ({_short(field)}), not {_a(wanted)}")
    metrics = value.get("metrics") if isinstance(value.get("metrics"), dict) else {}
    for key, metric in metrics.items():  # (shown with a number format)
        if key in KEY_METRICS and metric is not None and (isinstance(metric, bool) or not isinstance(metric, _NUMBER)):
            raise UnreadableFile(f"{uri}: metric {key!r} is {_a(_json_type(metric))} ({_short(metric)}), not a number")
    return value


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def write_json(uri: str, value: dict) -> None:
    storage.write_text(uri, json.dumps(value, indent=2, default=str))


def _lenient(uri: str) -> Optional[dict]:
    """For the writers, who rewrite the file: one that is not what they wrote counts as not there."""
    try:
        return read_json(uri)
    except UnreadableFile:
        return None


def read_status(run_dir: str) -> Optional[dict]:
    return _lenient(storage.join(run_dir, STATUS_FILE))


def read_progress(run_dir: str) -> Optional[dict]:
    return _lenient(storage.join(run_dir, PROGRESS_FILE))


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
