"""A run shorter than the sampling interval still shows its system metrics: a sample as each
worker starts and one with the last report, in a real MLflow store, on the local Ray cluster."""

import pytest
from conftest import CONFIGS
from mlflow.tracking import MlflowClient

from training import config as config_lib
from training.run.driver import run_training

pytestmark = pytest.mark.ray


def test_a_run_shorter_than_the_interval_logs_two_points_of_every_system_series(ray_cluster, workdir):
    # the default interval (10 s) and a run of a few seconds: before, no series at all
    job = config_lib.load(CONFIGS / "digits.yaml", ["train.max_steps=40", "train.eval_every_n_steps=20",
                                                    "checkpoint.every_n_steps=20", "tracking.register_model=false",
                                                    "tracking.export_onnx=false"], name="short")
    assert job.tracking.system_metrics_interval_s == 10
    summary = run_training(job, log=print)
    assert summary.steps == 40
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    run = client.get_run(summary.mlflow_run_id)
    series = [key for key in run.data.metrics if key.startswith("system/node-")]  # (a node's, not the run's own)
    names = {key.split("/", 2)[2] for key in series}
    assert {"cpu_utilization_percentage", "system_memory_usage_megabytes", "disk_usage_percentage",
            "network_receive_megabytes_per_s", "worker_0_rss_megabytes", "worker_1_rss_megabytes"} <= names, names
    for key in series:
        history = client.get_metric_history(run.info.run_id, key)
        assert len(history) >= 2, (key, history)
        assert len({m.timestamp for m in history}) == len(history)  # distinct samples, not one logged twice
