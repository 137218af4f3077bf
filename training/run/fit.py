"""The Ray Train side of a run, assembled on the driver: a TorchTrainer whose workers run
`training.worker.loop`, with the run's scaling, failure, checkpoint and callback settings."""

from __future__ import annotations

from typing import Optional

from training import storage
from training.adaptors.ray_private import caused_by, torch_trainer_class, unplaceable_workers, worker_failures
from training.config import JobConfig
from training.errors import DataError, RunFailed, UserError, first_line, last_line
from training.failure.registry import FAILURE_MODES
from training.run.paths import RunPaths
from training.run.resources import WorkerResources
from training.worker.config import WorkerConfig


def fit(job: JobConfig, paths: RunPaths, manifest_root: str, tracker, workers: WorkerResources, *,
        callbacks: tuple = (), initial_checkpoint: Optional[str] = None):
    """Run Ray Train to the end (in the Ray session the caller holds); its Result. RunFailed when the
    run fails beyond its failure budget."""
    import ray.train  # (Ray and torch: the run's, once its checks have passed)

    from training.tracking.callback import run_callbacks  # (lazy: ray.train)
    from training.worker.loop import train_loop_per_worker  # (lazy: ray.train, torch)

    scaling = ray.train.ScalingConfig(
        num_workers=job.scaling.num_workers if isinstance(job.scaling.num_workers, int)
        else tuple(job.scaling.num_workers),
        use_gpu=workers.use_gpu, resources_per_worker=workers.per_worker,
        elastic_resize_monitor_interval_s=job.scaling.resize_check_interval_s)
    storage_path, storage_filesystem = storage.for_ray_train(paths.storage_path)
    run_config = ray.train.RunConfig(
        name=job.name, storage_path=storage_path, storage_filesystem=storage_filesystem,
        failure_config=ray.train.FailureConfig(max_failures=job.failure.max_failures,
                                               max_preemption_failures=job.failure.max_preemption_failures),
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=job.checkpoint.keep,
                                                     checkpoint_score_attribute=job.checkpoint.score_metric,
                                                     checkpoint_score_order=job.checkpoint.score_mode),
        # Steps redone after a restart were logged already: MLflow gets each step once.
        callbacks=[*run_callbacks(tracker, tracker.last_step("train_loss")), *callbacks],
        logging_config=ray.train.LoggingConfig(log_level="WARNING"))
    torch_config = FAILURE_MODES[job.failure.mode].torch_config(workers.use_gpu)
    # A deterministic data error (a file gone, changed or corrupt) or bad input only a worker can see (a
    # pretrained folder it cannot find) ends the run at once: a restart would fail the same way,
    # max_failures times (for ever with -1).
    # A worker group that cannot be placed fails the run after failure.placement_timeout_s.
    trainer = torch_trainer_class()(
        train_loop_per_worker, final_errors=(DataError, UserError), placement_timeout_s=job.failure.placement_timeout_s,
        # (the workers never post: no webhook URL travels to them, nor into a checkpoint)
        train_loop_config=WorkerConfig.of(job, manifest_root, paths.run_dir, initial_checkpoint),
        scaling_config=scaling, run_config=run_config,
        **({"torch_config": torch_config} if torch_config is not None else {}))
    try:
        return trainer.fit()
    except ray.train.TrainingFailedError as exc:
        raise RunFailed(f"training run {job.name} failed: {failure_line(exc, job, workers)}") from exc


def failure_line(exc: BaseException, job: JobConfig, workers: WorkerResources) -> str:
    """What ended a failed run, in one line: a worker's data error as it was raised, a worker group
    that could not be placed with what the cluster has, else the last line of Ray Train's error."""
    data_error = next(filter(None, (caused_by(failure, (DataError,)) for failure in worker_failures(exc))), None)
    if data_error is not None:
        return first_line(data_error, 1000)
    count = unplaceable_workers(exc)
    if count is not None:
        import ray  # (lazy: ray)

        return (f"cannot place {count} workers with {_resources(workers.per_worker)} each within "
                f"failure.placement_timeout_s {job.failure.placement_timeout_s:g} s: the cluster has "
                f"{_resources(ray.cluster_resources(), workers.per_worker)} ("
                f"{_resources(ray.available_resources(), workers.per_worker)} free)")
    return last_line(exc)


def _resources(amounts: dict[str, float], only: Optional[dict] = None) -> str:
    return ", ".join(f"{amounts.get(name, 0):g} {name}" for name in (only or amounts))
