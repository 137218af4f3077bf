"""Sweeps without Ray: bad sweep files exit 2 before Ray is imported and write nothing; the pure
decisions (how many trials at once, which run a restarted trial runs, PBT's rebased seed)."""

import json
from pathlib import Path

import pytest
import torch
from cli_probe import run_cases
from conftest import REPO

from training.checkpoint import format as ckpt
from training.config import OptimConfig
from tuning import config as sweep_config
from tuning import exploit
from tuning.resources import TrialResources, concurrency

DIGITS = REPO / "training" / "configs" / "digits.yaml"
GOOD = f"base: {DIGITS}\nspace:\n  optim.lr: {{loguniform: [1.0e-4, 1.0e-2]}}\n"


BAD_SWEEPS = [
    (GOOD.replace("loguniform", "logunifrom"), [],
     "space.optim.lr.logunifrom: unknown key; allowed: choice, grid, loguniform, randint, uniform"),
    (GOOD.replace("optim.lr", "optim.lrr"), [], "space.optim.lrr: the value 0.0001 makes an invalid job config: "
     "optim.lrr: unknown key"),
    (GOOD.replace("[1.0e-4, 1.0e-2]", "[0, 1.0e-2]"), [], "space.optim.lr: loguniform: low must be above 0"),
    (GOOD.replace("[1.0e-4, 1.0e-2]", "[1.0e-2, 1.0e-4]"), [], "space.optim.lr: loguniform: low (0.01) must be below"),
    (GOOD + "  model.options.hiden: {choice: [[64]]}\n", [], "space.model.options.hiden: the value [64] makes an "
     "invalid job config: model.options.hiden: unknown key; allowed: dropout, hidden"),
    (GOOD + "  optim.weight_decay: {uniform: [-1, 0.1]}\n", [], "space.optim.weight_decay: the value -1.0"),
    (GOOD + "schedular: {name: asha}\n", [], "schedular: unknown key; allowed: base, max_concurrent_trials"),
    (GOOD, ["--set", "scheduler.name=hyperband"], "scheduler.name: must be 'fifo', 'asha' or 'pbt'"),
    (GOOD, ["--set", "train.max_stepz=5"], "train.max_stepz: unknown key"),
    (GOOD, ["--set", "metric=accuracy"], "metric: must be 'val_loss'"),
    (GOOD, ["--set", "search.algorithm=grid"], "space.optim.lr: search.algorithm grid needs choice or grid values"),
    (GOOD + "  model.options.dropout: {uniform: [0, 0.5]}\nscheduler: {name: pbt}\n", [],
     "space.model.options.dropout: PBT copies weights between trials"),
    (GOOD + "  tracking.experiment: {choice: [a, b]}\n", [], "space.tracking.experiment: tracking is the same"),
    (GOOD.replace(str(DIGITS), "missing.yaml"), [], "base: job config missing.yaml does not exist"),
    (GOOD, ["--set", "trial.scaling={num_workers: 0}"], "trial.scaling.num_workers: must be a positive int"),
    (GOOD, ["--name", "bad name!"], "name: 'bad name!' must start with a letter or digit"),
    (GOOD + "  train.global_batch_size: {choice: [32, 64]}\nscheduler: {name: pbt}\n", [],
     "space.train.global_batch_size: PBT continues trials from each other's checkpoints, data position included"),
    (GOOD + "set: train.max_steps=5\n", [], "set: must be a list of KEY=VALUE overrides"),
    (GOOD, ["--set", "tracking.cluster_config=nope.yaml"], "tracking.cluster_config: "),
    (GOOD, ["--set", "search.seed=-1"], "search.seed: Input should be greater than or equal to 0"),
    (GOOD, ["--set", "tracking.registered_model_name=a/b"], "tracking.registered_model_name: 'a/b' contains '/'"),
    (GOOD.replace(str(DIGITS), "job.yaml"), [], "base: job config job.yaml does not exist; a relative path is "
     "looked up next to the sweep file, then in the working directory"),
]


@pytest.fixture(scope="module")
def bad_sweeps(tmp_path_factory):
    """Every case of BAD_SWEEPS through `tuning.cli.main`, in one process, each with its sweep file in
    a directory of its own: [(result, directory)] in the order of BAD_SWEEPS."""
    cases = []
    for body, args, _ in BAD_SWEEPS:
        directory = tmp_path_factory.mktemp("sweep")
        (directory / "sweep.yaml").write_text(body)
        cases.append({"args": [str(directory / "sweep.yaml"), *args], "cwd": str(directory)})
    results = run_cases("tuning.cli", cases)
    return [(result, Path(case["cwd"])) for result, case in zip(results, cases)]


@pytest.mark.parametrize("index", range(len(BAD_SWEEPS)),
                         ids=[message[:60] for _, _, message in BAD_SWEEPS])
def test_bad_sweep_files_exit_2_before_ray(bad_sweeps, index):
    message = BAD_SWEEPS[index][2]
    result, directory = bad_sweeps[index]
    assert result["returncode"] == 2, result["stderr"] + result["stdout"]
    assert message in result["stderr"]
    assert "Traceback" not in result["stderr"]
    assert not result["ray_imported"], "Ray was imported on a bad-input path"
    assert [p.name for p in directory.iterdir()] == ["sweep.yaml"]  # nothing written


def test_the_shipped_sweeps_are_valid():
    asha = sweep_config.load(REPO / "tuning" / "sweeps" / "digits_asha.yaml")
    assert asha.config.scheduler.name == "asha" and asha.config.num_samples >= 8 and asha.name == "digits_asha"
    assert asha.base.scaling.num_workers == 1 and asha.base.train.max_steps == 320
    pbt = sweep_config.load(REPO / "tuning" / "sweeps" / "digits_pbt.yaml", ["num_samples=6"], name="p")
    assert pbt.config.scheduler.name == "pbt" and pbt.config.num_samples == 6 and pbt.name == "p"
    optuna = sweep_config.load(REPO / "tuning" / "sweeps" / "digits_optuna.yaml")
    assert optuna.config.search.algorithm == "optuna"


def test_concurrency_keeps_room_for_one_trials_workers():
    trial = TrialResources(driver={"CPU": 0.5}, min_workers={"CPU": 1.0}, max_workers={"CPU": 1.0})
    assert concurrency(None, trial, {"CPU": 4.0}, total_trials=10).trials == 2  # whole trials that fit
    assert concurrency(None, trial, {"CPU": 4.0}, total_trials=1).trials == 1
    lowered = concurrency(8, trial, {"CPU": 4.0}, total_trials=10)
    # 6 drivers (3 CPUs) + one trial's workers (1 CPU) fit; 7 drivers would starve every trial
    assert lowered.trials == 6 and "lowered from 8 to 6" in lowered.note
    assert concurrency(3, trial, {"CPU": 4.0}, total_trials=10).trials == 3
    too_big = concurrency(None, TrialResources({"CPU": 0.5}, {"GPU": 1.0}, {"GPU": 1.0}), {"CPU": 4.0}, 10)
    assert not too_big.fits and "autoscaler" in too_big.note


def test_on_an_autoscaling_cluster_trials_beyond_what_fits_now_wait_as_demand():
    trial = TrialResources(driver={"CPU": 0.25}, min_workers={"CPU": 1.0, "GPU": 1.0},
                           max_workers={"CPU": 1.0, "GPU": 1.0})
    head_only = {"CPU": 4.0}
    largest = {"CPU": 36.0, "GPU": 8.0}
    # nothing fits now, but 8 GPU nodes may come: 8 trials start, their workers are pending demand
    decision = concurrency(None, trial, head_only, total_trials=20, largest=largest)
    assert decision.trials == 8 and not decision.fits and decision.fits_at_largest
    assert "grows to CPU 36, GPU 8" in decision.note
    # the same cluster without its launcher config: one trial at a time
    assert concurrency(None, trial, head_only, total_trials=20).trials == 1
    # a trial that the cluster cannot hold even at its largest is refused
    never = concurrency(None, trial, head_only, 4, largest={"CPU": 36.0})
    assert not never.fits_at_largest and "grows it to at most CPU 36" in never.note


def test_a_restarted_trial_resumes_its_own_run_and_an_exploit_starts_a_new_one():
    assert exploit.decide_start("s-t1", "t1", None).run_name == "s-t1"
    own = exploit.decide_start("s-t1", "t1", {"run": "s-t1-x40", "trial_id": "t1", "step": 80})
    assert own.run_name == "s-t1-x40" and own.seed_from is None
    donor = {"run": "s-t2", "trial_id": "t2", "step": 40}
    exploited = exploit.decide_start("s-t1", "t1", donor)
    assert exploited.run_name == "s-t1-x40" and exploited.seed_from == donor


def test_a_rebased_seed_keeps_the_donors_weights_and_takes_the_new_hyperparameters(tmp_path):
    model = torch.nn.Linear(3, 2)
    old = OptimConfig(lr=0.01, weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=old.lr, weight_decay=old.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    donor = tmp_path / "donor"
    donor.mkdir()
    ckpt.save(donor, model_state=model.state_dict(), optimizer_state=optimizer.state_dict(),
              scheduler_state=scheduler.state_dict(), loop=ckpt.LoopState(step=40),
              config={"seed": 0, "optim": old.model_dump(mode="json")}, steps_per_epoch=10, world_size=1, metrics={})
    new = OptimConfig(lr=0.001, weight_decay=0.0)
    exploit.rebase(str(donor), tmp_path / "seed", new)
    state = ckpt.load(tmp_path / "seed")
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())
    assert state["loop"].step == 40 and state["optimizer"]["state"]  # moments kept
    group = state["optimizer"]["param_groups"][0]
    assert group["lr"] == pytest.approx(0.0005) and group["weight_decay"] == 0.0  # new lr at the same schedule point
    assert state["scheduler"]["base_lrs"] == [0.001] and state["config"]["optim"]["lr"] == 0.001
    # and the loop's own restore path takes it
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=new.lr)
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh, lambda step: 0.5)
    fresh.load_state_dict(state["optimizer"])
    fresh_scheduler.load_state_dict(state["scheduler"])
    fresh_scheduler.step()
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.0005)
    meta = json.loads((tmp_path / "seed" / ckpt.META_FILE).read_text())
    assert meta.get("state_bytes", (tmp_path / "seed" / ckpt.STATE_FILE).stat().st_size) == \
        (tmp_path / "seed" / ckpt.STATE_FILE).stat().st_size


def test_a_relative_base_is_found_next_to_the_sweep_file_first(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "job.yaml").write_text("seed: 7\ntrain: {max_steps: 5}\n")
    (folder / "sweep.yaml").write_text("base: job.yaml\nspace:\n  optim.lr: {loguniform: [1.0e-4, 1.0e-2]}\n")
    monkeypatch.chdir(tmp_path)  # not the sweep file's folder
    assert sweep_config.load(folder / "sweep.yaml").base.seed == 7
    # Not there: the working directory, as before (the shipped sweeps name training/configs/...).
    (tmp_path / "other.yaml").write_text("seed: 9\n")
    (folder / "sweep2.yaml").write_text("base: other.yaml\nspace:\n  optim.lr: {loguniform: [1.0e-4, 1.0e-2]}\n")
    assert sweep_config.load(folder / "sweep2.yaml").base.seed == 9
