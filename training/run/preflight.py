"""Checks the driver makes before anything starts: everything a user can get wrong fails here
with a UserError (exit code 2), before a byte is written or a worker started.

`prepare_checked` is the one way runs and sweeps prepare their data: the checks that need the data
(its task, its size) run on the loaded source, before the prepared dataset is written.
"""

from __future__ import annotations

import uuid
from typing import Callable, Optional

from cluster.config import ConfigError as ClusterConfigError
from cluster.config import load_cluster_yaml
from training import storage, topics
from training.config import JobConfig, TrainConfig, check_profile_range
from training.data.order import BatchPlan
from training.data.registry import source_of
from training.data.shards import changed_shard
from training.data.source import DataCheck, DataPlan, DataSection
from training.data.stream import RowGroup, steps_per_epoch
from training.errors import ConfigError, UserError, first_line, one_line
from training.models.family import ModelSection
from training.models.registry import build_model, check_fits_task, family_of
from training.redaction import redact
from training.run.cost import cluster_config_path
from training.run.paths import RunPaths
from training.tasks import TASKS, logits_of
from training.tracking.policy import SendPolicy
from training.tracking.transport import MlflowTransport


def prepare_checked(data: DataSection, paths: RunPaths, check: DataCheck, log: Callable[[str], None] = print,
                    plan: Optional[DataPlan] = None):
    """Prepare (or find cached) the job's data, running `check` on it first; the Manifest.
    `plan`: the data's plan, if made already."""
    plan = plan or source_of(data.source).plan(data, paths.data_cache)
    try:
        manifest = plan.prepare(check, log)
    except ValueError as exc:  # (the model's and the plug-ins' own errors are UserErrors naming their field)
        raise UserError(f"data ({data.source}): {exc}") from None
    check_shards(manifest)
    return manifest


def check_shards(manifest) -> None:
    """UserError if a shard of the prepared data changed since it was prepared (its SHA-256 is in
    the manifest): the run would train on other data than its record says, and resume inexactly."""
    problem = changed_shard(manifest)
    if problem:
        raise UserError(f"data: the prepared dataset at {redact(manifest.root)} changed since it was prepared: "
                        f"{problem}; remove that directory and run again to prepare it anew")


def config_checks(job: JobConfig, plan: DataPlan, metrics: tuple[tuple[str, str], ...] = ()) -> None:
    """What the config alone reveals, checked before any data is prepared or written: the batch
    against its micro-batches and the loader's partitions; where the config says the data's task
    (`plan.task`), the model and every validation metric named (`metrics`: (field, metric) pairs
    beside the run's own, a sweep's) against it."""
    check_micro_batch(job.train)
    check_partitions(job.train, getattr(plan, "batch_partitions", None))
    task = getattr(plan, "task", None)  # (a plan of a plug-in's own may not say)
    if task is not None:
        check_fits_task(job.model, task)
        check_metric_names(job, task)
        for field, metric in metrics:
            check_metric(field, metric, task)


def job_checks(job: JobConfig, paths: RunPaths, partitions: Optional[int] = None) -> DataCheck:
    """The checks of a training run, on its loaded data; `partitions`: the streaming loader's
    (the data plan's `batch_partitions`)."""

    def check(task: str, spec: dict, rows: dict) -> None:
        check_fits_task(job.model, task)
        check_model_builds(job.model, task, spec, sharded=job.parallel.strategy == "fsdp")
        check_metric_names(job, task)
        check_batch_fits(job.train, rows["train"], partitions)
        check_profile_fits(job.train, rows["train"])
        check_cluster_config(job.tracking.cluster_config)
        check_storage(paths)

    return check


def check_tracking(job: JobConfig, paths: RunPaths, record) -> None:
    """Before any data is prepared or written: a resumed run is tracked where it was, and a tracking
    server answers (one short request). A local store (sqlite, files) is created when the run starts."""
    if not job.tracking.enabled or paths.tracking_uri is None:
        return
    if record is not None:
        record.check_tracking(paths.tracking_uri)
    uri = paths.tracking_uri
    if "://" not in uri or uri.startswith(("sqlite:", "file:")):
        return

    try:
        MlflowTransport(uri, SendPolicy().attempt_timeout_s).check_reachable()
    except Exception as exc:
        reason = first_line(exc)
        raise UserError(redact(topics.line(topics.TRACKING, f"cannot reach MLflow at {uri}: {reason}"))) from None


def check_storage(paths: RunPaths) -> None:
    """Fail fast, before anything starts, if the storage path cannot be written."""
    probe = storage.join(paths.storage_path, f".write-probe-{uuid.uuid4().hex}")  # runs may start at once
    try:
        storage.write_text(probe, "ok")
        fs, path = storage.filesystem(probe)
        fs.delete_file(path)
    except Exception as exc:
        raise UserError(redact(f"checkpoint.storage_path {paths.storage_path} is not writable: {exc}")) from None


def check_metric(field: str, metric: str, task: str) -> None:
    allowed = TASKS[task].validation_metrics
    if metric not in allowed:
        raise ConfigError(f"{field}: {metric!r} is not a validation metric of {task} data; "
                          f"allowed: {', '.join(sorted(allowed))}")


def check_metric_names(job: JobConfig, task: str) -> None:
    for field, metric in (("checkpoint.score_metric", job.checkpoint.score_metric),
                          ("train.early_stopping.metric",
                           job.train.early_stopping.metric if job.train.early_stopping else None)):
        if metric is not None:
            check_metric(field, metric, task)


def check_batch_fits(train: TrainConfig, train_rows: int, partitions: Optional[int] = None) -> None:
    """At least one global batch per epoch (the workers' own rule, asked here before they start):
    of the rows, and, for streamed data, of the smallest of the `partitions` each batch draws from."""
    try:
        BatchPlan(train.global_batch_size, 1, 0).steps_per_epoch(train_rows)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if partitions is not None and streamed_steps_per_epoch(train_rows, partitions, train.global_batch_size) < 1:
        raise ConfigError(f"data.options.partitions {partitions}: the {train_rows} training rows over {partitions} "
                          f"partitions leave no whole train.global_batch_size {train.global_batch_size} per epoch "
                          "(every batch takes its share of each partition); use fewer partitions or a smaller batch")


def streamed_steps_per_epoch(train_rows: int, partitions: int, global_batch_size: int) -> int:
    """The streaming loader's steps per epoch (training.data.stream.steps_per_epoch: it counts only
    the rows, not how they lie in row groups)."""
    return steps_per_epoch([RowGroup(0, 0, train_rows)], partitions, global_batch_size)


def check_micro_batch(train: TrainConfig) -> None:
    if train.micro_batch_size is not None and train.micro_batch_size > train.global_batch_size:
        raise ConfigError(f"train.micro_batch_size {train.micro_batch_size} is larger than train.global_batch_size "
                          f"{train.global_batch_size}: a micro-batch is a part of one worker's share of a global "
                          f"batch; make it at most {train.global_batch_size}, or leave it out")


def check_partitions(train: TrainConfig, partitions: Optional[int]) -> None:
    """The workers' own rule, asked before anything is prepared: every partition gives a batch a row."""
    if partitions is not None and partitions > train.global_batch_size:
        raise ConfigError(f"data.options.partitions {partitions} is more than train.global_batch_size "
                          f"{train.global_batch_size}: every partition gives at least one row to each batch; set "
                          f"data.options.partitions to at most {train.global_batch_size}")


def check_profile_fits(train: TrainConfig, train_rows: int) -> None:
    """A run measured in epochs knows its last step once its data is known: the profiled steps lie
    within it (a run of max_steps is checked with its config)."""
    if train.profile is None or train.epochs is None:
        return
    steps = train.total_steps(BatchPlan(train.global_batch_size, 1, 0).steps_per_epoch(train_rows))
    check_profile_range(train.profile, steps, f"train.epochs {train.epochs:g} of {train_rows} rows")


def check_model_builds(model_section: ModelSection, task: str, spec: dict, sharded: bool = False) -> None:
    """Build the model on the meta device (no memory, any size): a plug-in that cannot be imported,
    rejects its options or returns something else fails here, before anything starts; `sharded`
    (fsdp): a model its family cannot shard too."""
    import torch  # (torch: once the data is known, not on the config path)

    with torch.device("meta"):
        model = build_model(model_section, {"task": task, **spec})
    check_model_shapes(model_section.name, model, task, spec)
    if sharded:
        family_of(model_section.name).check_shardable(model)


def check_model_shapes(name: str, model, task_name: str, spec: dict) -> None:
    """One forward pass of two rows on the meta device (shapes only, no memory, no arithmetic):
    a model whose input width does not take the data's, or whose logits are not one per class (per
    token in the vocabulary), fails here rather than in the first step. Evaluation mode: dropout and
    other training-only paths are the first step's to run."""
    import torch  # (torch: once the data is known, not on the config path)

    task, rows = TASKS[task_name], 2
    shape, dtype = task.sample(spec, rows)
    batch = torch.zeros(shape, dtype=getattr(torch, dtype), device="meta")
    expected, unit = task.logits_shape(spec, rows)
    model.eval()
    try:
        with torch.no_grad(), torch.device("meta"):  # (tensors the forward creates are meta tensors too)
            output = model(batch)
    except NotImplementedError:
        return
    except (Exception, SystemExit) as exc:
        if "meta" in str(exc):  # it cannot run on the meta device (`.item()`, a copy to the CPU): the
            return              # shapes are left to the first step
        raise UserError(f"model.name {name}: a forward pass on {rows} rows shaped like the data "
                        f"({list(batch.shape)}) fails: {one_line(exc)}; does the model take the data's "
                        f"{'input_dim ' + str(spec['input_dim']) if 'input_dim' in spec else 'seq_len'}?") from None
    try:
        logits = logits_of(output)
    except TypeError:
        raise UserError(f"model.name {name}: forward returns {type(output).__name__}, not a tensor of logits "
                        "or an object with .logits") from None
    if not task.logits_fit(tuple(logits.shape), expected):
        raise UserError(f"model.name {name}: forward on input {list(batch.shape)} returns logits of shape "
                        f"{list(logits.shape)}; the data needs {list(expected)} ({unit})")


def check_cluster_config(configured) -> None:
    """tracking.cluster_config prices the run once it has finished: a file that is not there or not a
    cluster config is refused now, not found out at the end (where it could only warn)."""
    if not configured:
        return

    path = cluster_config_path(configured)
    try:
        config = load_cluster_yaml(path)
    except ClusterConfigError as exc:
        raise ConfigError(f"tracking.cluster_config: {exc}; it names the cluster.yaml the run is priced by") from None
    types = config.get("available_node_types")
    if not isinstance(types, dict) or config.get("head_node_type") not in types:
        raise ConfigError(f"tracking.cluster_config: {path} is not a cluster config (it needs available_node_types "
                          "and a head_node_type among them)")
