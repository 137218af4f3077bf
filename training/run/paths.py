"""Where a run lives, resolved on the driver: its storage, its directory, the data cache and the
MLflow store, from the job config and the environment the driver runs in."""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from training import storage
from training.config import JobConfig


@dataclass(frozen=True)
class RunPaths:
    base_dir: str
    storage_path: str
    run_dir: str
    data_cache: str
    tracking_uri: Optional[str]


def in_submitted_job() -> bool:
    """This driver runs as a Ray job (`ray job submit`), in a temporary copy of the working directory."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def base_dir() -> str:
    """Where relative paths (runs/, mlflow.db) live: $TRAINING_BASE_DIR, else the working directory;
    in a submitted Ray job (whose working directory is a temporary copy) ~/training."""
    if os.environ.get("TRAINING_BASE_DIR"):
        return os.path.abspath(os.path.expanduser(os.environ["TRAINING_BASE_DIR"]))
    if in_submitted_job():
        return str(Path.home() / "training")
    return os.getcwd()


def resolve_paths(job: JobConfig, name: str) -> RunPaths:
    base = base_dir()
    storage_path = storage.absolute(job.checkpoint.storage_path, base)
    tracking_uri = None
    if job.tracking.enabled:
        tracking_uri = job.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
        if tracking_uri.startswith("sqlite:///") and not tracking_uri.startswith("sqlite:////"):
            tracking_uri = "sqlite:///" + os.path.join(base, tracking_uri[len("sqlite:///"):])
    data_cache = (storage.absolute(job.data.cache_dir, base) if job.data.cache_dir
                  else storage.join(storage_path, "datasets"))
    return RunPaths(base, storage_path, storage.join(storage_path, name), data_cache, tracking_uri)


def default_run_name(config_path: Optional[str], now: Optional[datetime.datetime] = None) -> str:
    """<config file's name>-<timestamp>, made a valid run name (`JobConfig.name`): a file named
    `my job (1)!.yaml` runs as `my-job-1-20250101-120000`, not as a path with spaces and parentheses."""
    stem = Path(config_path).stem if config_path else "job"
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-._")[:100] or "job"
    return f"{stem}-{(now or datetime.datetime.now()).strftime('%Y%m%d-%H%M%S')}"


def artifact_location(paths: RunPaths, job: JobConfig) -> Optional[str]:
    """Artifacts of an embedded (sqlite) store go next to the database, not into ./mlruns of
    whatever directory the driver runs in (a submitted job's is a temporary copy)."""
    if not paths.tracking_uri.startswith("sqlite:///"):
        return None  # a tracking server decides where artifacts go
    database = Path(paths.tracking_uri[len("sqlite:///"):])
    return (database.parent / "mlruns" / re.sub(r"[^A-Za-z0-9_.-]+", "-", job.tracking.experiment)).as_uri()
