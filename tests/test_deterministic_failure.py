"""A deterministic data error on a worker ends the run at once: a Parquet file rewritten after the
run indexed it fails the worker that reads it with a DataError, and Ray Train is told not to
restart the group (a restart would read the same file and fail the same way, max_failures times).
The run fails with the error's message; no worker group restarted. A run whose worker group cannot
be placed ends once failure.placement_timeout_s has passed, saying what it needed and what the
cluster has (Ray Train alone waits for ever)."""

import json
import os
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import CONFIGS

from training import config as config_lib
from training.errors import RunFailed
from training.observe.files import read_progress
from training.run.driver import run_training

pytestmark = pytest.mark.ray

SPARK_TABLE = Path(__file__).resolve().parent / "data" / "spark_digits"  # tests/data/make_spark_digits.py


def rewrite_with_a_row_less(path: Path) -> None:
    table = pq.read_table(path)
    pq.write_table(table.slice(1), path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def test_a_file_changed_during_the_run_fails_it_at_once_without_a_restart(ray_cluster, workdir):
    import shutil

    table = workdir / "warehouse" / "digits"
    shutil.copytree(SPARK_TABLE, table)
    data = (f"data.options={{path: '{table}', features: pixels, label: digit, validation_fraction: 0.25, "
            "partitions: 8, shuffle_window: 2}")
    job = config_lib.load(CONFIGS / "digits.yaml", [
        "data.source=parquet", data, "train.max_steps=60", "train.global_batch_size=64", "failure.max_failures=3",
        "train.eval_every_n_steps=50", "checkpoint.every_n_steps=50", "scaling.cpus_per_worker=0.5",
        "tracking.enabled=false"], name="changed")
    changed = []

    def change_a_training_file():
        """Once the run was indexed and checked, before its workers start: one training file
        rewritten (a row less: another size), as a job writing into the table would."""
        (manifest,) = (workdir / "runs" / "datasets").glob("parquet-*/manifest.json")
        uri = json.loads(manifest.read_text())["splits"]["train"]["files"][0]["uri"]
        victim = Path(uri.removeprefix("file://"))
        rewrite_with_a_row_less(victim)
        changed.append(victim)

    with pytest.raises(RunFailed) as failed:
        run_training(job, started=change_a_training_file, log=print)
    (victim,) = changed
    message = str(failed.value)
    assert message.startswith("training run changed failed: ") and "changed during the run (size" in message
    assert victim.name in message and "Traceback" not in message
    assert (read_progress(str(workdir / "runs" / "changed")) or {}).get("restarts", 0) == 0


def test_a_run_whose_workers_cannot_be_placed_fails_with_what_the_cluster_has(ray_cluster, workdir, monkeypatch):
    ray = ray_cluster
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "1")  # Ray Train's wait per attempt
    job = config_lib.load(CONFIGS / "digits.yaml", [
        "train.max_steps=20", "scaling.num_workers=2", "scaling.cpus_per_worker=0.5", "tracking.enabled=false",
        "failure.placement_timeout_s=3"], name="unplaceable")
    holder = ray.util.placement_group([{"CPU": 2}])  # every CPU of the cluster held (as by a leftover run)
    ray.get(holder.ready(), timeout=60)
    outcome = {}

    def target():
        try:
            run_training(job, log=print)
        except Exception as exc:
            outcome["error"] = exc

    try:
        runner = threading.Thread(target=target, daemon=True)
        runner.start()
        runner.join(timeout=180)  # (without the bound the run waits for placement for ever)
        assert not runner.is_alive(), "the unplaceable run did not end"
    finally:
        ray.util.remove_placement_group(holder)
    error = outcome.get("error")
    assert isinstance(error, RunFailed), error
    assert str(error) == ("training run unplaceable failed: cannot place 2 workers with 0.5 CPU each within "
                          "failure.placement_timeout_s 3 s: the cluster has 2 CPU (0 CPU free)")
