"""Integration: sweeps on a local Ray cluster of 2 CPUs, every trial a real training run, tracked in a
real MLflow store. More trials than fit at once, so a stopped trial that kept its workers would hang
the sweep (each test has a timeout). PBT's exploit: tests/test_pbt_sharded.py."""

import pytest
from conftest import REPO
from mlflow.tracking import MlflowClient
from webhook import receiver

from tuning import config as sweep_config
from tuning.resources import orphaned_groups
from tuning.sweep import run_sweep

pytestmark = [pytest.mark.ray, pytest.mark.slow]

DIGITS = REPO / "training" / "configs" / "digits.yaml"
FAST = ("train.eval_every_n_steps=10", "train.log_every_n_steps=10", "train.min_report_interval_s=0",
        "tracking.experiment=sweeps", "failure.max_failures=1")


def write_sweep(tmp_path, body: str, sets=()):
    lines = "\n".join(f"  - {s}" for s in (*FAST, *sets))
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {DIGITS}\nset:\n{lines}\ntrial:\n  driver_cpus: 0.25\n"
                    "  scaling: {num_workers: 1, cpus_per_worker: 0.5}\n" + body)
    return path


def children_of(client, parent_run_id):
    experiment = client.get_experiment_by_name("sweeps")
    return client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}'")


@pytest.mark.timeout(420)
def test_asha_sweep_stops_poor_trials_tracks_them_nested_and_registers_the_best(ray_cluster, workdir, monkeypatch):
    body = ("space:\n  optim.lr: {grid: [0.03, 0.00001, 0.00001]}\n  train.global_batch_size: {grid: [64, 5000]}\n"
            "scheduler: {name: asha, grace_period_steps: 10, reduction_factor: 2}\nnum_samples: 1\n"
            "max_concurrent_trials: 2\n")
    # the sweep posts its end once; its trials (runs) post nothing, though the base job names the webhook
    notify = "'tracking.notify=[{url: \"${SWEEP_HOOK}\", on: [finished, failed, restarted]}]'"
    sweep = sweep_config.load(write_sweep(workdir, body, ["train.max_steps=40", "checkpoint.every_n_steps=20",
                                                          notify]), name="asha")
    with receiver() as hook:
        monkeypatch.setenv("SWEEP_HOOK", hook.url("/sweep/T0KEN-sweep"))
        summary = run_sweep(sweep)

    assert hook.events() == ["finished"]
    posted = hook.posts[0]["body"]
    assert posted["kind"] == "sweep" and posted["name"] == "asha" and posted["metric"] == "val_accuracy"
    assert posted["counts"] == {s: sum(r.status == s for r in summary.rows) for s in ("finished", "stopped", "failed")}
    assert posted["best"]["trial_id"] == summary.best.trial_id and posted["mlflow_run_id"] == summary.parent_run_id
    assert not [p for p in workdir.rglob("*") if p.is_file() and b"T0KEN-sweep" in p.read_bytes()]

    by_status = {s: [r for r in summary.rows if r.status == s] for s in ("finished", "stopped", "failed")}
    assert len(summary.rows) == 6 and summary.concurrency == 2
    # a global batch of 5000 is more than digits has: those trials fail for good, the sweep goes on
    assert {r.params["train.global_batch_size"] for r in by_status["failed"]} == {5000} \
        and len(by_status["failed"]) == 3
    assert by_status["stopped"], "ASHA stopped no trial"
    assert all(r.steps < 40 and r.params["optim.lr"] == 0.00001 for r in by_status["stopped"])
    assert summary.best.params["optim.lr"] == 0.03 and summary.best.status == "finished"
    assert summary.best.last > 0.8 and summary.best.steps == 40
    # every trial's workers were given back: none of this job's groups outlive their controller
    assert orphaned_groups(ray_cluster.get_runtime_context().get_job_id()) == []

    client = MlflowClient(summary.tracking_uri)
    parent = client.get_run(summary.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.params["space.optim.lr"].startswith("grid(")
    assert parent.data.metrics["best_val_accuracy"] == pytest.approx(summary.best.last)
    assert parent.data.tags["best_trial_id"] == summary.best.trial_id
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"results.csv", "plots", "best", "sweep"} <= artifacts
    plots = {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
    assert plots == {"plots/learning_curves.png", "plots/val_accuracy_vs_optim.lr.png",
                     "plots/val_accuracy_vs_train.global_batch_size.png"}
    table = client.download_artifacts(parent.info.run_id, "results.csv")
    assert len(open(table).read().strip().splitlines()) == 7

    children = children_of(client, parent.info.run_id)
    started = [r for r in summary.rows if r.status != "failed" or r.mlflow_run_id]
    assert sorted(c.data.tags["tune.trial_id"] for c in children) == sorted(r.trial_id for r in started)
    status = {c.data.tags["tune.trial_id"]: c.info.status for c in children}
    assert all(status[r.trial_id] == "FINISHED" for r in by_status["stopped"])  # stopped by ASHA: not failed
    assert status[summary.best.trial_id] == "FINISHED"
    best_child = client.get_run(summary.best.mlflow_run_id)
    steps = [m.step for m in client.get_metric_history(best_child.info.run_id, "val_accuracy")]
    assert steps and steps[-1] == 40
    (version,) = client.search_model_versions("name = 'digits-digits_mlp'")
    assert version.run_id == summary.best.mlflow_run_id
    assert str(summary.registered["version"]) == str(version.version)
    assert version.tags["tune.trial_id"] == summary.best.trial_id
