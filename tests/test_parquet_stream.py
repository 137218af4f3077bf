"""The streaming data path: Parquet read in place from its footers' index, global batches drawn from a
fixed number of partitions, whatever the world size."""

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import wait_for

from training.backoff import RetryPolicy
from training.data import parquet
from training.data.files import changed, list_files
from training.data.order import BatchPlan
from training.data.parquet_read import FileReader
from training.data.stream import RowGroup, StreamingShard, deal, steps_per_epoch
from training.errors import DataError

B = 24


def id_groups(sizes):
    """Row groups whose rows are their global ids, and a loader that counts reads."""
    groups = [RowGroup(file=0, index=i, rows=n) for i, n in enumerate(sizes)]
    starts = np.cumsum([0] + list(sizes))
    reads = []

    def load(group_id):
        reads.append(group_id)
        return {"id": np.arange(starts[group_id], starts[group_id + 1])}

    return groups, load, reads


SIZES = [37, 50, 50, 50, 12, 50, 50, 44, 50, 50, 50, 29, 50, 50, 50, 50, 33, 50, 50, 50]


def shard(world_size, rank, partitions=4, window=2, sizes=SIZES, seed=7, read_ahead=False, read_threads=2):
    groups, load, reads = id_groups(sizes)
    return StreamingShard(groups, load, BatchPlan(B, world_size, rank), seed=seed, partitions=partitions,
                          window=window, read_ahead=read_ahead, read_threads=read_threads), reads


def global_batches(world_size, steps, **kw):
    shards = [shard(world_size, r, **kw)[0] for r in range(world_size)]
    return [np.concatenate([s.batch(step)["id"] for s in shards]) for step in range(steps)]


def test_the_same_global_batches_at_any_world_size():
    steps = 2 * steps_per_epoch(id_groups(SIZES)[0], 4, B) + 3  # into the third epoch
    reference = global_batches(1, steps)
    assert all(len(b) == B for b in reference)
    for world_size in (2, 3, 4):
        assert all(np.array_equal(a, b) for a, b in zip(reference, global_batches(world_size, steps)))


def test_sample_ids_are_the_rows_read():
    s, _ = shard(3, 2)
    for step in (0, 1, 9, 40, 3):
        rows = s.batch(step)["id"]  # (the test's rows carry their ids)
        assert np.array_equal(s.sample_ids(step), rows)


def test_an_epoch_reads_no_row_twice_and_nearly_all_of_them():
    per_epoch = steps_per_epoch(id_groups(SIZES)[0], 4, B)
    rows = np.concatenate(global_batches(2, per_epoch))
    assert len(np.unique(rows)) == len(rows)
    assert len(rows) > sum(SIZES) - B  # less than a batch's part of each partition left
    second = np.concatenate(global_batches(2, 2 * per_epoch)[per_epoch:])
    assert len(np.unique(second)) == len(second) and not np.array_equal(np.sort(rows), rows)


def test_a_resume_at_any_step_reads_what_the_run_would_have_read():
    continuous, _ = shard(2, 1)
    expected = [continuous.batch(s)["id"] for s in range(30)]
    for start in (0, 5, 17, 29):
        resumed, _ = shard(2, 1)
        assert np.array_equal(resumed.batch(start)["id"], expected[start])


def test_each_worker_reads_its_partitions_row_groups_only():
    per_epoch = steps_per_epoch(id_groups(SIZES)[0], 4, B)
    read = []
    for rank in range(2):
        s, reads = shard(2, rank)
        for step in range(per_epoch):
            s.batch(step)
        read.append(set(reads))
    assert len(read[0] & read[1]) <= 1  # W divides P: halves, but for the row group cut between them
    assert sum(len(r) for r in read) <= len(SIZES) + 1


def test_the_batches_do_not_depend_on_the_reading_threads():
    per_epoch = steps_per_epoch(id_groups(SIZES)[0], 4, B)
    expected = [shard(2, 1)[0].batch(step)["id"] for step in range(per_epoch + 5)]
    for threads in (1, 4):
        s, reads = shard(2, 1, read_ahead=True, read_threads=threads)
        assert all(np.array_equal(s.batch(step)["id"], want) for step, want in enumerate(expected))
        s.cache.close()
        assert len(reads) <= 2 * (len(SIZES) // 2 + 1)  # its half, cut groups included, once an epoch


def test_memory_is_bounded_by_the_window_not_the_dataset():
    sizes = [10] * 2000
    s, reads = shard(1, 0, partitions=4, window=2, sizes=sizes, read_ahead=True)
    largest = 0
    for step in range(s.steps_per_epoch):
        s.batch(step)
        largest = max(largest, len(s.cache._cache))
    assert largest <= s.cache.capacity <= 4 * 2 * 3  # three windows of each of its 4 partitions
    assert len(reads) <= len(sizes) * 1.2  # each row group read about once


def test_the_deal_cuts_equal_partitions_of_every_row_and_depends_on_the_epoch():
    groups = id_groups(SIZES)[0]
    for epoch in (0, 1):
        dealt = deal(groups, 7, epoch, 4)
        sizes = [sum(n for _, _, n in part) for part in dealt]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == sum(SIZES)
        covered = sorted((g, first + i) for part in dealt for g, first, n in part for i in range(n))
        assert covered == [(g.index, i) for g in groups for i in range(g.rows)]  # each row once
    assert deal(groups, 7, 0, 4) != deal(groups, 7, 1, 4)


def test_partitions_beyond_the_batch_are_refused():
    with pytest.raises(ValueError, match="partitions 32 is more than train.global_batch_size 24"):
        shard(1, 0, partitions=32)


# --- the parquet source's index ---

def write_spark_like(root, rows_per_file=40, days=("2026-01-01", "2026-01-02"), parts=3):
    """A table laid out as Spark writes one: Hive folders, part files, and writer bookkeeping."""
    rng = np.random.default_rng(0)
    next_id = 0
    for day in days:
        folder = root / f"day={day}"
        folder.mkdir(parents=True)
        for p in range(parts):
            ids = np.arange(next_id, next_id + rows_per_file)
            next_id += rows_per_file
            table = pa.table({"f0": rng.normal(size=rows_per_file).astype(np.float32),
                              "f1": ids.astype(np.float32), "label": (ids % 3).astype(np.int64)})
            pq.write_table(table, folder / f"part-{p:05d}-c000.snappy.parquet", row_group_size=16)
            (folder / f".part-{p:05d}-c000.snappy.parquet.crc").write_bytes(b"crc")
    (root / "_SUCCESS").write_text("")
    (root / "_committed_123").write_text("{}")
    (root / "_temporary" / "0").mkdir(parents=True)
    (root / "_temporary" / "0" / "part-x.parquet").write_bytes(b"half written")
    return next_id


def options(root, **kw):
    return parquet.ParquetOptions(path=str(root), features=["f0", "f1"], label="label",
                                  **({"validation_fraction": 0.2} | kw))


def test_the_index_reads_footers_skips_bookkeeping_and_understands_hive(tmp_path):
    total = write_spark_like(tmp_path / "t")
    index = parquet.index_of(options(tmp_path / "t"))
    files = index["splits"]["train"]["files"] + index["splits"]["validation"]["files"]
    assert len(files) == 6 and all(f["uri"].endswith(".snappy.parquet") for f in files)
    assert index["splits"]["train"]["rows"] + index["splits"]["validation"]["rows"] == total
    assert {f["partition"]["day"] for f in files} == {"2026-01-01", "2026-01-02"}
    assert all(f["row_groups"] == [16, 16, 8] for f in files)
    assert index["spec"] == {"input_dim": 2, "num_classes": 3}
    assert 1 <= len(index["splits"]["validation"]["files"]) < 6  # each file by its path's hash (validation_files)
    # the same split however the files are listed, and a filter on the partition
    assert parquet.index_of(options(tmp_path / "t"))["splits"] == index["splits"]
    one_day = parquet.index_of(options(tmp_path / "t", filter={"day": "2026-01-02"}))
    assert {f["partition"]["day"] for f in one_day["splits"]["train"]["files"]} == {"2026-01-02"}


SPARK_TABLE = Path(__file__).resolve().parent / "data" / "spark_digits"  # tests/data/make_spark_digits.py


def spark_table(tmp_path):
    """The digits as Spark writes them now, in local mode (tests/data/make_spark_digits.py)."""
    import shutil
    import sys

    if shutil.which("java") is None:
        pytest.skip("no Java runtime: install Java 17+ (make setup does, as root with apt-get)")
    sys.path.insert(0, str(SPARK_TABLE.parent))
    try:
        import make_spark_digits
    finally:
        sys.path.remove(str(SPARK_TABLE.parent))
    make_spark_digits.write(tmp_path / "digits")
    return tmp_path / "digits"


@pytest.mark.parametrize("written", ["committed", "now"])
def test_a_table_spark_wrote_is_indexed_and_read_as_written(tmp_path, written):
    """Spark's own output: parquet-mr files, Spark's schema metadata, Hive folders with `.crc` and
    `_SUCCESS` beside them, an `array<float>` column as a Parquet LIST, an INT96 timestamp the run
    does not read. The committed table (the one the training test runs on) and one written by the
    installed Spark in this test."""
    from sklearn.datasets import load_digits

    table = SPARK_TABLE if written == "committed" else spark_table(tmp_path)
    assert (table / "_SUCCESS").exists() and list(table.glob("day=*/.part-*.crc"))
    files = list_files(str(table))
    assert len(files) == 8 and {f.partition["day"] for f in files} == {"2026-01-01", "2026-01-02"}
    first = pq.ParquetFile(files[0].uri.removeprefix("file://"))
    assert first.metadata.created_by.startswith("parquet-mr") \
        and b"org.apache.spark.version" in first.schema_arrow.metadata
    opts = parquet.ParquetOptions(path=str(table), features="pixels", label="digit", validation_fraction=0.25)
    index = parquet.index_of(opts)
    splits = index["splits"]
    assert splits["train"]["rows"] + splits["validation"]["rows"] == 1797
    assert index["spec"] == {"input_dim": 64, "num_classes": 10}
    assert sum(len(f["row_groups"]) for f in splits["train"]["files"] + splits["validation"]["files"]) > 8

    # every row, read through the loader's reader, is a digit as scikit-learn has it
    digits = load_digits()
    expected = {(tuple((digits.data[i] / 16).astype(np.float32)), int(digits.target[i])) for i in range(1797)}
    read = set()
    for name in ("train", "validation"):
        reader = FileReader(splits[name], opts.columns())
        for group in range(len(reader.groups)):
            part = reader.load(group)
            assert part["x"].dtype == np.float32 and part["x"].shape[1] == 64
            read |= {(tuple(x), int(y)) for x, y in zip(part["x"], part["y"])}
    assert read == expected


def test_a_changed_file_is_named(tmp_path):
    write_spark_like(tmp_path / "t")
    index = parquet.index_of(options(tmp_path / "t"))
    recorded = index["splits"]["train"]["files"] + index["splits"]["validation"]["files"]
    listing = list_files(str(tmp_path / "t"))
    assert changed(recorded, listing) is None
    victim = tmp_path / "t" / "day=2026-01-01" / "part-00001-c000.snappy.parquet"
    os.utime(victim, ns=(1, 1))
    assert "part-00001-c000.snappy.parquet changed" in changed(recorded, list_files(str(tmp_path / "t")))


@pytest.mark.parametrize("mutate, message", [
    (lambda root: pq.write_table(pa.table({"f0": [1.0], "label": [1]}), root / "extra.parquet"),
     "extra.parquet has no column 'f1'"),
    (lambda root: pq.write_table(pa.table({"f0": pa.array([1.0], pa.float32()), "f1": pa.array([2.0], pa.float32()),
                                           "label": [-1]}), root / "neg.parquet"),
     "column 'label' has negative values"),
    (lambda root: (root / "junk.parquet").write_bytes(b"not parquet at all"), "junk.parquet is not a readable Parquet"),
])
def test_bad_data_is_named_before_training(tmp_path, mutate, message):
    write_spark_like(tmp_path / "t")
    mutate(tmp_path / "t")
    with pytest.raises(DataError, match=message):
        parquet.index_of(options(tmp_path / "t"))


def test_row_groups_stream_through_the_loader(tmp_path):
    total = write_spark_like(tmp_path / "t")
    index = parquet.index_of(options(tmp_path / "t", validation_path=None, validation_fraction=0.2))
    opts = options(tmp_path / "t")
    split = index["splits"]["train"]
    batches = []
    for world_size in (1, 2):
        readers = [FileReader(split, opts.columns()) for _ in range(world_size)]
        shards = [StreamingShard(readers[r].groups, readers[r].load, BatchPlan(8, world_size, r), seed=1,
                                 partitions=4, window=2) for r in range(world_size)]
        batches.append([np.concatenate([s.batch(step)["x"][:, 1] for s in shards]) for step in range(10)])
        assert shards[0].batch(0)["y"].dtype == np.int64
    assert all(np.array_equal(a, b) for a, b in zip(*batches))
    seen = np.concatenate(batches[0])
    assert len(np.unique(seen)) == len(seen) and seen.max() < total


def test_the_same_layout_on_s3_is_indexed_and_streamed(tmp_path, monkeypatch, moto_endpoint):
    import pyarrow.fs as pafs
    from aws import create_bucket, s3_env

    for key, value in s3_env(moto_endpoint).items():
        monkeypatch.setenv(key, value)
    create_bucket(moto_endpoint, "lake")
    total = write_spark_like(tmp_path / "t")
    s3, _ = pafs.FileSystem.from_uri("s3://lake/")
    pafs.copy_files(str(tmp_path / "t"), "lake/tables/t", source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=s3)

    index = parquet.index_of(options("s3://lake/tables/t"))
    local = parquet.index_of(options(tmp_path / "t"))
    files = index["splits"]["train"]["files"] + index["splits"]["validation"]["files"]
    assert len(files) == 6 and all(f["uri"].startswith("s3://lake/tables/t/day=") for f in files)
    assert sum(s["rows"] for s in index["splits"].values()) == total and index["spec"] == local["spec"]
    glob = list_files("s3://lake/tables/t/day=2026-01-01/*.parquet")
    assert len(glob) == 3 and {f.partition["day"] for f in glob} == {"2026-01-01"}
    split = index["splits"]["train"]
    reader = FileReader(split, options("s3://lake/tables/t").columns())
    shard = StreamingShard(reader.groups, reader.load, BatchPlan(8, 1, 0), seed=1, partitions=4, window=2,
                           on_close=reader.close)
    try:
        ids = np.concatenate([shard.batch(step)["x"][:, 1] for step in range(6)])
    finally:
        shard.close()
    assert len(np.unique(ids)) == len(ids) == 48


def test_a_read_retries_through_a_storage_outage(tmp_path, monkeypatch, moto_endpoint, caplog):
    """The endpoint unreachable mid-run (every connection dropped, none accepted): the row group's read
    is retried with backoff and logged until it is back, then returns the rows it would have."""
    import logging
    import threading

    import pyarrow.fs as pafs
    from aws import Outage, create_bucket, s3_env

    outage = Outage(int(moto_endpoint.rsplit(":", 1)[1]))
    for key, value in s3_env(outage.endpoint).items():
        monkeypatch.setenv(key, value)
    create_bucket(outage.endpoint, "outage")
    write_spark_like(tmp_path / "t")
    s3, _ = pafs.FileSystem.from_uri("s3://outage/")
    pafs.copy_files(str(tmp_path / "t"), "outage/t", source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=s3)
    split = parquet.index_of(options("s3://outage/t"))["splits"]["train"]
    reader = FileReader(split, options("s3://outage/t").columns(),
                                retry=RetryPolicy(attempts=8, first_delay_s=1, max_delay_s=2, budget_s=60))
    caplog.set_level(logging.WARNING, logger="training.data.parquet")
    outcome = {}
    outage.down()
    thread = threading.Thread(target=lambda: outcome.update(columns=reader.load(3)))
    thread.start()
    try:
        # past pyarrow's own retries of the request (seconds), into ours: the first is logged
        wait_for(lambda: any("retry 1 of at most 7" in r.getMessage() for r in caplog.records), 60,
                 "the read's first retry")
    finally:
        outage.up()
    thread.join(timeout=60)
    assert not thread.is_alive() and "columns" in outcome
    group = reader.groups[3]
    uri = split["files"][group.file]["uri"]
    message = next(r.getMessage() for r in caplog.records if "retry 1 of at most 7" in r.getMessage())
    assert message.startswith(f"reading {uri} (row group {group.index}) failed (")
    written = pq.ParquetFile(tmp_path / "t" / uri.removeprefix("s3://outage/t/"))  # the same row group, as written
    expected = reader.columns.arrays(written.read_row_group(group.index, columns=reader.columns.read()))
    assert all(np.array_equal(outcome["columns"][k], expected[k]) for k in expected)


def test_a_file_gone_or_changed_during_a_run_fails_naming_it(tmp_path):
    write_spark_like(tmp_path / "t")
    split = parquet.index_of(options(tmp_path / "t"))["splits"]["train"]
    reader = FileReader(split, options(tmp_path / "t").columns(),
                                retry=RetryPolicy(attempts=3, first_delay_s=0.01, max_delay_s=0.01))
    by_file = {}
    for group_id, group in enumerate(reader.groups):
        by_file.setdefault(group.file, group_id)
    (gone, gone_group), (changed, changed_group) = list(by_file.items())[:2]
    reader.load(gone_group)  # read before the file went: opened files stay readable until closed
    os.remove(split["files"][gone]["uri"])
    shard = StreamingShard(reader.groups, reader.load, BatchPlan(8, 1, 0), seed=1, partitions=4, window=2,
                           on_close=reader.close)
    try:
        fresh = FileReader(split, options(tmp_path / "t").columns())  # (a new worker: opens the file now)
        with pytest.raises(DataError, match=rf"^{split['files'][gone]['uri']} is gone: deleted or moved "
                                                    r"during the run.*restore it and resume"):
            fresh.load(gone_group)
        with pytest.raises(DataError, match=" is gone: "):  # through the loader's read-ahead
            for step in range(shard.steps_per_epoch):
                shard.batch(step)
    finally:
        shard.close()
    path = split["files"][changed]["uri"]
    table = pq.read_table(path)
    pq.write_table(table.slice(0, table.num_rows // 2), path)
    with pytest.raises(DataError, match=rf"^{path} changed during the run \(size \d+ -> \d+ bytes\)"):
        FileReader(split, options(tmp_path / "t").columns()).load(changed_group)
