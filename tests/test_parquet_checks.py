"""Parquet data checked on the driver before anything is written: empty files add no rows, `file://`
paths, broken files failing at once (not retried as an outage), nulls, label and token ranges
against the options, column types, list widths across files, globs within a folder, a validation
split stable when files are added and apart from the training files. Real files, no Ray."""

import logging
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from training.data import parquet
from training.data.files import list_files, list_splits
from training.data.parquet_checks import ColumnError, is_broken_file
from training.data.parquet_index import Columns
from training.data.registry import data_section
from training.errors import DataError, UserError

SPARK_TABLE = Path(__file__).resolve().parent / "data" / "spark_digits"


def classes(n=40, label=None, f0=None, **extra) -> pa.Table:
    ids = np.arange(n)
    return pa.table({"f0": f0 if f0 is not None else ids.astype(np.float32),
                     "label": label if label is not None else (ids % 3).astype(np.int64), **extra})


def dataset(root: Path, files=4, **kw) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        pq.write_table(classes(), root / f"part-{i:02d}.parquet", row_group_size=16, **kw)
    return root


def options(root, **kw):
    return parquet.ParquetOptions(path=str(root), **({"features": ["f0"], "label": "label",
                                                      "validation_fraction": 0.3} | kw))


def index(root, **kw) -> dict:
    return parquet.index_of(options(root, **kw))


def prepared(tmp_path, root, **kw):
    """The source's own path on the driver: plan, then prepare (UserError naming the option)."""
    section = data_section({"source": "parquet", "options": {"path": str(root), "features": ["f0"],
                                                            "label": "label", "validation_fraction": 0.3} | kw})
    return parquet.SOURCE.plan(section, str(tmp_path / "cache")).prepare(None, lambda _: None)


# --- 1. empty files add no rows ---

def test_an_empty_file_first_or_anywhere_adds_no_rows(tmp_path):
    root = dataset(tmp_path / "t")
    pq.write_table(classes().slice(0, 0), root / "part-00-a-empty.parquet")  # first in path order
    pq.write_table(classes().slice(0, 0), root / "part-99-empty.parquet")
    pq.write_table(pa.table({}), root / "part-50-no-columns.parquet")
    built = index(root)
    assert built["spec"] == {"input_dim": 1, "num_classes": 3}  # (the statistics still give the classes)
    assert built["splits"]["train"]["rows"] + built["splits"]["validation"]["rows"] == 4 * 40


def test_a_transform_tries_its_function_on_the_first_file_with_rows(tmp_path):
    table = tmp_path / "digits"
    shutil.copytree(SPARK_TABLE, table)
    first = sorted(table.rglob("*.parquet"))[0]
    empty = pq.read_table(first).slice(0, 0)
    pq.write_table(empty, first.parent / "part-00000-0000-empty.snappy.parquet")
    section = data_section({"source": "parquet", "options": {
        "path": str(first.parent), "features": "x", "label": "label",
        "validation_path": str(table / "day=2026-01-02"),
        "transform": {"function": "plugins.transforms:scale_pixels"}}})
    plan = parquet.SOURCE.plan(section, str(tmp_path / "cache"))  # (it tries the function before it plans)
    assert plan.inputs["train"][0].uri.endswith("0000-empty.snappy.parquet")


# --- 2. file:// URIs, NUL ---

def test_file_uris_are_taken_wherever_a_path_is(tmp_path):
    root = dataset(tmp_path / "t")
    other = dataset(tmp_path / "v", files=2)
    built = index(f"file://{root}", validation_fraction=None, validation_path=f"file://{other}")
    assert built["splits"]["validation"]["rows"] == 80 and built["splits"]["train"]["rows"] == 160
    assert len(list_files(f"file://{root}/*.parquet")) == 4


def test_a_nul_in_a_path_is_refused_by_name(tmp_path):
    with pytest.raises(ValidationError, match="control character"):
        options(f"{tmp_path}/t\0x")
    with pytest.raises(ValidationError, match="control character"):
        options(tmp_path, validation_fraction=None, validation_path=["ok", "bad\0"])


# --- 3. a broken file fails at once; a transient error is one to retry ---

def corrupt_page(path: Path) -> None:
    data = bytearray(path.read_bytes())
    start = pq.ParquetFile(path).metadata.row_group(0).column(0).data_page_offset
    data[start:start + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("breaks", [
    lambda p: p.write_bytes(p.read_bytes()[:-4] + b"XXXX"),  # no magic bytes
    lambda p: p.write_bytes(p.read_bytes()[:-40] + b"\x07" * 32 + p.read_bytes()[-8:]),  # a footer that fails
    corrupt_page,  # the footer reads; the first row group does not
])
def test_a_broken_file_fails_at_once_naming_it(tmp_path, caplog, breaks):
    root = dataset(tmp_path / "t")
    breaks(root / "part-00.parquet")
    with caplog.at_level(logging.WARNING), pytest.raises(UserError, match=r"data.options.path: .*part-00.parquet is "
                                                                          "not a readable Parquet file"):
        prepared(tmp_path, root)
    assert "retry" not in caplog.text  # (not waited on as a storage outage)


def test_broken_bytes_and_outages_are_told_apart():
    s3 = pafs.S3FileSystem(endpoint_override="127.0.0.1:9", scheme="http", access_key="k", secret_key="s",
                           retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1), connect_timeout=1)
    with pytest.raises(OSError) as unreachable:
        s3.open_input_file("bucket/key.parquet")
    assert not is_broken_file(unreachable.value)
    assert is_broken_file(OSError("Couldn't deserialize thrift: No more data to read."))
    assert is_broken_file(pa.ArrowInvalid("Parquet magic bytes not found in footer."))
    assert is_broken_file(FileNotFoundError("gone"))


# --- 4. nulls, label and token ranges against the options ---

def one_bad_file(root: Path, table: pa.Table, **kw) -> Path:
    dataset(root)
    pq.write_table(table, root / "part-02.parquet", row_group_size=16, **kw)
    return root


@pytest.mark.parametrize("table, message", [
    (classes(label=pa.array([0, 1, 2] * 6 + [None] + [1] * 21)), r"part-02.parquet row group 1: column 'label' has "
                                                                 "null values"),
    (classes(f0=pa.array([1.0] * 39 + [None], pa.float32())), r"part-02.parquet row group 2: column 'f0' has null"),
])
@pytest.mark.parametrize("statistics", [True, False])
def test_nulls_are_refused_naming_file_row_group_and_column(tmp_path, table, message, statistics):
    if not statistics:  # (written without statistics: the row group is read instead; the first one here)
        bad = min(i for column in table.columns for i, null in enumerate(column.is_null().to_pylist()) if null)
        table = pa.concat_tables([table.slice(bad), table.slice(0, bad)])
        message = message.replace("row group 1", "row group 0").replace("row group 2", "row group 0")
    root = one_bad_file(tmp_path / "t", table, write_statistics=statistics)
    with pytest.raises(ColumnError, match=message) as caught:
        index(root, num_classes=3)
    assert caught.value.option in ("data.options.label", "data.options.features")


def test_null_tokens_are_refused(tmp_path):
    root = tmp_path / "lm"
    root.mkdir()
    pq.write_table(pa.table({"tokens": [[1, 2, 3]] * 10}), root / "a.parquet")
    pq.write_table(pa.table({"tokens": [[1, 2, 3]] * 9 + [[1, None, 3]]}), root / "b.parquet")
    with pytest.raises(ColumnError, match="b.parquet row group 0: column 'tokens' has null values"):
        index(root, features=None, label=None, tokens="tokens")


@pytest.mark.parametrize("kw, label, message, option", [
    ({"num_classes": 3}, [0, 1, 2, 3], r"part-02.parquet holds label 3 in column 'label', but "
                                       r"data.options.num_classes is 3: .* at least 4", "data.options.num_classes"),
    ({}, [0, 1, 2 ** 40], r"class ids up to 1,099,511,627,776: .* more than 1,000,000", "data.options.label"),
    ({}, [0, 1, -1], r"column 'label' has negative values \(min -1\) in .*part-02.parquet row group 0",
     "data.options.label"),
])
def test_labels_are_checked_against_the_statistics(tmp_path, kw, label, message, option):
    root = one_bad_file(tmp_path / "t", classes(n=len(label), label=pa.array(label, pa.int64())))
    with pytest.raises(ColumnError, match=message) as caught:
        index(root, **kw)
    assert caught.value.option == option
    with pytest.raises(UserError, match=f"^{option}: "):
        prepared(tmp_path, root, **kw)


def test_a_boolean_label_is_two_classes(tmp_path):
    root = tmp_path / "t"
    root.mkdir()
    for i in range(3):
        pq.write_table(classes(label=pa.array([True, False] * 20)), root / f"{i}.parquet")
    assert index(root)["spec"] == {"input_dim": 1, "num_classes": 2}


def test_a_vocab_size_below_the_token_ids_is_refused(tmp_path):
    root = tmp_path / "lm"
    root.mkdir()
    for i in range(3):
        tokens = pa.array([[1, 2, 50 + i]] * 10, pa.list_(pa.int32()))
        pq.write_table(pa.table({"tokens": tokens}), root / f"{i}.parquet")
    assert index(root, features=None, label=None, tokens="tokens")["spec"] == {"vocab_size": 53, "seq_len": 2}
    with pytest.raises(ColumnError, match="2.parquet holds token id 52 .* data.options.vocab_size is 52"):
        index(root, features=None, label=None, tokens="tokens", vocab_size=52)


# --- 5. column types ---

@pytest.mark.parametrize("extra, kw, option, message", [
    ({"s": pa.array([{"a": 1.0}] * 40)}, {"features": ["f0", "s"]}, "data.options.features",
     r"column 's' is struct<a: double>; features must be numeric"),
    ({"name": pa.array(["x"] * 40)}, {"features": ["name"]}, "data.options.features", r"column 'name' is string"),
    ({"when": pa.array(np.arange(40), pa.timestamp("us"))}, {"label": "when"}, "data.options.label",
     r"column 'when' is timestamp\[us\]; a label must be an integer \(or boolean\) column"),
    ({"y": pa.array(np.arange(40) / 2)}, {"label": "y"}, "data.options.label", r"column 'y' is double; a label must"),
    ({"t": pa.array(np.arange(40))}, {"tokens": "t", "features": None, "label": None}, "data.options.tokens",
     r"column 't' is int64; tokens must be a list column of integer"),
    ({"t": pa.array([["a"]] * 40)}, {"tokens": "t", "features": None, "label": None}, "data.options.tokens",
     r"column 't' is list<element: string>"),
])
def test_column_types_are_refused_naming_the_option(tmp_path, extra, kw, option, message):
    root = tmp_path / "t"
    root.mkdir()
    for i in range(3):
        pq.write_table(classes(**extra), root / f"{i}.parquet")
    with pytest.raises(ColumnError, match=message) as caught:
        index(root, **kw)
    assert caught.value.option == option


# --- 6. list widths ---

def test_rows_of_different_widths_across_files_are_refused_naming_them(tmp_path):
    root = tmp_path / "lm"
    root.mkdir()
    pq.write_table(pa.table({"tokens": [[1, 2, 3, 4]] * 30}), root / "a.parquet")
    pq.write_table(pa.table({"tokens": [[1, 2, 3, 4]] * 30}), root / "b.parquet")
    pq.write_table(pa.table({"tokens": [[1, 2, 3, 4, 5]] * 30}), root / "c.parquet")
    with pytest.raises(ColumnError, match=r"column 'tokens' has rows of 4 values in .*[ab].parquet but 5 in "
                                          r".*c.parquet") as caught:
        index(root, features=None, label=None, tokens="tokens")
    assert caught.value.option == "data.options.tokens"
    (root / "c.parquet").unlink()
    pq.write_table(pa.table({"tokens": [[1, 2, 3, 4]] * 20 + [[1, 2, 3]] * 10}), root / "c.parquet",
                   row_group_size=20)
    with pytest.raises(ColumnError, match=r"c.parquet: column 'tokens' has rows of 4 values in row group 0 but 3 "
                                          "in row group 1"):
        index(root, features=None, label=None, tokens="tokens")


def test_the_decode_names_the_column_not_numpy():
    columns = Columns(features=("x",), label="y")
    uneven = pa.table({"x": pa.array([[1.0, 2.0], [1.0, 2.0, 3.0]]), "y": [0, 1]})
    with pytest.raises(DataError, match="column 'x': rows of different lengths"):
        columns.arrays(uneven)
    with pytest.raises(DataError, match="column 'y' has null values"):
        columns.arrays(pa.table({"x": pa.array([[1.0], [2.0]]), "y": [0, None]}))
    with pytest.raises(DataError, match="column 'x' has null values in its lists"):
        columns.arrays(pa.table({"x": pa.array([[1.0], [None]]), "y": [0, 1]}))
    with pytest.raises(DataError, match="column 'f' .* does not read as numbers"):
        Columns(features=("f",), label="y").arrays(pa.table({"f": ["a", "b"], "y": [0, 1]}))


# --- 7. globs within a folder; a validation split stable when files are added ---

def test_a_glob_star_stays_in_its_folder_and_double_star_goes_down(tmp_path):
    root = dataset(tmp_path / "t")
    dataset(root / "nested" / "deeper", files=2)
    assert len(list_files(f"{root}/*.parquet")) == 4
    assert len(list_files(f"{root}/**/*.parquet")) == 6
    assert len(list_files(f"{root}/nested/*/part-0[01].parquet")) == 2


def test_the_validation_split_keeps_its_files_when_files_are_added(tmp_path):
    root = dataset(tmp_path / "t", files=20)
    before = list_splits(str(root), None, 0.3).splits
    for i in range(20, 60):
        pq.write_table(classes(), root / f"part-{i:02d}.parquet")
    after = list_splits(str(root), None, 0.3).splits
    assert {f.uri for f in before["validation"]} <= {f.uri for f in after["validation"]}
    assert {f.uri for f in before["train"]} <= {f.uri for f in after["train"]}
    assert 0.15 < len(after["validation"]) / 60 < 0.45
    moved = tmp_path / "elsewhere"
    shutil.copytree(root, moved)  # (by the path below the dataset's folder: the same split wherever it lies)
    assert [Path(f.uri).name for f in list_splits(str(moved), None, 0.3).splits["validation"]] == \
        [Path(f.uri).name for f in after["validation"]]


# --- 8. validation apart from training ---

@pytest.mark.parametrize("validation", ["same", "inside", "outside"])
def test_a_validation_path_overlapping_the_path_is_refused(tmp_path, validation):
    root = dataset(tmp_path / "t")
    dataset(root / "sub", files=2)
    path, validation_path = {"same": (root, root), "inside": (root, root / "sub"),
                             "outside": (root / "sub", root)}[validation]
    with pytest.raises(UserError, match=r"data.options.validation_path: .* also listed by data.options.path"):
        prepared(tmp_path, path, validation_fraction=None, validation_path=str(validation_path))
