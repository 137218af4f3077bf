"""The tracking backlog file, `<run dir>/tracking_backlog.jsonl` (driver and Ray Train controller):
the metrics MLflow has not taken yet, with the run's final status once it has one, kept in the
run's storage while MLflow is away; `replay_backlogs` delivers those left by earlier runs when a
run starts.

The file is one JSON line of header (run_id, tracking_uri, status, end_time_ms, written), then one
line per metric (key, value, timestamp, step). It is always rewritten whole, never appended to.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Optional

import pyarrow.fs as pafs

from training import storage, topics
from training.redaction import redact

log = topics.logger(topics.TRACKING, __name__)

BACKLOG_FILE = "tracking_backlog.jsonl"


def backlog_uri(run_dir: str) -> str:
    return storage.join(run_dir, BACKLOG_FILE)


def write_backlog(uri: str, run_id: str, tracking_uri: str, metrics: list,
                  status: Optional[tuple[str, int]]) -> bool:
    """Write the file (metrics are `mlflow.entities.Metric`; status is (status, end_time_ms) or None).
    False, with a warning, if the storage refused it."""
    header = {"run_id": run_id, "tracking_uri": redact(tracking_uri), "status": status[0] if status else None,
              "end_time_ms": status[1] if status else None, "written": time.time()}
    lines = [json.dumps(header)] + [json.dumps({"key": m.key, "value": m.value, "timestamp": m.timestamp,
                                                "step": m.step}) for m in metrics]
    try:
        storage.write_text(uri, "\n".join(lines) + "\n")
        return True
    except Exception as exc:
        log.warning("could not write %s: %s", uri, exc)
        return False


def read_backlog(uri: str) -> Optional[tuple[dict, list]]:
    """(header, metrics) of a backlog file, or None if there is none."""
    from mlflow.entities import Metric  # (lazy: mlflow)

    if not storage.exists(uri):
        return None
    lines = [line for line in storage.read_text(uri).splitlines() if line.strip()]
    if not lines:
        return None
    rows = [json.loads(line) for line in lines[1:]]
    return json.loads(lines[0]), [Metric(r["key"], r["value"], r["timestamp"], r["step"]) for r in rows]


def remove_backlog(uri: str) -> bool:
    """Remove the file once its metrics are delivered; False, with a warning, if it is still there."""
    try:
        fs, path = storage.filesystem(uri)
        fs.delete_file(path)
    except FileNotFoundError:
        pass
    except Exception as exc:  # replaying it later is harmless: the store keeps one copy of each metric
        log.warning("could not remove %s: %s", uri, exc)
        return False
    return True


def replay_backlogs(storage_path: str, tracker, log_line: Callable[[str], None] = print) -> None:
    """At the start of a run, with MLflow reachable: deliver the backlog files of runs in the same
    storage tracked at the same MLflow (tracker's). This run's own (a resumed run) gets its metrics;
    another run's only once it has ended (its file holds a final status), which is then set too."""

    fs, root = storage.filesystem(storage_path)
    try:
        entries = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except OSError:
        return
    for entry in sorted(entries, key=lambda e: e.base_name):
        if entry.type != pafs.FileType.Directory:
            continue
        run_dir = storage.join(storage_path, entry.base_name)
        uri = backlog_uri(run_dir)
        try:
            found = read_backlog(uri)
        except Exception as exc:
            log.warning("cannot read %s: %s", uri, exc)
            continue
        if found is None or redact(found[0].get("tracking_uri") or "") != redact(tracker.tracking_uri):
            continue
        header, metrics = found
        own = run_dir == tracker.run_dir
        if not own and header.get("status") is None:
            continue  # that run may still be going; it delivers its own backlog, or its resume does
        # A tracker of the same class for that run (named by type: tracker.py imports this module).
        replay = type(tracker)(tracker.tracking_uri, header["run_id"], run_dir, tracker.policy)
        if own:
            done = replay.catch_up()
            done = replay.close(0.0) and done
        else:
            replay.finish(header["status"], header.get("end_time_ms"))
            done = not storage.exists(uri)
        if done:
            log_line(topics.line(topics.TRACKING, f"sent {len(metrics)} metrics kept in {uri} to MLflow run "
                                 f"{header['run_id']}" + ("" if own else f" and marked it {header['status']}")))
