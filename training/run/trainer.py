"""The Ray Train side of a run, assembled on the driver: a TorchTrainer whose workers run
`training.worker.loop`, with the run's scaling, failure, checkpoint and callback settings."""

from __future__ import annotations

from typing import Optional

from training.config import JobConfig, without_notify
from training.errors import RunFailed
from training.run.paths import RunPaths
from training.run.resources import WorkerResources


def fit(job: JobConfig, paths: RunPaths, manifest_root: str, tracker, workers: WorkerResources, *,
        callbacks: tuple = (), initial_checkpoint: Optional[str] = None):
    """Run Ray Train to the end (in the Ray session the caller holds); its Result. RunFailed when the
    run fails beyond its failure budget."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from training.tracking.callback import run_callbacks
    from training.worker.loop import train_loop_per_worker

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
    seeded = {"initial_checkpoint": initial_checkpoint} if initial_checkpoint else {}
    continuous = {"torch_config": continuous_torch_config(workers.use_gpu)} if job.failure.mode == "continue" else {}
    trainer = TorchTrainer(train_loop_per_worker,
                           # (the workers never post: no webhook URL travels to them, nor into a checkpoint)
                           train_loop_config={"job": without_notify(job.model_dump(mode="json")),
                                              "manifest_root": manifest_root,
                                              "run_dir": paths.run_dir, **seeded},
                           scaling_config=scaling, run_config=run_config, **continuous)
    try:
        return trainer.fit()
    except ray.train.TrainingFailedError as exc:
        raise RunFailed(f"training run {job.name} failed: {root_cause(exc)}") from exc


# failure.mode continue: how fast the lighthouse drops a dead replica group from the quorum. Replica
# groups heartbeat every 100 ms (torchft's default); torchft's default timeout (5 s) would leave the
# survivors waiting 5 s for a quorum after a kill.
LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS = 500


def continuous_torch_config(use_gpu: bool):
    """Ray Train's torchft backend: a lighthouse actor on the head and one replica group per worker,
    of which the controller replaces only the failed ones. min_replicas 1: any one group alive keeps
    training."""
    from ray.train.v2.torch.torchft_config import TorchftConfig

    return TorchftConfig(lighthouse_kwargs={"min_replicas": 1, "heartbeat_timeout_ms": LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS},
                         backend="nccl" if use_gpu else "gloo")


def root_cause(exc: BaseException) -> str:
    """The last line of a failure's text: what went wrong, without Ray's wrapping."""
    text = str(exc).strip().splitlines()
    tail = [line for line in text if line.strip()][-1:] or [type(exc).__name__]
    return tail[0][:500]
