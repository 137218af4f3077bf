"""A sweep's trials that ASHA stops keep what they reported: in MLflow, every result in the trial's
own child run, which ends FINISHED with the reason in a tag; in storage, a status.json that says
`scheduler_stopped`. A local Ray cluster of 2 CPUs, real training runs, a real MLflow store."""

import json
import shutil

import pytest
from conftest import REPO
from mlflow.tracking import MlflowClient

from training.metrics import mlflow_name
from tuning.events import STOPPED_BY_TAG, stop_reason
from tuning.report import log_missing_results

DIGITS = REPO / "training" / "configs" / "digits.yaml"
SWEEP = f"""base: {DIGITS}
set:
  - train.max_steps=40
  - train.eval_every_n_steps=10
  - train.log_every_n_steps=10
  - train.min_report_interval_s=0
  - checkpoint.every_n_steps=20
  - tracking.experiment=sweeps
  - tracking.export_onnx=false
  - failure.max_failures=1
trial:
  driver_cpus: 0.25
  scaling: {{num_workers: 1, cpus_per_worker: 0.5}}
space:
  optim.lr: {{grid: [0.03, 0.00001, 0.00001, 0.00002]}}
scheduler: {{name: asha, grace_period_steps: 10, reduction_factor: 2}}
num_samples: 1
max_concurrent_trials: 2
"""


def test_missing_results_are_logged_once_beside_what_was_sent(tmp_path, empty_mlflow_db):
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("x")).info.run_id
    client.log_metric(run_id, "val_accuracy", 0.25, timestamp=1_000, step=10)  # what the controller sent
    reports = [(10, 1.0, {"val_accuracy": 0.25, "train_loss": 2.0}),
               (20, 2.5, {"val_accuracy": 0.5, "train_loss": 1.5, "samples_per_s": 900.0}),
               (20, 9.0, {"val_accuracy": 0.9, "train_loss": 0.1})]  # (step 20 again after a restart)

    assert log_missing_results(client, run_id, reports) == 4
    assert log_missing_results(client, run_id, reports) == 0
    history = {key: [(m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, mlflow_name(key))]
               for key in ("val_accuracy", "train_loss", "samples_per_s")}
    assert sorted(history["val_accuracy"]) == [(10, 0.25, 1_000), (20, 0.5, 2_500)]
    assert sorted(history["train_loss"]) == [(10, 2.0, 1_000), (20, 1.5, 2_500)]
    assert history["samples_per_s"] == [(20, 900.0, 2_500)]  # under the name the run's own tracker gives it


def assert_stopped_trials_keep_their_metrics_and_end_finished(summary, workdir):
    """What a finished run of SWEEP left (its SweepSummary; runs under `workdir`): the trials that
    ASHA stopped, and the others, each with every result it reported in its own MLflow child run.
    (Checked on the sweep that tests/test_sweep_console.py runs: one sweep for both.)"""
    stopped = [r for r in summary.rows if r.status == "stopped"]
    assert stopped, "ASHA stopped no trial"
    assert {r.status for r in summary.rows} == {"finished", "stopped"}
    client = MlflowClient(summary.tracking_uri)
    for row in summary.rows:
        child = client.get_run(row.mlflow_run_id)
        reported = [(step, value) for step, value in row.history]  # the trial's results, as Tune has them
        assert reported, row
        logged = [(m.step, m.value) for m in sorted(client.get_metric_history(child.info.run_id, "val_accuracy"),
                                                     key=lambda m: m.step)]
        steps = [step for step, _ in logged]
        assert len(steps) == len(set(steps)), f"a step logged twice: {row.trial_id} {steps}"
        # every result the trial reported; a stopped trial's run may have evaluated once more before it ended
        assert steps[:len(reported)] == [step for step, _ in reported], row.trial_id
        assert [v for _, v in logged[:len(reported)]] == pytest.approx([v for _, v in reported]), row.trial_id
        assert all(reported[-1][0] < step <= 40 for step in steps[len(reported):]), (row.trial_id, steps)
        assert client.get_metric_history(child.info.run_id, "train_loss"), row.trial_id
        assert child.info.status == "FINISHED", (row.trial_id, row.status)
        status = json.loads((workdir / "runs" / row.run / "status.json").read_text())
        if row.status == "stopped":
            reason = stop_reason("asha", row.steps, "val_accuracy", row.last)
            # (at most the last step: ASHA's last rung is the sweep's last step, and a trial it stops
            # there before its run has written its summary is stopped, at 40)
            assert reason == f"ASHA at step {row.steps} (val_accuracy {row.last:.4f})" and row.steps <= 40
            assert child.data.tags[STOPPED_BY_TAG] == reason
            assert child.data.tags["tune.trial_status"] == "stopped"
            # it ended when it was last evaluated, not when the sweep ended
            assert child.info.end_time == int(row.reports[-1][1] * 1000)
            assert status["state"] == "scheduler_stopped" and status["error"] == reason
        else:
            assert STOPPED_BY_TAG not in child.data.tags and status["state"] == "finished"
