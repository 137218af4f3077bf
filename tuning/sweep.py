"""One sweep from the driver: check, prepare the data once, open the parent MLflow run, start or
join Ray, run (or resume) Tune, then record the results under the parent run.

The sweep lives in `<storage_path>/sweeps/<name>/` (Tune's experiment and `sweep.json`); each trial's
training run in `<storage_path>/<name>-<trial id>/`, like any training run.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from training import storage
from training.errors import ConfigError, UserError
from tuning.config import Sweep

STATE_FILE = "sweep.json"


@dataclass
class SweepSummary:
    name: str
    path: str
    rows: list = field(default_factory=list)
    best: Optional[object] = None
    parent_run_id: Optional[str] = None
    tracking_uri: Optional[str] = None
    registered: Optional[dict] = None
    released_groups: int = 0
    concurrency: int = 0
    resumed: bool = False
    wall_s: float = 0.0


def sweep_dir(sweep: Sweep) -> str:
    from training.run.driver import resolve_paths

    return storage.join(resolve_paths(sweep.base, sweep.name).storage_path, "sweeps", sweep.name)


def read_state(sweep: Sweep) -> Optional[dict]:
    uri = storage.join(sweep_dir(sweep), STATE_FILE)
    return json.loads(storage.read_text(uri)) if storage.exists(uri) else None


def check_resumable(sweep: Sweep, state: dict) -> None:
    now = json.loads(json.dumps(sweep.identity()))
    changed = sorted(key for key, value in now.items() if state["identity"].get(key) != value)
    if changed:
        raise ConfigError(f"sweep {sweep.name!r} already exists with a different {', '.join(changed)}; resuming it "
                          "would mix two sweeps. Use a new --name, or the original sweep file to resume it.")


def run_sweep(sweep: Sweep, log: Callable[[str], None] = print) -> SweepSummary:
    """Run (or resume) a sweep to the end. UserError before anything starts on bad input."""
    from training.data.prepare import prepare
    from training.run.driver import check_storage, resolve_paths
    from training.metrics import VALIDATION_METRICS

    started = time.monotonic()
    state = read_state(sweep)
    if state is not None:
        check_resumable(sweep, state)
    paths = resolve_paths(sweep.base, sweep.name)

    def check(task: str, spec: dict, rows: dict) -> None:
        if sweep.config.metric not in VALIDATION_METRICS[task]:
            raise ConfigError(f"metric: {sweep.config.metric!r} is not a validation metric of {task} data; "
                              f"allowed: {', '.join(sorted(VALIDATION_METRICS[task]))}")
        check_storage(paths)

    try:
        manifest = prepare(sweep.base.data, paths.data_cache, log=log, check=check)
    except ValueError as exc:
        raise UserError(f"data ({sweep.base.data.source}): {exc}") from None
    from tuning import report

    parent = report.start_parent(sweep, paths, state)
    path = sweep_dir(sweep)
    if state is None:
        state = {"name": sweep.name, "identity": sweep.identity(), "created": time.time(),
                 "parent_run_id": parent.run_id, "tracking_uri": paths.tracking_uri}
        storage.write_text(storage.join(path, STATE_FILE), json.dumps(state, indent=2))
    log(f"sweep {sweep.name}: {'resuming' if _started(path) else 'starting'}; storage {path}")
    summary = SweepSummary(name=sweep.name, path=path, parent_run_id=parent.run_id, tracking_uri=paths.tracking_uri)
    try:
        grid, summary.released_groups, summary.concurrency, summary.resumed = _tune(sweep, paths, parent.run_id, log)
        report.finish(sweep, paths, manifest, grid, parent, state, summary, log)
    except BaseException:
        parent.finish("FAILED")
        raise
    storage.write_text(storage.join(path, STATE_FILE), json.dumps(state, indent=2))
    summary.wall_s = time.monotonic() - started
    parent.finish("FINISHED")
    return summary


def _started(path: str) -> bool:
    return storage.exists(storage.join(path, "tuner.pkl"))


def _tune(sweep: Sweep, paths, parent_run_id: Optional[str], log):
    import ray
    from ray import tune

    from training.run.capacity import maximum_resources, use_gpus
    from training.plugins import plugin_module_paths
    from training.run.driver import in_submitted_job, live_local_cluster
    from tuning import resources, schedule
    from tuning.trial import TrialSetup, train_trial

    largest = maximum_resources()  # None: no launcher config on this machine

    # Save the sweep's state often: a driver that dies resumes from it (it is small).
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    started_ray = not ray.is_initialized()
    if started_ray:
        plugin_paths = [] if in_submitted_job() else plugin_module_paths(sweep.base.model.name, sweep.base.data.source)
        address = None if os.environ.get("RAY_ADDRESS") else (live_local_cluster() or "local")
        ray.init(address=address, log_to_driver=True,
                 runtime_env={"py_modules": plugin_paths} if plugin_paths else None)
    local_only = started_ray and not os.environ.get("RAY_ADDRESS") and address == "local"
    try:
        cluster = ray.cluster_resources()
        needs = resources.trial_resources(sweep.base, sweep.config.trial.driver_cpus, use_gpus(cluster, largest))
        decision = resources.concurrency(sweep.config.max_concurrent_trials, needs, cluster,
                                         schedule.trial_count(sweep), largest)
        if not decision.fits_at_largest:
            raise UserError(f"trial.scaling: {decision.note}")
        if not decision.fits and local_only:
            raise UserError(f"trial.scaling: {decision.note} (this local cluster has no autoscaler)")
        if decision.note:
            log(f"sweep: {decision.note}")
        if largest is not None:
            log(f"sweep: the cluster has {resources.describe(cluster)} now; its autoscaler may grow it to "
                f"{resources.describe(largest)}")
        log(f"sweep: up to {decision.trials} trial(s) at once, each {needs.total()}")
        setup = TrialSetup(sweep_name=sweep.name, base_raw=schedule.absolute_base(sweep, paths),
                           base_dir=paths.base_dir, tracking_uri=paths.tracking_uri,
                           experiment=sweep.base.tracking.experiment, parent_run_id=parent_run_id,
                           report_checkpoints=sweep.config.scheduler.name == "pbt")
        trainable = tune.with_resources(tune.with_parameters(train_trial, setup=setup), needs.driver)
        path = sweep_dir(sweep)
        release = resources.ReleaseStoppedTrials()
        resumed = tune.Tuner.can_restore(path)
        if resumed:
            log(f"sweep {sweep.name}: resuming from {path}")
            tuner = tune.Tuner.restore(path, trainable=trainable, resume_unfinished=True, resume_errored=False)
        else:
            tuner = tune.Tuner(
                trainable, param_space=schedule.param_space(sweep),
                tune_config=schedule.tune_config(sweep, decision.trials),
                run_config=tune.RunConfig(
                    name=sweep.name, storage_path=storage.join(paths.storage_path, "sweeps"),
                    callbacks=[release], failure_config=tune.FailureConfig(max_failures=sweep.config.trial.max_failures),
                    checkpoint_config=tune.CheckpointConfig(num_to_keep=None), verbose=1))
        grid = tuner.fit()
        time.sleep(1.0)  # the last trials' controllers end with their actors
        released = resources.release_orphaned_groups(ray.get_runtime_context().get_job_id())
        return grid, len(released) + resources.ReleaseStoppedTrials.total_released, decision.trials, resumed
    finally:
        if started_ray:
            ray.shutdown()
