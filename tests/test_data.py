"""Data: Parquet shards with a manifest, cached by digest; a sample order that ignores world size."""

import json
import os

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from aws import s3_env

from training import storage
from training.data.manifest import MANIFEST, Manifest
from training.data.order import DIGEST_MODULUS, BatchPlan, batch_digest, epoch_order
from training.data.registry import data_section, prepare
from training.data.shards import SplitReader, TrainShard, changed_shard
from training.data.source import validation_part
from training.data.tinylm import stdlib_source_files
from training.errors import UserError


def read_split(manifest: Manifest, split: str) -> pa.Table:
    """The whole split, read straight from its shards."""
    fs, _ = storage.filesystem(manifest.root)
    return pq.ParquetDataset([storage.filesystem(u)[1] for u in manifest.shard_uris(split)], filesystem=fs).read()


def quiet(_):
    pass


def test_digits_prepared_as_parquet_with_manifest(tmp_path):
    manifest = prepare(data_section(dict(source="digits", num_shards=3)), str(tmp_path), log=quiet)
    assert manifest.task == "classification"
    assert manifest.spec == {"input_dim": 64, "num_classes": 10}
    assert manifest.rows("train") + manifest.rows("validation") == 1797
    assert manifest.rows("validation") == round(1797 * 0.2)
    body = json.loads((tmp_path / os.path.basename(manifest.root) / MANIFEST).read_text())
    assert len(body["splits"]["train"]["shards"]) == 3 and len(body["digest"]) == 64
    assert "x: fixed_size_list<item: float>[64]" in body["schema"]
    train = read_split(manifest, "train")
    assert train.num_rows == manifest.rows("train")
    assert sum(s["rows"] for s in body["splits"]["train"]["shards"]) == train.num_rows
    assert read_split(manifest, "validation").num_rows == manifest.rows("validation")


def test_prepared_data_is_reused_not_rebuilt(tmp_path):
    first = prepare(data_section(dict(source="digits")), str(tmp_path), log=quiet)
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.parquet")}
    lines = []
    again = prepare(data_section(dict(source="digits")), str(tmp_path), log=lines.append)
    assert again == first and "cached" in lines[0]
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.parquet")} == stamps
    other = prepare(data_section(dict(source="digits", options={"val_fraction": 0.3})), str(tmp_path), log=quiet)
    assert other.root != first.root  # a changed option is a different dataset


def test_an_incomplete_dataset_is_rebuilt(tmp_path):
    manifest = prepare(data_section(dict(source="digits")), str(tmp_path), log=quiet)
    os.remove(os.path.join(manifest.root, MANIFEST))  # as if the writer died before the manifest
    lines = []
    rebuilt = prepare(data_section(dict(source="digits")), str(tmp_path), log=lines.append)
    assert "prepared" in lines[0] and rebuilt.digest == manifest.digest


def test_tinylm_reads_the_standard_library(tmp_path):
    files = stdlib_source_files()
    assert len(files) > 100 and not any("site-packages" in f.parts for f in files)
    manifest = prepare(data_section(dict(source="tinylm", options={"seq_len": 32, "max_bytes": 50_000})), str(tmp_path),
                       log=quiet)
    assert manifest.task == "language_model" and manifest.spec == {"vocab_size": 256, "seq_len": 32}
    tokens = SplitReader(manifest, "train").take(np.arange(4))["tokens"]
    assert tokens.shape == (4, 33) and int(tokens.max()) < 256
    text = bytes(tokens[:, :-1].reshape(-1).tolist()).decode("utf-8", errors="replace")
    assert any(word in text for word in ("def ", "import ", "class ", "return ", " = ")), text
    assert manifest.rows("train") * 33 <= 50_000 and manifest.rows("validation") >= 1


def test_sample_order_is_a_pure_function_of_seed_and_epoch():
    assert np.array_equal(epoch_order(7, 3, 100), epoch_order(7, 3, 100))
    assert not np.array_equal(epoch_order(7, 3, 100), epoch_order(7, 4, 100))
    assert sorted(epoch_order(7, 3, 100)) == list(range(100))


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_global_batches_do_not_depend_on_world_size(tmp_path, world_size):
    manifest = prepare(data_section(dict(source="digits")), str(tmp_path), log=quiet)
    reader = SplitReader(manifest, "train")
    reference = TrainShard(reader, BatchPlan(64, 1, 0), seed=3)
    shards = [TrainShard(reader, BatchPlan(64, world_size, rank, micro_batch_size=5), seed=3)
              for rank in range(world_size)]
    steps_per_epoch = reference.steps_per_epoch
    for step in (0, 1, steps_per_epoch - 1, steps_per_epoch, 2 * steps_per_epoch + 5):
        whole = reference.batch(step)["y"]
        parts = [shard.batch(step)["y"] for shard in shards]
        assert np.array_equal(np.concatenate(parts), whole)
        assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1


def test_the_data_digest_adds_up_across_workers_and_tells_orders_apart(tmp_path):
    manifest = prepare(data_section(dict(source="digits")), str(tmp_path), log=quiet)
    reader = SplitReader(manifest, "train")

    def digest(world_size, steps, seed=3):
        shards = [TrainShard(reader, BatchPlan(64, world_size, rank), seed=seed) for rank in range(world_size)]
        total = 0
        for step in steps:
            for shard in shards:
                shard.batch(step)
                total = (total + batch_digest(step, shard.sample_ids(step))) % DIGEST_MODULUS
        return total

    steps = range(0, 2 * reader.num_rows // 64 + 3)  # into the third epoch
    assert digest(1, steps) == digest(2, steps) == digest(3, steps) != digest(1, steps, seed=4)
    assert digest(1, steps) != digest(1, range(1, len(steps) + 1))  # the same rows one step later
    assert 0 < digest(1, steps) < DIGEST_MODULUS


def test_resuming_mid_epoch_reads_what_an_uninterrupted_run_reads(tmp_path):
    manifest = prepare(data_section(dict(source="digits")), str(tmp_path), log=quiet)
    reader = SplitReader(manifest, "train")
    plan = BatchPlan(32, 2, 1)
    uninterrupted = TrainShard(reader, plan, seed=0)
    expected = [uninterrupted.batch(s)["x"] for s in range(10, 60)]
    resumed = TrainShard(reader, plan, seed=0)  # a new process that starts at step 10
    assert all(np.array_equal(resumed.batch(s)["x"], e) for s, e in zip(range(10, 60), expected))


@pytest.mark.parametrize("source", ["digits", "tinylm"])
def test_a_split_read_into_memory_gives_the_rows_read_from_parquet(tmp_path, source):
    options = {"seq_len": 32, "max_bytes": 50_000} if source == "tinylm" else {}
    manifest = prepare(data_section(dict(source=source, options=options)), str(tmp_path), log=quiet)
    in_memory, from_files = SplitReader(manifest, "train"), SplitReader(manifest, "train", in_memory_limit_bytes=0)
    assert in_memory.in_memory and not from_files.in_memory
    plan = BatchPlan(16, 2, 1)
    a, b = TrainShard(in_memory, plan, seed=4), TrainShard(from_files, plan, seed=4)
    for step in (0, 3, a.steps_per_epoch + 1):
        batch_a, batch_b = a.batch(step), b.batch(step)
        assert batch_a.keys() == batch_b.keys()
        assert all(np.array_equal(batch_a[k], batch_b[k]) and batch_a[k].dtype == batch_b[k].dtype for k in batch_a)


def test_micro_batches_cover_the_part():
    plan = BatchPlan(64, 2, 0, micro_batch_size=10)
    slices = plan.micro_batches(32)
    assert [s.stop - s.start for s in slices] == [10, 10, 10, 2]
    assert BatchPlan(64, 2, 0).micro_batches(32) == [slice(0, 32)]


def test_validation_is_split_across_workers(tmp_path):
    manifest = prepare(data_section(dict(source="digits")), str(tmp_path), log=quiet)
    reader = SplitReader(manifest, "validation")
    parts = [validation_part(reader, 3, rank)["y"] for rank in range(3)]
    assert sum(len(p) for p in parts) == manifest.rows("validation")


def test_data_on_s3_through_pyarrow(monkeypatch, moto_endpoint):
    endpoint = moto_endpoint
    for key, value in s3_env(endpoint).items():
        monkeypatch.setenv(key, value)
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="train-data")
    manifest = prepare(data_section(dict(source="digits")), "s3://train-data/cache", log=quiet)
    assert manifest.root.startswith("s3://train-data/cache/digits-")
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=endpoint).list_objects_v2(
        Bucket="train-data")["Contents"]]
    assert any(k.endswith(MANIFEST) for k in keys) and sum(k.endswith(".parquet") for k in keys) == 8
    loaded = Manifest.load(manifest.root)
    assert loaded == manifest
    assert SplitReader(loaded, "train").take(np.arange(3))["x"].shape == (3, 64)
    lines = []
    prepare(data_section(dict(source="digits")), "s3://train-data/cache", log=lines.append)
    assert "cached" in lines[0]


def test_plugin_source_rejects_wrong_shapes(tmp_path):
    with pytest.raises(UserError, match="match no task"):
        prepare(data_section(dict(source="plugins.examples:bad_columns")), str(tmp_path), log=quiet)
    with pytest.raises(UserError, match="cannot import module"):
        prepare(data_section(dict(source="no_such_module:fn")), str(tmp_path), log=quiet)
    with pytest.raises(UserError, match="rejected data.options"):
        prepare(data_section(dict(source="plugins.examples:blobs", options={"colour": 1})), str(tmp_path), log=quiet)


def test_a_changed_shard_of_a_reused_dataset_is_refused(tmp_path):
    """The SHA-256 recorded for each shard is checked when a run or sweep takes a prepared dataset:
    a shard edited in place (same rows, same size), cut short or removed is named, and the run
    refused with how to clear it."""
    from training.run.preflight import check_shards

    manifest = prepare(data_section(dict(source="digits", num_shards=2)), str(tmp_path), log=quiet)
    assert changed_shard(manifest) is None
    check_shards(manifest)  # unchanged: nothing said
    shard = tmp_path / os.path.basename(manifest.root) / "train" / "part-00001.parquet"
    original = shard.read_bytes()

    table = pq.read_table(shard)
    labels = table.column("y").to_numpy()
    pq.write_table(table.set_column(table.schema.get_field_index("y"), "y",
                                    pa.array((labels + 1) % 10, type=table.column("y").type)), shard,
                   compression="zstd")
    again = prepare(data_section(dict(source="digits", num_shards=2)), str(tmp_path), log=quiet)  # reused as it is
    assert "train/part-00001.parquet has SHA-256" in changed_shard(again)
    with pytest.raises(UserError, match=r"changed since it was prepared: shard train/part-00001.parquet .*"
                                        r"remove that directory and run again"):
        check_shards(again)

    shard.write_bytes(original[: len(original) // 2])
    assert "train/part-00001.parquet is not a readable Parquet file" in changed_shard(again)
    shard.unlink()
    assert changed_shard(again) == "shard train/part-00001.parquet is missing"
    shard.write_bytes(original)
    assert changed_shard(again) is None
