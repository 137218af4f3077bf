"""The Ray Train side of a run, assembled on the driver: a TorchTrainer whose workers run
`training.worker.loop`, with the run's scaling, failure, checkpoint and callback settings."""

from __future__ import annotations

from typing import Optional

from training.config import JobConfig
from training.errors import RunFailed, last_line
from training.failure.registry import FAILURE_MODES
from training.run.paths import RunPaths
from training.run.resources import WorkerResources
from training.worker.config import WorkerConfig


def fit(job: JobConfig, paths: RunPaths, manifest_root: str, tracker, workers: WorkerResources, *,
        callbacks: tuple = (), initial_checkpoint: Optional[str] = None):
    """Run Ray Train to the end (in the Ray session the caller holds); its Result. RunFailed when the
    run fails beyond its failure budget."""
    import ray.train  # (Ray and torch: the run's, once its checks have passed)
    from ray.train.torch import TorchTrainer  # (lazy: ray.train)

    from training.tracking.callback import run_callbacks  # (lazy: ray.train)
    from training.worker.loop import train_loop_per_worker  # (lazy: ray.train, torch)

    scaling = ray.train.ScalingConfig(
        num_workers=job.scaling.num_workers if isinstance(job.scaling.num_workers, int)
        else tuple(job.scaling.num_workers),
        use_gpu=workers.use_gpu, resources_per_worker=workers.per_worker,
        elastic_resize_monitor_interval_s=job.scaling.resize_check_interval_s)
    run_config = ray.train.RunConfig(
        name=job.name, storage_path=paths.storage_path,
        failure_config=ray.train.FailureConfig(max_failures=job.failure.max_failures,
                                               max_preemption_failures=job.failure.max_preemption_failures),
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=job.checkpoint.keep,
                                                     checkpoint_score_attribute=job.checkpoint.score_metric,
                                                     checkpoint_score_order=job.checkpoint.score_mode),
        # Steps redone after a restart were logged already: MLflow gets each step once.
        callbacks=[*run_callbacks(tracker, tracker.last_step("train_loss")), *callbacks],
        logging_config=ray.train.LoggingConfig(log_level="WARNING"))
    torch_config = FAILURE_MODES[job.failure.mode].torch_config(workers.use_gpu)
    trainer = TorchTrainer(train_loop_per_worker,
                           # (the workers never post: no webhook URL travels to them, nor into a checkpoint)
                           train_loop_config=WorkerConfig.of(job, manifest_root, paths.run_dir, initial_checkpoint),
                           scaling_config=scaling, run_config=run_config,
                           **({"torch_config": torch_config} if torch_config is not None else {}))
    try:
        return trainer.fit()
    except ray.train.TrainingFailedError as exc:
        raise RunFailed(f"training run {job.name} failed: {last_line(exc)}") from exc
