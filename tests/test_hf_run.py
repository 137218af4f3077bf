"""The `hf` family on a local Ray cluster: the shipped llama_stdlib.yaml trains for a few steps; a tiny
HF Llama under DDP with a worker SIGKILLed mid-run ends with weights bit-identical to an
uninterrupted run; and a few FSDP steps whose sharded checkpoint holds the transformers names."""

import json
import os
import signal
import threading
import time

import pytest
import torch
from conftest import CONFIGS, train_worker_pids, wait_for

from training import config as config_lib
from training.checkpoint import format as ckpt
from training.run.driver import run_training

pytestmark = pytest.mark.ray

# A tiny Llama from an inline config on the byte-level tinylm source (vocab 256, from the data).
TINY_LLAMA = ["data.source=tinylm", "data.options={seq_len: 32, max_bytes: 60000}",
              "model.options.config={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
              "num_attention_heads: 4, num_key_value_heads: 2, tie_word_embeddings: true}",
              "train.global_batch_size=16", "train.log_every_n_steps=5", "train.min_report_interval_s=0",
              "tracking.enabled=false", "checkpoint.keep=1"]


def final_weights(run_dir):
    return ckpt.load(sorted(run_dir.glob("checkpoint-*"))[-1])["model"]


def test_llama_stdlib_trains_on_the_standard_library_with_a_trained_bpe(ray_cluster, workdir):
    overrides = ["train.max_steps=20", "train.eval_every_n_steps=20", "checkpoint.every_n_steps=20",
                 "data.options.max_bytes=300000", "data.options.tokenizer.train.sample_bytes=300000",
                 "data.options.tokenizer.train.vocab_size=512", "data.options.partitions=2", "failure.max_failures=0",
                 "tracking.register_model=false"]
    job = config_lib.load(CONFIGS / "llama_stdlib.yaml", overrides, name="llama-stdlib")
    summary = run_training(job, log=print)
    assert summary.steps == 20 and summary.metrics["world_size"] == 2
    assert summary.metrics["val_perplexity"] < 512 and summary.metrics["tokens_per_s"] > 0  # better than uniform
    assert summary.metrics["train_loss"] < 6.24  # below ln(512): it learned
    state = final_weights(workdir / "runs" / "llama-stdlib")
    assert state["model.embed_tokens.weight"].shape == (512, 128)  # the tokenizer's vocabulary
    assert "model.layers.1.mlp.down_proj.weight" in state  # transformers' own names


@pytest.mark.chaos
@pytest.mark.slow
def test_a_killed_worker_resumes_an_hf_llama_to_bit_identical_weights(ray_cluster, workdir):
    run = TINY_LLAMA + ["train.max_steps=120", "checkpoint.every_n_steps=20", "train.eval_every_n_steps=40",
                        "failure.max_failures=3"]
    clean = run_training(config_lib.load(CONFIGS / "llama_stdlib.yaml", run, name="clean"), log=print)

    kills = []

    def kill_one_after_the_first_checkpoint():
        wait_for(lambda: list((workdir / "runs" / "chaos").glob("checkpoint-*")), 240, "a first checkpoint")
        time.sleep(0.5)
        pids = train_worker_pids()
        if pids:
            os.kill(pids[-1], signal.SIGKILL)
            kills.append(pids[-1])

    killer = threading.Thread(target=kill_one_after_the_first_checkpoint, daemon=True)
    killer.start()
    chaotic = run_training(config_lib.load(CONFIGS / "llama_stdlib.yaml", run, name="chaos"), log=print)
    killer.join(timeout=5)

    assert kills, "no worker was killed"
    assert chaotic.steps == clean.steps == 120
    expected, actual = final_weights(workdir / "runs" / "clean"), final_weights(workdir / "runs" / "chaos")
    assert expected.keys() == actual.keys() and "lm_head.weight" in expected  # (tied: one tensor, both names)
    for name in expected:
        assert torch.equal(expected[name], actual[name]), f"{name} differs after a killed worker"


@pytest.mark.slow
def test_fsdp_shards_the_llama_layers_and_resumes_at_another_world_size(ray_cluster, workdir):
    run = TINY_LLAMA + ["parallel.strategy=fsdp", "checkpoint.every_n_steps=10", "train.eval_every_n_steps=10"]
    first = run_training(config_lib.load(CONFIGS / "llama_stdlib.yaml", run + ["train.max_steps=10"], name="fsdp"),
                         log=print)
    assert first.steps == 10 and first.metrics["world_size"] == 2
    (checkpoint,) = (workdir / "runs" / "fsdp").glob("checkpoint-*")
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["layout"] == "sharded" and {"__0_0.distcp", "__1_0.distcp"} <= set(meta["files"])
    resumed = run_training(config_lib.load(CONFIGS / "llama_stdlib.yaml", run + [
        "train.max_steps=14", "scaling.num_workers=1"], name="fsdp"), log=print)
    assert resumed.resumed and resumed.steps == 14 and resumed.metrics["start_step"] == 10


@pytest.mark.slow
def test_a_pretrained_llama_is_read_in_shards_under_fsdp_and_trains_as_under_ddp(ray_cluster, workdir):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = workdir / "pretrained"
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(
        model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True)).save_pretrained(folder)
    run = TINY_LLAMA + [f"model.options={{pretrained: {folder}}}", "train.max_steps=4", "train.eval_every_n_steps=4",
                        "checkpoint.every_n_steps=4", "train.log_every_n_steps=1"]
    ddp = run_training(config_lib.load(CONFIGS / "llama_stdlib.yaml", run, name="ddp"), log=print)
    fsdp = run_training(config_lib.load(CONFIGS / "llama_stdlib.yaml", run + ["parallel.strategy=fsdp"], name="fsdp"),
                        log=print)
    # The same weights to start from (a model built on the meta device, sharded, each worker reading its
    # shards) and the same batches: the same losses, up to the order of float sums.
    assert abs(fsdp.metrics["val_loss"] - ddp.metrics["val_loss"]) < 1e-4 * ddp.metrics["val_loss"]
    assert fsdp.metrics["val_loss"] < 5.5  # below ln(256): it learned
