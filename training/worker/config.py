"""What every worker of a run is given (built on the driver, which has validated the job config;
pickled to the workers by Ray Train, so nothing is validated again there): each component's own
section, and where the run's data and storage are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from training.config import CheckpointConfig, JobConfig, OptimConfig, ParallelConfig, TrainConfig, without_notify
from training.models.family import ModelSection


@dataclass(frozen=True)
class WorkerConfig:
    seed: int
    model: ModelSection
    optim: OptimConfig
    train: TrainConfig
    parallel: ParallelConfig
    checkpoint: CheckpointConfig
    failure_mode: str
    cpus_per_worker: float
    system_metrics_interval_s: float
    manifest_root: str
    run_dir: str
    # A checkpoint to start from when the run has none of its own (a sweep's exploit).
    initial_checkpoint: Optional[str] = None
    # The resolved job config as each checkpoint stores it (no webhooks: a URL travels to no worker).
    job_record: Optional[dict] = None

    @classmethod
    def of(cls, job: JobConfig, manifest_root: str, run_dir: str,
           initial_checkpoint: Optional[str] = None) -> "WorkerConfig":
        return cls(seed=job.seed, model=job.model, optim=job.optim, train=job.train, parallel=job.parallel,
                   checkpoint=job.checkpoint, failure_mode=job.failure.mode,
                   cpus_per_worker=job.scaling.cpus_per_worker,
                   system_metrics_interval_s=job.tracking.system_metrics_interval_s, manifest_root=manifest_root,
                   run_dir=run_dir, initial_checkpoint=initial_checkpoint,
                   job_record=without_notify(job.model_dump(mode="json")))
