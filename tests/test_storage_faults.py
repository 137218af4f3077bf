"""Checkpoints on S3 (moto_server on loopback): a training run writes and resumes from them (by its
name, in the same MLflow run); an upload that meets a storage outage retries with backoff until the
endpoint is back; storage that cannot be reached fails the command before anything starts."""

import logging
import os
import shutil
import subprocess
import sys
import threading
import time

import pyarrow.fs as pafs
import pytest
from aws import create_bucket, free_port, s3_env
from conftest import CONFIGS, wait_for

from training import config as config_lib
from training.checkpoint import format as ckpt
from training.checkpoint.upload import RetryPolicy, upload, with_retries


def saved_checkpoint(directory, step):
    import torch

    directory.mkdir()
    ckpt.save(directory, model_state={"w": torch.ones(10_000)}, optimizer_state={}, scheduler_state={},
              loop=ckpt.LoopState(step=step), config={"seed": 0}, steps_per_epoch=10, world_size=1, metrics={})
    return directory


def test_an_upload_retries_through_a_storage_outage(tmp_path, monkeypatch, caplog):
    port = free_port()
    for key, value in s3_env(f"http://127.0.0.1:{port}").items():
        monkeypatch.setenv(key, value)
    local = saved_checkpoint(tmp_path / "local", 20)
    outcome = {}

    def target():
        try:
            outcome["result"] = upload(local, "s3://ckpts/runs/r", "checkpoint-00000020",
                                       RetryPolicy(attempts=8, first_delay_s=1, max_delay_s=2))
        except Exception as exc:
            outcome["error"] = exc

    caplog.set_level(logging.WARNING, logger="training.checkpoint.upload")
    uploader = threading.Thread(target=target)
    uploader.start()  # nothing listens on the endpoint yet
    # past pyarrow's own retries (about 6 s per request), into ours: the first of them is logged
    wait_for(lambda: any("retry 1 of at most 7" in record.getMessage() for record in caplog.records), 120,
             "the upload's first retry")
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1",
                               "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                create_bucket(f"http://127.0.0.1:{port}", "ckpts")
                break
            except Exception:
                assert time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.2)
        uploader.join(timeout=60)
        assert "error" not in outcome, outcome.get("error")
        fs, path = outcome["result"]
        assert path == "ckpts/runs/r/checkpoint-00000020" and ckpt.is_complete(fs, path)
        assert any("retry 1 of at most 7" in record.getMessage() for record in caplog.records)  # logged
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_retries_back_off_then_give_up_with_the_cause():
    calls, slept = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError("connection reset")

    with_retries(flaky, "uploading", RetryPolicy(attempts=5, first_delay_s=1, max_delay_s=3), sleep=slept.append)
    assert len(calls) == 3 and slept == [1, 2]

    def broken():
        raise OSError("no route to host")

    with pytest.raises(OSError, match="uploading failed 4 times in 0 s; giving up: no route to host"):
        with_retries(broken, "uploading", RetryPolicy(attempts=4, first_delay_s=1, max_delay_s=3), sleep=slept.append)
    assert slept[2:] == [1, 2, 3]


def test_unreachable_storage_fails_fast_with_exit_2_and_nothing_started(tmp_path):
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "HOME": str(tmp_path),
           **s3_env(f"http://127.0.0.1:{free_port()}")}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "training", str(CONFIGS / "digits.yaml"),
                             "--set", "checkpoint.storage_path=s3://nowhere/runs",
                             "--set", f"data.cache_dir={tmp_path / 'cache'}"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "checkpoint.storage_path s3://nowhere/runs is not reachable" in result.stderr
    assert time.monotonic() - started < 120
    assert not (tmp_path / "mlflow.db").exists() and "Ray" not in result.stdout


@pytest.mark.ray
@pytest.mark.slow
def test_training_checkpoints_to_s3_and_a_named_run_resumes_in_the_same_mlflow_run(tmp_path, monkeypatch, moto_endpoint,
                                                                                 empty_mlflow_db):
    """A run on S3 storage, resumed twice by its name: the second time continues it from its S3
    checkpoints in the same MLflow run; the third finds nothing left to train and ends with its last
    checkpoint's step and metrics."""
    import ray
    from mlflow.tracking import MlflowClient

    from training.run.driver import run_training

    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    monkeypatch.setenv("TRAINING_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    endpoint = moto_endpoint
    for key, value in s3_env(endpoint).items():
        monkeypatch.setenv(key, value)
    create_bucket(endpoint, "ckpts")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2)  # started here, so its workers see the endpoint
    try:
        overrides = ["checkpoint.storage_path=s3://ckpts/runs", "train.eval_every_n_steps=20",
                     "checkpoint.every_n_steps=20", "train.log_every_n_steps=5", "train.min_report_interval_s=0",
                     "scaling.num_workers=1", "tracking.register_model=false", "tracking.export_onnx=false"]
        first = run_training(config_lib.load(CONFIGS / "digits.yaml", overrides + ["train.max_steps=40"], name="again"))
        assert first.steps == 40 and not first.resumed
        second = run_training(config_lib.load(CONFIGS / "digits.yaml", overrides + ["train.max_steps=80"],
                                              name="again"))
        assert second.steps == 80 and second.resumed
        # Once more: nothing left to train; the run ends with its last checkpoint's step and metrics.
        third = run_training(config_lib.load(CONFIGS / "digits.yaml", overrides + ["train.max_steps=80"], name="again"))
        assert third.steps == 80 and third.resumed and third.metrics["val_accuracy"] == second.metrics["val_accuracy"]
    finally:
        ray.shutdown()
    fs, _ = pafs.FileSystem.from_uri("s3://ckpts/runs")
    names = {info.base_name for info in fs.get_file_info(pafs.FileSelector("ckpts/runs/again"))}
    assert {"run.json", "checkpoint-00000080"} <= names
    assert ckpt.is_complete(fs, "ckpts/runs/again/checkpoint-00000080")
    assert ckpt.newest_complete(fs, "ckpts/runs/again")[0] == 80

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("digits")
    (run,) = client.search_runs([experiment.experiment_id], filter_string="tags.`training.run_name` = 'again'")
    assert run.info.run_id == first.mlflow_run_id == second.mlflow_run_id and run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    # The second part continued from step 40: no step logged twice, metrics continue by step.
    assert steps == sorted(set(steps)) and steps[0] == 5 and steps[-1] == 80 and 45 in steps
    assert run.data.params["train.max_steps"] == "40"  # params record the first start; resumes keep them
