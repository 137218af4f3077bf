"""One training run from the driver: resolve paths, prepare data, open the MLflow run, start or
join Ray, fit a TorchTrainer, then log the final model and a summary.

Everything a user can get wrong is checked before Ray starts (UserError, exit code 2).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from training import config as config_lib
from training import storage
from training.config import JobConfig
from training.errors import ConfigError, RunFailed, UserError
from training.metrics import VALIDATION_METRICS

RUN_FILE = "run.json"


@dataclass(frozen=True)
class RunPaths:
    base_dir: str
    storage_path: str
    run_dir: str
    data_cache: str
    tracking_uri: Optional[str]


@dataclass
class RunSummary:
    name: str
    run_dir: str
    steps: int
    metrics: dict
    wall_s: float
    resumed: bool
    checkpoint_path: Optional[str] = None
    mlflow_run_id: Optional[str] = None
    tracking_uri: Optional[str] = None
    registered_model: Optional[str] = None
    extra: dict = field(default_factory=dict)


def in_submitted_job() -> bool:
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
    data_cache = storage.absolute(job.data.cache_dir, base) if job.data.cache_dir else storage.join(storage_path, "datasets")
    return RunPaths(base, storage_path, storage.join(storage_path, name), data_cache, tracking_uri)


def default_run_name(config_path: Optional[str]) -> str:
    stem = Path(config_path).stem if config_path else "job"
    return f"{stem}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def check_storage(paths: RunPaths) -> None:
    """Fail fast, before anything starts, if the storage path cannot be written."""
    probe = storage.join(paths.storage_path, f".write-probe-{uuid.uuid4().hex}")  # runs may start at once
    try:
        storage.write_text(probe, "ok")
        fs, path = storage.filesystem(probe)
        fs.delete_file(path)
    except Exception as exc:
        raise UserError(f"checkpoint.storage_path {paths.storage_path} is not writable: {exc}") from None


def read_run_record(paths: RunPaths) -> Optional[dict]:
    record_uri = storage.join(paths.run_dir, RUN_FILE)
    return json.loads(storage.read_text(record_uri)) if storage.exists(record_uri) else None


def check_resumable(job: JobConfig, record: dict, name: str) -> None:
    now = config_lib.identity_of(job)
    changed = [key for key, value in now.items() if record["identity"].get(key) != value]
    if changed:
        raise ConfigError(
            f"run {name!r} already exists with a different {', '.join(changed)}; resuming it would mix two "
            "different runs. Use a new --name, or the original values to resume it.")


def check_metric_names(job: JobConfig, task: str) -> None:
    allowed = VALIDATION_METRICS[task]
    for dotted, metric in (("checkpoint.score_metric", job.checkpoint.score_metric),
                           ("train.early_stopping.metric",
                            job.train.early_stopping.metric if job.train.early_stopping else None)):
        if metric is not None and metric not in allowed:
            raise ConfigError(f"{dotted}: {metric!r} is not a validation metric of {task} data; "
                              f"allowed: {', '.join(sorted(allowed))}")


def _check_model_builds(job: JobConfig, task: str, spec: dict) -> None:
    """Build the model on the meta device (no memory, any size): a plug-in that cannot be imported,
    rejects its options or returns something else fails here, before anything starts."""
    import torch

    from training.models import build_model

    with torch.device("meta"):
        build_model(job.model.name, job.model.options, {"task": task, **spec})


def run_training(job: JobConfig, config_path: Optional[str] = None, log: Callable[[str], None] = print, *,
                 callbacks: tuple = (), initial_checkpoint: Optional[str] = None,
                 mlflow_run_id: Optional[str] = None, mlflow_tags: Optional[dict] = None) -> RunSummary:
    """Run (or resume) one training run to the end. Raises UserError before anything starts on bad
    input and RunFailed if the run itself fails.

    For runs driven by another program (a sweep): `callbacks`, extra Ray Train callbacks;
    `initial_checkpoint`, a checkpoint to start from when the run has none of its own;
    `mlflow_run_id`, an MLflow run to continue when the run has no record yet; `mlflow_tags`,
    extra tags (`mlflow.parentRunId` nests the run)."""
    from training.data.prepare import prepare
    from training.models import check_model_fits_task

    started = time.monotonic()
    timings = {"start": time.time()}  # wall-clock marks of a run's phases, for cold-start measurements
    name = job.name or default_run_name(config_path)
    job = job.model_copy(update={"name": name})
    paths = resolve_paths(job, name)
    try:
        record = read_run_record(paths)
    except OSError as exc:
        raise UserError(f"checkpoint.storage_path {paths.storage_path} is not reachable: "
                        f"{str(exc).splitlines()[0][:300]}") from None
    if record is not None:
        check_resumable(job, record, name)
    from training.run.capacity import maximum_resources

    largest = maximum_resources()  # None: no launcher config on this machine

    def check(task: str, spec: dict, rows: dict) -> None:  # on the loaded data, before anything is written
        check_model_fits_task(job.model.name, task)
        _check_model_builds(job, task, spec)
        check_metric_names(job, task)
        if job.train.global_batch_size > rows["train"]:
            raise ConfigError(f"train.global_batch_size {job.train.global_batch_size} is larger than the "
                              f"{rows['train']} training rows")
        check_storage(paths)

    try:
        manifest = prepare(job.data, paths.data_cache, log=log, check=check)
    except ValueError as exc:
        raise UserError(f"data ({job.data.source}): {exc}") from None
    timings["data_ready"] = time.time()

    log(f"run {name}: {'resuming' if record else 'starting'}; storage {paths.run_dir}")
    tracker = _start_tracking(job, paths, record, name, run_id=mlflow_run_id, extra_tags=mlflow_tags)
    timings["tracking_ready"] = time.time()
    if record is None:
        storage.write_text(storage.join(paths.run_dir, RUN_FILE), json.dumps({
            "name": name, "identity": config_lib.identity_of(job), "created": time.time(),
            "mlflow_run_id": tracker.run_id, "tracking_uri": paths.tracking_uri}, indent=2))
        storage.write_text(storage.join(paths.run_dir, "config.yaml"), config_lib.to_yaml(job))

    try:
        result = _fit(job, paths, manifest, tracker, name, timings, callbacks=callbacks,
                      initial_checkpoint=initial_checkpoint, largest=largest)
    except KeyboardInterrupt:
        tracker.finish("KILLED")
        raise
    except BaseException:
        tracker.finish("FAILED")
        raise
    from training.run.finalize import finalize

    # A run resumed at its last step trains nothing and reports nothing: its checkpoint has the metrics.
    metrics = dict(result.metrics or {}) or _checkpoint_metrics(result.checkpoint)
    summary = RunSummary(name=name, run_dir=paths.run_dir, steps=int(metrics.get("step", 0)),
                         metrics=metrics, wall_s=time.monotonic() - started, resumed=record is not None,
                         checkpoint_path=result.checkpoint.path if result.checkpoint else None,
                         mlflow_run_id=tracker.run_id, tracking_uri=paths.tracking_uri,
                         extra={"timings": {**timings, "fit_done": time.time(),
                                            "worker_start": metrics.get("worker_start_time"),
                                            "first_step": metrics.get("first_step_time")}})
    finalize(job, manifest, result, tracker, summary, log)
    tracker.finish("FINISHED")
    return summary


def _checkpoint_metrics(checkpoint) -> dict:
    """The step and metrics a checkpoint recorded (meta.json), or {} without one."""
    from training.checkpoint.format import read_meta

    meta = read_meta(checkpoint.filesystem, checkpoint.path) if checkpoint is not None else None
    return {**meta.get("metrics", {}), "step": meta["step"]} if meta else {}


def _start_tracking(job: JobConfig, paths: RunPaths, record: Optional[dict], name: str,
                    run_id: Optional[str] = None, extra_tags: Optional[dict] = None):
    from training.tracking.backlog import replay_backlogs
    from training.tracking.tracker import MlflowTracker, NullTracker

    if not job.tracking.enabled:
        return NullTracker()
    import ray
    import torch

    tags = {"training.run_name": name, "git_commit": git_commit(), "ray_version": ray.__version__,
            "torch_version": torch.__version__, "world_size": str(job.scaling.num_workers),
            "mlflow.runName": name, **(extra_tags or {})}
    run_id = record.get("mlflow_run_id") if record else run_id
    if record and record.get("tracking_uri") not in (None, paths.tracking_uri):
        raise ConfigError(f"run {name!r} is tracked at {record['tracking_uri']}, not {paths.tracking_uri}; "
                          "set tracking.tracking_uri to the original to resume it")
    try:
        tracker = MlflowTracker.start(paths.tracking_uri, job.tracking.experiment, name, run_id, tags,
                                      config_lib.flatten(job), artifact_location=_artifact_location(paths, job),
                                      run_dir=paths.run_dir)
    except Exception as exc:
        raise UserError(f"tracking: cannot reach MLflow at {paths.tracking_uri}: {exc}") from None
    tracker.client.log_text(tracker.run_id, config_lib.to_yaml(job), "config/resolved_config.yaml")
    replay_backlogs(paths.storage_path, tracker)  # what MLflow missed while it was away, this run's included
    return tracker


def _artifact_location(paths: RunPaths, job: JobConfig) -> Optional[str]:
    """Artifacts of an embedded (sqlite) store go next to the database, not into ./mlruns of
    whatever directory the driver runs in (a submitted job's is a temporary copy)."""
    if not paths.tracking_uri.startswith("sqlite:///"):
        return None  # a tracking server decides where artifacts go
    database = Path(paths.tracking_uri[len("sqlite:///"):])
    return (database.parent / "mlruns" / re.sub(r"[^A-Za-z0-9_.-]+", "-", job.tracking.experiment)).as_uri()


def _fit(job: JobConfig, paths: RunPaths, manifest, tracker, name: str, timings: dict, callbacks: tuple = (),
         initial_checkpoint: Optional[str] = None, largest: Optional[dict] = None):
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    from training.tracking.callback import run_callbacks
    from training.worker.loop import train_loop_per_worker
    from training.plugins import plugin_module_paths

    # The Train controller takes at most one report per worker per poll; poll more often than
    # the default 2 s so that reports do not stall fast steps (read by the controller at start).
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    # A preemption notice gives about two minutes: notice it within a second, not five.
    os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1")
    started_ray = False
    if not ray.is_initialized():
        # Plug-in modules outside installed packages travel to every node with the job. (A submitted
        # job ships them in its --working-dir.)
        plugin_paths = [] if in_submitted_job() else plugin_module_paths(job.model.name, job.data.source)
        started_ray = True  # shut down (or disconnect) when done
        # Started locally, Ray includes the dashboard: it serves the state API that Ray Train's
        # placement-group cleaner needs.
        address = None if os.environ.get("RAY_ADDRESS") else (live_local_cluster() or "local")
        ray.init(address=address, log_to_driver=True,
                 runtime_env={"py_modules": plugin_paths} if plugin_paths else None)
    timings["ray_ready"] = time.time()
    try:
        use_gpu = job.scaling.use_gpu
        if use_gpu == "auto":  # an autoscaling cluster may have no GPU node yet
            from training.run.capacity import use_gpus

            use_gpu = use_gpus(ray.cluster_resources(), largest)
        scaling = ray.train.ScalingConfig(
            num_workers=job.scaling.num_workers if isinstance(job.scaling.num_workers, int)
            else tuple(job.scaling.num_workers),
            use_gpu=use_gpu, resources_per_worker={"CPU": job.scaling.cpus_per_worker, **job.scaling.resources_per_worker,
                                                   **({"GPU": 1} if use_gpu else {})},
            elastic_resize_monitor_interval_s=job.scaling.resize_check_interval_s)
        run_config = ray.train.RunConfig(
            name=name, storage_path=paths.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=job.failure.max_failures,
                                                   max_preemption_failures=job.failure.max_preemption_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=job.checkpoint.keep,
                                                         checkpoint_score_attribute=job.checkpoint.score_metric,
                                                         checkpoint_score_order=job.checkpoint.score_mode),
            callbacks=[*run_callbacks(tracker, tracker.last_step("train_loss")), *callbacks], logging_config=ray.train.LoggingConfig(log_level="WARNING"))
        seeded = {"initial_checkpoint": initial_checkpoint} if initial_checkpoint else {}
        trainer = TorchTrainer(train_loop_per_worker,
                               train_loop_config={"job": job.model_dump(mode="json"), "manifest_root": manifest.root,
                                                  "run_dir": paths.run_dir, **seeded},
                               scaling_config=scaling, run_config=run_config)
        try:
            return trainer.fit()
        except ray.train.TrainingFailedError as exc:
            raise RunFailed(f"training run {name} failed: {_root_cause(exc)}") from exc
    finally:
        if started_ray:
            ray.shutdown()


def live_local_cluster() -> Optional[str]:
    """The address of a cluster started on this machine with `ray start`, if it is alive. A dead
    cluster's address (left in /tmp/ray/ray_current_cluster when its head was killed) is forgotten,
    as `ray stop` would: `ray.init()` would wait on it, and so would the state API in every process
    of the next cluster (40 s per call: Ray Train's placement-group cleaner stalls each run's end)."""
    from training.adaptors.ray_private import forget_recorded_address, recorded_local_address

    try:
        address = recorded_local_address()
    except Exception:  # none recorded (or Ray's private helpers moved): start a local cluster
        return None
    if address is None:
        return None
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except (OSError, ValueError):
        forget_recorded_address()
        return None
    return address


def _root_cause(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    tail = [line for line in text if line.strip()][-1:] or [type(exc).__name__]
    return tail[0][:500]
