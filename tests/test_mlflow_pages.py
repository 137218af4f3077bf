"""What MLflow shows of a run, and what MLflow says during one, against a real MLflow store (no Ray):
the run page's charts lead with the loss and the validation metrics, the dataset drawer gets a
schema MLflow's UI renders, and MLflow's registration and validation messages stay in the run's
log file."""

import json
import shutil

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from training.run.console import ConsoleRouter, Place, RunLog, console_log


@pytest.fixture
def tracking_uri(tmp_path, empty_mlflow_db):
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path}/mlflow.db"


# --- MLflow's own messages: the run's log file, not the console ---------------------------------------

class Refuses(torch.nn.Module):
    """A model that fails on its own input example (as a graph traced on other strides did)."""

    def forward(self, tokens):
        raise ValueError("Guard failed: tokens.stride()[0] != 64")


def mlflow_chatter(tracking_uri: str) -> None:
    """A registration as mlflow.register_model does it (a first and a second version of one name), and
    a model logged with an input example that fails MLflow's validation: MLflow's own messages, for real."""
    import mlflow
    import mlflow.pytorch
    from mlflow.models import infer_signature

    example = np.arange(130).reshape(2, 65)
    mlflow.set_tracking_uri(tracking_uri)
    try:
        with mlflow.start_run():
            info = mlflow.pytorch.log_model(Refuses(), name="refuses", serialization_format="pickle",
                                            signature=infer_signature(example, np.zeros((2, 3))),
                                            input_example=example)
        for _ in range(2):
            mlflow.register_model(info.model_uri, "chatter")
    finally:
        mlflow.set_tracking_uri(None)


def test_mlflow_registration_and_validation_messages_stay_in_the_log_file(tmp_path, tracking_uri, capsys):
    log = RunLog(tmp_path / "driver.log")
    log.start()
    with console_log(log):
        print("the run's own line")
        mlflow_chatter(tracking_uri)
    out, err = capsys.readouterr()
    written = (tmp_path / "driver.log").read_text()
    for said in ("Successfully registered model 'chatter'", "Registered model 'chatter' already exists",
                 "Created version '2' of model 'chatter'", "Failed to validate serving input example",
                 "Got error: Guard failed"):
        assert said in written, said  # (MLflow does say it: the log file has it)
    assert out == "the run's own line\n" and err == "", (out, err)
    assert '\n  "inputs": [' in written  # the example's JSON: lines of the same record


def test_only_mlflow_errors_reach_the_console():
    router = ConsoleRouter()
    assert router.mlflow_event("2026/01/02 03:04:05 ERROR mlflow.store: the store is gone\nmore\n") is Place.CONSOLE
    assert router.mlflow_event("\x1b[33m2026/01/02 03:04:05 WARNING mlflow.models: slow\x1b[0m\n") is Place.LOG
    assert router.mlflow_event("Created version '3' of model 'x'.\n") is Place.LOG


# --- the dataset drawer ---------------------------------------------------------------------------------

def logged_datasets(tracking_uri: str, manifest) -> dict:
    """{context: dataset} of the datasets logged for `manifest` in a new run, read back from MLflow."""
    from types import SimpleNamespace

    from training.tracking.datasets import log_datasets

    client = MlflowClient(tracking_uri)
    run_id = client.create_run(client.create_experiment(f"pages-{len(client.search_experiments())}")).info.run_id
    warnings = []
    log_datasets(SimpleNamespace(client=client, run_id=run_id), manifest, warnings.append)
    assert warnings == []
    return {i.tags[0].value: i.dataset for i in client.get_run(run_id).inputs.dataset_inputs}


def columns_as_the_ui_reads_them(schema: str) -> dict:
    """What MLflow's dataset drawer does with a dataset's schema (ExperimentViewDatasetSchema in its UI):
    JSON.parse it; with an `mlflow_colspec` key, a table of each entry's `name` and `type` (rendered
    as text: a string), else "Unrecognized Schema Format"."""
    parsed = json.loads(schema)
    assert isinstance(parsed, dict) and list(parsed) == ["mlflow_colspec"], parsed
    assert all(isinstance(c["name"], str) and isinstance(c["type"], str) for c in parsed["mlflow_colspec"])
    return {c["name"]: c for c in parsed["mlflow_colspec"]}


def test_a_prepared_dataset_carries_a_schema_the_dataset_drawer_renders(tmp_path, tracking_uri):
    from training.data.registry import data_section, prepare

    manifest = prepare(data_section({"source": "digits"}), str(tmp_path / "cache"), log=print)
    datasets = logged_datasets(tracking_uri, manifest)
    assert set(datasets) == {"training", "validation"}
    for dataset in datasets.values():
        columns = columns_as_the_ui_reads_them(dataset.schema)
        assert columns == {"x": {"type": "array", "items": {"type": "float"}, "name": "x", "required": True},
                           "y": {"type": "long", "name": "y", "required": True}}, columns
        assert json.loads(dataset.profile)["arrow_schema"] == manifest.schema  # (Arrow's own words, too)


def test_a_table_read_in_place_carries_its_columns_and_its_source_as_written(tmp_path, tracking_uri):
    from pathlib import Path

    from training.data.registry import data_section, prepare

    table = tmp_path / "warehouse" / "digits"
    shutil.copytree(Path(__file__).resolve().parent / "data" / "spark_digits", table)
    options = {"path": str(table), "features": "pixels", "label": "digit", "validation_fraction": 0.25,
               "partitions": 4, "filter": {"day": "2026-01-02"}}
    manifest = prepare(data_section({"source": "parquet", "options": options}), str(tmp_path / "cache"), log=print)
    for dataset in logged_datasets(tracking_uri, manifest).values():
        columns = columns_as_the_ui_reads_them(dataset.schema)
        assert set(columns) == {"pixels", "digit"} and columns["pixels"]["type"] == "array", columns
        source = json.loads(dataset.source)
        assert source["uri"] == str(table) and source["filter"] == {"day": "2026-01-02"}


# --- the run page's charts ------------------------------------------------------------------------------

def run_page_sections(metric_keys) -> list[tuple[str, list[str]]]:
    """The run page's "Model metrics" tab as MLflow 3.17's UI lays it out for a run's metrics, in order:
    (section, its charts). Ported from its getBaseChartAndSectionConfigs (filterMetricNames keeps the
    keys not starting "system/"; extractChartSectionName: the part before the last "/", or "Model
    metrics" for none): the named sections first, sorted, then "Model metrics"; charts sorted by key."""
    sections: dict[str, list[str]] = {}
    for key in sorted(k for k in metric_keys if not k.startswith("system/")):
        sections.setdefault(key.rpartition("/")[0] or "Model metrics", []).append(key)
    return [(name, sections[name]) for name in sorted(n for n in sections if n != "Model metrics")] + (
        [("Model metrics", sections["Model metrics"])] if "Model metrics" in sections else [])


def a_report(step: int) -> dict:
    """A report as rank 0 of a language model's run in failure.mode continue makes it: the worker's
    real window metrics (training/worker/progress.py), the replica ledger's, the checkpoint's cost,
    the validation metrics and a system sample."""
    import time

    from training.failure.replicas import ReplicaLedger
    from training.observe.system import SYSTEM_KEY
    from training.worker.progress import Progress, RunFacts

    facts = RunFacts(global_batch_size=8, steps_per_epoch=10, total_steps=20, world_size=2, start_step=0,
                     worker_start_s=time.time(), seq_len=16, flops_per_token=1e6, peak_flops_per_s=1e12)
    progress = Progress(facts, rank=0, device=torch.device("cpu"))
    progress.add(torch.tensor(8.0), 4)
    progress.step_done()
    ledger = ReplicaLedger(world_size=2, global_batch_size=8)
    ledger.record(step, 1, 4, time.time())
    return {**progress.metrics(step, progress.reduce(False), lr=0.01, data_digest=12345), **ledger.report_metrics(),
            "checkpoint_bytes": 1000, "checkpoint_save_s": 0.1, "checkpoint_blocking_s": 0.05,
            "preemption_checkpoint_step": step, "val_loss": 2.0, "val_perplexity": 7.4, "val_token_accuracy": 0.3,
            SYSTEM_KEY: [{"node": "node-abcdef12", "time_s": time.time(),
                          "node_values": {"cpu_utilization_percentage": 5.0}}]}


def test_the_run_page_opens_on_the_loss_and_the_validation_metrics(tracking_uri):
    from training.tracking.callback import RunCallback
    from training.tracking.tracker import MlflowTracker

    client = MlflowClient(tracking_uri)
    run_id = client.create_run(client.create_experiment("charts")).info.run_id
    tracker = MlflowTracker(tracking_uri, run_id)
    callback = RunCallback(tracker)
    for step in (10, 20):
        callback.after_report(None, [a_report(step)], checkpoint=None)
    tracker.log_metrics({"cluster_cost_usd_estimate": 0.01, "cluster_gpu_energy_kwh_estimate": 0.0}, step=0)
    assert tracker.close(30)
    logged = client.get_run(run_id).data.metrics

    sections = run_page_sections(logged)
    assert sections == [("Model metrics", ["train_loss", "train_lr", "val_loss", "val_perplexity",
                                           "val_token_accuracy"])], sections
    # the rest, on the System metrics tab: the nodes' samples, and how the run ran, a section each
    assert {k.split("/")[1] for k in logged if k.startswith("system/")} == {
        "node-abcdef12", "progress", "data", "throughput", "step_time", "clock", "replicas", "checkpoint", "cost"}
    history = client.get_metric_history(run_id, "system/data/data_digest")  # (what exact-resume tests read)
    assert [(m.step, m.value) for m in history] == [(10, 12345.0), (20, 12345.0)]
    assert tracker.last_step("train_loss") == 20 and tracker.last_step("data_digest") == 20


def test_every_metric_a_run_reports_has_its_place():
    """A metric a worker reports and this module does not place would open the run page (a
    plug-in's own metric keeps its name, as the learning curves do, on purpose)."""
    from training.metrics import KEY_METRICS, MLFLOW_NAMES, PLOTTED, mlflow_name

    learning_curves = {"train_loss", "val_loss", "val_perplexity", "val_token_accuracy"}
    reported = {k for k, v in a_report(10).items() if isinstance(v, (int, float)) and k not in ("step", "total_steps")}
    assert {k for k in reported if mlflow_name(k) == k} == learning_curves
    assert all(mlflow_name(k) == k for k in PLOTTED)  # (the end-of-run plot reads them back by these names)
    assert [k for k in KEY_METRICS if mlflow_name(k) != k] == ["samples_per_s"]
    assert all(name.startswith("system/") for key, name in MLFLOW_NAMES.items() if key != "lr")
