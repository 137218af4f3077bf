"""The sweep in MLflow: one parent run, each trial's training run nested under it as a child.

The parent holds the search space (params), the resolved sweep, a results table (results.csv), the
best trial's config and metric, and plots: a learning curve per trial, and the metric against each
swept parameter. The best trial's model is registered. Each child has a `tune.trial_status` tag;
children of failed trials are marked FAILED. A trial that the scheduler stopped is not a failure:
its child is FINISHED at the time of its last evaluation, with a `tune.stopped_by` tag saying which
scheduler stopped it where, and holds every result the trial reported (its Train controller ends
with the trial, and what it had not yet sent to MLflow is lost with it: the sweep logs those results
from Tune's record of them). Its training run's status.json says `scheduler_stopped`.
"""

from __future__ import annotations

import csv
import math
import numbers
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import ray.train
import yaml

from training import config as config_lib
from training import storage
from training.adaptors.ray_private import result_grid_trials
from training.metrics import mlflow_name
from training.redaction import redact, redact_values
from training.run.finalize import load_final_model, log_model, register_model, registered_model_name
from training.run.paths import artifact_location
from training.run.record import Record
from training.tracking.tracker import MlflowTracker, NullTracker
from tuning.config import Sweep
from tuning.events import STOPPED_BY_TAG, mark_scheduler_stopped, params_text, stop_reason
from tuning.schedule import absolute_base
from tuning.trial import SWEEP_TAG, TRIAL_TAG, TrialSetup, trial_job


@dataclass
class TrialRow:
    trial_id: str
    status: str  # finished | stopped | failed
    run: str
    params: dict
    steps: int
    last: Optional[float]
    best: Optional[float]
    mlflow_run_id: Optional[str] = None
    history: list = field(default_factory=list)  # (step, metric)
    timeline: list = field(default_factory=list)  # (step, metric, wall-clock time of the evaluation)
    checkpoint_path: Optional[str] = None
    reports: list = field(default_factory=list)  # (step, wall-clock time, the training run's metrics) per result


def start_parent(sweep: Sweep, paths, state: Optional[Record]):
    if paths.tracking_uri is None:
        return NullTracker()
    params = {f"space.{path}": dim.describe() for path, dim in sweep.space.items()}
    cfg = sweep.config
    params.update({"search.algorithm": cfg.search.algorithm, "search.seed": str(cfg.search.seed),
                   "scheduler": cfg.scheduler.name, "metric": cfg.metric, "mode": cfg.mode,
                   "num_samples": str(cfg.num_samples)})
    if cfg.scheduler.name == "asha":
        params.update({"scheduler.grace_period_steps": str(cfg.scheduler.grace_period_steps),
                       "scheduler.reduction_factor": str(cfg.scheduler.reduction_factor)})
    if cfg.scheduler.name == "pbt":
        params.update({"scheduler.perturbation_interval_steps": str(cfg.scheduler.perturbation_interval_steps),
                       "scheduler.quantile_fraction": str(cfg.scheduler.quantile_fraction),
                       "scheduler.resample_probability": str(cfg.scheduler.resample_probability),
                       "scheduler.synch": str(cfg.scheduler.synch)})
    tags = {SWEEP_TAG: sweep.name, "tune.role": "sweep", "mlflow.runName": sweep.name}
    parent = MlflowTracker.start(paths.tracking_uri, sweep.base.tracking.experiment, sweep.name,
                                 state.mlflow_run_id if state else None, tags, params,
                                 artifact_location=artifact_location(paths, sweep.base))
    text = yaml.safe_dump(redact_values({"sweep": cfg.model_dump(mode="json"), "base": config_lib.shown(sweep.base)}),
                          sort_keys=False)
    parent.client.log_text(parent.run_id, text, "sweep/resolved_sweep.yaml")
    return parent


def trial_rows(sweep: Sweep, grid, paths) -> list[TrialRow]:
    metric = sweep.config.metric
    rows = []
    for trial, result in zip(result_grid_trials(grid), grid):
        metrics = result.metrics or {}
        run = metrics.get("training_run") or f"{sweep.name}-{trial.trial_id}"
        frame = result.metrics_dataframe
        timeline = []
        if frame is not None and metric in frame:
            walls = frame["wall_time"] if "wall_time" in frame else frame["timestamp"]
            timeline = [(int(s), float(v), float(w)) for s, v, w in zip(frame["step"], frame[metric], walls)
                        if not _nan(v)]
        history = [(s, v) for s, v, _ in timeline]
        values = [v for _, v in history]
        best = (max if sweep.config.mode == "max" else min)(values) if values else None
        if result.error is not None:
            status = "failed"
        elif storage.exists(storage.join(paths.storage_path, run, "summary.json")):
            status = "finished"
        else:
            status = "stopped"
        rows.append(TrialRow(trial.trial_id, status, run, dict(trial.config), int(metrics.get("step", 0)),
                             values[-1] if values else None, best, history=history, timeline=timeline,
                             checkpoint_path=metrics.get("checkpoint_path"), reports=_reports(frame)))
    return rows


def _not_training_metric(key: str) -> bool:
    """What Tune and the trial add to each result, not the training run's own metrics."""
    from ray.tune.result import AUTO_RESULT_KEYS  # (lazy: ray.tune)

    return (key in AUTO_RESULT_KEYS or key.startswith("config/")
            or key in ("done", "trial_id", "training_run", "checkpoint_path", "should_checkpoint", "step",
                       "total_steps"))


def _reports(frame) -> list:
    if frame is None or "step" not in frame:
        return []
    reports = []
    for record in frame.to_dict("records"):
        values = {k: float(v) for k, v in record.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)
                  and not _nan(float(v)) and not _not_training_metric(k)}
        wall = record.get("wall_time", record.get("timestamp"))
        reports.append((int(record["step"]), None if _nan(wall) else float(wall), values))
    return reports


def best_row(sweep: Sweep, rows: list[TrialRow]) -> Optional[TrialRow]:
    scored = [r for r in rows if r.status != "failed" and r.last is not None]
    if not scored:
        return None
    pick = max if sweep.config.mode == "max" else min
    return pick(scored, key=lambda r: r.last)


def finish(sweep: Sweep, paths, manifest, grid, parent, state: Record, summary, log) -> None:
    rows = trial_rows(sweep, grid, paths)
    summary.rows, summary.best = rows, best_row(sweep, rows)
    for row in rows:
        log(f"  trial {row.trial_id} {row.status:8} {sweep.config.metric} {_fmt(row.last)} at step {row.steps} "
            f"{params_text(row.params)}")
    if parent.run_id is None:
        return
    client = parent.client
    children = {run.data.tags.get(TRIAL_TAG): run for run in client.search_runs(
        [client.get_run(parent.run_id).info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent.run_id}'")}
    for row in rows:
        child = children.get(row.trial_id)
        if child is None:
            continue
        row.mlflow_run_id = child.info.run_id
        client.set_tag(child.info.run_id, "tune.trial_status", row.status)
        if row.status == "stopped":
            _end_stopped(sweep, paths, client, child, row)
        elif child.info.status != row.status.upper():  # finished: FINISHED, failed: FAILED
            client.set_terminated(child.info.run_id, status=row.status.upper())
    counts = {status: sum(r.status == status for r in rows) for status in ("finished", "stopped", "failed")}
    for status, count in counts.items():
        client.log_metric(parent.run_id, f"trials_{status}", count)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _write_table(sweep, rows, tmp / "results.csv")
        client.log_artifact(parent.run_id, str(tmp / "results.csv"))
        for plot in _plots(sweep, rows, tmp):
            client.log_artifact(parent.run_id, str(plot), "plots")
        best = summary.best
        if best is not None:
            setup = TrialSetup(sweep.name, absolute_base(sweep, paths), paths.base_dir, paths.tracking_uri,
                               sweep.base.tracking.experiment, parent.run_id, False)
            job = trial_job(setup, best.params, best.run)
            client.log_text(parent.run_id, config_lib.to_yaml(job), "best/config.yaml")
            client.log_metric(parent.run_id, f"best_{sweep.config.metric}", best.last)
            client.set_tag(parent.run_id, "best_trial_id", best.trial_id)
            if best.mlflow_run_id:
                client.set_tag(parent.run_id, "best_run_id", best.mlflow_run_id)
            if sweep.base.tracking.register_model and best.mlflow_run_id:
                summary.registered = state.registered or register_trial(sweep, job, manifest, best, parent)
                state.registered = summary.registered
            log(f"sweep {sweep.name}: best trial {best.trial_id} ({sweep.config.metric} {_fmt(best.last)}) "
                f"{params_text(best.params)}")
    log(f"  MLflow parent run {parent.run_id} at {redact(parent.tracking_uri)}")
    if summary.registered:
        log(f"  registered model: {summary.registered['name']} version {summary.registered['version']}")


def _end_stopped(sweep: Sweep, paths, client, child, row: TrialRow) -> None:
    """A trial the scheduler stopped: every result it reported in its child run, which ends FINISHED
    at its last evaluation with the reason in a tag; its training run's status.json says so too."""
    reason = stop_reason(sweep.config.scheduler.name, row.steps, sweep.config.metric, row.last)
    ended_s = next((wall for _, wall, _ in reversed(row.reports) if wall is not None), None)
    log_missing_results(client, child.info.run_id, row.reports)
    if child.info.status != "FINISHED" or child.data.tags.get(STOPPED_BY_TAG) != reason:
        client.set_tag(child.info.run_id, STOPPED_BY_TAG, reason)
        client.set_terminated(child.info.run_id, status="FINISHED",
                              end_time=int(ended_s * 1000) if ended_s is not None else None)
    mark_scheduler_stopped(storage.join(paths.storage_path, row.run), reason, ended_s or time.time())


def log_missing_results(client, run_id: str, reports: list) -> int:
    """Log each reported (step, metric) that the run lacks, under its MLflow name, at the time it was
    measured; what the Train controller did send is left as it is, so no step is logged twice.
    Returns how many were logged."""
    from mlflow.entities import Metric  # (lazy: mlflow)

    keys = {mlflow_name(key) for _, _, values in reports for key in values}
    logged = {key: {m.step for m in client.get_metric_history(run_id, key)} for key in keys}
    missing = {}
    for step, wall, values in reports:  # (a step reported again after a restart: its first report)
        for key, value in ((mlflow_name(k), v) for k, v in values.items()):
            if step not in logged[key] and (key, step) not in missing:
                missing[key, step] = Metric(key, value, int((wall if wall is not None else time.time()) * 1000), step)
    missing = list(missing.values())
    for start in range(0, len(missing), 1000):  # (MLflow's limit for one request)
        client.log_batch(run_id, metrics=missing[start:start + 1000])
    return len(missing)


def register_trial(sweep: Sweep, job, manifest, best: TrialRow, parent) -> Optional[dict]:
    """Register the best trial's logged model; a trial stopped before the end has none: log it from
    its last checkpoint first."""
    client = parent.client
    name = registered_model_name(sweep.base)
    experiment_id = client.get_run(best.mlflow_run_id).info.experiment_id
    logged = client.search_logged_models(experiment_ids=[experiment_id],
                                         filter_string=f"source_run_id = '{best.mlflow_run_id}'",
                                         order_by=[{"field_name": "creation_time", "ascending": False}])
    registering = job.model_copy(update={"tracking": job.tracking.model_copy(
        update={"register_model": True, "registered_model_name": name})})
    if logged:  # (aliases and tags as a single run's: training/tracking/registry.py)
        version = register_model(registering, manifest, client, logged[0].model_id, best.mlflow_run_id)[
            "registered_version"]
    elif best.checkpoint_path:
        fs, path = storage.filesystem(best.checkpoint_path)
        model = load_final_model(job.model, manifest, ray.train.Checkpoint(path, filesystem=fs))
        ended_ms = client.get_run(best.mlflow_run_id).info.end_time
        version = log_model(registering, manifest, model, MlflowTracker(parent.tracking_uri, best.mlflow_run_id))[
            "registered_version"]
        # (logging reopens the run and ends it now: it ended at its last evaluation, _end_stopped)
        client.set_terminated(best.mlflow_run_id, status="FINISHED", end_time=ended_ms)
    else:
        return None
    if version is None:  # tracking.register_when improved, and the best trial does not beat @best
        return None
    client.set_model_version_tag(name, str(version), SWEEP_TAG, sweep.name)
    client.set_model_version_tag(name, str(version), TRIAL_TAG, best.trial_id)
    return {"name": name, "version": str(version)}


def _write_table(sweep: Sweep, rows: list[TrialRow], path: Path) -> None:
    params = list(sweep.space)
    metric = sweep.config.metric
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["trial_id", "status", "steps", f"{metric}_last", f"{metric}_best", *params,
                         "training_run", "mlflow_run_id"])
        for row in rows:
            writer.writerow([row.trial_id, row.status, row.steps, row.last, row.best,
                             *[row.params.get(p) for p in params], row.run, row.mlflow_run_id])


def _plots(sweep: Sweep, rows: list[TrialRow], folder: Path) -> list[Path]:
    import matplotlib  # (lazy: matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (lazy: matplotlib)

    metric, written = sweep.config.metric, []
    fig, axis = plt.subplots(figsize=(8, 5))
    for row in rows:
        if row.history:
            axis.plot(*zip(*row.history), marker=".", label=f"{row.trial_id} ({row.status})")
    axis.set(xlabel="step", ylabel=metric, title=f"{sweep.name}: {metric} per trial")
    axis.legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    written.append(folder / "learning_curves.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    for path, dim in sweep.space.items():
        points = [(row.params.get(path), row.last) for row in rows if row.last is not None]
        numeric = all(isinstance(x, (int, float)) for x, _ in points)
        fig, axis = plt.subplots(figsize=(6, 4))
        xs = [x if numeric else str(x) for x, _ in points]
        axis.scatter(xs, [y for _, y in points])
        if dim.kind == "loguniform":
            axis.set_xscale("log")
        axis.set(xlabel=path, ylabel=f"{metric} (last)", title=f"{metric} vs {path}")
        fig.tight_layout()
        written.append(folder / f"{metric}_vs_{path}.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written


def _nan(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4f}"
