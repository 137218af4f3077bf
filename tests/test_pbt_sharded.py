"""Integration: a PBT sweep on a local Ray cluster of 2 CPUs, through to an exploit: the exploited
trial continues from the donor's checkpoint, rebased onto its own hyperparameters, tracked as one
MLflow child run per trial. The trials train with parallel.strategy: fsdp, the harder of the two
checkpoint layouts (sharded); the rebase itself is tested on both layouts without Ray
(test_checkpoint_format.py). On digits (the smallest model fsdp takes: only the root is sharded),
one worker per trial."""

import json
import time

import pytest
import torch
from conftest import REPO, first_exploit, wait_for
from mlflow.tracking import MlflowClient

from training.adaptors import ray_private
from training.checkpoint import format as ckpt
from training.models.registry import build_model, model_section
from tuning import config as sweep_config
from tuning.resources import TRAIN_CONTROLLER_CLASS
from tuning.sweep import run_sweep

pytestmark = [pytest.mark.ray, pytest.mark.slow]

DIGITS = REPO / "training" / "configs" / "digits.yaml"
# Synchronous PBT (see test_tuning_ray.py): one exploit, at step 100, whatever the trials' start
# times, with 50 steps left to train after it.
MAX_STEPS = 150
INTERVAL_STEPS = 100
SETS = ("train.eval_every_n_steps=20", "train.log_every_n_steps=20", "train.min_report_interval_s=0",
        "tracking.experiment=sweeps", "failure.max_failures=1", "parallel.strategy=fsdp",
        f"train.max_steps={MAX_STEPS}", "checkpoint.every_n_steps=20", "checkpoint.keep=20",
        "tracking.export_onnx=false")


def _sweep_file(tmp_path):
    lines = "\n".join(f"  - {s}" for s in SETS)
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {DIGITS}\nset:\n{lines}\ntrial:\n  driver_cpus: 0.25\n"
                    "  scaling: {num_workers: 1, cpus_per_worker: 0.5}\n"
                    "space:\n  optim.lr: {grid: [0.00001, 0.03]}\n"
                    f"scheduler: {{name: pbt, perturbation_interval_steps: {INTERVAL_STEPS}, quantile_fraction: 0.5, "
                    "resample_probability: 1.0, synch: true}\nnum_samples: 1\n")
    return path


@pytest.mark.timeout(600)
def test_pbt_exploit_continues_from_a_sharded_donor(ray_cluster, workdir):
    import pyarrow.fs as pafs

    # (the shared cluster's job is this test process's: earlier tests' runs may have left their own)
    before = _alive_controllers(ray_cluster), _left_groups(ray_cluster)
    summary = run_sweep(sweep_config.load(_sweep_file(workdir), name="pbt"))
    assert len(summary.rows) == 2 and not [r for r in summary.rows if r.status == "failed"]
    _nothing_left(ray_cluster, *before)

    runs = workdir / "runs"
    seed_run, step = first_exploit(runs, MAX_STEPS)
    seed = seed_run / "seed"
    assert ckpt.has_sharded_layout(seed) and ckpt.is_complete(pafs.LocalFileSystem(), str(seed))
    donors = [p / ckpt.checkpoint_dir_name(step) for p in runs.iterdir() if p.name.startswith("pbt-")
              and not p.name.startswith(seed_run.name[:-len(f"-x{step}")])
              and (p / ckpt.checkpoint_dir_name(step) / ckpt.META_FILE).is_file()]
    assert donors, "no other trial's checkpoint at the exploit step"

    # the seed holds the donor's weights, bit for bit, and the exploited trial's hyperparameters:
    # those its new run was configured with
    seed_state = torch.load(seed / ckpt.TRAIN_STATE_FILE, weights_only=True)
    model_config = seed_state["config"]["model"]

    def weights(directory):
        model = build_model(model_section(model_config), {"task": "classification", "input_dim": 64, "num_classes": 10})
        return ckpt.load_model_state(directory, model)

    donor_weights, seed_weights = weights(donors[0]), weights(seed)
    assert all(torch.equal(seed_weights[k], v) for k, v in donor_weights.items())
    assert seed_state["loop"]["step"] == step
    # the new run continued from it: its first checkpoint is after the donor's step, not from 0
    own = sorted(seed_run.glob("checkpoint-*"))
    assert own and ckpt.step_of(own[0].name) > step
    own_config = torch.load(own[0] / ckpt.TRAIN_STATE_FILE, weights_only=True)["config"]
    assert seed_state["config"]["optim"] == own_config["optim"]
    assert seed_state["scheduler"]["base_lrs"] == [own_config["optim"]["lr"]]

    # where the donor was, not back at chance
    def accuracy(checkpoint):
        return json.loads((checkpoint / ckpt.META_FILE).read_text())["metrics"]["val_accuracy"]

    assert accuracy(own[0]) >= accuracy(donors[0]) - 0.05
    trial_id = seed_run.name[len("pbt-"):-len(f"-x{step}")]
    row = next(r for r in summary.rows if r.trial_id == trial_id)
    assert row.last >= accuracy(donors[0]) - 0.05
    client = MlflowClient(summary.tracking_uri)
    experiment = client.get_experiment_by_name("sweeps")
    children = client.search_runs([experiment.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{summary.parent_run_id}'")
    assert len(children) == 2  # one child per trial, exploits included


def _alive_controllers(ray) -> dict[str, str]:
    """The job's Train controllers alive now, each with its owner's class ("driver": this process)."""
    actors = ray_private.actor_records(ray.get_runtime_context().get_job_id())
    by_worker = {a.address.worker_id: a for a in actors}
    return {a.actor_id.hex(): getattr(by_worker.get(a.owner_address.worker_id), "class_name", "driver")
            for a in actors if a.class_name == TRAIN_CONTROLLER_CLASS and a.state != ray_private.actor_dead_state()}


def _left_groups(ray) -> set[str]:
    job_id = ray.get_runtime_context().get_job_id()
    return {g.placement_group_id.hex() for g in ray_private.placement_groups()
            if g.creator_job_id.hex() == job_id and g.state != ray_private.placement_group_removed_state()}


def _nothing_left(ray, controllers_before: dict, groups_before: set):
    """The sweep left nothing on the cluster: no Train controller of its own alive, no placement
    group of its own (Tune's trial groups, the runs' worker groups), every CPU free. (Once, a trial's
    controller and its worker group outlived the sweep, and the next run waited for placement
    without end.)"""

    def controllers_alive():
        return {k: v for k, v in _alive_controllers(ray).items() if k not in controllers_before}

    # (a few seconds for the GCS to record a death already under way; a left-over controller stays)
    deadline = time.monotonic() + 10
    while controllers_alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    controllers = controllers_alive()
    assert controllers == {}, f"Train controllers (and their owners) alive after the sweep: {controllers}"
    groups = _left_groups(ray) - groups_before
    assert groups == set(), f"placement groups left after the sweep: {groups}"
    wait_for(lambda: ray.available_resources().get("CPU", 0) >= ray.cluster_resources()["CPU"], 30,
             "every CPU free after the sweep")
