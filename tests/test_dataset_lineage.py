"""Lineage in MLflow: a run's dataset inputs, written to and read back from a real MLflow store,
name the data as the config wrote it (not JSON-encoded twice) and the partition filter that chose
its files. No Ray: the datasets are logged as the driver logs them, from the prepared data's record."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from training.data.manifest import Manifest
from training.data.registry import data_section, prepare
from training.tracking.datasets import log_datasets

SPARK_TABLE = Path(__file__).resolve().parent / "data" / "spark_digits"  # tests/data/make_spark_digits.py


@pytest.fixture
def store(tmp_path, empty_mlflow_db):
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    return MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")


def logged_sources(client, manifest) -> dict:
    """{context: (source type, source as JSON)} of the datasets logged for `manifest` in a new run."""
    experiment = client.create_experiment(f"lineage-{len(client.search_experiments())}")
    run_id = client.create_run(experiment).info.run_id
    warnings = []
    log_datasets(SimpleNamespace(client=client, run_id=run_id), manifest, warnings.append)
    assert warnings == []
    inputs = client.get_run(run_id).inputs.dataset_inputs
    return {i.tags[0].value: (i.dataset.source_type, json.loads(i.dataset.source)) for i in inputs}


def test_a_table_read_in_place_is_recorded_by_its_path_as_written_and_its_filter(tmp_path, store):
    table = tmp_path / "warehouse" / "digits"
    shutil.copytree(SPARK_TABLE, table)
    options = {"path": str(table), "features": "pixels", "label": "digit", "validation_fraction": 0.25,
               "partitions": 4, "filter": {"day": "2026-01-02"}}
    manifest = prepare(data_section({"source": "parquet", "options": options}), str(tmp_path / "cache"), log=print)
    sources = logged_sources(store, manifest)
    assert set(sources) == {"training", "validation"}
    for context, (source_type, source) in sources.items():
        assert source_type == "parquet"
        assert source["uri"] == str(table), source  # the path itself, not '"/…/digits"'
        assert source["filter"] == {"day": "2026-01-02"}
        assert source["index"] == manifest.root
    assert sources["validation"][1]["validation_fraction"] == 0.25


def test_an_object_store_uri_is_recorded_as_written_with_its_password_hidden(tmp_path, store):
    """(A record as the parquet source writes one; no S3 is reached: only the record is logged.)"""
    split = {"rows": 10, "files": [{"uri": "s3://lake/warehouse/events/day=1/part-0.parquet"}]}
    written = {"path": "s3://etl:secret@lake/warehouse/events", "validation_path": ["s3://lake/val/a", "s3://lake/val/b"],
               "filter": {"day": [1, 2]}, "tokens": "tokens"}
    manifest = Manifest(root=str(tmp_path / "index"), source="parquet", options=written, task="language_model",
                        spec={"vocab_size": 50, "seq_len": 8}, splits={"train": split, "validation": split},
                        schema="tokens: list<int32>", digest="ab" * 32)
    sources = logged_sources(store, manifest)
    assert sources["training"][1]["uri"] == "s3://etl:***@lake/warehouse/events"
    assert sources["validation"][1]["uri"] == ["s3://lake/val/a", "s3://lake/val/b"]  # its own path
    assert all(source["filter"] == {"day": [1, 2]} for _, source in sources.values())

    prepared = Manifest(**{**manifest.__dict__, "options": {}, "root": str(tmp_path / "prepared"),
                           "origin": {"path": "s3://lake/raw/books", "validation_path": None, "filter": {},
                                      "tokenizer": "trained"}})
    sources = logged_sources(store, prepared)
    assert sources["training"][1] == {"uri": "s3://lake/raw/books", "prepared": str(tmp_path / "prepared"),
                                      "tokenizer": "trained"}  # no filter: none recorded


def test_a_transformed_table_is_recorded_by_its_input_path_and_filter(tmp_path, store):
    table = tmp_path / "warehouse" / "digits"
    shutil.copytree(SPARK_TABLE, table)
    options = {"path": str(table), "features": "x", "label": "label", "validation_fraction": 0.25, "partitions": 4,
               "filter": {"day": "2026-01-01"},
               "transform": {"function": "plugins.transforms:scale_pixels", "run_on": "driver"}}
    manifest = prepare(data_section({"source": "parquet", "options": options}), str(tmp_path / "cache"), log=print)
    for _, source in logged_sources(store, manifest).values():
        assert source["uri"] == str(table) and source["filter"] == {"day": "2026-01-01"}
        assert source["transform"] == "plugins.transforms:scale_pixels" and source["prepared"] == manifest.root
