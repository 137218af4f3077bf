"""Metric names every process agrees on, which of them a person reads first, and the names MLflow
shows them under (no torch here: the CLIs check configs against them). Which validation metrics a
task reports is the task's (training/tasks.py); this module only names them."""

TRAIN_LOSS = "train_loss"
SAMPLES_PER_S = "samples_per_s"
VAL_LOSS = "val_loss"
VAL_ACCURACY = "val_accuracy"
VAL_PERPLEXITY = "val_perplexity"
VAL_TOKEN_ACCURACY = "val_token_accuracy"

# What a run's summary, its notifications and `status` show, in this order (those it has).
KEY_METRICS = (TRAIN_LOSS, VAL_LOSS, VAL_ACCURACY, VAL_PERPLEXITY, VAL_TOKEN_ACCURACY, SAMPLES_PER_S)
# The learning curves plotted when a run ends (the loss panel, then one panel per other metric it has).
PLOTTED = (TRAIN_LOSS, VAL_LOSS, VAL_ACCURACY, VAL_PERPLEXITY)

# MLflow's run page (its UI, 3.17) charts on its "Model metrics" tab every metric not named
# `system/...`, in sections by the part of the name before its last "/": the named sections first,
# alphabetically, then the metrics with no "/" in one section, by name. Its "System metrics" tab charts
# the `system/...` ones, a section per prefix (the nodes' samples are `system/<node>/...`,
# training/observe/system.py). So the loss and the validation metrics keep their names (as do a
# plug-in's own metrics), and the learning rate is `train_lr`, to sort beside the loss: the Model
# metrics tab shows them alone, loss first. Everything else a run logs is about how it ran, and goes to
# the System metrics tab, under `system/<what>/<name>`. Only MLflow's names change: reports, status,
# notifications, summaries and sweeps use the names on the left.
_MLFLOW_GROUPS = {
    "progress": ("epoch", "start_step", "world_size", "preemption_checkpoint_step"),
    "data": ("data_digest",),
    "throughput": (SAMPLES_PER_S, "tokens_per_s", "mfu"),
    "step_time": ("time_data_wait_ms", "time_forward_backward_ms", "time_optimizer_ms"),
    # wall clocks (time.time()): when each report was made, when each worker group started and took
    # its first step (for throughput and recovery times over any span; bench/recovery.py)
    "clock": ("wall_time", "worker_start_time", "first_step_time"),
    "memory": ("peak_memory_bytes",),
    "checkpoint": ("checkpoint_bytes", "checkpoint_save_s", "checkpoint_blocking_s"),
    "replicas": ("replicas", "samples_used", "samples_skipped", "short_steps", "replica_lost", "replica_rejoined"),
    "cost": ("cluster_cost_usd_estimate", "cluster_gpu_energy_kwh_estimate"),
}
MLFLOW_NAMES = {"lr": "train_lr",
                **{name: f"system/{group}/{name}" for group, names in _MLFLOW_GROUPS.items() for name in names}}


def mlflow_name(name: str) -> str:
    """The name a run's metric has in MLflow (the same, for the loss, the validation metrics and any
    metric not listed above)."""
    return MLFLOW_NAMES.get(name, name)
