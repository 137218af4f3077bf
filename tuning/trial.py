"""One trial: the function trainable Tune runs, which runs one training run through
`training.run.driver.run_training`, the same code path as `python -m training`.

The run is named after the trial (`<sweep>-<trial id>`), so a restarted trial resumes its own run
from its own checkpoints, and it continues the trial's one MLflow child run. The Train controller
forwards each evaluation (under PBT: each checkpoint, with a copy of it) to this trial's Tune
session through a queue, so that ASHA decides at every evaluation and PBT can copy weights.
"""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pyarrow.fs as pafs
import ray.train
from ray import tune
from ray.util.queue import Empty, Queue

from training import config as config_lib
from training import storage
from training.config import JobConfig
from training.run.driver import run_training
from training.run.paths import resolve_paths
from training.schema import set_path
from tuning import exploit
from tuning.space import plain

TRIAL_TAG, SWEEP_TAG = "tune.trial_id", "tune.sweep"


@dataclass(frozen=True)
class TrialSetup:
    """What every trial of a sweep shares (sent to the trial actors once)."""
    sweep_name: str
    base_raw: dict  # the base job, paths already absolute
    base_dir: str
    tracking_uri: Optional[str]
    experiment: str
    parent_run_id: Optional[str]
    report_checkpoints: bool  # PBT: every Tune report carries a checkpoint to copy from


def trial_job(setup: TrialSetup, params: dict, run_name: str) -> JobConfig:
    raw = setup.base_raw
    for path, value in params.items():
        raw = set_path(raw, path, plain(value))
    raw = set_path(raw, "name", run_name)
    raw = set_path(raw, "tracking.register_model", False)  # the sweep registers its best trial's model
    return config_lib.validate(raw, f"trial {run_name}")


class ForwardToTune(ray.train.UserCallback):
    """On the Train controller: hands evaluation reports (or, under PBT, checkpoint reports) to the trial."""

    def __init__(self, reports, eval_every_n_steps: int, checkpoints_only: bool):
        self.reports, self.eval_every, self.checkpoints_only = reports, eval_every_n_steps, checkpoints_only

    def after_report(self, run_context, metrics, checkpoint) -> None:
        latest = metrics[0]
        step, total = int(latest["step"]), int(latest.get("total_steps", 0))
        if self.checkpoints_only:
            wanted = checkpoint is not None
        else:
            wanted = checkpoint is not None or step % self.eval_every == 0 or step == total
        if wanted:
            metrics = dict(latest, checkpoint_path=checkpoint.path) if checkpoint is not None else dict(latest)
            self.reports.put({"metrics": metrics, "checkpoint": checkpoint if self.checkpoints_only else None})


def find_child_run(setup: TrialSetup, trial_id: str) -> Optional[str]:
    """The trial's MLflow run if one exists (a restarted trial, or a PBT exploit's new training run)."""
    if setup.tracking_uri is None or setup.parent_run_id is None:
        return None
    from mlflow.tracking import MlflowClient  # (lazy: mlflow)

    client = MlflowClient(setup.tracking_uri)
    experiment = client.get_experiment_by_name(setup.experiment)
    found = client.search_runs([experiment.experiment_id], max_results=1, filter_string=(
        f"tags.`mlflow.parentRunId` = '{setup.parent_run_id}' and tags.`{TRIAL_TAG}` = '{trial_id}'"))
    return found[0].info.run_id if found else None


def train_trial(params: dict, setup: TrialSetup) -> None:
    """Tune's function trainable."""


    os.environ["TRAINING_BASE_DIR"] = setup.base_dir  # Tune moved the working directory into the trial's
    trial_id = tune.get_context().get_trial_id()
    base_name = f"{setup.sweep_name}-{trial_id}"
    tune_checkpoint = tune.get_checkpoint()
    source = None
    if tune_checkpoint is not None:
        with tune_checkpoint.as_directory() as directory:
            source = exploit.read_source(directory)
    start = exploit.decide_start(base_name, trial_id, source)
    job = trial_job(setup, params, start.run_name)
    seed = _seed_checkpoint(job, tune_checkpoint) if start.seed_from else None
    if seed:
        print(f"trial {trial_id}: continuing from trial {start.seed_from['trial_id']} at step "
              f"{start.seed_from['step']} as run {start.run_name}", flush=True)

    reports = Queue(maxsize=1, actor_options={"num_cpus": 0})
    callback = ForwardToTune(reports, job.train.eval_every_n_steps, setup.report_checkpoints)
    tags = {SWEEP_TAG: setup.sweep_name, TRIAL_TAG: trial_id}
    if setup.parent_run_id:
        tags["mlflow.parentRunId"] = setup.parent_run_id
    outcome: dict = {}

    def run() -> None:
        try:
            run_training(job, log=lambda line: print(line, flush=True), callbacks=(callback,),
                         initial_checkpoint=seed, mlflow_run_id=find_child_run(setup, trial_id), mlflow_tags=tags)
        except BaseException as exc:  # raised again in Tune's thread, where Tune sees it
            outcome["error"] = exc

    runner = threading.Thread(target=run, name=f"training-{start.run_name}", daemon=True)
    runner.start()
    while True:
        try:
            item = reports.get(timeout=0.5)
        except Empty:
            if runner.is_alive():
                continue
            try:
                item = reports.get_nowait()
            except Empty:
                break
        _report(item, start.run_name, trial_id)
    runner.join()
    if "error" in outcome:
        raise outcome["error"]


def _report(item: dict, run_name: str, trial_id: str) -> None:
    metrics = {k: v for k, v in item["metrics"].items() if isinstance(v, (int, float, str))}
    metrics["training_run"] = run_name
    checkpoint = item["checkpoint"]
    if checkpoint is None:
        tune.report(metrics)
        return
    with checkpoint.as_directory() as source, tempfile.TemporaryDirectory() as tmp:
        exploit.write_tune_copy(source, Path(tmp), run=run_name, trial_id=trial_id, step=int(metrics["step"]))
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(tmp))  # Tune persists a copy


def _seed_checkpoint(job: JobConfig, tune_checkpoint) -> str:
    """The donor's checkpoint rebased onto this trial's hyperparameters, where this trial's workers
    can read it (next to the run's own checkpoints)."""

    run_dir = resolve_paths(job, job.name).run_dir
    seed_uri = storage.join(run_dir, "seed")
    if storage.exists(seed_uri):  # the trial restarted before its first checkpoint: same seed
        return seed_uri

    with tune_checkpoint.as_directory() as donor, tempfile.TemporaryDirectory() as tmp:
        exploit.rebase(donor, Path(tmp) / "seed", job.optim)
        fs, path = storage.filesystem(seed_uri)
        fs.create_dir(path, recursive=True)
        pafs.copy_files(str(Path(tmp) / "seed"), path, source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=fs)
    return seed_uri
