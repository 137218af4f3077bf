"""Checkpoint round trip and format version; model plug-ins and built-ins (no Ray)."""

import json

import pytest
import torch

from training.checkpoint import format as ckpt
from training.config import OptimConfig
from training.errors import UserError
from training.models.registry import build_model as build_section
from training.models.registry import check_fits_task, model_section
from training.worker.optim import build_optimizer, lr_factor
from training.worker.seeding import StepSeeder, step_seed, step_seeds


def build_model(name: str, options: dict, spec: dict):
    """The model of a `model` section {name, options} for data described by `spec`."""
    return build_section(model_section({"name": name, "options": options}), spec)

DIGITS = {"task": "classification", "input_dim": 64, "num_classes": 10}
TINYLM = {"task": "language_model", "vocab_size": 256, "seq_len": 16}


def test_checkpoint_round_trip_restores_everything(tmp_path):
    torch.manual_seed(0)
    model = build_model("digits_mlp", {}, DIGITS)
    optimizer = build_optimizer(OptimConfig(), model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(OptimConfig(warmup_steps=3), 50))
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    scheduler.step()
    loop = ckpt.LoopState(step=17, best_metric=0.5, evals_without_improvement=1)
    ckpt.save(tmp_path, model_state=model.state_dict(), optimizer_state=optimizer.state_dict(),
              scheduler_state=scheduler.state_dict(), loop=loop, config={"seed": 3}, steps_per_epoch=5,
              world_size=2, metrics={"val_loss": 0.5, "note": "x"})
    state = ckpt.load(tmp_path)
    assert state["loop"] == loop and state["config"] == {"seed": 3}
    fresh = build_model("digits_mlp", {}, DIGITS)
    fresh.load_state_dict(state["model"])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    fresh_optimizer = build_optimizer(OptimConfig(), fresh)
    fresh_optimizer.load_state_dict(state["optimizer"])
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"],
                       optimizer.state_dict()["state"][0]["exp_avg"])
    meta = json.loads((tmp_path / ckpt.META_FILE).read_text())
    assert (meta["step"], meta["epoch"], meta["position_in_epoch"], meta["world_size"]) == (17, 3, 2, 2)
    assert meta["metrics"] == {"val_loss": 0.5} and meta["format_version"] == ckpt.FORMAT_VERSION


def test_checkpoint_of_another_format_is_refused(tmp_path):
    torch.save({"format_version": 999}, tmp_path / ckpt.STATE_FILE)
    with pytest.raises(ValueError, match="format 999"):
        ckpt.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        ckpt.load(tmp_path / "missing")


def _save_tiny(directory, step):
    directory.mkdir(parents=True)
    ckpt.save(directory, model_state={"w": torch.ones(1000)}, optimizer_state={}, scheduler_state={},
              loop=ckpt.LoopState(step=step), config={"seed": 0}, steps_per_epoch=10, world_size=1, metrics={})


def test_the_newest_complete_checkpoint_is_found_and_cut_short_ones_never(tmp_path):
    import pyarrow.fs as pafs

    fs, run = pafs.LocalFileSystem(), tmp_path / "run"
    for step in (20, 30, 40, 50):
        _save_tiny(run / ckpt.checkpoint_dir_name(step), step)
    state = run / ckpt.checkpoint_dir_name(50) / ckpt.STATE_FILE
    state.write_bytes(state.read_bytes()[:100])  # upload cut short: state.pt truncated
    (run / ckpt.checkpoint_dir_name(40) / ckpt.META_FILE).unlink()  # meta.json not there yet
    (run / ckpt.checkpoint_dir_name(30) / ckpt.META_FILE).write_text('{"format_ver')  # meta.json cut short
    (run / "checkpoint-tmp").mkdir()  # not a checkpoint name
    assert ckpt.newest_complete(fs, str(run)) == (20, str(run / ckpt.checkpoint_dir_name(20)))
    assert ckpt.newest_complete(fs, str(run), newer_than=20) is None
    assert ckpt.newest_complete(fs, str(tmp_path / "no-such-run")) is None
    assert ckpt.step_of("/x/checkpoint-00000123/") == 123 and ckpt.step_of("checkpoint_000001") is None


def test_step_seed_depends_on_seed_step_and_rank():
    seeds = {step_seed(s, t, r) for s in (0, 1) for t in (0, 1, 2) for r in (0, 1)}
    assert len(seeds) == 12 and step_seed(0, 5, 1) == step_seed(0, 5, 1)


def test_step_seeds_in_a_block_are_the_step_seeds_one_at_a_time():
    for seed, first, rank in ((0, 0, 0), (12345, 1000, 3), ((1 << 63) + 7, (1 << 40) - 5, 1)):
        assert step_seeds(seed, first, 50, rank) == [step_seed(seed, first + k, rank) for k in range(50)]


def test_the_step_seeder_draws_what_seeding_each_step_alone_draws():
    """Across a block's edge, and when a resumed run starts mid-block, or steps go back."""
    seeder = StepSeeder(7, 1, torch.device("cpu"))
    for step in (0, 1, StepSeeder.BLOCK - 1, StepSeeder.BLOCK, StepSeeder.BLOCK + 1, 5000, 3):
        seeder(step)
        drawn = torch.rand(4)
        torch.manual_seed(step_seed(7, step, 1))
        assert torch.equal(drawn, torch.rand(4)), step


def test_warmup_then_cosine():
    factor = lr_factor(OptimConfig(warmup_steps=10, min_lr_ratio=0.1), total_steps=110)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(60) == pytest.approx(0.55) and factor(110) == pytest.approx(0.1)


def test_builtin_models_shapes():
    assert build_model("digits_mlp", {"hidden": [32]}, DIGITS)(torch.randn(5, 64)).shape == (5, 10)
    assert build_model("digits_cnn", {}, DIGITS)(torch.randn(3, 64)).shape == (3, 10)
    gpt = build_model("gpt", {"n_layer": 1, "d_model": 32, "n_head": 2}, TINYLM)
    assert gpt(torch.randint(0, 256, (2, 16))).shape == (2, 16, 256)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_an_untrained_gpt_starts_at_the_loss_of_a_uniform_guess(preset):
    """The first loss is about ln(vocabulary): the model starts knowing nothing, not sure of wrong tokens."""
    import math

    torch.manual_seed(0)
    vocab = 2048
    gpt = build_model("gpt", {"preset": preset}, {"task": "language_model", "vocab_size": vocab, "seq_len": 32})
    tokens = torch.randint(0, vocab, (4, 33))
    with torch.no_grad():
        logits = gpt(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).item()
    assert abs(loss - math.log(vocab)) < 0.05 * math.log(vocab)


def test_model_plugin_by_import_string():
    model = build_model("plugins.examples:linear", {"scale": 2.0}, DIGITS)
    assert model(torch.randn(4, 64)).shape == (4, 10)
    with pytest.raises(UserError, match="not a torch.nn.Module"):
        build_model("plugins.examples:not_a_module", {}, DIGITS)
    with pytest.raises(UserError, match="has no function 'missing'"):
        build_model("plugins.examples:missing", {}, DIGITS)
    with pytest.raises(UserError, match="rejected model.options"):
        build_model("plugins.examples:linear", {"depth": 3}, DIGITS)
    with pytest.raises(UserError, match="not an import string"):
        build_model("plugins/examples.py:linear", {}, DIGITS)


def test_model_must_fit_the_task():
    with pytest.raises(UserError, match="gpt is for language_model data"):
        check_fits_task(model_section({"name": "gpt"}), "classification")
    check_fits_task(model_section({"name": "plugins.examples:linear"}), "classification")


def test_a_run_on_a_described_cluster_is_priced(monkeypatch):
    from conftest import REPO

    from training.run.cost import cluster_config_path, estimate_cost_metrics

    monkeypatch.setenv("TRAINING_CLUSTER_CONFIG", str(REPO / "cluster.yaml"))
    path = cluster_config_path(None)
    metrics = estimate_cost_metrics(path, wall_s=2 * 3600, gpu_nodes=2)
    from cluster.prices import load_price_table

    table = load_price_table()
    expected = 2 * (table.get("m5.xlarge").on_demand_usd_per_hour + 2 * table.get("g5.xlarge").spot_usd_per_hour)
    assert metrics["cluster_cost_usd_estimate"] == pytest.approx(expected, rel=1e-3)
    assert metrics["cluster_gpu_energy_kwh_estimate"] == pytest.approx(
        2 * 2 * table.get("g5.xlarge").gpu_rated_watts / 1000)
    assert cluster_config_path("~/x.yaml").endswith("/x.yaml")


def test_the_largest_cluster_is_read_from_its_launcher_config(tmp_path, monkeypatch):
    from conftest import REPO

    from training.run.resources import maximum_resources, use_gpus

    assert maximum_resources() is None  # not on a launched head
    # cluster.yaml: a head of 4 CPUs, then spot (priority 10, up to 8 x {4 CPU, 1 GPU}) before
    # on-demand (up to 4 x {8 CPU, 1 GPU}), within max_workers 12
    monkeypatch.setenv("TRAINING_CLUSTER_CONFIG", str(REPO / "cluster.yaml"))
    largest = maximum_resources()
    assert largest == {"CPU": 4 + 8 * 4 + 4 * 8, "GPU": 12}
    # no GPU node yet (GPU workers start from zero): `auto` still trains on GPUs
    assert use_gpus({"CPU": 4.0}, largest) and not use_gpus({"CPU": 4.0}, None)
    capped = tmp_path / "capped.yaml"
    capped.write_text("max_workers: 3\nhead_node_type: h\navailable_node_types:\n  h: {resources: {CPU: 2}}\n"
                      "  a: {max_workers: 2, priority: 1, resources: {CPU: 1}}\n"
                      "  b: {max_workers: 2, priority: 5, resources: {CPU: 10}}\n")
    monkeypatch.setenv("TRAINING_CLUSTER_CONFIG", str(capped))
    assert maximum_resources() == {"CPU": 2 + 2 * 10 + 1 * 1}
    monkeypatch.setenv("TRAINING_CLUSTER_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(UserError, match="TRAINING_CLUSTER_CONFIG.*no such file"):
        maximum_resources()


def test_early_stopping_counts_evaluations_without_improvement():
    from training.config import JobConfig
    from training.worker.evaluate import update_early_stopping as _update_early_stopping

    job = JobConfig.model_validate({"train": {"max_steps": 10, "early_stopping": {
        "metric": "val_accuracy", "mode": "max", "patience_evals": 2, "min_delta": 0.01}}})
    loop = ckpt.LoopState()
    for accuracy, stopped in ((0.5, False), (0.8, False), (0.805, False), (0.79, True)):
        _update_early_stopping(job.train.early_stopping, loop, {"val_accuracy": accuracy})
        assert loop.stopped_early is stopped
    assert loop.best_metric == 0.8
    with pytest.raises(ValueError, match="not a validation metric"):
        _update_early_stopping(job.train.early_stopping, ckpt.LoopState(), {"val_loss": 1.0})


def test_logging_a_model_leaves_no_tracking_uri_behind(tmp_path, monkeypatch):
    """mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI; a run's finalize must not leave it set
    for the next run in the process or the processes it starts."""
    import os

    from training.tracking.tracker import fluent_mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with fluent_mlflow(f"sqlite:///{tmp_path}/a.db") as mlflow:
        assert mlflow.get_tracking_uri() == f"sqlite:///{tmp_path}/a.db"
    assert "MLFLOW_TRACKING_URI" not in os.environ
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    with fluent_mlflow(f"sqlite:///{tmp_path}/b.db"):
        pass
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://tracking.example:5000"


def test_a_models_shapes_are_checked_by_one_forward_pass_on_the_meta_device():
    from training.config import JobConfig
    from training.run.preflight import check_model_builds

    blobs = {"input_dim": 6, "num_classes": 3}
    for name in ["plugins.examples:linear", "plugins.examples:explodes", "plugins.examples:itemizing"]:
        # fits; fails only in training mode (the first step's to find); cannot run on meta (not checked)
        check_model_builds(JobConfig(model={"name": name}).model, "classification", blobs)
    check_model_builds(JobConfig(model={"name": "gpt"}).model, "language_model", TINYLM)
    with pytest.raises(UserError, match=r"returns logits of shape \[2, 4\]; the data needs \[2, 3\]"):
        check_model_builds(JobConfig(model={"name": "plugins.examples:wide_output"}).model, "classification", blobs)
    with pytest.raises(UserError, match="does the model take the data's input_dim 6"):
        check_model_builds(JobConfig(model={"name": "plugins.examples:fixed_input"}).model, "classification", blobs)
    with pytest.raises(UserError, match="model.name digits_cnn: digits_cnn needs square images"):
        check_model_builds(JobConfig(model={"name": "digits_cnn"}).model, "classification", blobs)


def test_a_plugin_that_fails_is_a_user_error_naming_its_field():
    from training.plugins import load_callable

    with pytest.raises(UserError, match=r"^model.name: importing module 'plugins.raises_at_import' failed: "
                                        r"RuntimeError: cannot reach the license server;"):
        load_callable("plugins.raises_at_import:build", "model.name")
    with pytest.raises(UserError, match=r"importing module 'plugins.exits_at_import' failed: SystemExit: 0"):
        load_callable("plugins.exits_at_import:build", "model.name")
    with pytest.raises(UserError, match=r"model.name plugins.examples:model_fails failed: ValueError: hidden sizes"):
        build_model("plugins.examples:model_fails", {}, DIGITS)
