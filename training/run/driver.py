"""One training run from the driver: check the job, plan and prepare its data, join or start Ray,
open its MLflow run, fit a TorchTrainer, then log the final model and a summary.

Everything a user can get wrong is checked before Ray starts (UserError, exit code 2).
"""

from __future__ import annotations

import subprocess
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from training import config as config_lib
from training import storage, topics
from training.adaptors.ray_private import autoscaler_node_groups
from training.config import JobConfig
from training.data.registry import source_of
from training.errors import RunFailed, UserError, last_line
from training.models.family import check_pinned
from training.models.registry import family_of
from training.observe import notify
from training.observe.system import SYSTEM_KEY
from training.redaction import redact
from training.run import interrupt, preflight
from training.run.fit import fit
from training.run.paths import RunPaths, artifact_location, default_run_name, resolve_paths
from training.run.placement import PlacementDecision, decide_placement, decide_wait
from training.run.record import Record
from training.run.resources import NodeGroup, WorkerResources, maximum_node_groups, summed, worker_resources
from training.run.session import check_cluster_to_join, ray_session
from training.tracking.backlog import replay_backlogs
from training.tracking.datasets import log_datasets
from training.tracking.tracker import RUN_NAME_TAG, MlflowTracker, NullTracker

RUN_FILE = "run.json"


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
    use_gpu: bool = False  # each worker held a GPU (scaling.use_gpu, `auto` resolved for the cluster)
    extra: dict = field(default_factory=dict)


def run_training(job: JobConfig, config_path: Optional[str] = None, log: Callable[[str], None] = print, *,
                 callbacks: tuple = (), initial_checkpoint: Optional[str] = None,
                 mlflow_run_id: Optional[str] = None, mlflow_tags: Optional[dict] = None,
                 started: Optional[Callable[[], None]] = None) -> RunSummary:
    """Run (or resume) one training run to the end. Raises UserError before anything starts on bad
    input and RunFailed if the run itself fails.

    For runs driven by another program (a sweep): `callbacks`, extra Ray Train callbacks;
    `initial_checkpoint`, a checkpoint to start from when the run has none of its own;
    `mlflow_run_id`, an MLflow run to continue when the run has no record yet; `mlflow_tags`,
    extra tags (`mlflow.parentRunId` nests the run). `started` is called once the checks have
    passed and the run begins (its log file may be opened then: bad input writes nothing)."""


    started_s = time.monotonic()
    timings = {"start": time.time()}  # wall-clock marks of a run's phases, for cold-start measurements
    targets = notify.resolve(job.tracking.notify)  # (a variable not set: exit 2, before anything starts)
    name = job.name or default_run_name(config_path)
    job = job.model_copy(update={"name": name})
    paths = resolve_paths(job, name)
    record_uri = storage.join(paths.run_dir, RUN_FILE)
    record = Record.read(record_uri, name, f"checkpoint.storage_path {redact(paths.storage_path)}")
    if record is not None:
        record.check_resumable(config_lib.identity_of(job), "run", "the original values")
    pinned = family_of(job.model.name).pinned(job.model)  # (an adapter's base: its digest)
    if record is not None:
        check_pinned(record.pinned, pinned)
    preflight.check_tracking(job, paths, record)
    # The data is planned once: its input listed and checked (paths, options, tokenizer or function,
    # splits), without Ray; a resumed run's, against what it started on.
    plan = source_of(job.data.source).plan(job.data, paths.data_cache)
    preflight.config_checks(job, plan)  # (what the config alone reveals: before anything is prepared)
    if record is not None and record.dataset:
        plan.check_unchanged(record.dataset.get("root"))
    largest = maximum_node_groups()  # None: no launcher config on this machine
    checks = preflight.job_checks(job, paths, getattr(plan, "batch_partitions", None))
    # What is prepared on the cluster is prepared inside the Ray session the fit then uses; the
    # job's checks on the data (rows, the model's shapes) run once it is prepared.
    on_cluster = plan.wants_cluster()
    manifest = None if on_cluster else preflight.prepare_checked(job.data, paths, checks, log, plan)
    # (after the checks above, which import no Ray: a leftover local cluster, or a RAY_ADDRESS, that
    # cannot be joined)
    check_cluster_to_join()
    with ExitStack() as session:
        placed = None
        if on_cluster:
            ray_up = session.enter_context(ray_session(*plugin_specs(job)))
            placed = place(job, largest, ray_up.local_only)  # (before the data is prepared)
            manifest = preflight.prepare_checked(job.data, paths, checks, log, plan)
        return _run(job, paths, record, record_uri, name, manifest, largest, placed, timings, started_s, log,
                    callbacks, initial_checkpoint, mlflow_run_id, mlflow_tags, targets, started, pinned)


def plugin_specs(job: JobConfig) -> list[str]:
    """The job's plug-ins that Ray ships to the cluster when they are local source: the model's, the
    data source's, the data transform's."""
    return [*family_of(job.model.name).plugins(job.model), *source_of(job.data.source).plugins(job.data)]


def place(job: JobConfig, largest: Optional[list[NodeGroup]],
          local_only: bool) -> tuple[WorkerResources, PlacementDecision, Optional[list[NodeGroup]]]:
    """Once Ray is up, before the run starts: what each worker holds, whether the group can be
    placed, and the cluster at its largest where known; UserError (exit 2) when the cluster cannot
    hold the group and cannot grow to."""
    if largest is None:  # (what an autoscaler published in Ray's GCS, where one did)
        published = autoscaler_node_groups()
        largest = [NodeGroup(resources, count) for resources, count in published] if published else None
    workers = worker_resources(job.scaling, _ray().cluster_resources(), summed(largest) if largest else None)
    decision = decide_placement(job.scaling, workers.per_worker, live_nodes(), largest, local_only)
    if decision.action == "refuse":
        raise UserError(decision.message)
    return workers, decision, largest


def live_nodes() -> list[dict[str, float]]:
    return [dict(node.get("Resources") or {}) for node in _ray().nodes() if node.get("Alive")]


def _ray():
    import ray  # (lazy: ray)

    return ray


# How often a run that waits for the autoscaler looks at the cluster again (it says so every 30 s).
WAIT_POLL_S = 5.0


@contextmanager
def waiting_for_nodes(job: JobConfig, workers: WorkerResources, decision: PlacementDecision,
                      largest: Optional[list[NodeGroup]], log: Callable[[str], None],
                      clock: Callable[[], float] = time.monotonic):
    """For the `with` block (the fit): while the group waits for nodes the autoscaler may add, say
    so on the console, with the pending demand, every 30 s (placement.decide_wait decides)."""
    if decision.action != "wait":
        yield
        return
    stop = threading.Event()

    def watch() -> None:
        since, said, message, fits = clock(), None, decision.message, False
        while True:
            wait = decide_wait(message, since, said, clock(), fits)
            if wait.say:
                log(wait.say)
                said = clock()
            if wait.done or stop.wait(WAIT_POLL_S):
                return
            try:
                now = decide_placement(job.scaling, workers.per_worker, live_nodes(), largest, local_only=False)
            except Exception:  # (Ray is being shut down: the run has ended)
                return
            fits, message = now.action == "start", now.message or message

    thread = threading.Thread(target=watch, name="placement-wait", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()


def _run(job, paths, record, record_uri, name, manifest, largest, placed, timings, started, log, callbacks,
         initial_checkpoint, mlflow_run_id, mlflow_tags, targets, on_start, pinned=None) -> RunSummary:
    """From the prepared data to the end of the run (inside the Ray session that prepared the data,
    if one did)."""
    from training.run.finalize import finalize  # (lazy: torch)

    timings["data_ready"] = time.time()
    # Ray joined (or started) first: a cluster that cannot be joined (a wrong RAY_ADDRESS, no token)
    # is refused before the run writes anything or starts its MLflow run.
    with ray_session(*plugin_specs(job)) as ray_up:
        timings["ray_ready"] = time.time()
        # A group the cluster cannot hold is refused here: before the run writes anything.
        workers, decision, largest = placed or place(job, largest, ray_up.local_only)
        tracker, watch = _start(job, paths, record, record_uri, name, manifest, log, mlflow_run_id, mlflow_tags,
                                targets, on_start, pinned)
        timings["tracking_ready"] = time.time()
        try:
            with waiting_for_nodes(job, workers, decision, largest, log):
                result = fit(job, paths, manifest.root, tracker, workers,
                             callbacks=(*watch.callbacks(), *callbacks), initial_checkpoint=initial_checkpoint)
        except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM (training/run/interrupt.py): resumable
            _interrupted(tracker, watch, exc)
            raise
        except BaseException as exc:
            tracker.finish("FAILED")
            watch.end("failed", _error_line(exc))
            raise

    # A group resumed at the last step trains nothing and reports nothing: its checkpoint has the metrics.
    from training.checkpoint.format import metrics_of  # (lazy: torch)
    from training.checkpoint.restore import final_checkpoint  # (lazy: ray.train)

    checkpoint = final_checkpoint(result.checkpoint, paths.run_dir)
    metrics = dict(result.metrics or {})
    metrics.pop(SYSTEM_KEY, None)  # rank 0's last system-metric samples: logged by the controller already
    if checkpoint is not None and (not metrics or checkpoint is not result.checkpoint):
        metrics = metrics_of(checkpoint.filesystem, checkpoint.path)
    summary = RunSummary(name=name, run_dir=paths.run_dir, steps=int(metrics.get("step", 0)),
                         metrics=metrics, wall_s=time.monotonic() - started, resumed=record is not None,
                         checkpoint_path=checkpoint.path if checkpoint else None,
                         mlflow_run_id=tracker.run_id, tracking_uri=paths.tracking_uri, use_gpu=workers.use_gpu,
                         extra={"timings": {**timings, "fit_done": time.time(),
                                            "worker_start": metrics.get("worker_start_time"),
                                            "first_step": metrics.get("first_step_time")}})
    try:
        finalize(job, manifest, result, checkpoint, tracker, summary, log)
    except KeyboardInterrupt as exc:
        _interrupted(tracker, watch, exc)
        raise
    except BaseException as exc:
        watch.end("failed", _error_line(exc))
        raise
    tracker.finish("FINISHED")
    watch.end("finished", metrics=metrics)
    return summary


def _start(job, paths, record, record_uri, name, manifest, log, mlflow_run_id, mlflow_tags, targets, on_start,
           pinned=None):
    """The run begins: its log, its MLflow run (with its dataset and tokenizer, when new), its record
    and config in storage, and the watch that posts and records its progress."""
    from training.observe.run_watch import RunWatch  # (lazy: ray.train)

    if on_start is not None:
        on_start()
    log(f"run {name}: {'resuming' if record else 'starting'}; storage {paths.run_dir}")
    tracker = start_tracking(job, paths, record, name, run_id=mlflow_run_id, extra_tags=mlflow_tags)
    if record is None:
        if job.tracking.enabled:
            log_datasets(tracker, manifest, log)
            source_of(job.data.source).track(tracker, manifest, log)
        Record(name, config_lib.identity_of(job), tracker.run_id, paths.tracking_uri,
                  dataset={"root": manifest.root, "digest": manifest.digest}, pinned=pinned or None).write(record_uri)
        storage.write_text(storage.join(paths.run_dir, "config.yaml"), config_lib.to_yaml(job))
    return tracker, RunWatch.start(name, paths, tracker, targets, log)


def _interrupted(tracker, watch, exc: BaseException) -> None:
    """The run stopped on purpose, resumable: MLflow's run KILLED, status.json `interrupted`."""
    watch.end("interrupted", interrupt.reason(exc))  # (first: the record that makes it resumable)
    tracker.finish("KILLED")


def _error_line(exc: BaseException) -> str:
    """The failure's line for status.json: an error whose text says nothing by itself (Ray's
    SystemExit(1), an exception without a message) is named by its type."""
    if isinstance(exc, RunFailed):
        return redact(str(exc))[:500]
    line = last_line(exc)
    return line if any(c.isalpha() for c in line) else f"{type(exc).__name__}: {line}"


def start_tracking(job: JobConfig, paths: RunPaths, record: Optional[Record], name: str,
                   run_id: Optional[str] = None, extra_tags: Optional[dict] = None):
    """The run's tracker: its MLflow run continued (a resume) or created, with the job's params and
    tags; the backlogs of earlier runs in the same storage delivered. UserError if MLflow is away."""

    if not job.tracking.enabled:
        return NullTracker()
    import ray  # (lazy: ray)
    import torch  # (lazy: torch)

    tags = {RUN_NAME_TAG: name, "git_commit": git_commit(), "ray_version": ray.__version__,
            "torch_version": torch.__version__, "world_size": str(job.scaling.num_workers),
            "mlflow.runName": name, **(extra_tags or {})}
    if record is not None:  # (tracked where it was: preflight.check_tracking, before the data)
        run_id = record.mlflow_run_id
    try:
        tracker = MlflowTracker.start(paths.tracking_uri, job.tracking.experiment, name, run_id, tags,
                                      config_lib.flatten(job), artifact_location=artifact_location(paths, job),
                                      run_dir=paths.run_dir)
    except Exception as exc:
        raise UserError(redact(topics.line(topics.TRACKING,
                                           f"cannot reach MLflow at {paths.tracking_uri}: {exc}"))) from None
    tracker.client.log_text(tracker.run_id, config_lib.to_yaml(job), "config/resolved_config.yaml")
    replay_backlogs(paths.storage_path, tracker)  # what MLflow missed while it was away, this run's included
    return tracker


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
