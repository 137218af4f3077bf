"""LoRA adapters on the `hf` family (training/models/hf_adapter.py), on tiny Llamas the tests save
with save_pretrained. Without Ray: the adapter put in place with only its weights trainable and in the
optimizer, every bad input refused naming its option, a checkpoint of the adapter alone restored over
the base, the base's digest pinned, the PEFT folder and the merged model an export writes. On a local
Ray cluster, in one test (four runs): FSDP training with a sharded checkpoint of the adapter alone,
resumed at another world size; a DDP run whose loss falls, exported and logged; a worker SIGKILLed
mid-run and the adapter bit-identical to the unkilled run's; a resumed run whose base changed refused
by the command, exit 2."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import types

import pytest
import torch
from conftest import CONFIGS, train_worker_pids, wait_for

from training.checkpoint import format as ckpt
from training.errors import ConfigError, UserError
from training.models.family import check_pinned
from training.models.registry import build_model, family_of, model_section
from training.worker.optim import build_optimizer

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300}
SPEC = {"task": "language_model", "vocab_size": 300, "seq_len": 16}


def save_llama(folder, seed: int = 1, **sizes):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**LLAMA, **sizes})).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("llama") / "base")


def lora(folder, **adapter):
    return model_section({"name": "hf", "options": {"pretrained": str(folder)}, "adapter": {"r": 4, **adapter}})


def built(section, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(section, SPEC)


def lora_state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items() if ".lora_" in k}


def logits(model, tokens):
    with torch.no_grad():
        output = model.eval()(tokens)
    return getattr(output, "logits", output)


TOKENS = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(5))


# --- the adapter on the model ---------------------------------------------------------------------

def test_lora_trains_only_its_weights_which_alone_the_optimizer_holds(base):
    model = built(lora(base))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    # r * (in + out) per targeted weight: q 64+64, k and v 64+32, o 64+64, gate and up 64+128, down 128+64
    assert sum(p.numel() for p in trainable.values()) == 2 * 4 * (128 + 96 + 96 + 128 + 3 * 192) == 8192
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B of 7 projections in 2 layers: attention's and the MLP's
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in model.state_dict()
    optimizer = build_optimizer(model_section_optim(), model)
    assert sum(p.numel() for group in optimizer.param_groups for p in group["params"]) == 8192
    # B starts at zero: the model starts as its base, whose logits it gives
    plain = build_model(model_section({"name": "hf", "options": {"pretrained": str(base)}}), SPEC)
    assert torch.equal(logits(model, TOKENS), logits(plain, TOKENS))
    # the adapter's initial weights are the seed's alone (the same on every worker, sharded or not)
    assert all(torch.equal(a, b) for a, b in zip(lora_state(model).values(), lora_state(built(lora(base), 0)).values()))
    only_q = built(lora(base, target_modules=["q_proj", "v_proj"], r=2))
    assert sum(p.numel() for p in only_q.parameters() if p.requires_grad) == 2 * 2 * (128 + 96)


def model_section_optim():
    from training.config import OptimConfig

    return OptimConfig(name="adamw", lr=1e-3)


@pytest.mark.parametrize("adapter, error, message", [
    ({"r": 0}, ConfigError, "model.adapter.r: Input should be greater than or equal to 1"),
    ({"r": 5000}, ConfigError, "model.adapter.r: Input should be less than or equal to 4096"),
    ({"alpha": 0}, ConfigError, "model.adapter.alpha: Input should be greater than 0"),
    ({"alpha": -8}, ConfigError, "model.adapter.alpha"),
    ({"dropout": 1.0}, ConfigError, "model.adapter.dropout: Input should be less than 1"),
    ({"dropout": -0.1}, ConfigError, "model.adapter.dropout"),
    ({"kind": "dora"}, ConfigError, "model.adapter.kind"),
    ({"target_modules": []}, ConfigError, "model.adapter.target_modules"),
    ({"rank": 4}, ConfigError, "model.adapter.rank: unknown key"),
    ({"target_modules": ["q_proj", "qkv_proj"]}, UserError,
     "model.adapter.target_modules: the llama model has no linear layer named qkv_proj; its linear layers: "
     "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"),
    ({"target_modules": ["lm_head"]}, UserError, "no linear layer named lm_head"),  # (the head is not adapted)
    ({"r": 40}, UserError, r"model.adapter.r: 40 is more than the rank of the smallest targeted weight \(k_proj: "
                           r"64 -> 32\); use at most 32"),
    ({"kind": "qlora"}, UserError, "model.adapter.kind: qlora .* needs a CUDA GPU"),
])
def test_bad_adapters_are_refused_naming_the_option_by_the_drivers_meta_check(base, adapter, error, message):
    """Raised on the driver, by the config or by the meta-device build (preflight.check_model_builds),
    before Ray starts."""
    from training.run.preflight import check_model_builds

    if torch.cuda.is_available() and adapter.get("kind") == "qlora":
        pytest.skip("the refusal of qlora is for a machine without CUDA")
    with pytest.raises(error, match=message):
        check_model_builds(lora(base, **adapter), "language_model", {k: v for k, v in SPEC.items() if k != "task"})


def test_an_adapter_needs_a_pretrained_causal_lm(base):
    """Decided: an adapter over random weights (an inline config) is refused, as is one for a task whose new
    head would have to train in full."""
    with pytest.raises(ConfigError, match=r"model: an adapter \(model.adapter\) trains on top of pretrained weights"
                                          ".*set model.options.pretrained"):
        model_section({"name": "hf", "options": {"config": {"model_type": "llama"}}, "adapter": {}})
    with pytest.raises(ConfigError, match="is for model.options.task causal_lm, not sequence_classification"):
        model_section({"name": "hf", "options": {"pretrained": str(base), "task": "sequence_classification"},
                       "adapter": {}})


def test_a_config_without_an_adapter_is_written_as_before(base):
    """(run.json's identity of an hf run recorded before adapters were an option stays the same)"""
    plain = model_section({"name": "hf", "options": {"pretrained": str(base)}})
    assert "adapter" not in plain.model_dump(mode="json")
    assert lora(base).model_dump(mode="json")["adapter"]["r"] == 4


# --- checkpoints and the base --------------------------------------------------------------------

def trained_a_little(model, steps: int = 3):
    optimizer = build_optimizer(model_section_optim(), model)
    for _ in range(steps):
        out = model.train()(TOKENS[:, :-1]).logits
        torch.nn.functional.cross_entropy(out.reshape(-1, 300), TOKENS[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def test_a_checkpoint_holds_the_adapter_and_its_optimizer_state_and_restores_over_the_base(base, tmp_path):
    section = lora(base)
    frozen = family_of("hf").checkpoints_frozen(section)
    assert frozen is False and family_of("hf").checkpoints_frozen(model_section({"name": "hf", "options": {
        "pretrained": str(base)}})) is True
    model = built(section)
    optimizer = trained_a_little(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    fields = dict(loop=ckpt.LoopState(step=3), config={"seed": 0}, steps_per_epoch=10, world_size=1, metrics={})
    (tmp_path / "adapter").mkdir()
    ckpt.write(tmp_path / "adapter", model=model, optimizer=optimizer, scheduler=scheduler, sharded=False,
               frozen=frozen, **fields)
    state = ckpt.load(tmp_path / "adapter")
    assert set(state["model"]) == set(lora_state(model)) and len(state["optimizer"]["state"]) == 28

    fresh = built(section, seed=9)  # (another adapter to start from: the checkpoint's replaces it)
    fresh_optimizer = build_optimizer(model_section_optim(), fresh)
    ckpt.restore(tmp_path / "adapter", fresh, fresh_optimizer, torch.optim.lr_scheduler.LambdaLR(
        fresh_optimizer, lambda step: 1.0), sharded=False, frozen=False)
    assert torch.equal(logits(fresh, TOKENS), logits(model, TOKENS))
    with pytest.raises(ValueError, match="does not fit the model"):  # the names of another model's adapter
        ckpt.load_model_into(built(lora(base, target_modules=["q_proj"])), state["model"], False, "x")

    # the size: the adapter's checkpoint against the whole model's (AdamW: two moments per weight)
    full = build_model(model_section({"name": "hf", "options": {"pretrained": str(base)}}), SPEC)
    full_optimizer = trained_a_little(full, steps=1)
    (tmp_path / "full").mkdir()
    ckpt.write(tmp_path / "full", model=full, optimizer=full_optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(
        full_optimizer, lambda step: 1.0), sharded=False, **fields)
    small, whole = ckpt.written_bytes(tmp_path / "adapter"), ckpt.written_bytes(tmp_path / "full")
    print(f"adapter checkpoint {small} bytes, full {whole} bytes ({whole / small:.1f}x)")
    assert small * 8 < whole


def test_the_bases_digest_is_pinned_and_a_changed_base_refused(base, tmp_path):
    folder = shutil.copytree(base, tmp_path / "base")
    section = lora(folder)
    pinned = family_of("hf").pinned(section)
    assert list(pinned) == ["model.options.pretrained"] and len(pinned["model.options.pretrained"]) == 64
    assert family_of("hf").pinned(model_section({"name": "hf", "options": {"pretrained": str(folder)}})) == {}
    check_pinned(pinned, family_of("hf").pinned(section))  # unchanged: resumes
    check_pinned(None, pinned)  # a run recorded before pins were: resumes
    save_llama(folder, seed=2)  # other weights, same shapes
    with pytest.raises(UserError, match=r"model.options.pretrained: its files changed since the run started"):
        check_pinned(pinned, family_of("hf").pinned(section))


# --- export ---------------------------------------------------------------------------------------

def test_the_export_writes_the_peft_folder_and_the_merged_model_with_the_trained_logits(base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from training.run.hf_export import write_hf_folder

    section = lora(base, alpha=8)
    model = built(section)
    trained_a_little(model)
    expected = logits(model, TOKENS)
    job = types.SimpleNamespace(model=section, data=types.SimpleNamespace(options=None))
    manifest = types.SimpleNamespace(root=str(tmp_path / "no-data"), origin=None, task="language_model")
    files = write_hf_folder(job, manifest, None, str(tmp_path / "hf"), model=model)
    assert {"config.json", "model.safetensors", "adapter/adapter_config.json",
            "adapter/adapter_model.safetensors"} <= set(files)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert (logits(merged, TOKENS) - expected).abs().max().item() < 1e-5
    config = json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base) and config["r"] == 4 and config["lora_alpha"] == 8
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]
    fresh = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(fresh, str(tmp_path / "hf" / "adapter"))
    assert (logits(with_adapter, TOKENS) - expected).abs().max().item() < 1e-5

    no_merge = built(lora(base, merge=False))
    files = write_hf_folder(types.SimpleNamespace(model=lora(base, merge=False), data=job.data), manifest, None,
                            str(tmp_path / "adapter-only"), model=no_merge)
    assert files == ["adapter/adapter_config.json", "adapter/adapter_model.safetensors"]


# --- on Ray ---------------------------------------------------------------------------------------

# The byte-level tinylm source (vocab 256, no tokenizer: the final model is logged as a pickle, its HF
# folder, the adapter's inside, beside it) and a tiny pretrained Llama for it. A checkpoint every 5
# steps: an adapter's is a few hundred KB, and the kill lands at the first with 25 steps still to go.
RUN = ["data.source=tinylm", "data.options={seq_len: 32, max_bytes: 60000}", "train.global_batch_size=16",
       "train.log_every_n_steps=5", "train.min_report_interval_s=0", "checkpoint.keep=1",
       "model.adapter={r: 8, alpha: 16}", "optim.lr=0.03", "optim.warmup_steps=0", "train.max_steps=30",
       "checkpoint.every_n_steps=5", "train.eval_every_n_steps=30", "tracking.enabled=false",
       "failure.max_failures=3"]
CHANCE = 5.45  # a little below ln(256) = 5.55, where the random base starts: a loss under it learned


def adapter_weights(run_dir):
    return ckpt.load(sorted(run_dir.glob("checkpoint-*"))[-1])["model"]


def kill_a_worker_at_the_first_checkpoint(run_dir, kills: list) -> None:
    """SIGKILL a training worker as soon as the run's first checkpoint is complete (not after a
    time): the run has most of its steps still to do, restarts its group and resumes from it."""
    import pyarrow.fs as pafs

    wait_for(lambda: ckpt.newest_complete(pafs.LocalFileSystem(), str(run_dir)), 300, "a first checkpoint")
    pids = train_worker_pids()
    if pids:
        os.kill(pids[-1], signal.SIGKILL)
        kills.append(pids[-1])


@pytest.mark.ray
@pytest.mark.chaos
@pytest.mark.slow
def test_lora_learns_exports_resumes_bit_identically_after_a_killed_worker_and_under_fsdp(ray_cluster, workdir):
    import mlflow
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    from training import config as config_lib
    from training.checkpoint.restore import final_checkpoint
    from training.data.manifest import Manifest
    from training.run.driver import run_training
    from training.run.final_model import load_final_model

    def train(overrides, name, **kwargs):
        return run_training(config_lib.load(CONFIGS / "llama_stdlib.yaml", overrides, name=name), log=print, **kwargs)

    folder = save_llama(workdir / "base", vocab_size=256, hidden_size=32, intermediate_size=64)
    run = RUN + [f"model.options={{pretrained: {folder}}}"]

    # FSDP (frozen and trainable weights in each sharded layer, the base read in shards): trains, and
    # resumes from its sharded checkpoint of the adapter alone at another world size
    fsdp = run + ["parallel.strategy=fsdp", "checkpoint.every_n_steps=10", "train.eval_every_n_steps=10"]
    first = train(fsdp + ["train.max_steps=10"], "fsdp")
    assert first.steps == 10 and first.metrics["world_size"] == 2
    (checkpoint,) = (workdir / "runs" / "fsdp").glob("checkpoint-*")
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["layout"] == "sharded" and {"__0_0.distcp", "__1_0.distcp"} <= set(meta["files"])
    saved = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    weights = [key for key in saved if key.startswith("model.")]
    assert len(weights) == 2 * 7 * 2 and all(".lora_" in key for key in weights)  # the adapter alone: A and B
    again = train(fsdp + ["train.max_steps=20", "scaling.num_workers=1"], "fsdp")
    assert again.resumed and again.steps == 20 and again.metrics["start_step"] == 10
    assert again.metrics["world_size"] == 1 and again.metrics["train_loss"] < CHANCE

    # DDP: the loss falls; the export's merged folder gives the trained model's logits, the adapter
    # folder inside it; both in MLflow, the merged model registered
    tracked = ["tracking.enabled=true", "tracking.model_format=pickle"]
    clean = train(run + tracked, "clean")
    assert clean.steps == 30 and clean.metrics["world_size"] == 2 and clean.metrics["train_loss"] < CHANCE
    state = adapter_weights(workdir / "runs" / "clean")
    assert state and all(".lora_" in name for name in state)
    record = json.loads((workdir / "runs" / "clean" / "run.json").read_text())
    assert set(record["pinned"]) == {"model.options.pretrained"}
    hf = workdir / "runs" / "clean" / "hf"
    trained = load_final_model(config_lib.load(CONFIGS / "llama_stdlib.yaml", run, name="clean").model,
                               Manifest.load(record["dataset"]["root"]),
                               final_checkpoint(None, str(workdir / "runs" / "clean")))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    merged = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    assert (logits(merged, tokens) - logits(trained, tokens)).abs().max().item() < 1e-5
    assert clean.registered_model
    client = mlflow.MlflowClient(clean.tracking_uri)
    assert {a.path for a in client.list_artifacts(clean.mlflow_run_id, "hf/adapter")} == {
        "hf/adapter/adapter_config.json", "hf/adapter/adapter_model.safetensors"}

    # DDP, a worker SIGKILLed mid-run: the adapter bit-identical to the unkilled run's
    kills = []
    killer = threading.Thread(target=kill_a_worker_at_the_first_checkpoint, args=(workdir / "runs" / "chaos", kills),
                              daemon=True)
    killer.start()
    chaotic = train(run, "chaos")
    killer.join(timeout=5)
    assert kills, "no worker was killed"
    assert chaotic.steps == 30 and chaotic.metrics["start_step"] >= 5  # (the group restarted from a checkpoint)
    resumed = adapter_weights(workdir / "runs" / "chaos")
    assert resumed.keys() == state.keys()
    for name in state:
        assert torch.equal(state[name], resumed[name]), f"{name} differs after a killed worker"

    # a changed base: the resumed run is refused by the command, exit 2 naming the option, before Ray starts
    save_llama(folder, seed=7, vocab_size=256, hidden_size=32, intermediate_size=64)
    command = [sys.executable, "-m", "training", str(CONFIGS / "llama_stdlib.yaml"), "--name", "chaos"]
    refused = subprocess.run(command + [arg for override in run for arg in ("--set", override)], capture_output=True,
                             text=True, cwd=workdir, timeout=300)
    assert refused.returncode == 2, refused.stderr
    assert "model.options.pretrained: its files changed since the run started" in refused.stderr
