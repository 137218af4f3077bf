"""The registered model, as a user meets it: a real checkpoint of every built-in model family goes
through the end of a run (`finalize`) into a real MLflow store, and is then loaded from the registry
and called exactly as a user would; the registry's aliases and tags after runs of different quality;
the run's last lines. No Ray: the run's end is the driver's, on a checkpoint written here."""

import shutil
from pathlib import Path
from types import SimpleNamespace

import mlflow
import numpy as np
import pytest
import torch
from conftest import CONFIGS

from training import config as config_lib
from training.checkpoint import format as ckpt
from training.data.registry import prepare
from training.errors import ConfigError
from training.models.registry import build_model
from training.run.driver import RunSummary
from training.run.finalize import finalize, summary_lines
from training.tracking import registry
from training.tracking.policy import SendPolicy
from training.tracking.tracker import MlflowTracker

FAST = SendPolicy(attempt_timeout_s=5.0, first_backoff_s=0.2, max_backoff_s=1.0, persist_every_s=1.0, end_wait_s=10.0)
# What MLflow prints when it registers through mlflow.register_model, or when an input example fails.
NOISE = ("Registered model", "Successfully registered", "Created version", "Failed to validate", "Guard failed")


@pytest.fixture
def store(tmp_path, monkeypatch, empty_mlflow_db):
    """An empty sqlite store that MLflow's fluent API (what a user calls) points at."""
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # a sqlite store's default artifact root is ./mlruns, of the working directory
    return uri


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    return tmp_path_factory.mktemp("datasets")


def finish_run(root: Path, datasets: Path, uri: str, name: str, config: str, overrides: list[str],
               reported: dict, seed: int = 0):
    """A run's end as the driver meets it: its MLflow run with the metrics it reported, its last
    checkpoint (the model's weights for `seed`), then `finalize`. Returns (job, manifest, summary, lines)."""
    job = config_lib.load(CONFIGS / config, [f"tracking.tracking_uri={uri}", "tracking.export_onnx=false",
                                             *overrides], name=name)
    manifest = prepare(job.data, str(datasets), log=lambda line: None)
    torch.manual_seed(seed)
    model = build_model(job.model, {"task": manifest.task, **manifest.spec})
    run_dir = root / "runs" / name
    directory = run_dir / ckpt.checkpoint_dir_name(20)
    directory.mkdir(parents=True)
    ckpt.save(directory, model_state=model.state_dict(), optimizer_state={}, scheduler_state={},
              loop=ckpt.LoopState(step=20), config=job.model_dump(mode="json"), steps_per_epoch=10, world_size=1,
              metrics=reported)
    tracker = MlflowTracker.start(uri, job.tracking.experiment, name, None, {}, {}, run_dir=str(run_dir), policy=FAST)
    for step in (10, 20):  # an earlier evaluation, then the last: the last is the run's score
        tracker.log_metrics({k: v * step / 20 for k, v in reported.items()}, step)
    import ray.train

    checkpoint = ray.train.Checkpoint.from_directory(str(directory))
    result = SimpleNamespace(checkpoint=checkpoint, metrics=reported, best_checkpoints=[(checkpoint, reported)])
    summary = RunSummary(name=name, run_dir=str(run_dir), steps=20, metrics={"step": 20, **reported}, wall_s=1.0,
                         resumed=False, checkpoint_path=str(directory), mlflow_run_id=tracker.run_id, tracking_uri=uri)
    lines = []
    finalize(job, manifest, result, checkpoint, tracker, summary, lines.append)
    tracker.finish("FINISHED")
    return job, manifest, model.eval(), summary, lines


SMALL_TEXT = ["data.options.max_bytes=100000", "data.options.val_every_n_files=2"]  # (validation: 4 rows or more)


@pytest.mark.parametrize("config, model_name, model_format, data", [
    ("digits.yaml", "digits_mlp", "pt2", []),
    ("digits.yaml", "digits_cnn", "pt2", []),
    ("tinylm.yaml", "gpt", "pt2", SMALL_TEXT),
    ("tinylm.yaml", "gpt", "pt2", ["data.options.max_bytes=100000"]),  # one validation row: the sample's is doubled
    ("digits.yaml", "digits_mlp", "pickle", []),
    ("digits.yaml", "digits_cnn", "pickle", []),
    ("tinylm.yaml", "gpt", "pickle", SMALL_TEXT),
])
def test_a_registered_model_loads_and_predicts_on_any_batch_size(tmp_path, datasets, store, capfd, config,
                                                                 model_name, model_format, data):
    """The issue's failure: a language model exported on a non-contiguous slice refused every
    ordinary array (`Guard failed: tokens.stride()[0] != 64`), and its input example failed MLflow's
    validation on the console. Now every family, in both formats, is called as a user calls it."""
    overrides = [f"model={{name: {model_name}}}", f"tracking.model_format={model_format}", *data]
    job, manifest, model, summary, lines = finish_run(tmp_path, datasets, store, "user", config, overrides,
                                                      {"val_loss": 0.5, "val_accuracy": 0.8})
    printed = capfd.readouterr()
    assert not [n for n in NOISE if n in printed.out + printed.err], printed.out + printed.err
    assert summary.extra.get("mlflow_model_logged") is not False, lines
    name = summary.registered_model
    assert name == job.data.source + "-" + model_name and summary.extra["registered_version"] == "1"
    language_model = manifest.task == "language_model"
    dtype = np.int64 if language_model else np.float32

    served = mlflow.pyfunc.load_model(f"models:/{name}@latest")
    called = mlflow.pytorch.load_model(f"models:/{name}@best")
    for batch in (1, 2, 7):
        x = np.ones((batch, 64), dtype=dtype)  # ordinary, contiguous input: token id 1, or pixels of 1.0
        expected = model(torch.from_numpy(x)).detach().numpy()
        predicted = served.predict(x)
        assert predicted.shape == ((batch, 64, manifest.spec["vocab_size"]) if language_model else (batch, 10))
        np.testing.assert_allclose(predicted, expected, atol=1e-4)
        out = called(torch.zeros((batch, 64), dtype=torch.long if language_model else torch.float32))
        assert out.shape == predicted.shape
    example = mlflow.models.Model.load(f"models:/{name}@latest").load_input_example(
        mlflow.artifacts.download_artifacts(f"models:/{name}@latest"))
    assert np.asarray(example).shape[1] == 64  # the input example is kept (and validated: nothing printed)


def test_aliases_and_tags_follow_the_score_and_register_when(tmp_path, datasets, store, capfd):
    """Three runs of different quality: every one a version, @best on the best (val_accuracy, max);
    @latest, MLflow's own, on the last. With register_when improved, a worse run adds no version."""
    client = mlflow.MlflowClient(store)
    runs = {}
    for name, accuracy in (("first", 0.70), ("second", 0.90), ("third", 0.80)):
        runs[name] = finish_run(tmp_path, datasets, store, name, "digits.yaml", [], {"val_loss": 1 - accuracy,
                                                                                    "val_accuracy": accuracy})
    model = "digits-digits_mlp"
    assert str(client.get_model_version_by_alias(model, "best").version) == "2"
    assert str(client.get_model_version_by_alias(model, "latest").version) == "3"
    for version, (name, accuracy) in enumerate((("first", 0.70), ("second", 0.90), ("third", 0.80)), start=1):
        _, manifest, _, summary, lines = runs[name]
        found = client.get_model_version(model, str(version))
        assert found.tags == {"run_id": summary.mlflow_run_id, "data_digest": manifest.digest,
                              "score_metric": "val_accuracy", "score": repr(accuracy)}
        assert found.run_id == summary.mlflow_run_id and f"by run {name}" in found.description
        logged = client.get_logged_model(summary.extra["model_id"])
        assert logged.name == model and {m.key: m.value for m in logged.metrics}["val_accuracy"] == accuracy
        # linking the final metrics to the model adds nothing to the run's own history
        assert [m.step for m in client.get_metric_history(summary.mlflow_run_id, "val_accuracy")] == [10, 20]
    assert "now @best" in runs["second"][4][-3] and "now @best" not in runs["third"][4][-3]
    assert "0.8 does not beat version 2's 0.9" in runs["third"][4][-3]

    # register only on improvement: a worse run adds nothing, a better one a version that takes @best
    improved = ["tracking.register_when=improved"]
    _, _, _, worse, lines = finish_run(tmp_path, datasets, store, "worse", "digits.yaml", improved,
                                       {"val_loss": 0.15, "val_accuracy": 0.85})
    assert worse.registered_model is None and len(client.search_model_versions(f"name = '{model}'")) == 3
    assert lines[-3].startswith("  not registered (tracking.register_when improved): val_accuracy 0.85 does not beat")
    _, _, _, better, lines = finish_run(tmp_path, datasets, store, "better", "digits.yaml", improved,
                                        {"val_loss": 0.05, "val_accuracy": 0.95})
    assert better.extra["registered_version"] == "4"
    assert str(client.get_model_version_by_alias(model, "best").version) == "4"
    printed = capfd.readouterr()
    assert not [n for n in NOISE if n in printed.out + printed.err], printed.out + printed.err


def test_a_logged_model_is_registered_later_into_its_own_store(tmp_path, datasets, store, empty_mlflow_db):
    """A sweep registers its best trial's logged model after the trial: through the client of the
    sweep's store, whatever MLflow's global tracking URI says (here another, empty, store)."""
    from training.run.finalize import register_model

    job, manifest, _, summary, lines = finish_run(tmp_path, datasets, store, "trial", "digits.yaml",
                                                  ["tracking.register_model=false"], {"val_loss": 0.1,
                                                                                       "val_accuracy": 0.9})
    assert summary.registered_model is None and lines[-2].startswith('  load it: mlflow.pyfunc.load_model("models:/m-')
    shutil.copy(empty_mlflow_db, tmp_path / "elsewhere.db")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/elsewhere.db")
    try:
        registered = register_model(job, manifest, mlflow.MlflowClient(store), summary.extra["model_id"],
                                    summary.mlflow_run_id)
    finally:
        mlflow.set_tracking_uri(None)  # (and the fixture's variable is put back after the test)
    assert registered["registered_version"] == "1" and registered["best_moved"]
    assert mlflow.MlflowClient(store).get_model_version_by_alias("digits-digits_mlp", "best").tags["score"] == "0.9"


def test_the_last_lines_say_how_to_load_the_model_and_open_the_ui(tmp_path, datasets, store):
    _, _, _, summary, lines = finish_run(tmp_path, datasets, store, "lines", "digits.yaml", [],
                                         {"val_loss": 0.1, "val_accuracy": 0.9})
    assert lines[-3].startswith("  registered model: digits-digits_mlp version 1, now @best")
    assert lines[-2] == ('  load the best: mlflow.pyfunc.load_model("models:/digits-digits_mlp@best")  '
                         "(this run's: models:/digits-digits_mlp/1)")
    assert lines[-1].startswith("  MLflow UI: ") and lines[-1].endswith(
        f"mlflow ui --backend-store-uri {store}, then open http://127.0.0.1:5000")
    assert summary_lines(summary) == lines[-len(summary_lines(summary)):]
    # A tracking server: its page for the run, the password never shown.
    server = RunSummary(name="r", run_dir="/tmp/r", steps=1, metrics={}, wall_s=1.0, resumed=False,
                        mlflow_run_id="abc", tracking_uri="http://me:s3cret@mlflow.example:5000",
                        extra={"mlflow_url": "http://mlflow.example:5000/#/experiments/1/runs/abc",
                               "model_uri": "models:/m-1"})
    assert summary_lines(server)[-2:] == ['  load it: mlflow.pyfunc.load_model("models:/m-1")',
                                          "  MLflow UI: http://mlflow.example:5000/#/experiments/1/runs/abc"]
    assert "s3cret" not in "\n".join(summary_lines(server))


ACC, LOSS = registry.Best("1", "val_accuracy", 0.8), registry.Best("1", "val_loss", 0.3)


@pytest.mark.parametrize("score, metric, mode, best, register_when, registered, moved", [
    (0.9, "val_accuracy", "max", None, "improved", True, True),  # the first version takes @best
    (0.9, "val_accuracy", "max", ACC, "improved", True, True),
    (0.8, "val_accuracy", "max", ACC, "always", True, False),  # a tie keeps @best
    (0.8, "val_accuracy", "max", ACC, "improved", False, False),
    (0.2, "val_loss", "min", LOSS, "always", True, True),
    (0.4, "val_loss", "min", LOSS, "always", True, False),
    (None, "val_loss", "min", LOSS, "always", True, False),  # no score: never the best
    (float("nan"), "val_loss", "min", LOSS, "improved", False, False),
    (0.4, "val_loss", "min", ACC, "always", True, True),  # the score metric changed: not comparable
])
def test_the_registration_decision(score, metric, mode, best, register_when, registered, moved):
    decision = registry.decide(score, metric, mode, register_when, best)
    assert (decision.register, decision.move_best) == (registered, moved), decision.reason


def test_register_when_is_validated():
    with pytest.raises(ConfigError, match="tracking.register_when"):
        config_lib.load(CONFIGS / "digits.yaml", ["tracking.register_when=sometimes"])
    assert config_lib.load(CONFIGS / "digits.yaml").tracking.register_when == "always"
