"""Chaos: a sweep's driver (a real `python -m tuning` process) is SIGKILLed mid-sweep; the same command
resumes it: the finished trial is kept, the interrupted one continues its own training run from its
checkpoints, and MLflow holds one child run per trial."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, tracked_history
from mlflow.tracking import MlflowClient

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.chaos]

# The second trial is long enough that the kill lands mid-run while MLflow catches up with its first
# checkpoints; the first, which only has to finish before it, is short (a grid runs in its order,
# one trial at a time here).
FIRST_STEPS, STEPS = 100, 500
SWEEP = f"""base: {REPO / 'training' / 'configs' / 'digits.yaml'}
set: [train.eval_every_n_steps=20, checkpoint.every_n_steps=20, train.log_every_n_steps=10,
      train.min_report_interval_s=0, tracking.experiment=sweeps, tracking.export_onnx=false]
space:
  train.max_steps: {{grid: [{FIRST_STEPS}, {STEPS}]}}
num_samples: 1
max_concurrent_trials: 1
trial: {{driver_cpus: 0.25, scaling: {{num_workers: 1, cpus_per_worker: 0.5}}}}
"""



def command(workdir, address):
    env = {**os.environ, "RAY_ADDRESS": address, "TRAINING_BASE_DIR": str(workdir), "PYTHONPATH": str(REPO)}
    return [sys.executable, "-m", "tuning", str(workdir / "sweep.yaml"), "--name", "again"], env


@pytest.mark.timeout(600)
def test_a_sweep_whose_driver_was_killed_resumes_with_the_same_command(ray_cluster, workdir):
    (workdir / "sweep.yaml").write_text(SWEEP)
    address = ray_cluster.get_runtime_context().gcs_address
    args, env = command(workdir, address)
    runs = workdir / "runs"
    log = open(workdir / "first.log", "w")
    driver = subprocess.Popen(args, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 400
    client = None
    # Kill once one trial finished and the next one has a checkpoint of its own, whose metrics MLflow
    # has (metrics still queued in the killed driver's processes when it dies are not what this is about).
    while time.monotonic() < deadline and driver.poll() is None:
        finished = [p for p in runs.glob("again-*") if (p / "summary.json").exists()]
        running = [p for p in runs.glob("again-*")
                   if not (p / "summary.json").exists() and list(p.glob("checkpoint-*"))]
        if finished and running:
            client = client or MlflowClient(f"sqlite:///{workdir}/mlflow.db")  # (created by the sweep by now)
            if tracked_history(client, "sweeps", "val_accuracy", running[0].name):
                break
        time.sleep(0.5)
    assert driver.poll() is None, open(workdir / "first.log").read()[-3000:]
    time.sleep(2.5)  # let the sweep's state (saved every 2 s) see the finished trial
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    (done,) = finished
    done_summary = (done / "summary.json").read_text()
    assert json.loads(done_summary)["steps"] == FIRST_STEPS
    interrupted = running[0]
    steps_at_kill = max(int(p.name.split("-")[1]) for p in interrupted.glob("checkpoint-*"))
    assert steps_at_kill < STEPS

    again = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resuming" in again.stdout
    assert (done / "summary.json").read_text() == done_summary  # the finished trial was not run again
    resumed = json.loads((interrupted / "summary.json").read_text())
    assert resumed["resumed"] and resumed["steps"] == STEPS  # continued its own run from its checkpoints
    trial_runs = sorted(p.name for p in runs.glob("again-*"))
    assert len(trial_runs) == 2

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    experiment = client.get_experiment_by_name("sweeps")
    parents = client.search_runs([experiment.experiment_id], filter_string="tags.`tune.role` = 'sweep'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = client.search_runs([experiment.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    trial_ids = [c.data.tags["tune.trial_id"] for c in children]
    assert len(trial_ids) == 2 and len(set(trial_ids)) == 2  # no trial counted twice
    assert all(c.info.status == "FINISHED" for c in children)
    history = client.get_metric_history(
        next(c for c in children if c.data.tags["training.run_name"] == interrupted.name).info.run_id, "val_accuracy")
    steps = [m.step for m in history]
    # one history, continued after the kill: no step logged twice (metrics of a checkpoint written just
    # before the kill but not yet reported are not re-sent: the run resumes after it)
    assert steps == sorted(set(steps)) and steps[-1] == STEPS and min(steps) <= steps_at_kill
