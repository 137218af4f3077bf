"""Run storage on Azure Blob (abfs://CONTAINER@ACCOUNT/path), against Azurite on loopback: the
storage helpers and the `parquet` source's listing there; a training run that reads a Parquet table
in place from Blob storage and checkpoints there, with a worker SIGKILLed mid-run, ends bit-identical
to an uninterrupted run; the account key (from the environment) shows up in no output, MLflow
record or stored file."""

import os
import signal
import threading
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
from azurite import ACCOUNT, azurite, missing
from conftest import CONFIGS, train_worker_pids

from training import config as config_lib
from training import storage
from training.checkpoint import format as ckpt

SPARK_TABLE = Path(__file__).resolve().parent / "data" / "spark_digits"  # tests/data/make_spark_digits.py


def test_azure_uris_name_container_then_account():
    assert storage.azure_location("abfs://ckpts@acct/runs/a/") == ("acct", "ckpts", "runs/a")
    assert storage.azure_location("az://ckpts@acct.dfs.core.windows.net") == ("acct", "ckpts", "")
    assert storage.object_path("abfss://ckpts@acct.blob.core.windows.net/x/y") == "ckpts/x/y"
    assert storage.uri_at("abfs://data@acct/t", "data/t/part-0.parquet") == "abfs://data@acct/t/part-0.parquet"
    assert storage.uri_at("s3://b/t", "b/t/p") == "s3://b/t/p" and storage.uri_at("/d/t", "/d/t/p") == "/d/t/p"
    # Ray Train and Tune get Azure storage as a filesystem and a path on it; other URIs as they are
    path, fs = storage.for_ray_train("abfs://ckpts@acct/runs/sweeps")
    assert path == "ckpts/runs/sweeps" and isinstance(fs, pafs.AzureFileSystem)
    assert storage.for_ray_train("s3://b/runs") == ("s3://b/runs", None)
    with pytest.raises(ValueError, match=r"abfs://acct/runs is not an Azure Blob URI of the form "
                                         r"abfs://CONTAINER@ACCOUNT/path"):
        storage.filesystem("abfs://acct/runs")


@pytest.fixture(scope="module")
def blob_env():
    reason = missing()
    if reason:
        pytest.skip(reason)
    with azurite() as env:
        yield env


@pytest.fixture
def on_blob(blob_env, monkeypatch):
    for key, value in blob_env.items():
        monkeypatch.setenv(key, value)
    return blob_env


def upload_table(container: str) -> str:
    fs, root = storage.filesystem(f"abfs://{container}@{ACCOUNT}")
    fs.create_dir(root)  # (a container)
    pafs.copy_files(str(SPARK_TABLE), f"{root}/digits", source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)
    return f"abfs://{container}@{ACCOUNT}/digits"


def test_storage_helpers_and_a_parquet_listing_on_blob_storage(on_blob):
    from training.data.files import list_files

    uri = f"abfs://helpers@{ACCOUNT}/runs/r/run.json"
    storage.filesystem(uri)[0].create_dir("helpers")
    assert not storage.exists(uri)
    storage.write_text(uri, '{"a": 1}')
    assert storage.exists(uri) and storage.read_text(uri) == '{"a": 1}'

    table = upload_table("listing")
    files = list_files(table)  # bookkeeping (_SUCCESS, .crc) skipped, URIs that read back
    assert files and all(f.uri.startswith(f"{table}/day=") and f.uri.endswith(".parquet") for f in files)
    assert {f.partition["day"] for f in files} == {"2026-01-01", "2026-01-02"}
    fs, path = storage.filesystem(files[0].uri)
    assert fs.get_file_info(path).size == files[0].size


def final_weights(fs, run_path: str, local: Path) -> dict:
    step, newest = ckpt.newest_complete(fs, run_path)
    local.mkdir(parents=True)
    pafs.copy_files(newest, str(local), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    return ckpt.load(local)["model"]


@pytest.mark.ray
@pytest.mark.chaos
def test_a_run_reads_parquet_from_blob_checkpoints_there_and_resumes_bit_identically(on_blob, workdir, capfd):
    import ray

    from training.run.driver import run_training

    table = upload_table("warehouse")
    runs = f"abfs://ckpts@{ACCOUNT}/runs"
    fs, runs_path = storage.filesystem(runs)
    fs.create_dir("ckpts")
    overrides = ["data.source=parquet", f"data.options={{path: '{table}', features: pixels, label: digit, "
                 "validation_fraction: 0.25, partitions: 8, shuffle_window: 2}", f"checkpoint.storage_path={runs}",
                 "train.max_steps=100", "train.eval_every_n_steps=50", "train.global_batch_size=64",
                 "checkpoint.every_n_steps=50", "train.min_report_interval_s=0", "scaling.num_workers=1",
                 "tracking.register_model=false", "tracking.export_onnx=false", "failure.max_failures=2"]
    kills = []

    def kill_after_first_checkpoint():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not ckpt.is_complete(fs, f"{runs_path}/chaos/"
                                                                       f"{ckpt.checkpoint_dir_name(50)}"):
            time.sleep(0.05)
        for pid in train_worker_pids()[:1]:
            os.kill(pid, signal.SIGKILL)
            kills.append(pid)

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2)  # started here, so that its workers have the account's key
    try:
        clean = run_training(config_lib.load(CONFIGS / "digits.yaml", overrides, name="clean"), log=print)
        killer = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
        killer.start()
        chaotic = run_training(config_lib.load(CONFIGS / "digits.yaml", overrides, name="chaos"), log=print)
        killer.join(timeout=5)
    finally:
        ray.shutdown()

    out, err = capfd.readouterr()
    assert kills, "no worker was killed"
    # resumed from the Blob checkpoint, not from scratch (which would end with the clean run's weights too)
    assert "resumed from step 50 with 1 worker (ckpts/runs/chaos/" in out + err, out[-3000:]
    assert clean.steps == chaotic.steps == 100 and clean.metrics["val_accuracy"] >= 0.8
    expected = final_weights(fs, f"{runs_path}/clean", workdir / "clean")
    actual = final_weights(fs, f"{runs_path}/chaos", workdir / "chaos")
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected), "weights differ after the kill"
    # The table was read where it is: the data cache (on Blob storage too) holds an index, no copy.
    indexes = [i for i in fs.get_file_info(pafs.FileSelector(f"{runs_path}/datasets", recursive=True))
               if i.type == pafs.FileType.File]
    assert indexes and all(i.base_name == "manifest.json" for i in indexes), [i.path for i in indexes]

    key = on_blob[storage.AZURE_KEY_ENV]
    assert key not in out + err
    assert key.encode() not in (workdir / "mlflow.db").read_bytes()
    for info in fs.get_file_info(pafs.FileSelector(runs_path, recursive=True)):
        if info.type == pafs.FileType.File and info.size < 1_000_000:
            with fs.open_input_stream(info.path) as stream:
                assert key.encode() not in stream.read(), f"the account key is in {info.path}"
