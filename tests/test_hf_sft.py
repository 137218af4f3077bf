"""Fine-tuning end to end: the generation check at a run's end (training/run/generate.py), sweeps over
a LoRA fine-tune's adapter and learning rate (tuning/), PBT's exploit of an adapter run's
checkpoint. Without Ray: generation on a tiny Llama over chat data, rendered with the data's template
and logged to a real MLflow store as a table; eval.generate refused for a model that cannot
generate; a sweep over model.adapter.r/alpha/dropout and optim.lr with ASHA validated and its trials'
configs drawn and validated; the exploit's copy of an adapter checkpoint holding the adapter and its
optimizer state alone, restored over the base read from its folder. On Ray: the two-stage pipeline
of llama_stdlib.yaml and sft_stdlib.yaml, shortened."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import CONFIGS, REPO
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from training import config as config_lib
from training.errors import ConfigError
from training.run import generate

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
PROMPTS = ["alpha beta", "gamma delta epsilon"]


def chat_data(tmp_path) -> dict:
    """A small chat set (JSON Lines) and a byte-level BPE trained on its words: data.options."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    for split, count in (("train", 16), ("validation", 4)):
        (tmp_path / split).mkdir()
        rows = [{"messages": [{"role": "user", "content": " ".join(rng.choice(WORDS, 3))},
                              {"role": "assistant", "content": " ".join(rng.choice(WORDS, 4))}]} for _ in range(count)]
        (tmp_path / split / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"path": str(tmp_path / "train"), "validation_path": str(tmp_path / "validation"), "format": "chat",
            "seq_len": 64, "tokenizer": {"file": str(tmp_path / "tokenizer.json")}, "chat": {"template": "default"}}


def chat_job(data_options, **sections):
    return config_lib.validate({
        "model": {"name": "hf", "options": {"config": LLAMA}}, "data": {"source": "text", "options": data_options},
        "train": {"max_steps": 2, "global_batch_size": 4}, "scaling": {"num_workers": 1}, **sections})


# --- the generation check -------------------------------------------------------------------------

def test_generation_renders_chat_prompts_with_the_runs_template_and_logs_a_table_to_mlflow(tmp_path, empty_mlflow_db):
    import shutil

    from mlflow.tracking import MlflowClient

    from training.data import text
    from training.models.registry import build_model
    from training.tracking.tracker import MlflowTracker

    job = chat_job(chat_data(tmp_path), eval={"generate": {"prompts": PROMPTS, "max_new_tokens": 5}})
    manifest = text.SOURCE.plan(job.data, str(tmp_path / "cache")).prepare(None, lambda line: None)
    torch.manual_seed(0)
    model = build_model(job.model, {"task": manifest.task, **manifest.spec})

    rows = generate.generations(job, manifest, model)
    assert [row["prompt"] for row in rows] == PROMPTS
    # each prompt is the user's turn in the data's own template, ending where the assistant answers
    assert rows[0]["input"] == "<|endoftext|><|user|>\nalpha beta\n<|assistant|>\n"
    assert all(1 <= row["new_tokens"] <= 5 and isinstance(row["output"], str) for row in rows)
    assert generate.generations(job, manifest, model) == rows  # greedy: the same model says the same

    lines = generate.summary_lines(rows)
    assert lines[0] == "  generated (eval.generate):" and lines[1] == "  prompt: alpha beta"
    assert lines[2] == f"    -> {rows[0]['output']}".replace("\n", "\\n")

    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker.start(uri, "generation", "gen", None, {}, {}, artifact_location=str(tmp_path / "artifacts"))
    assert generate.log_table(tracker, rows, print)
    local = MlflowClient(uri).download_artifacts(tracker.run_id, generate.TABLE_FILE, str(tmp_path / "down"))
    table = json.loads(open(local).read())
    assert table["columns"] == ["prompt", "input", "output", "new_tokens"]
    assert [r[0] for r in table["data"]] == PROMPTS and [r[2] for r in table["data"]] == [r["output"] for r in rows]


def test_eval_generate_is_refused_for_a_model_that_cannot_generate(tmp_path):
    section = {"eval": {"generate": {"prompts": ["alpha"]}}}
    classify = {"name": "hf", "options": {"config": {**LLAMA}, "task": "sequence_classification"}}
    with pytest.raises(ConfigError, match=r"eval.generate: generation needs a language model .* with task "
                                          r"sequence_classification"):
        config_lib.validate({"model": classify, "data": {"source": "text", "options": {
            "path": "x", "label_column": "label", "validation_fraction": 0.1, "tokenizer": {"file": "t.json"}}},
            **section})
    with pytest.raises(ConfigError, match="eval.generate: generation needs a language model .* this job's is digits"):
        config_lib.load(CONFIGS / "digits.yaml", ["eval.generate.prompts=[a]"])
    with pytest.raises(ConfigError, match=r"eval.generate.max_new_tokens"):
        chat_job(chat_data(tmp_path), eval={"generate": {"prompts": ["a"], "max_new_tokens": 0}})
    shipped = config_lib.load(CONFIGS / "sft_stdlib.yaml")
    assert shipped.eval.generate.max_new_tokens == 40 and shipped.model.adapter.r == 16
    assert config_lib.load(CONFIGS / "digits.yaml").eval.generate is None


# --- sweeps over a fine-tune ----------------------------------------------------------------------

def write_sweep(tmp_path, space: str, scheduler: str = "{name: asha, grace_period_steps: 20}"):
    path = tmp_path / "sft_sweep.yaml"
    path.write_text(f"base: {CONFIGS / 'sft_stdlib.yaml'}\nset: [train.max_steps=80]\nspace:\n{space}\n"
                    f"scheduler: {scheduler}\nmetric: val_loss\nmode: min\nnum_samples: 6\n")
    return path


def test_a_sweep_over_the_adapter_and_the_learning_rate_with_asha_validates_and_expands(tmp_path):
    from ray.tune.search.sample import Domain

    from tuning import config as sweep_config
    from tuning.schedule import _scheduler
    from tuning.space import tune_param_space
    from tuning.trial import TrialSetup, trial_job

    sweep = sweep_config.load(REPO / "tuning" / "sweeps" / "sft_stdlib_asha.yaml")  # (the shipped example)
    assert list(sweep.space) == ["model.adapter.r", "model.adapter.alpha", "model.adapter.dropout", "optim.lr"]
    assert type(_scheduler(sweep)).__name__ == "AsyncHyperBandScheduler"
    domains = tune_param_space(sweep.space, sweep.config.search.algorithm)
    setup = TrialSetup(sweep.name, sweep.base_raw, str(tmp_path), None, "x", None, False)
    np.random.seed(0)
    for trial in range(6):
        params = {path: domain.sample() for path, domain in domains.items() if isinstance(domain, Domain)}
        job = trial_job(setup, params, f"sft-sweep-{trial}")
        assert job.model.adapter.r == params["model.adapter.r"] and job.model.adapter.r in (4, 8, 16)
        assert job.model.adapter.alpha == pytest.approx(params["model.adapter.alpha"])
        assert 0.0 <= job.model.adapter.dropout <= 0.2 and job.optim.lr == pytest.approx(params["optim.lr"])
        assert job.model.adapter.kind == "lora" and not job.tracking.register_model  # (the sweep registers its best)

    # a value the adapter refuses, named with its dimension; PBT (weights copied between trials) keeps the adapter
    with pytest.raises(ConfigError, match=r"space.model.adapter.r: the value 0 makes an invalid job config"):
        sweep_config.load(write_sweep(tmp_path, "  model.adapter.r: {choice: [0, 8]}"))
    with pytest.raises(ConfigError, match=r"space.model.adapter.dropout: the value 1.0 makes an invalid job config"):
        sweep_config.load(write_sweep(tmp_path, "  model.adapter.dropout: {uniform: [0.5, 1.0]}"))
    with pytest.raises(ConfigError, match=r"space.model.adapter.r: PBT copies weights between trials"):
        sweep_config.load(write_sweep(tmp_path, "  model.adapter.r: {choice: [4, 8]}", "{name: pbt}"))
    pbt = sweep_config.load(write_sweep(tmp_path, "  optim.lr: {loguniform: [1.0e-4, 1.0e-2]}", "{name: pbt}"))
    assert pbt.base.model.adapter.r == 16


# --- PBT's exploit of an adapter run --------------------------------------------------------------

def test_pbts_exploit_copies_the_adapter_and_its_optimizer_state_and_never_the_base(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from training.checkpoint import format as ckpt
    from training.config import OptimConfig
    from training.models.registry import build_model, family_of, model_section
    from training.worker.optim import build_optimizer
    from tuning import exploit

    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA, vocab_size=300))
    base.save_pretrained(tmp_path / "base")
    section = model_section({"name": "hf", "options": {"pretrained": str(tmp_path / "base")}, "adapter": {"r": 4}})
    spec = {"task": "language_model", "vocab_size": 300, "seq_len": 16}
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(5))
    donor = build_model(section, spec)
    donor_optim = OptimConfig(lr=0.01)
    optimizer = build_optimizer(donor_optim, donor)
    for _ in range(3):
        out = donor.train()(tokens[:, :-1]).logits
        torch.nn.functional.cross_entropy(out.reshape(-1, 300), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    frozen = family_of("hf").checkpoints_frozen(section)
    (tmp_path / "donor").mkdir()
    ckpt.write(tmp_path / "donor", model=donor, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 1.0), sharded=False, loop=ckpt.LoopState(step=3),
        config={"seed": 0, "optim": donor_optim.model_dump(mode="json")}, steps_per_epoch=10, world_size=1,
        metrics={}, frozen=frozen)
    exploit.write_tune_copy(str(tmp_path / "donor"), tmp_path / "tune", run="donor", trial_id="a", step=3)

    explored = OptimConfig(lr=0.002)
    exploit.rebase(str(tmp_path / "tune"), tmp_path / "seed", explored)
    seed = ckpt.load(tmp_path / "seed")
    adapter_names = {name for name, p in donor.named_parameters() if p.requires_grad}
    assert adapter_names and all(".lora_" in name for name in adapter_names)
    assert set(seed["model"]) == adapter_names  # the adapter alone: no base weight travels
    assert len(seed["optimizer"]["state"]) == len(adapter_names)  # and its moments alone
    assert seed["optimizer"]["param_groups"][0]["initial_lr"] == 0.002  # on the trial's new hyperparameters
    base_bytes = (tmp_path / "base" / "model.safetensors").stat().st_size
    assert ckpt.written_bytes(tmp_path / "seed") < base_bytes  # (adapter, moments and all: less than the base)

    # the trial continues: its model built from the pretrained folder, the seed restored over it
    trial = build_model(section, spec)
    trial_optimizer = build_optimizer(explored, trial)
    ckpt.restore(tmp_path / "seed", trial, trial_optimizer, torch.optim.lr_scheduler.LambdaLR(
        trial_optimizer, lambda step: 1.0), sharded=False, frozen=frozen)
    for name, param in trial.named_parameters():
        expected = dict(donor.named_parameters())[name]
        assert torch.equal(param, expected), name  # adapter from the donor, base from the folder (the donor's too)
    with torch.no_grad():
        assert torch.equal(trial.eval()(tokens).logits, donor.eval()(tokens).logits)


# --- the worked example, shortened, on Ray --------------------------------------------------------

PRETRAIN = ["model.options.config.hidden_size=32", "model.options.config.intermediate_size=64",
            "model.options.config.num_hidden_layers=1", "data.options.max_bytes=200000", "data.options.seq_len=32",
            "data.options.partitions=2", "data.options.tokenizer.train={vocab_size: 512, sample_bytes: 200000}",
            "train.max_steps=4", "train.global_batch_size=8", "train.eval_every_n_steps=4",
            "checkpoint.every_n_steps=4", "tracking.enabled=false", "failure.max_failures=0"]


@pytest.mark.ray
def test_a_pretrained_export_fine_tuned_with_lora_on_packed_chats_gives_a_merged_model_and_generations(
        ray_cluster, workdir):
    import mlflow
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.checkpoint import format as ckpt
    from training.checkpoint.restore import final_checkpoint
    from training.data.chat import DEFAULT_TEMPLATE
    from training.data.manifest import Manifest
    from training.run.driver import run_training
    from training.run.final_model import load_final_model

    pretrained = run_training(config_lib.load(CONFIGS / "llama_stdlib.yaml", PRETRAIN, name="pre"), log=print)
    assert pretrained.steps == 4 and (workdir / "runs" / "pre" / "hf" / "tokenizer.json").is_file()

    sft = ["model.options.pretrained=runs/pre/hf", "model.adapter={r: 4, alpha: 8}", "data.options.seq_len=64",
           "train.max_steps=4", "train.global_batch_size=8", "train.eval_every_n_steps=4", "checkpoint.every_n_steps=4",
           "failure.max_failures=0", "eval.generate={prompts: ['json.dumps(obj)'], max_new_tokens: 4}"]
    summary = run_training(config_lib.load(CONFIGS / "sft_stdlib.yaml", sft, name="sft"), log=print)
    assert summary.steps == 4 and summary.metrics["val_loss"] > 0
    run_dir = workdir / "runs" / "sft"
    (checkpoint,) = run_dir.glob("checkpoint-*")
    assert all(".lora_" in name for name in ckpt.load(checkpoint)["model"])  # the adapter alone, the base frozen

    # the merged folder, loaded by transformers, is the trained model; the PEFT folder is inside it
    record = json.loads((run_dir / "run.json").read_text())
    manifest = Manifest.load(record["dataset"]["root"])
    assert manifest.task == "packed_language_model"
    job = config_lib.load(CONFIGS / "sft_stdlib.yaml", sft, name="sft")
    trained = load_final_model(job.model, manifest, final_checkpoint(None, str(run_dir)))
    merged = AutoModelForCausalLM.from_pretrained(str(run_dir / "hf"), dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (merged(tokens).logits - trained.eval()(tokens).logits).abs().max().item() < 1e-5
    assert {p.name for p in (run_dir / "hf" / "adapter").iterdir()} == {"adapter_config.json",
                                                                         "adapter_model.safetensors"}
    assert AutoTokenizer.from_pretrained(str(run_dir / "hf")).chat_template == DEFAULT_TEMPLATE  # (served as trained)

    # registered under the config's name; the generation check in the summary and in MLflow as a table
    assert summary.registered_model == "sft-stdlib"
    (row,) = summary.extra["generations"]
    assert row["input"].endswith("<|user|>\njson.dumps(obj)\n<|assistant|>\n") and 1 <= row["new_tokens"] <= 4
    assert json.loads((run_dir / "summary.json").read_text())["generations"] == [row]
    client = mlflow.MlflowClient(summary.tracking_uri)
    table = json.loads(open(client.download_artifacts(summary.mlflow_run_id, generate.TABLE_FILE,
                                                      str(workdir))).read())
    assert table["data"][0][:3] == [row["prompt"], row["input"], row["output"]]
