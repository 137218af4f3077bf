"""A trained model as a Hugging Face folder (training/run/hf_export.py): the built-in gpt as GPT-2 with
logits equal to the trained model's, the data's tokenizer with it, sharded weights, S3, an HF model
(a Llama) saved as this service's checkpoint and logged with MLflow's transformers flavor; and at a
real run's end and through `python -m training export`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
        "        self.y = y\n\nimport os\nprint(os.path.join('a', 'b'))\n") * 40
SAMPLE = "def norm(self):\n    return (self.x ** 2 + self.y ** 2) ** 0.5  # ünïcode"


def train_bpe(vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from training.data.tokenizer import EOS

    tokenizer = Tokenizer(models.BPE())  # (as training/data/tokenizer.py trains one)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TEXT], trainer=trainer)
    return tokenizer


def text_job(model: dict):
    from training import config as config_lib

    return config_lib.validate({
        "model": model, "train": {"max_steps": 2, "global_batch_size": 2},
        "data": {"source": "text", "options": {"path": "stdlib", "validation_fraction": 0.05, "seq_len": 16,
                                               "tokenizer": {"train": {"vocab_size": 300}}}}})


def prepared_root(tmp_path: Path, tokenizer, seq_len: int = 16):
    """A prepared dataset's record (what the model's sizes and tokenizer are read from)."""
    from training.data.manifest import Manifest
    from training.data.tokenizer import TOKENIZER_FILE

    root = tmp_path / "data"
    root.mkdir()
    if tokenizer is not None:
        (root / TOKENIZER_FILE).write_text(tokenizer.to_str())
    return Manifest(root=str(root), source="text", options={}, task="language_model",
                    spec={"vocab_size": tokenizer.get_vocab_size(), "seq_len": seq_len}, splits={}, schema="",
                    digest="0" * 64)


def save_checkpoint(directory: Path, model: torch.nn.Module, sharded: bool = False):
    """The model's checkpoint as a worker writes one (training/checkpoint/format.py write)."""
    import ray.train

    from training.checkpoint import format as ckpt

    directory.mkdir(parents=True)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    ckpt.write(directory, model=model, optimizer=optimizer, scheduler=scheduler, sharded=sharded,
               loop=ckpt.LoopState(step=3), config={"seed": 0}, steps_per_epoch=10, world_size=1, metrics={})
    return ray.train.Checkpoint(str(directory))


def trained_gpt(vocab_size: int, seq_len: int, options):
    """A gpt whose every weight is off its initial value (LayerNorms and biases included)."""
    from training.models.gpt_nn import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size, seq_len, options)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.eval()


def max_logit_diff(hf_dir: Path, model: torch.nn.Module, tokens: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return (loaded(tokens).logits - model(tokens)).abs().max().item()


def test_the_builtin_gpt_exports_as_gpt2_with_equal_logits_and_the_datas_tokenizer(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from training.run.hf_export import write_hf_folder

    job = text_job({"name": "gpt", "options": {"n_layer": 2, "n_head": 4, "d_model": 64}})
    tokenizer = train_bpe()
    manifest = prepared_root(tmp_path, tokenizer)
    model = trained_gpt(tokenizer.get_vocab_size(), 16, job.model.options)
    checkpoint = save_checkpoint(tmp_path / "checkpoint-00000003", model)
    files = write_hf_folder(job, manifest, checkpoint, str(tmp_path / "hf"))

    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    tokens = torch.randint(0, tokenizer.get_vocab_size(), (3, 16), generator=torch.Generator().manual_seed(1))
    diff = max_logit_diff(tmp_path / "hf", model, tokens)
    print(f"max |logits difference| gpt vs its GPT-2 folder: {diff:.3g}")
    assert diff <= 1e-5
    config = AutoConfig.from_pretrained(tmp_path / "hf")
    assert (config.model_type, config.activation_function, config.n_positions) == ("gpt2", "gelu", 16)
    assert config.eos_token_id == config.pad_token_id == 0  # the text source's end-of-document token
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == 0
    # GPT-2's own checkpoints use the tanh GELU ("gelu_new"): with it the same weights give other logits.
    tanh = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", activation_function="gelu_new").eval()
    with torch.no_grad():
        assert (tanh(tokens).logits - model(tokens)).abs().max().item() > 1e-4

    loaded = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert loaded(SAMPLE)["input_ids"] == tokenizer.encode(SAMPLE).ids
    assert (loaded.eos_token, loaded.pad_token_id) == ("<|endoftext|>", 0)
    assert loaded.decode(tokenizer.encode(SAMPLE).ids) == SAMPLE
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    out = hf.generate(**loaded(["def add"], return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert out.shape == (1, len(tokenizer.encode("def add").ids) + 5)
    assert all(oct(p.stat().st_mode)[-3:] == "644" for p in (tmp_path / "hf").iterdir())  # (not safetensors' 0600)


def test_a_sharded_checkpoint_exports_in_shards_above_the_size_with_its_index(tmp_path):
    from training.run.hf_export import write_hf_folder

    job = text_job({"name": "gpt", "options": {"n_layer": 3, "n_head": 4, "d_model": 64}})
    tokenizer = train_bpe()
    manifest = prepared_root(tmp_path, tokenizer)
    model = trained_gpt(tokenizer.get_vocab_size(), 16, job.model.options)
    checkpoint = save_checkpoint(tmp_path / "checkpoint-00000003", model, sharded=True)  # (DCP, one shard)
    assert (tmp_path / "checkpoint-00000003" / ".metadata").is_file()
    files = write_hf_folder(job, manifest, checkpoint, str(tmp_path / "hf"), max_shard_size="100KB")

    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files and "model.safetensors" not in files
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    tokens = torch.randint(0, tokenizer.get_vocab_size(), (2, 16), generator=torch.Generator().manual_seed(2))
    assert max_logit_diff(tmp_path / "hf", model, tokens) <= 1e-5


def test_the_folder_goes_to_s3_and_replaces_what_was_there(tmp_path, monkeypatch, moto_endpoint):
    import pyarrow.fs as pafs
    from aws import create_bucket, s3_env

    from training.run.hf_export import write_hf_folder

    for key, value in s3_env(moto_endpoint).items():
        monkeypatch.setenv(key, value)
    create_bucket(moto_endpoint, "hf-out")
    job = text_job({"name": "gpt", "options": {"n_layer": 1, "n_head": 2, "d_model": 32}})
    tokenizer = train_bpe()
    manifest = prepared_root(tmp_path, tokenizer)
    model = trained_gpt(tokenizer.get_vocab_size(), 16, job.model.options)
    checkpoint = save_checkpoint(tmp_path / "checkpoint-00000003", model)
    fs, _ = pafs.FileSystem.from_uri("s3://hf-out/models")
    with fs.open_output_stream("hf-out/models/gpt/model-00009-of-00009.safetensors") as stream:
        stream.write(b"an old shard")
    write_hf_folder(job, manifest, checkpoint, "s3://hf-out/models/gpt")

    names = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector("hf-out/models/gpt")))
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    (tmp_path / "down").mkdir()
    pafs.copy_files("hf-out/models/gpt", str(tmp_path / "down"), source_filesystem=fs,
                    destination_filesystem=pafs.LocalFileSystem())
    tokens = torch.randint(0, tokenizer.get_vocab_size(), (2, 16), generator=torch.Generator().manual_seed(3))
    assert max_logit_diff(tmp_path / "down", model, tokens) <= 1e-5


def test_an_hf_llama_run_exports_its_folder_and_logs_registered_with_the_transformers_flavor(tmp_path,
                                                                                              empty_mlflow_db):
    """The hf family (family.hf_model gives the PreTrainedModel): a Llama from an inline config,
    saved as a worker saves its checkpoint, written as its folder with the data's tokenizer, and
    logged to MLflow as a transformers model, registered, that generates text offline."""
    import mlflow
    import mlflow.transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.models.registry import build_model
    from training.run.finalize import load_final_model, log_model
    from training.run.hf_export import write_hf_folder
    from training.tasks import logits_of
    from training.tracking.tracker import MlflowTracker

    tokenizer = train_bpe(vocab_size=320)
    job = text_job({"name": "hf", "options": {"config": {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}}})
    manifest = prepared_root(tmp_path, tokenizer)
    torch.manual_seed(0)
    trained = build_model(job.model, {"task": manifest.task, **manifest.spec})
    checkpoint = save_checkpoint(tmp_path / "checkpoint-00000003", trained)
    files = write_hf_folder(job, manifest, checkpoint, str(tmp_path / "hf"))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    tokens = torch.randint(0, tokenizer.get_vocab_size(), (2, 16), generator=torch.Generator().manual_seed(4))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (loaded(tokens).logits - logits_of(trained.eval()(tokens))).abs().max().item()
    print(f"max |logits difference| Llama vs its folder: {diff:.3g}")
    assert diff <= 1e-5 and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert loaded.config.eos_token_id == 0 and AutoTokenizer.from_pretrained(tmp_path / "hf").eos_token_id == 0

    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("hf", artifact_location=(tmp_path / "mlruns").as_uri())
    run_id = client.create_run(experiment).info.run_id
    logged = log_model(job, manifest, load_final_model(job.model, manifest, checkpoint), MlflowTracker(uri, run_id))
    assert logged["model_format"] == "transformers" and logged["registered_version"] == "1"
    mlflow.set_tracking_uri(uri)
    try:
        assert "transformers" in mlflow.models.get_model_info(logged["model_uri"]).flavors
        assert client.get_logged_model(logged["model_id"]).source_run_id == run_id
        pipe = mlflow.transformers.load_model(f"models:/{logged['registered_model']}/1")
        text = pipe("def add", max_new_tokens=4, do_sample=False)[0]["generated_text"]
        assert text.startswith("def add") and len(text) > len("def add")
        assert mlflow.pyfunc.load_model(logged["model_uri"]).predict(["def add"])[0].startswith("def add")
    finally:
        mlflow.set_tracking_uri(None)


def test_a_family_without_an_hf_form_is_refused_naming_it():
    from training import config as config_lib
    from training.errors import UserError
    from training.run.hf_export import check_exports_hf, exports_hf

    job = config_lib.validate({"model": {"name": "digits_mlp"}, "data": {"source": "digits"}})
    assert not exports_hf(job.model)
    with pytest.raises(UserError, match="model.name: digits_mlp has no Hugging Face form"):
        check_exports_hf(job.model)


# --- a real run: the folder at its end, in MLflow, and `python -m training export` -------------------

def export(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRAINING_BASE_DIR": str(cwd), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "training", "export", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.ray
def test_a_gpt_run_ends_with_its_hf_folder_logged_and_exports_again_from_the_command(ray_cluster, workdir):
    import mlflow
    import numpy as np
    import ray.train
    from transformers import AutoTokenizer

    from training import config as config_lib
    from training.data.manifest import Manifest
    from training.data.registry import source_of
    from training.run.driver import run_training
    from training.run.finalize import load_final_model

    overrides = ["train.max_steps=6", "train.eval_every_n_steps=6", "checkpoint.every_n_steps=3",
                 "checkpoint.keep=3", "data.options.max_bytes=200000",
                 "data.options.tokenizer.train.sample_bytes=200000",
                 "data.options.tokenizer.train.vocab_size=400", "data.options.partitions=2", "failure.max_failures=0",
                 "tracking.export_onnx=false", "scaling.num_workers=1"]
    job = config_lib.load(REPO / "training" / "configs" / "tinylm_bpe.yaml", overrides, name="bpe-hf")
    lines = []
    summary = run_training(job, log=lambda line: (lines.append(line), print(line)))
    run_dir = workdir / "runs" / "bpe-hf"
    assert summary.extra["hf_exported"] and summary.extra["hf_folder"] == str(run_dir / "hf")
    assert any(line.startswith("  Hugging Face folder: ") for line in lines)
    listing = sorted(p.name for p in (run_dir / "hf").iterdir())
    print("exported folder:", listing)
    assert listing == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                       "tokenizer_config.json"]
    client = mlflow.MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    assert sorted(a.path for a in client.list_artifacts(summary.mlflow_run_id, "hf")) == [f"hf/{n}" for n in listing]
    assert summary.extra["model_format"] == "pt2" and summary.registered_model  # (its own flavor, registered)

    # The command, on the run's newest checkpoint and on an older one.
    done = export(["bpe-hf", "--format", "hf", "--out", "out6"], workdir)
    assert done.returncode == 0, done.stderr
    assert "step 6" in done.stdout
    done = export(["bpe-hf", "--checkpoint", "3", "--format", "hf", "--out", str(workdir / "out3")], workdir)
    assert done.returncode == 0, done.stderr
    record = json.loads((run_dir / "run.json").read_text())
    manifest = Manifest.load(record["dataset"]["root"])
    rows = torch.from_numpy(source_of("text").rows(manifest, "validation").take(np.arange(2))["tokens"])[:, :-1]

    for step, out in ((6, "out6"), (3, "out3")):
        model = load_final_model(job.model, manifest, ray.train.Checkpoint(str(run_dir / f"checkpoint-{step:08d}")))
        diff = max_logit_diff(workdir / out, model, rows)
        print(f"step {step}: max |logits difference| trained vs exported: {diff:.3g}")
        assert diff <= 1e-5
    assert max_logit_diff(workdir / "out6", model, rows) > 1e-5  # (the steps' weights differ: --checkpoint chose)
    from tokenizers import Tokenizer

    data_tokenizer = Tokenizer.from_file(str(Path(manifest.root) / "tokenizer.json"))
    assert AutoTokenizer.from_pretrained(workdir / "out6")(SAMPLE)["input_ids"] == data_tokenizer.encode(SAMPLE).ids

    # Bad input: exit 2, one line, nothing written.
    cases = [(["no-such-run", "--format", "hf", "--out", "a"], "no run in"),
             (["bpe-hf", "--checkpoint", "4", "--format", "hf", "--out", "b"], "--checkpoint 4: run"),
             (["bpe-hf", "--format", "hf", "--out", "out6"], "--out"),
             (["bpe-hf", "--format", "onnx", "--out", "c"], "invalid choice: 'onnx'")]
    digits_run = workdir / "runs" / "digits-run"
    digits_run.mkdir()
    shutil.copy(run_dir / "run.json", digits_run / "run.json")
    (digits_run / "config.yaml").write_text((REPO / "training" / "configs" / "digits.yaml").read_text())
    cases.append((["digits-run", "--format", "hf", "--out", "d"], "model.name: digits_mlp has no Hugging Face form"))
    for args, words in cases:
        done = export(args, workdir)
        assert done.returncode == 2 and words in done.stderr, (args, done.stderr)
        if "invalid choice" not in words:
            assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not any((workdir / name).exists() for name in "abcd")
