"""One sweep from the driver: check, prepare the data once, open the parent MLflow run, start or
join Ray, run (or resume) Tune, then record the results under the parent run.

The sweep lives in `<storage_path>/sweeps/<name>/` (Tune's experiment and `sweep.json`); each trial's
training run in `<storage_path>/<name>-<trial id>/`, like any training run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from training import storage
from training.data.registry import source_of
from training.errors import UserError, first_line
from training.observe import notify
from training.observe.notify import mlflow_run_url, sweep_message
from training.observe.webhook import Notifier
from training.run import preflight
from training.run.driver import plugin_specs
from training.run.paths import resolve_paths
from training.run.record import Record
from training.run.resources import maximum_resources, worker_resources
from training.run.session import check_cluster_to_join, ray_session
from tuning import schedule
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
    return storage.join(resolve_paths(sweep.base, sweep.name).storage_path, "sweeps", sweep.name)


def read_state(sweep: Sweep) -> Optional[Record]:
    return Record.read(storage.join(sweep_dir(sweep), STATE_FILE), sweep.name, f"sweep storage {sweep_dir(sweep)}")


def run_sweep(sweep: Sweep, log: Callable[[str], None] = print,
              started: Optional[Callable[[], None]] = None) -> SweepSummary:
    """Run (or resume) a sweep to the end. UserError before anything starts on bad input. `started`
    is called once the checks have passed and the sweep begins (its log file may be opened then)."""

    started_s = time.monotonic()
    # The base job's webhooks are the sweep's (its trials do not post); a variable not set: exit 2 now.
    targets = [t for t in notify.resolve(sweep.base.tracking.notify) if set(t.events) & set(notify.SWEEP_EVENTS)]
    state = read_state(sweep)
    if state is not None:
        state.check_resumable(sweep.identity(), "sweep", "the original sweep file")
    paths = resolve_paths(sweep.base, sweep.name)
    plan = source_of(sweep.base.data.source).plan(sweep.base.data, paths.data_cache)
    # (what the config alone reveals, the sweep's metric included: before anything is prepared)
    preflight.config_checks(sweep.base, plan, metrics=(("metric", sweep.config.metric),))

    def check(task: str, spec: dict, rows: dict) -> None:
        preflight.check_metric("metric", sweep.config.metric, task)
        preflight.check_storage(paths)

    manifest = preflight.prepare_checked(sweep.base.data, paths, check, log, plan)
    from tuning import report  # (lazy: ray.train, torch)

    check_cluster_to_join()  # (a RAY_ADDRESS where nothing answers: refused before the parent run exists)

    if started is not None:
        started()
    parent = report.start_parent(sweep, paths, state)
    path = sweep_dir(sweep)
    state_uri = storage.join(path, STATE_FILE)
    if state is None:
        state = Record(sweep.name, sweep.identity(), parent.run_id, paths.tracking_uri)
        state.write(state_uri)
    log(f"sweep {sweep.name}: {'resuming' if _started(path) else 'starting'}; storage {path}")
    summary = SweepSummary(name=sweep.name, path=path, parent_run_id=parent.run_id, tracking_uri=paths.tracking_uri)
    try:
        grid, summary.released_groups, summary.concurrency, summary.resumed = _tune(sweep, paths, parent.run_id, log)
        report.finish(sweep, paths, manifest, grid, parent, state, summary, log)
    except BaseException as exc:
        parent.finish("FAILED")
        if not isinstance(exc, KeyboardInterrupt):
            _notify(sweep, summary, parent, targets, "failed", log, error=f"{type(exc).__name__}: {exc}")
        raise
    state.write(state_uri)
    summary.wall_s = time.monotonic() - started_s
    parent.finish("FINISHED")
    _notify(sweep, summary, parent, targets, "finished", log)
    return summary


def _notify(sweep: Sweep, summary: SweepSummary, parent, targets, event: str, log, error: Optional[str] = None) -> None:
    """Post the sweep's end (trial counts, the best trial, the parent MLflow run) to the webhooks
    subscribed to it; a webhook that fails only warns."""

    notifier = Notifier(targets, warn=log)
    if not notifier.wants(event):
        return
    counts = {s: sum(r.status == s for r in summary.rows) for s in ("finished", "stopped", "failed")}
    best = summary.best
    url = None
    if parent.run_id is not None:
        try:
            url = mlflow_run_url(parent.tracking_uri, parent.client.get_run(parent.run_id).info.experiment_id,
                                 parent.run_id)
        except Exception:
            pass
    body = sweep_message(event, sweep.name, counts=counts, metric=sweep.config.metric, mlflow_run_id=parent.run_id,
                         mlflow_url=url, error=first_line(error, 500) if error else None,
                         best={"trial_id": best.trial_id, "run": best.run, "value": best.last, "steps": best.steps,
                               "params": {k: str(v) for k, v in best.params.items()}} if best else None)
    notifier.notify(event, body)


def _started(path: str) -> bool:
    return storage.exists(storage.join(path, "tuner.pkl"))


def _tune(sweep: Sweep, paths, parent_run_id: Optional[str], log):
    import ray  # (lazy: ray)
    from ray import tune  # (lazy: ray)

    from tuning import resources  # (Ray, and its placement groups)
    from tuning.events import SweepEvents  # (lazy: ray.tune)
    from tuning.trial import TrialSetup, train_trial  # (lazy: ray.train, torch)

    largest = maximum_resources()  # None: no launcher config on this machine
    # Save the sweep's state often: a driver that dies resumes from it (it is small).
    with ray_session(*plugin_specs(sweep.base), env={"TUNE_GLOBAL_CHECKPOINT_S": "2"}) as session:
        cluster = ray.cluster_resources()
        needs = resources.trial_resources(sweep.base, sweep.config.trial.driver_cpus,
                                          worker_resources(sweep.base.scaling, cluster, largest))
        decision = resources.concurrency(sweep.config.max_concurrent_trials, needs, cluster,
                                         schedule.trial_count(sweep), largest)
        if not decision.fits_at_largest:
            raise UserError(f"trial.scaling: {decision.note}")
        if not decision.fits and session.local_only:
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
        resources.ReleaseStoppedTrials.begin_sweep()
        # (Tune resolves a URI with pyarrow, which misreads Azure's: Azure goes to it as a filesystem and a path)
        tune_path, tune_fs = storage.for_ray_train(path)
        resumed = tune.Tuner.can_restore(tune_path, storage_filesystem=tune_fs)
        if resumed:
            log(f"sweep {sweep.name}: resuming from {path}")
            tuner = tune.Tuner.restore(tune_path, trainable=trainable, resume_unfinished=True, resume_errored=False,
                                       storage_filesystem=tune_fs)
        else:
            tuner = tune.Tuner(
                trainable, param_space=schedule.param_space(sweep),
                tune_config=schedule.tune_config(sweep, decision.trials),
                run_config=tune.RunConfig(
                    name=sweep.name, storage_path=storage.for_ray_train(storage.join(paths.storage_path, "sweeps"))[0],
                    storage_filesystem=tune_fs,
                    callbacks=[release, SweepEvents(sweep.config.metric, sweep.config.scheduler.name,
                                                    paths.storage_path)],
                    failure_config=tune.FailureConfig(max_failures=sweep.config.trial.max_failures),
                    # (Tune's progress tables: the CLI keeps them in the sweep's log file)
                    checkpoint_config=tune.CheckpointConfig(num_to_keep=None), verbose=1))
        grid = tuner.fit()
        job_id = ray.get_runtime_context().get_job_id()
        # Tune has ended every trial's actor; a controller still alive would hold its workers for ever.
        ended = resources.end_sweep_controllers(job_id, resources.ReleaseStoppedTrials.trial_actor_ids)
        if ended.controllers:
            log(f"sweep: ended {len(ended.controllers)} Ray Train controller(s) that outlived their trials")
        released = len(ended.groups) + len(resources.release_orphaned_groups(job_id))
        return grid, released + resources.ReleaseStoppedTrials.total_released, decision.trials, resumed
