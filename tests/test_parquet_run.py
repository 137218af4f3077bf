"""Integration: a training run on a table Spark wrote (Hive-partitioned, with its `.crc` and `_SUCCESS`
files), read where it is by the `parquet` source, streamed by 2 workers on a local Ray cluster and
tracked in MLflow; a worker killed mid-epoch resumes to bit-identical weights; a resume after the
data changed is refused before anything is written."""

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, train_worker_pids
from mlflow.tracking import MlflowClient

from training import config as config_lib
from training.checkpoint import format as ckpt
from training.errors import UserError
from training.metrics import mlflow_name
from training.run.driver import run_training

pytestmark = pytest.mark.ray


SPARK_TABLE = Path(__file__).resolve().parent / "data" / "spark_digits"  # tests/data/make_spark_digits.py


def kill_a_worker_after(run_dir, step, kills):
    """SIGKILL one training worker once the run has a complete checkpoint at `step` (mid-epoch)."""

    def target():
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (run_dir / ckpt.checkpoint_dir_name(step) / ckpt.META_FILE).exists():
            time.sleep(0.05)
        # (at once: 150 steps of digits take about a second here, and a kill after the run's end
        # would resume nothing)
        for pid in train_worker_pids()[:1]:
            os.kill(pid, signal.SIGKILL)
            kills.append(pid)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def digest_history(workdir, name):
    """step -> data digest, as the run's MLflow run has it."""
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id],
                                filter_string=f"tags.`training.run_name` = '{name}'")
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, mlflow_name("data_digest"))}


def final_weights(run_dir):
    return ckpt.load(sorted(run_dir.glob("checkpoint-*"))[-1])["model"]


def test_a_run_streams_a_spark_table_in_place_resumes_bit_identically_and_refuses_changed_data(ray_cluster, workdir):
    table = workdir / "warehouse" / "digits"
    shutil.copytree(SPARK_TABLE, table)  # (copy2: sizes and modification times as Spark left them)
    data = (f"data.options={{path: '{table}', features: pixels, label: digit, validation_fraction: 0.25, "
            "partitions: 8, shuffle_window: 2}")
    overrides = ["data.source=parquet", data, "train.max_steps=150", "train.eval_every_n_steps=50",
                 "train.global_batch_size=64", "checkpoint.every_n_steps=50", "tracking.register_model=false",
                 "tracking.export_onnx=false", "failure.max_failures=2"]
    job = config_lib.load(CONFIGS / "digits.yaml", overrides, name="parquet-digits")
    summary = run_training(job, log=print)

    assert summary.steps == 150 and summary.metrics["world_size"] == 2
    assert summary.metrics["val_accuracy"] >= 0.9
    cache = workdir / "runs" / "datasets"
    (index_dir,) = [p for p in cache.iterdir() if p.name.startswith("parquet-")]
    assert [p.name for p in index_dir.iterdir()] == ["manifest.json"]  # an index only: nothing copied
    inputs = MlflowClient(f"sqlite:///{workdir}/mlflow.db").get_run(summary.mlflow_run_id).inputs.dataset_inputs
    by_context = {i.tags[0].value: i.dataset for i in inputs}
    assert set(by_context) == {"training", "validation"}
    assert str(table) in by_context["training"].source and by_context["training"].source_type == "parquet"
    rows = {context: json.loads(dataset.profile)["num_rows"] for context, dataset in by_context.items()}
    recorded = json.loads((index_dir / "manifest.json").read_text())["splits"]
    assert rows == {"training": recorded["train"]["rows"], "validation": recorded["validation"]["rows"]}
    assert sum(rows.values()) == 1797  # every digit, in one split or the other

    # A worker SIGKILLed mid-epoch (an epoch is about 21 steps): the group restarts from step 50 and
    # streams on from that row of that epoch, to the same weights, bit for bit.
    kills = []
    killer = kill_a_worker_after(workdir / "runs" / "parquet-chaos", 50, kills)
    chaotic = run_training(config_lib.load(CONFIGS / "digits.yaml", overrides, name="parquet-chaos"), log=print)
    killer.join(timeout=5)
    assert kills and chaotic.steps == 150
    expected, actual = (final_weights(workdir / "runs" / "parquet-digits"),
                        final_weights(workdir / "runs" / "parquet-chaos"))
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected), "weights differ after a restart"

    # Resized from 2 workers to 1 (a resume at another size, as after an elastic resize; the elastic
    # node test takes a run 2 -> 1 -> 2): the same global batches as the fixed run, step for step
    # (the data digest: training.data.order.batch_digest).
    resized = None
    for workers, steps in ((2, 60), (1, 150)):
        resized = run_training(config_lib.load(CONFIGS / "digits.yaml", overrides + [
            f"scaling.num_workers={workers}", f"train.max_steps={steps}"], name="parquet-resized"), log=print)
        assert resized.steps == steps and resized.metrics["world_size"] == workers
    assert resized.metrics["data_digest"] == summary.metrics["data_digest"] == chaotic.metrics["data_digest"]
    fixed, elastic = (digest_history(workdir, name) for name in ("parquet-digits", "parquet-resized"))
    assert {50, 60, 100, 150} <= set(elastic) and all(elastic[s] == fixed[s] for s in elastic if s in fixed)

    victim = next(table.glob("day=2026-01-02/part-00002-*.snappy.parquet"))
    os.utime(victim, ns=(10**18, 10**18))
    before = sorted(p.name for p in cache.iterdir())
    with pytest.raises(UserError, match=f"{victim.name} changed"):
        run_training(config_lib.load(CONFIGS / "digits.yaml", overrides, name="parquet-digits"), log=print)
    assert sorted(p.name for p in cache.iterdir()) == before
