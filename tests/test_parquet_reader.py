"""Reading indexed Parquet row groups (training/data/parquet_read.py): open files bounded and closed,
and a read that fails the same way every time stopped at once instead of retried as an outage."""

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO

from training.backoff import RetryPolicy
from training.data import parquet
from training.data.parquet_read import FileReader, read_failure
from training.errors import DataError, StorageUnavailable

# One process: 400 files of 2 row groups each, indexed, then streamed through three epochs by two
# read threads under a descriptor limit far below the number of files.
_MANY_FILES = textwrap.dedent("""
    import os, resource, sys
    import numpy as np, pyarrow as pa, pyarrow.parquet as pq
    from training.backoff import RetryPolicy
    from training.data import parquet
    from training.data.order import BatchPlan
    from training.data.parquet_read import FileReader
    from training.data.stream import StreamingShard

    root = sys.argv[1]
    for f in range(400):
        ids = np.arange(f * 20, (f + 1) * 20)
        pq.write_table(pa.table({"x": ids.astype(np.float32), "label": (ids % 3).astype(np.int64)}),
                       f"{root}/part-{f:04d}.parquet", row_group_size=10)
    options = parquet.ParquetOptions(path=root, features=["x"], label="label", validation_fraction=0.1,
                                     partitions=4, shuffle_window=4)
    split = parquet.index_of(options)["splits"]["train"]

    def descriptors():
        return len(os.listdir("/proc/self/fd")) - 1  # (less the listing's own)

    before = descriptors()
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    reader = FileReader(split, options.columns(), retry=RetryPolicy(attempts=2, first_delay_s=0.01, max_delay_s=0.01))
    shard = StreamingShard(reader.groups, reader.load, BatchPlan(16, 1, 0), seed=3, partitions=4, window=4,
                           read_threads=2, on_close=reader.close)
    seen = []
    for step in range(3 * shard.steps_per_epoch):
        seen.append(shard.batch(step)["x"][:, 0])
    during = descriptors()
    shard.close(wait=True)
    print(len(split["files"]), shard.steps_per_epoch, len(np.unique(np.concatenate(seen[:shard.steps_per_epoch]))),
          before, during, descriptors())
""")


def test_a_stream_of_many_files_stays_within_a_low_descriptor_limit_and_closes_them(tmp_path):
    result = subprocess.run([sys.executable, "-c", _MANY_FILES, str(tmp_path)], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    files, steps, distinct, before, during, after = map(int, result.stdout.split())
    assert files > 300 and steps > 20 and before < 40  # (the limit is far below the files read)
    assert distinct == steps * 16  # an epoch's rows, none twice
    assert during < 64 and after == before  # every file the loader opened is closed


def spark_like(root, files=3, rows=40):
    root.mkdir()
    for f in range(files):
        ids = np.arange(f * rows, (f + 1) * rows)
        pq.write_table(pa.table({"f0": ids.astype(np.float32), "label": (ids % 3).astype(np.int64)}),
                       root / f"part-{f:05d}.parquet", row_group_size=16, compression="snappy")
    return parquet.ParquetOptions(path=str(root), features=["f0"], label="label", validation_fraction=0.2)


def test_a_corrupt_row_group_fails_at_once_naming_the_file_and_row_group(tmp_path, caplog):
    options = spark_like(tmp_path / "t")
    split = parquet.index_of(options)["splits"]["train"]
    # a policy that, were the read retried as an outage, would log its one retry and then give up
    reader = FileReader(split, options.columns(), retry=RetryPolicy(attempts=2, first_delay_s=0.01, max_delay_s=0.01))
    group_id = 1
    group = reader.groups[group_id]
    path = split["files"][group.file]["uri"]
    column = pq.ParquetFile(path).metadata.row_group(group.index).column(0)
    with open(path, "r+b") as f:  # its page header overwritten; the file's size unchanged
        f.seek(column.dictionary_page_offset or column.data_page_offset)
        f.write(b"\xff" * 32)
    caplog.set_level(logging.WARNING)
    with pytest.raises(DataError, match=rf"^{path} \(row group {group.index}\) cannot be read: .*thrift.*"
                                        r"The file is corrupt"):
        reader.load(group_id)
    assert not [r for r in caplog.records if "retry" in r.getMessage()]  # not once taken for an outage
    reader.load(0 if group_id else 2)  # the file's other row groups still read
    reader.close()


def test_a_file_that_is_not_parquet_fails_at_once(tmp_path, caplog):
    options = spark_like(tmp_path / "t")
    split = parquet.index_of(options)["splits"]["train"]
    reader = FileReader(split, options.columns(), retry=RetryPolicy(attempts=2, first_delay_s=0.01, max_delay_s=0.01))
    path = split["files"][0]["uri"]
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # the footer's magic bytes
        f.seek(size - 4)
        f.write(b"XXXX")
    caplog.set_level(logging.WARNING)
    with pytest.raises(DataError, match=rf"^{path} \(row group 0\) cannot be read: Parquet magic bytes not found"):
        reader.load(0)
    assert not [r for r in caplog.records if "retry" in r.getMessage()]


def test_an_outage_past_the_retries_is_not_a_data_error(tmp_path, monkeypatch):
    """Storage that does not answer within the retries may answer later: the worker fails with
    StorageUnavailable, which Ray Train restarts (within max_failures), not with a DataError, which
    ends the run at once."""
    for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    options = spark_like(tmp_path / "t")
    split = parquet.index_of(options)["splits"]["train"]
    # the first file moved to an object store that refuses every connection (nothing listens on port 9)
    split["files"][0]["uri"] = "s3://lake/part-0.parquet?endpoint_override=127.0.0.1:9&scheme=http"
    reader = FileReader(split, options.columns(), retry=RetryPolicy(attempts=2, first_delay_s=0.01, max_delay_s=0.01))
    with pytest.raises(StorageUnavailable, match=r"failed 2 times in .* giving up") as caught:
        reader.load(0)
    assert not isinstance(caught.value, DataError)
    reader.close()


def test_read_failures_are_told_apart():
    assert read_failure(OSError("When reading information for key 'a' in bucket 'b': AWS Error NETWORK_CONNECTION "
                                "during HeadObject operation: curlCode: 7, Couldn't connect to server")) == "transient"
    assert read_failure(OSError("AWS Error SLOW_DOWN during GetObject operation: Please reduce your request rate"))\
        == "transient"
    assert read_failure(ConnectionResetError(104, "Connection reset by peer")) == "transient"
    assert read_failure(OSError("Couldn't deserialize thrift: don't know what type")) == "deterministic"
    assert read_failure(OSError("Corrupt snappy compressed data.")) == "deterministic"
    assert read_failure(OSError("GZipCodec failed: invalid block type")) == "deterministic"
    assert read_failure(OSError("Unexpected end of stream")) == "deterministic"
    assert read_failure(pa.ArrowInvalid("Parquet magic bytes not found in footer")) == "deterministic"
    assert read_failure(OSError(24, "Too many open files")) == "deterministic"
    assert read_failure(MemoryError()) is None


def test_read_threads_reading_the_same_files_at_once_read_what_one_reads(tmp_path):
    """Row groups of the same few files read by four threads at once (each read has the file to
    itself): the batches are those read without read-ahead."""
    from training.data.order import BatchPlan
    from training.data.stream import StreamingShard

    options = spark_like(tmp_path / "t", files=2, rows=640)
    split = parquet.index_of(options)["splits"]["train"]

    def batches(**kw):
        reader = FileReader(split, options.columns())
        shard = StreamingShard(reader.groups, reader.load, BatchPlan(16, 1, 0), seed=5, partitions=4, window=4,
                               on_close=reader.close, **kw)
        try:
            return [shard.batch(step)["x"].copy() for step in range(2 * shard.steps_per_epoch)]
        finally:
            shard.close(wait=True)

    expected = batches(read_ahead=False)
    assert all(np.array_equal(a, b) for a, b in zip(batches(read_ahead=True, read_threads=4), expected))


def test_a_gather_of_more_row_groups_than_the_cache_holds_reads_them_all():
    """The cache's slots run out while one gather holds its row groups: it makes more, and every
    row comes from its own row group (no slot reused under a gather)."""
    from training.data.row_group_cache import RowGroupCache, gather

    sizes = [5, 7, 3, 6]
    starts = np.cumsum([0] + sizes)

    def load(group):
        ids = np.arange(starts[group], starts[group + 1])
        return {"id": ids, "pair": np.stack([ids, -ids], axis=1)}

    for threads in (0, 2):
        cache = RowGroupCache(load, capacity=1, slot_rows=max(sizes), threads=threads)
        groups = np.array([3, 0, 2, 1, 0, 3, 2])
        rows = np.array([5, 4, 0, 6, 0, 1, 2])
        out = gather(cache, groups, rows)
        cache.close(wait=True)
        assert np.array_equal(out["id"], starts[groups] + rows)
        assert np.array_equal(out["pair"], np.stack([out["id"], -out["id"]], axis=1))
        assert len(cache._cache) == 1  # (back within its capacity once the gather let go)
