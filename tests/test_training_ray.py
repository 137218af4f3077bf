"""Integration: real training runs on a local Ray cluster, tracked in a real MLflow store. (A named
run resumed in the same MLflow run: tests/test_storage_faults.py, on S3 storage.)"""

import mlflow
import numpy as np
import pytest
import torch
from conftest import CONFIGS
from mlflow.tracking import MlflowClient

from training import config as config_lib
from training.metrics import mlflow_name
from training.run.driver import run_training

pytestmark = pytest.mark.ray


def runs_named(client, experiment, name):
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id], filter_string=f"tags.`training.run_name` = '{name}'")


def test_default_job_reaches_95_percent_and_is_tracked(ray_cluster, workdir):
    job = config_lib.load(CONFIGS / "digits.yaml", name="digits-default")
    summary = run_training(job, config_path=str(CONFIGS / "digits.yaml"))

    assert summary.steps == 400 and summary.metrics["world_size"] == 2
    assert summary.metrics["val_accuracy"] >= 0.95
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    (run,) = runs_named(client, "digits", "digits-default")
    assert run.info.status == "FINISHED" and run.info.run_id == summary.mlflow_run_id
    assert run.data.params["optim.lr"] == "0.003" and run.data.params["scaling.num_workers"] == "2"
    for tag in ("git_commit", "ray_version", "torch_version", "world_size"):
        assert run.data.tags[tag]
    history = client.get_metric_history(run.info.run_id, "train_loss")
    steps = [m.step for m in history]
    assert steps == sorted(steps) and steps[-1] == 400 and len(steps) >= 5
    assert history[-1].value < history[0].value
    val_steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy")]
    assert {100, 200, 300, 400} <= set(val_steps)
    assert client.get_metric_history(run.info.run_id, mlflow_name("samples_per_s"))[-1].value > 0

    assert run.info.artifact_uri.startswith((workdir / "mlruns" / "digits").as_uri())  # beside mlflow.db
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config", "plots", "summary.json"} <= artifacts
    assert [a.path for a in client.list_artifacts(run.info.run_id, "plots")] == ["plots/learning_curve.png"]
    config_text = client.download_artifacts(run.info.run_id, "config/resolved_config.yaml")
    assert config_lib.load(config_text).name == "digits-default"

    # The final model: logged with a signature, registered, loadable, any batch size.
    (version,) = client.search_model_versions("name = 'digits-digits_mlp'")
    assert version.run_id == run.info.run_id
    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    model = mlflow.pytorch.load_model(f"models:/digits-digits_mlp/{version.version}")
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.from_numpy((digits.data[:7] / 16).astype(np.float32))
    assert model(x).shape == (7, 10)
    logged = client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                         filter_string=f"source_run_id = '{run.info.run_id}'")
    assert len(logged) == 1
    signature = mlflow.models.get_model_info(logged[0].model_uri).signature
    assert signature.inputs.to_dict()[0]["tensor-spec"]["shape"] in ([-1, 64], (-1, 64))

    # Checkpoints: the best two by val_accuracy and the latest, each complete.
    checkpoints = sorted((workdir / "runs" / "digits-default").glob("checkpoint-*"))
    assert 1 <= len(checkpoints) <= 3 and checkpoints[-1].name == "checkpoint-00000400"
    assert all((c / "state.pt").is_file() and (c / "meta.json").is_file() for c in checkpoints)
