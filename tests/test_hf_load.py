"""Pretrained weights onto workers (training/models/hf_load.py): a remote folder on a real moto_server
copied once per node (two processes at once, one download counted in the server's request log),
resumed and checked; and a meta-built model sharded with FSDP2 over 2 real gloo processes, filled
from safetensors, with logits equal to a plain `from_pretrained` model's."""

import json
import os
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from aws import AWS_ENV, create_bucket, free_port, moto_server
from conftest import REPO

from training.errors import DataError, UserError
from training.models.hf_load import MANIFEST, load_sharded, node_local_folder

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)


def tiny_model(kind: str = "llama", tied: bool = False):
    torch.manual_seed(0)
    config = (transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig)(
        **TINY, tie_word_embeddings=tied)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_tiny(folder: Path, kind: str = "llama", tied: bool = False, dtype=None) -> Path:
    model = tiny_model(kind, tied)
    (model.to(dtype) if dtype is not None else model).save_pretrained(folder)
    return folder


def logits_of(model) -> "torch.Tensor":
    tokens = (torch.arange(24).reshape(2, 12) * 7) % TINY["vocab_size"]
    with torch.no_grad():
        return model(input_ids=tokens).logits


def plain_logits(folder: Path) -> "torch.Tensor":
    return logits_of(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))


# --- the node's copy of a remote folder -------------------------------------------------------------

@contextmanager
def recorded_moto(tmp_path: Path):
    """A moto_server of this module's own whose request log (moto's recorder) the tests read."""
    log = tmp_path / "requests.jsonl"
    with moto_server(env={"MOTO_ENABLE_RECORDING": "1", "MOTO_RECORDER_FILEPATH": str(log)}, cwd=tmp_path) as endpoint:
        yield endpoint, log


def reset_log(endpoint: str) -> None:
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/recorder/reset-recording", method="POST"))


def gets(log: Path, name: str) -> list[dict]:
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [e for e in entries if e["method"] == "GET" and e["url"].split("?")[0].endswith("/" + name)]


def upload(folder: Path, endpoint: str, bucket: str, prefix: str) -> str:
    import pyarrow.fs as pafs

    create_bucket(endpoint, bucket)
    pafs.copy_files(str(folder), f"{bucket}/{prefix}", source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=pafs.S3FileSystem(endpoint_override=endpoint, region="us-east-1"))
    return f"s3://{bucket}/{prefix}"


@pytest.fixture
def s3(tmp_path, monkeypatch):
    with recorded_moto(tmp_path) as (endpoint, log):
        for key, value in {**AWS_ENV, "AWS_ENDPOINT_URL": endpoint}.items():
            monkeypatch.setenv(key, value)
        yield endpoint, log


def test_two_processes_of_a_node_download_once_and_the_copy_loads(s3, tmp_path):
    endpoint, log = s3
    source = save_tiny(tmp_path / "tiny")
    uri = upload(source, endpoint, "pretrained-once", "models/tiny")
    cache = tmp_path / "node-cache"
    reset_log(endpoint)
    code = "import sys; from training.models.hf_load import node_local_folder; print(node_local_folder(*sys.argv[1:]))"
    workers = [subprocess.Popen([sys.executable, "-c", code, uri, str(cache)], cwd=REPO, env=os.environ.copy(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [worker.communicate(timeout=120) for worker in workers]
    assert all(worker.returncode == 0 for worker in workers), outputs
    folders = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(folders) == 1
    folder = Path(folders.pop())
    assert folder.parent == cache
    assert len(gets(log, "model.safetensors")) == 1 and len(gets(log, "config.json")) == 1
    assert sorted(p.name for p in folder.iterdir() if p.name != MANIFEST) == sorted(p.name for p in source.iterdir())
    assert torch.equal(plain_logits(folder), plain_logits(source))
    # a third call (a later run on the node) reads no weights again
    reset_log(endpoint)
    assert node_local_folder(uri, str(cache)) == str(folder)
    assert gets(log, "model.safetensors") == []


def test_a_copy_cut_short_resumes_and_a_corrupt_one_is_copied_again(s3, tmp_path):
    endpoint, log = s3
    source = save_tiny(tmp_path / "tiny")
    uri = upload(source, endpoint, "pretrained-resume", "tiny")
    cache = tmp_path / "node-cache"
    folder = Path(node_local_folder(uri, str(cache)))
    weights, whole = folder / "model.safetensors", (source / "model.safetensors").read_bytes()
    etag = json.loads((folder / MANIFEST).read_text())["model.safetensors"][1]

    def cut_short(content: bytes) -> None:  # as a worker killed mid-copy leaves it
        manifest = json.loads((folder / MANIFEST).read_text())
        del manifest["model.safetensors"]
        (folder / MANIFEST).write_text(json.dumps(manifest))
        weights.unlink()
        (folder / "model.safetensors.partial").write_bytes(content)
        (folder / "model.safetensors.partial-etag").write_text(etag)

    half = len(whole) // 2
    cut_short(whole[:half])
    reset_log(endpoint)
    node_local_folder(uri, str(cache))
    assert weights.read_bytes() == whole and not (folder / "model.safetensors.partial").exists()
    assert [e["headers"].get("Range") for e in gets(log, "model.safetensors")] == [f"bytes={half}-{len(whole) - 1}"]

    cut_short(b"\0" * half)  # the same length, wrong bytes: the ETag's MD5 catches it
    reset_log(endpoint)
    node_local_folder(uri, str(cache))
    assert weights.read_bytes() == whole
    assert len(gets(log, "model.safetensors")) == 2  # the rest of the bad copy, then the whole file again


def test_an_unreadable_remote_folder_is_a_user_error_naming_the_option(s3, tmp_path):
    endpoint, _ = s3
    with pytest.raises(UserError, match=r"model\.options\.pretrained: s3://no-such-bucket/m cannot be read"):
        node_local_folder("s3://no-such-bucket/m", str(tmp_path / "cache"))
    create_bucket(endpoint, "pretrained-empty")
    with pytest.raises(UserError, match=r"model\.options\.pretrained: s3://pretrained-empty/nothing does not exist"):
        node_local_folder("s3://pretrained-empty/nothing", str(tmp_path / "cache"))
    (tmp_path / "no-config").mkdir()
    (tmp_path / "no-config" / "model.safetensors").write_bytes(b"x")
    uri = upload(tmp_path / "no-config", endpoint, "pretrained-noconfig", "m")
    with pytest.raises(UserError, match=r"model\.options\.pretrained: s3://pretrained-noconfig/m has no config\.json"):
        node_local_folder(uri, str(tmp_path / "cache"))


def test_a_local_folder_is_used_in_place_and_checked(tmp_path):
    folder = save_tiny(tmp_path / "tiny")
    assert node_local_folder(str(folder)) == str(folder)
    assert node_local_folder(f"file://{folder}") == str(folder)
    with pytest.raises(UserError, match=r"model\.options\.pretrained: .*missing is not a folder"):
        node_local_folder(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"model\.options\.pretrained: .*empty has no config\.json"):
        node_local_folder(str(tmp_path / "empty"))


# --- sharded loading ----------------------------------------------------------------------------------

def meta_model(folder: Path):
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _sharded_worker(rank: int, world: int, port: int, folders: list[str], out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    found = {}
    for folder in folders:
        model = meta_model(Path(folder))
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        load_sharded(model, folder)
        local = sum(p.to_local().numel() for p in model.parameters())
        found[folder] = {"logits": logits_of(model), "local_params": local,
                         "params": sum(p.numel() for p in model.parameters()),
                         "tied": model.lm_head.weight is model.model.embed_tokens.weight}
    if rank == 0:
        torch.save(found, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    folders = {"llama": save_tiny(root / "llama"), "qwen2_tied": save_tiny(root / "qwen2", "qwen2", tied=True),
               "llama_bf16_file": save_tiny(root / "bf16", dtype=torch.bfloat16)}
    out = root / "logits.pt"
    torch.multiprocessing.spawn(_sharded_worker, args=(2, free_port(), [str(f) for f in folders.values()], str(out)),
                                nprocs=2, join=True)
    found = torch.load(out)
    return {name: (folder, found[str(folder)]) for name, folder in folders.items()}


@pytest.mark.parametrize("name", ["llama", "qwen2_tied", "llama_bf16_file"])
def test_a_sharded_load_gives_the_logits_of_from_pretrained(sharded_results, name):
    folder, found = sharded_results[name]
    assert found["local_params"] < found["params"]  # each rank holds a shard, not the model
    assert found["tied"] == (name == "qwen2_tied")
    torch.testing.assert_close(found["logits"], plain_logits(folder), rtol=0, atol=1e-5)


def test_rotary_buffers_are_computed_again_not_left_empty(tmp_path):
    folder = save_tiny(tmp_path / "tiny")
    model = meta_model(folder)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.fill_(-1.5e10)  # what to_empty may leave
    load_sharded(model, str(folder))  # no process group: one process reads every weight
    torch.testing.assert_close(logits_of(model), plain_logits(folder), rtol=0, atol=1e-5)


def test_weights_that_do_not_match_the_config_are_a_data_error(tmp_path):
    folder = save_tiny(tmp_path / "tiny")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3, "hidden_size": 64}))
    model = meta_model(folder)
    model.to_empty(device="cpu")
    with pytest.raises(DataError, match=r"model\.options\.pretrained: the weights in .* do not match the model's "
                                        r"config: missing model\.layers\.2\."):
        load_sharded(model, str(folder))
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    model = meta_model(folder)
    model.to_empty(device="cpu")
    with pytest.raises(DataError, match=r"shapes differ|\(128, 64\) in the file, \(96, 64\) in the model"):
        load_sharded(model, str(folder))
