"""The parquet source's `transform`: a user's plug-in run over the input files (per batch or per
row, with the files' Hive partition values), written a file at a time as Parquet (an interrupted
preparation resumes, a changed function gives a new dataset) and streamed like Parquet read in place;
bad functions and outputs refused naming the option and the file, nothing written. In-process, no
Ray; one Ray test prepares on the cluster with Ray Data and trains on the output."""

import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import CONFIGS

from training.data import parquet, transform
from training.data.file_work import output_name
from training.data.manifest import MANIFEST, Manifest
from training.data.order import BatchPlan
from training.data.parquet import open_stream
from training.data.registry import data_section, prepare
from training.errors import ConfigError, UserError

SPARK_TABLE = Path(__file__).resolve().parent / "data" / "spark_digits"  # tests/data/make_spark_digits.py
ROWS = 1797  # every digit, across the table's 8 files


@pytest.fixture
def table(tmp_path):
    target = tmp_path / "warehouse" / "digits"
    shutil.copytree(SPARK_TABLE, target)  # (copy2: sizes and modification times as Spark left them)
    return target


def data_options(table, function="plugins.transforms:scale_pixels", **transform_extra) -> dict:
    return {"path": str(table), "features": "x", "label": "label", "validation_fraction": 0.25, "partitions": 4,
            "transform": {"function": function, **transform_extra}}


def data_config(table, function="plugins.transforms:scale_pixels", **transform_extra):
    return data_section(dict(source="parquet", options=data_options(table, function, **transform_extra)))


def plan(data, cache_root):
    return parquet.SOURCE.plan(data, cache_root)


def check_unchanged(recorded_root, data, cache_root):
    plan(data, cache_root).check_unchanged(recorded_root)


def input_rows(table) -> dict:
    """id -> (pixels, digit, day) of every row of the Spark table."""
    rows = {}
    for path in sorted(table.rglob("*.parquet")):
        day = path.parent.name.split("=")[1]
        for row in pq.read_table(path).to_pylist():
            rows[row["id"]] = (np.asarray(row["pixels"], np.float32), row["digit"], day)
    return rows


def written(cache) -> list[Path]:
    return sorted(p for p in Path(cache).rglob("*") if p.is_file()) if Path(cache).exists() else []


def test_a_batch_transform_sees_the_partitions_and_its_output_is_streamed(table, tmp_path):
    lines = []
    manifest = prepare(data_config(table), str(tmp_path / "cache"), log=lines.append)
    assert manifest.task == "classification" and manifest.spec == {"input_dim": 64, "num_classes": 10}
    assert manifest.rows("train") + manifest.rows("validation") == ROWS
    assert manifest.origin["transform"] == "plugins.transforms:scale_pixels"
    assert any("transformed 8 of 8 files" in line and "in this process" in line for line in lines)
    out = [pq.read_table(p) for p in Path(manifest.root).rglob("*.parquet")]
    assert len(out) == 8 and all(t.schema.names == ["x", "label", "day"] for t in out)
    days = {d for t in out for d in t.column("day").to_pylist()}
    assert days == {1, 2}  # the partition value, from the folders (Spark leaves it out of the files)
    # Each output file keeps its input's row groups (the layout the streaming loader partitions).
    for path in Path(manifest.root).rglob("*.parquet"):
        source = next(p for p in table.rglob("*.parquet") if output_name(str(p)) == path.name)
        assert [pq.ParquetFile(path).metadata.row_group(g).num_rows
                for g in range(pq.ParquetFile(path).num_row_groups)] \
            == [pq.ParquetFile(source).metadata.row_group(g).num_rows
                for g in range(pq.ParquetFile(source).num_row_groups)]

    # Streamed: every training row once per epoch, scaled as the function scaled it.
    by_pixels = {tuple(np.round(p / 16, 5)): digit for p, digit, _ in input_rows(table).values()}
    plan = BatchPlan(global_batch_size=32, world_size=1, rank=0, micro_batch_size=32)
    stream = open_stream(manifest, plan, seed=0)
    seen = 0
    for step in range(manifest.rows("train") // 32):
        batch = stream.batch(step)
        for x, y in zip(batch["x"], batch["y"]):
            assert by_pixels[tuple(np.round(x, 5))] == y
        seen += len(batch["y"])
    assert seen == manifest.rows("train") // 32 * 32


def test_row_and_pandas_transforms(table, tmp_path):
    pytest.importorskip("pandas")
    odd = prepare(data_config(table, "plugins.transforms:odd_digits_as_dicts", per="row", options={"keep": "odd"}),
                  str(tmp_path / "a"), log=print)
    digits = [d for _, d, _ in input_rows(table).values()]
    assert odd.rows("train") + odd.rows("validation") == sum(d % 2 for d in digits)
    assert odd.spec["num_classes"] == 5  # (9 // 2) + 1
    frame = prepare(data_config(table, "plugins.transforms:as_pandas"), str(tmp_path / "b"), log=print)
    assert frame.rows("train") + frame.rows("validation") == ROWS and frame.spec["input_dim"] == 64


def test_an_interrupted_preparation_resumes_without_rewriting_finished_files(table, tmp_path):
    cache = str(tmp_path / "cache")
    failing = data_config(table, options={"fail_on_day": "2026-01-02"}, run_on="driver")
    # (the function fails on day 2's files: the check on the first rows passes, on day 1)
    with pytest.raises(UserError, match=r"data.options.transform.function: plugins.transforms:scale_pixels failed on "
                                        r".*day=2026-01-02/part-.*: RuntimeError: cannot handle day 2026-01-02"):
        prepare(failing, cache, log=print)
    kept = written(cache)
    day_one = {output_name(str(p)) for p in table.glob("day=2026-01-01/*.parquet")}
    assert kept and {p.name for p in kept} <= day_one  # the files before it, complete:
    assert not any(p.name == MANIFEST or p.name.endswith(".tmp") for p in kept)  # nothing half-written
    assert all(pq.read_table(p).schema.names == ["x", "label", "day"] for p in kept)


def test_a_resumed_preparation_keeps_the_files_written_before(table, tmp_path):
    cache = str(tmp_path / "cache")
    data = data_config(table, run_on="driver")
    planned = plan(data, cache)
    first = planned.tasks()[:3]
    assert all("error" not in r for r in transform.transform_in_driver(first, planned))  # then the driver died
    kept = {p: p.stat().st_mtime_ns for p in written(cache)}
    assert len(kept) == 3
    lines = []
    manifest = prepare(data, cache, log=lines.append)
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # not rewritten
    assert any("transformed 5 of 8 files" in line for line in lines)
    assert any("3 files prepared earlier were kept" in line for line in lines)
    assert manifest.rows("train") + manifest.rows("validation") == ROWS
    again = []
    assert prepare(data, cache, log=again.append).root == manifest.root and "cached" in again[0]


def test_a_changed_function_or_input_gives_another_dataset_and_a_resume_on_it_is_refused(table, tmp_path):
    package = tmp_path / "code" / "mytransforms"
    package.mkdir(parents=True)
    module = package / "__init__.py"
    module.write_text("def keep(table):\n    return table.select(['pixels', 'digit']).rename_columns(['x', 'label'])\n")
    import sys

    sys.path.insert(0, str(tmp_path / "code"))
    try:
        data = data_config(table, "mytransforms:keep", run_on="driver")
        cache = str(tmp_path / "cache")
        manifest = prepare(data, cache, log=print)
        check_unchanged(manifest.root, data, cache)  # unchanged: no error
        module.write_text(module.read_text() + "# scaled differently from now on\n")
        sys.modules.pop("mytransforms")
        with pytest.raises(UserError, match="the input data or the transform's module changed"):
            check_unchanged(manifest.root, data, cache)
        assert plan(data, cache).root != manifest.root
    finally:
        sys.path.remove(str(tmp_path / "code"))
        sys.modules.pop("mytransforms", None)
    manifest = prepare(data_config(table), cache, log=print)
    victim = next(table.rglob("*.parquet"))
    os.utime(victim, ns=(10**18, 10**18))
    with pytest.raises(UserError, match="the input data or the transform's module changed"):
        check_unchanged(manifest.root, data_config(table), cache)


BAD = [
    ("not importable", {"function": "plugins.nowhere:scale"}, UserError,
     ["data.options.transform.function", "cannot import module 'plugins.nowhere'"]),
    ("no such function", {"function": "plugins.transforms:missing"}, UserError,
     ["data.options.transform.function", "has no function 'missing'"]),
    ("raises", {"options": {"fail_on_day": "2026-01-01"}}, UserError,
     ["data.options.transform.function: plugins.transforms:scale_pixels failed on", "day=2026-01-01", "RuntimeError"]),
    ("bad options", {"options": {"colour": "red"}}, UserError,
     ["scale_pixels failed on", "TypeError", "data.options.transform.options", "colour"]),
    ("output lacks a column", {"function": "plugins.transforms:no_label"}, UserError,
     ["data.options.transform.function", "has no column 'x'", "(it has: pixels)"]),
    ("not a table", {"function": "plugins.transforms:not_a_table"}, UserError,
     ["returned list", "return a pyarrow.Table, a pandas DataFrame or a dict of columns"]),
    ("unknown input column", {"columns": ["pixels", "colour"]}, UserError,
     ["data.options.transform.columns: ", "has no column 'colour'"]),
    ("unknown per", {"per": "file"}, ConfigError, ["data.options.transform.per"]),
]


@pytest.mark.parametrize("case, change, error, words", BAD, ids=[c[0] for c in BAD])
def test_bad_transforms_are_refused_naming_the_option_and_file_with_nothing_written(table, tmp_path, case, change,
                                                                                     error, words):
    options = data_options(table)
    options = {**options, "transform": {**options["transform"], **change}}
    with pytest.raises(error) as raised:
        prepare(data_section(dict(source="parquet", options=options)), str(tmp_path / "cache"), log=print)
    for word in words:
        assert word in str(raised.value), str(raised.value)
    assert written(tmp_path / "cache") == []


def test_an_output_whose_columns_change_between_batches_is_refused(table, tmp_path):
    package = tmp_path / "code"
    package.mkdir()
    (package / "drifting.py").write_text(
        "import pyarrow as pa\n"
        "def f(table):\n"
        "    label = table.column('digit')\n"
        "    if table.num_rows % 2:\n"
        "        label = pa.array([v + 0.5 for v in label.to_pylist()])\n"
        "    return {'x': table.column('pixels'), 'label': label}\n")
    import sys

    sys.path.insert(0, str(package))
    try:
        sizes = [pq.ParquetFile(p).metadata.row_group(g).num_rows for p in table.rglob("*.parquet")
                 for g in range(pq.ParquetFile(p).num_row_groups)]
        assert any(s % 2 for s in sizes) and any(s % 2 == 0 for s in sizes)  # (the test's premise)
        with pytest.raises(UserError, match="data.options.transform.function: .*(other columns or types|label)"):
            prepare(data_config(table, "drifting:f", run_on="driver"), str(tmp_path / "cache"), log=print)
    finally:
        sys.path.remove(str(package))
        sys.modules.pop("drifting", None)
    assert not [p for p in written(tmp_path / "cache") if p.name == MANIFEST or p.name.endswith(".tmp")]


@pytest.mark.ray
def test_a_run_transforms_on_the_cluster_with_ray_data_and_trains_on_the_output(ray_cluster, workdir):
    from training import config as config_lib
    from training.run.driver import run_training

    table = workdir / "warehouse" / "digits"
    shutil.copytree(SPARK_TABLE, table)
    data = (f"data.options={{path: '{table}', features: x, label: label, validation_fraction: 0.25, partitions: 4, "
            "transform: {function: 'plugins.transforms:scale_pixels', run_on: cluster}}")
    overrides = ["data.source=parquet", data, "train.max_steps=40", "train.eval_every_n_steps=40",
                 "checkpoint.every_n_steps=40", "tracking.register_model=false", "tracking.export_onnx=false",
                 "failure.max_failures=0", "optim.warmup_steps=0", "optim.lr=0.01"]
    lines = []
    summary = run_training(config_lib.load(CONFIGS / "digits.yaml", overrides, name="transformed"),
                           log=lambda line: (lines.append(line), print(line)))
    assert summary.steps == 40 and summary.metrics["val_accuracy"] >= 0.6  # (chance: 0.1)
    assert any("transformed 8 of 8 files" in line and "on the cluster (Ray Data)" in line for line in lines)
    (root,) = (workdir / "runs" / "datasets").glob("transform-*")
    on_cluster = Manifest.load(str(root))
    in_driver = prepare(
        data_section(dict(source="parquet",
                          options={**config_lib.load(CONFIGS / "digits.yaml", overrides).data.options_as_written(),
                                   "transform": {"function": "plugins.transforms:scale_pixels", "run_on": "driver"}})),
        str(workdir / "again"), log=print)
    assert on_cluster.splits["train"]["rows"] == in_driver.splits["train"]["rows"]
    for path in root.rglob("*.parquet"):  # the same rows, wherever transformed
        twin = Path(in_driver.root) / path.relative_to(root)
        assert pq.read_table(path).equals(pq.read_table(twin))
    from mlflow.tracking import MlflowClient

    inputs = MlflowClient(f"sqlite:///{workdir}/mlflow.db").get_run(summary.mlflow_run_id).inputs.dataset_inputs
    assert all("plugins.transforms:scale_pixels" in i.dataset.source and str(table) in i.dataset.source for i in inputs)


def test_an_input_file_that_is_not_parquet_is_named(table, tmp_path):
    bad = table / "day=2026-01-02" / "part-99999-notes.parquet"
    bad.write_text("not parquet at all")
    with pytest.raises(UserError, match=f"data.options.path: {bad} is not a readable Parquet file"):
        prepare(data_config(table, run_on="driver"), str(tmp_path / "cache"), log=print)
    assert not [p for p in written(tmp_path / "cache") if p.name == MANIFEST or p.name.endswith(".tmp")]
