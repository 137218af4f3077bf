"""Chaos: the driver dies (laptop closed, job killed). Running the same command with the same run
name resumes from the latest checkpoint and continues the same MLflow run, each step logged once."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import CONFIGS, tracked_history

from training.metrics import mlflow_name

pytestmark = [pytest.mark.ray, pytest.mark.chaos, pytest.mark.slow]

# failure.mode continue, two workers: a killed driver takes the lighthouse, the controller and every
# replica group with it, the most there is to bring back. (Restart mode's resume after a killed
# driver: tests/test_tuning_resume.py, where the sweep's driver is killed and each trial's run
# resumes from its checkpoint; a resume by name in restart mode: test_storage_faults.py, test_parquet_run.py.)
STEPS = 400  # (the kill came at the checkpoint at step 150 on an idle machine)
COMMAND = [sys.executable, "-m", "training", str(CONFIGS / "digits.yaml"), "--name", "laptop",
           "--set", f"train.max_steps={STEPS}", "--set", "checkpoint.every_n_steps=50",
           "--set", "train.eval_every_n_steps=200", "--set", "train.global_batch_size=32",
           "--set", "failure.mode=continue", "--set", "scaling.num_workers=2",
           "--set", "scaling.cpus_per_worker=0.5",  # (2 CPUs: two workers and torchft's lighthouse)
           "--set", "train.min_report_interval_s=0", "--set", "tracking.register_model=false",
           "--set", "tracking.export_onnx=false"]  # (nothing here is about the exported model)


def environment(base):
    return {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "HOME": str(base),
            "TRAINING_BASE_DIR": str(base),
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"],
            "RAY_TMPDIR": os.environ["RAY_TMPDIR"]}  # this session's own (conftest): joins no other Ray


def kill_everything_started_under(base):
    """The killed driver's Ray processes, if any outlived it (found by the environment they inherited)."""
    import psutil

    marker = f"TRAINING_BASE_DIR={base}"
    for process in psutil.process_iter():
        try:
            if marker in "\0".join(f"{k}={v}" for k, v in process.environ().items()):
                process.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def newest_checkpoint(run_dir) -> int:
    steps = [int(p.name.split("-")[1]) for p in run_dir.glob("checkpoint-*") if (p / "meta.json").exists()]
    return max(steps, default=-1)



def kill_at_a_checkpoint_then_resume(tmp_path, command, steps):
    """Run `command`, SIGKILL its driver and everything in its session at the first checkpoint after
    MLflow has the run's first metrics, run it again; returns (the checkpoint step it was killed at,
    the second run's output, the MLflow client). The second run must finish all `steps`."""
    import ray  # noqa: F401  (puts Ray's vendored psutil on the path)
    from mlflow.tracking import MlflowClient

    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(command, cwd=tmp_path, env=environment(tmp_path), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    run_dir = tmp_path / "runs" / "laptop"
    deadline = time.monotonic() + 300
    # Killed at the first checkpoint after MLflow has the run's first metrics (metrics still queued
    # in the killed processes, seconds' worth while the tracker starts, are not what this is about).
    client, tracked_since = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db"), None
    try:
        while True:
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no tracked metrics and checkpoint after them"
            if tracked_since is None and tracked_history(client, "digits", "train_loss"):
                tracked_since = newest_checkpoint(run_dir)
            if tracked_since is not None and newest_checkpoint(run_dir) > tracked_since:
                break
            time.sleep(0.2)
        os.killpg(first.pid, signal.SIGKILL)  # the driver and everything in its session, at once
        first.wait(timeout=30)
    finally:
        kill_everything_started_under(tmp_path)
    killed_at = newest_checkpoint(run_dir)
    assert killed_at < steps

    second = subprocess.run(command, cwd=tmp_path, env=environment(tmp_path), capture_output=True, text=True,
                            timeout=600)
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-4000:]
    assert "run laptop: resuming" in output and f"run laptop finished: {steps} steps" in output
    resumed = [line for line in output.splitlines() if "resumed from step" in line]
    assert resumed and int(resumed[0].split("resumed from step ")[1].split()[0]) >= killed_at
    return killed_at, output, client


def test_a_killed_driver_is_resumed_by_the_same_command(tmp_path, empty_mlflow_db):
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    killed_at, _, client = kill_at_a_checkpoint_then_resume(tmp_path, COMMAND, STEPS)
    (run,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id])  # one run
    assert run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert steps == sorted(set(steps)), "a step logged twice"  # continuing by step
    assert steps[0] <= 50 and steps[-1] == STEPS
    # every replica group came back: the resumed run reports both, as replica groups
    replicas = client.get_metric_history(run.info.run_id, mlflow_name("replicas"))
    assert any(m.step > killed_at for m in replicas) and replicas[-1].step == STEPS and replicas[-1].value == 2
