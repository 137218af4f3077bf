"""Integration: a training run on Parquet files read where they are (the `parquet` source), laid out
as Spark writes a partitioned table, streamed by 2 workers on a local Ray cluster and tracked in
MLflow; a resume after the data changed is refused before anything is written."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient
from sklearn.datasets import load_digits

from conftest import CONFIGS
from training import config as config_lib
from training.errors import UserError
from training.run.driver import run_training

pytestmark = pytest.mark.ray


def write_digits_table(root):
    """The digits as a Hive-partitioned table (by a collection day), 4 part files per partition, row
    groups of 64 rows, with the files Spark leaves beside its output."""
    digits = load_digits()
    x, y = (digits.data / 16).astype(np.float32), digits.target.astype(np.int64)
    day = np.random.default_rng(0).integers(0, 2, len(y))
    for d in (0, 1):
        rows = np.flatnonzero(day == d)
        folder = root / f"day=2026-01-0{d + 1}"
        folder.mkdir(parents=True)
        for part, chunk in enumerate(np.array_split(rows, 4)):
            pixels = pa.FixedSizeListArray.from_arrays(pa.array(x[chunk].ravel()), 64)
            pq.write_table(pa.table({"pixels": pixels, "digit": y[chunk]}),
                           folder / f"part-{part:05d}-4c1d.c000.snappy.parquet", row_group_size=64)
            (folder / f".part-{part:05d}-4c1d.c000.snappy.parquet.crc").write_bytes(b"\0")
    (root / "_SUCCESS").write_text("")


def test_a_run_streams_parquet_in_place_and_refuses_changed_data_on_resume(ray_cluster, workdir):
    table = workdir / "warehouse" / "digits"
    write_digits_table(table)
    data = (f"data.options={{path: '{table}', features: pixels, label: digit, validation_fraction: 0.25, "
            "partitions: 8, shuffle_window: 2}")
    overrides = ["data.source=parquet", data, "train.max_steps=150", "train.eval_every_n_steps=50",
                 "train.global_batch_size=64", "checkpoint.every_n_steps=50", "tracking.register_model=false",
                 "tracking.export_onnx=false"]
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

    victim = table / "day=2026-01-02" / "part-00002-4c1d.c000.snappy.parquet"
    os.utime(victim, ns=(10**18, 10**18))
    before = sorted(p.name for p in cache.iterdir())
    with pytest.raises(UserError, match="part-00002-4c1d.c000.snappy.parquet changed"):
        run_training(config_lib.load(CONFIGS / "digits.yaml", overrides, name="parquet-digits"), log=print)
    assert sorted(p.name for p in cache.iterdir()) == before
