"""What the service promises holds for the `hf` family too: a sequence classifier started from a base
model's folder under FSDP gets its fresh head drawn from the seed, the same on every rank and at any
world size (2 real gloo processes, no Ray); an HF Llama read from a pretrained folder on S3
(moto_server) under FSDP, its worker SIGKILLed and then its driver, resumed by the same command to
weights bit-identical to an unkilled run's, the folder downloaded once for the node; under
`failure.mode: continue` a killed worker replaced while the survivor trains; and an ASHA sweep over
the LoRA rank and the learning rate of a fine-tune of a pretrained Llama folder, which stops trials
and registers its best trial's merged model with MLflow's transformers flavor (and, run on one of
its stopped trials, the path that registers a stopped best)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from aws import AWS_ENV, free_port
from conftest import CONFIGS, train_worker_pids, wait_for

from training import config as config_lib
from training.models.hf_load import load_sharded
from training.run.driver import run_training

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=64, pad_token_id=0)
TOKENS = (torch.arange(1, 25).reshape(2, 12) * 7) % 255 + 1  # (no pad id: every token is real)


# --- a fresh classification head under FSDP (no Ray) -----------------------------------------------

def save_without_head(root: Path) -> dict[str, Path]:
    """A base model's folder (LlamaModel: no `model.` prefix, no head) and a causal LM's (a head, but
    not a classifier's)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY)
    folders = {"base": root / "base", "causal_lm": root / "causal_lm"}
    transformers.LlamaModel(config).save_pretrained(folders["base"])
    transformers.LlamaForCausalLM(config).save_pretrained(folders["causal_lm"])
    return folders


def sharded_classifier(folder: str, seed: int):
    """As a worker builds it under FSDP: on the meta device, sharded, storage given (garbage: NaN
    here), the seed set, then its shards read."""
    from torch.distributed.fsdp import fully_shard

    config = transformers.AutoConfig.from_pretrained(folder, num_labels=3)
    with torch.device("meta"):
        model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    if torch.distributed.is_initialized():
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    torch.manual_seed(seed)
    torch.rand(7)  # (draws between the seed and the load, as a worker's may: the head does not depend on them)
    load_sharded(model, folder)
    return model


def _classifier_worker(rank: int, world: int, port: int, folders: list[str], out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    found = {}
    for folder in folders:
        model = sharded_classifier(folder, seed=11)
        head = model.score.weight
        found[folder] = {"head": head.full_tensor(), "sharded": head.to_local().shape[0] < 3}
        with torch.no_grad():
            found[folder]["logits"] = model(input_ids=TOKENS).logits
    torch.save(found, f"{out}.{rank}")
    dist.destroy_process_group()


def test_a_fresh_head_under_fsdp_is_drawn_from_the_seed_alike_on_every_rank_and_world_size(tmp_path):
    folders = save_without_head(tmp_path)
    out = tmp_path / "found"
    torch.multiprocessing.spawn(_classifier_worker, args=(2, free_port(), [str(f) for f in folders.values()],
                                                          str(out)), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]
    for name, folder in folders.items():
        zero, one = ranks[0][str(folder)], ranks[1][str(folder)]
        assert zero["sharded"] and one["sharded"]
        assert torch.equal(zero["head"], one["head"]), f"{name}: the ranks drew different heads"
        head = zero["head"]
        assert torch.isfinite(head).all() and 0.01 < head.std().item() < 0.04  # initializer_range 0.02
        # one process, the same seed: the same head (not a function of the world size)
        alone = sharded_classifier(str(folder), seed=11)
        assert torch.equal(alone.score.weight.detach(), head)
        assert not torch.equal(sharded_classifier(str(folder), seed=12).score.weight.detach(), head)
        # the base read from the folder: logits of from_pretrained's model given the same head
        plain = transformers.AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3,
                                                                                dtype=torch.float32)
        with torch.no_grad():
            plain.score.weight.copy_(head)
            expected = plain(input_ids=TOKENS).logits
        torch.testing.assert_close(zero["logits"], expected, rtol=0, atol=1e-5)


# --- on Ray -------------------------------------------------------------------------------------------

LLAMA = CONFIGS / "llama_stdlib.yaml"
# A tiny Llama on the byte-level tinylm source (vocab 256).
TINY_RUN = ["data.source=tinylm", "data.options={seq_len: 32, max_bytes: 60000}", "train.global_batch_size=16",
            "train.log_every_n_steps=5", "train.min_report_interval_s=0", "tracking.enabled=false",
            "checkpoint.keep=1"]
INLINE = ("model.options.config={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
          "num_attention_heads: 4, num_key_value_heads: 2, tie_word_embeddings: true}")


def newest_checkpoint(run_dir: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in run_dir.glob("checkpoint-*") if (p / "meta.json").exists()]
    return max(steps, default=-1)


def hf_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "hf" / "model.safetensors")  # (written at the run's end from its last checkpoint)


@pytest.mark.ray
@pytest.mark.chaos
@pytest.mark.slow
def test_fsdp_from_s3_survives_a_killed_worker_and_driver_bit_identically(tmp_path, monkeypatch):
    """FSDP, pretrained weights on S3: an unkilled run, and the same run whose worker is SIGKILLed
    after its first checkpoint and whose driver is SIGKILLed after the restart's checkpoint, then run
    again with the same command: bit-identical final weights; every process of the node (the
    drivers' checks, each worker group) read the weights from one download."""
    import ray
    from test_hf_load import gets, recorded_moto, upload

    torch.manual_seed(3)
    folder = tmp_path / "pretrained"
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True)).save_pretrained(folder)
    monkeypatch.setenv("TRAINING_BASE_DIR", str(tmp_path))
    monkeypatch.setenv("TRAINING_HF_CACHE", str(tmp_path / "node-cache"))
    monkeypatch.chdir(tmp_path)
    with recorded_moto(tmp_path) as (endpoint, log):
        for key, value in {**AWS_ENV, "AWS_ENDPOINT_URL": endpoint}.items():
            monkeypatch.setenv(key, value)
        uri = upload(folder, endpoint, "pretrained-holds", "llama")
        steps = 60
        run = TINY_RUN + [f"model.options={{pretrained: {uri}}}", "parallel.strategy=fsdp", f"train.max_steps={steps}",
                          "checkpoint.every_n_steps=10", "train.eval_every_n_steps=30", "failure.max_failures=3"]
        if ray.is_initialized():
            ray.shutdown()
        context = ray.init(address="local", num_cpus=2)  # started here: its workers see the endpoint and the cache
        try:
            clean = run_training(config_lib.load(LLAMA, run, name="clean"), log=print)
            assert clean.steps == steps and clean.metrics["world_size"] == 2

            command = [sys.executable, "-m", "training", str(LLAMA), "--name", "chaos"]
            for override in run:
                command += ["--set", override]
            env = {**os.environ, "RAY_ADDRESS": context.address_info["gcs_address"]}
            chaos_dir, out = tmp_path / "runs" / "chaos", open(tmp_path / "first.log", "w")
            first = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
            try:
                wait_for(lambda: newest_checkpoint(chaos_dir) >= 10 or first.poll() is not None, 240,
                         "a first checkpoint")
                victims = train_worker_pids()
                assert first.poll() is None and len(victims) == 2, (tmp_path / "first.log").read_text()[-3000:]
                killed_worker_at = newest_checkpoint(chaos_dir)
                os.kill(victims[-1], signal.SIGKILL)
                # the group restarted (new workers) and checkpointed again: now the driver
                wait_for(lambda: (newest_checkpoint(chaos_dir) > killed_worker_at and not set(train_worker_pids())
                                  & set(victims)) or first.poll() is not None, 240, "a checkpoint after the restart")
                assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
                os.killpg(first.pid, signal.SIGKILL)
                first.wait(timeout=30)
            finally:
                if first.poll() is None:
                    os.killpg(first.pid, signal.SIGKILL)
            killed_driver_at = newest_checkpoint(chaos_dir)
            assert killed_worker_at < killed_driver_at < steps
            again = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
            output = again.stdout + again.stderr
            assert again.returncode == 0, output[-4000:]
            assert "run chaos: resuming" in output and f"run chaos finished: {steps} steps" in output
        finally:
            ray.shutdown()
        weights = gets(log, "model.safetensors")
    print(f"worker killed at step {killed_worker_at}, driver at {killed_driver_at}")
    expected, actual = hf_weights(tmp_path / "runs" / "clean"), hf_weights(chaos_dir)
    assert expected.keys() == actual.keys() and "model.layers.1.mlp.down_proj.weight" in expected
    for name in expected:
        assert torch.equal(expected[name], actual[name]), f"{name} differs after a killed worker and driver"
    assert len(weights) == 1, f"the pretrained weights were downloaded {len(weights)} times on one node"


@pytest.mark.chaos
@pytest.mark.slow
def test_continue_mode_replaces_a_killed_worker_of_an_hf_llama_while_the_survivor_trains(ray_cluster, workdir):
    steps = 400
    run = TINY_RUN + [INLINE, "failure.mode=continue", "scaling.cpus_per_worker=0.5", f"train.max_steps={steps}",
                      "checkpoint.every_n_steps=50", "train.eval_every_n_steps=200", "failure.max_failures=3"]
    seen: dict = {"snapshots": []}
    done = threading.Event()

    def chaos():
        try:
            wait_for(lambda: newest_checkpoint(workdir / "runs" / "cont") >= 50, 240, "a first checkpoint")
            victim, survivor = sorted(train_worker_pids())
            os.kill(victim, signal.SIGKILL)
            seen.update(victim=victim, survivor=survivor)
            while not done.is_set():  # every worker process from the kill to the end of the run
                seen["snapshots"].append(set(train_worker_pids()))
                time.sleep(0.1)
        except BaseException as exc:  # reported by the test, not lost in the thread
            seen["error"] = exc

    killer = threading.Thread(target=chaos, daemon=True)
    killer.start()
    try:
        summary = run_training(config_lib.load(LLAMA, run, name="cont"), log=print)
    finally:
        done.set()
        killer.join(timeout=30)

    assert "error" not in seen, seen.get("error")
    snapshots = seen["snapshots"]
    new = set().union(*snapshots) - {seen["victim"], seen["survivor"]}
    assert len(new) == 1, f"expected one replacement worker, saw {sorted(new)}"
    joined = next((i for i, pids in enumerate(snapshots) if new <= pids), None)
    assert joined is not None, "the replacement never ran"
    assert all(seen["survivor"] in pids for pids in snapshots[:joined + 1]), "the survivor was replaced too"
    assert summary.steps == steps and summary.metrics["short_steps"] >= 1
    assert summary.metrics["samples_skipped"] >= 8 * summary.metrics["short_steps"]  # (8: half a batch of 16)
    # (train_loss is NaN when the last report's window holds only sync rounds: a replacement that came late)
    assert summary.metrics["val_loss"] == summary.metrics["val_loss"]


def save_pretrained_llama(folder: Path) -> Path:
    """A tiny random Llama as a pretrained folder (vocab 300: the sweep's trained BPE)."""
    torch.manual_seed(1)
    config = transformers.AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def merged_llama(model_uri: str):
    """The registered model as MLflow's transformers flavor loads it: a plain LlamaForCausalLM, the
    adapter merged into its weights and gone."""
    import mlflow.transformers

    model = mlflow.transformers.load_model(model_uri, return_type="components")["model"]
    assert type(model) is transformers.LlamaForCausalLM and not hasattr(model, "peft_config")
    assert not [key for key in model.state_dict() if "lora" in key]
    return model.float().eval()


def llama_logits(model, tokens):
    with torch.no_grad():
        output = model.eval()(tokens)
    return getattr(output, "logits", output)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_asha_over_the_lora_rank_and_lr_of_a_pretrained_llama_stops_trials_and_registers_the_best_merged(
        ray_cluster, workdir):
    """One sweep for both promises: ASHA over model.adapter.r and optim.lr of a LoRA fine-tune stops
    the poor trials at its rung; the best trial's merged model is registered with the transformers
    flavor and gives its adapter's logits. The path a stopped best takes (no logged model: rebuilt
    from the pretrained folder and its adapter checkpoint, merged, logged, registered) is then run on
    a real stopped trial of the same sweep."""
    import mlflow
    import ray.train
    from mlflow.tracking import MlflowClient
    from peft import PeftModel

    from training.run.final_model import load_final_model
    from training.run.hf_export import run_job
    from training.tracking.tracker import MlflowTracker, fluent_mlflow
    from tuning import config as sweep_config
    from tuning.report import register_trial
    from tuning.sweep import run_sweep
    from tuning.trial import TRIAL_TAG

    base = save_pretrained_llama(workdir / "base")
    sets = ["data.options={path: stdlib, max_bytes: 100000, seq_len: 32, validation_fraction: 0.05, "
            "tokenizer: {train: {vocab_size: 300, sample_bytes: 100000}}}", f"model.options={{pretrained: {base}}}",
            "model.adapter={r: 8, alpha: 8}", "optim.warmup_steps=0", "train.max_steps=20",
            "train.eval_every_n_steps=10", "checkpoint.every_n_steps=10", "checkpoint.keep=2",
            "train.log_every_n_steps=10", "train.min_report_interval_s=0", "train.global_batch_size=16",
            "tracking.experiment=hf-sweeps", "failure.max_failures=1"]
    lines = "\n".join(f"  - {s!r}" for s in sets)
    path = workdir / "sweep.yaml"
    # Tune's grid order (by path: the rank varies fastest), two at a time: (8, 0.03) with (4, 0.03), the
    # later of them to the rung stopped if it is worse; then (8, 1e-6) and (4, 1e-6), which learn
    # nothing and meet a rung whose median is a learning trial's: both stopped.
    path.write_text(f"base: {LLAMA}\nset:\n{lines}\ntrial:\n  driver_cpus: 0.25\n"
                    "  scaling: {num_workers: 1, cpus_per_worker: 0.5}\n"
                    "space:\n  optim.lr: {grid: [0.03, 0.000001]}\n  model.adapter.r: {grid: [8, 4]}\n"
                    "metric: val_loss\nmode: min\n"
                    "scheduler: {name: asha, grace_period_steps: 10, reduction_factor: 2}\nnum_samples: 1\n"
                    "max_concurrent_trials: 2\n")
    sweep = sweep_config.load(path, name="lora-asha")
    summary = run_sweep(sweep)

    rows = summary.rows
    assert sorted((r.params["optim.lr"], r.params["model.adapter.r"]) for r in rows) == [
        (0.000001, 4), (0.000001, 8), (0.03, 4), (0.03, 8)] and not [r for r in rows if r.status == "failed"]
    idle = [r for r in rows if r.params["optim.lr"] == 0.000001]
    assert all(r.status == "stopped" and r.steps == 10 for r in idle), rows
    best = summary.best
    assert best.status == "finished" and best.steps == 20 and best.params["optim.lr"] == 0.03

    # the best trial's merged model, registered with the transformers flavor: its adapter's logits
    client = MlflowClient(summary.tracking_uri)
    (version,) = client.search_model_versions("name = 'text-hf'")
    assert version.run_id == best.mlflow_run_id and summary.registered == {"name": "text-hf", "version": "1"}
    with fluent_mlflow(summary.tracking_uri):
        flavor = mlflow.models.get_model_info("models:/text-hf/1").flavors["transformers"]
        merged = merged_llama("models:/text-hf/1")
    assert flavor["task"] == "text-generation" and flavor["pipeline_model_type"] == "LlamaForCausalLM"
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    adapter = workdir / "runs" / best.run / "hf" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == best.params["model.adapter.r"]
    unmerged = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), str(adapter))
    expected = llama_logits(unmerged, tokens)
    assert not torch.equal(expected, llama_logits(transformers.AutoModelForCausalLM.from_pretrained(base), tokens))
    assert (llama_logits(merged, tokens) - expected).abs().max().item() < 1e-5

    # a stopped trial as the best: its model rebuilt from the base and its adapter checkpoint, merged,
    # registered; its run keeps the end time of its last evaluation
    loser = idle[-1]
    job, manifest = run_job(str(workdir / "runs" / loser.run))
    trained = load_final_model(job.model, manifest, ray.train.Checkpoint(loser.checkpoint_path))
    assert trained.peft_config["default"].r == loser.params["model.adapter.r"]
    expected = llama_logits(trained, tokens)
    ended_ms = client.get_run(loser.mlflow_run_id).info.end_time
    registered = register_trial(sweep, job, manifest, loser, MlflowTracker(summary.tracking_uri,
                                                                           summary.parent_run_id))
    assert registered == {"name": "text-hf", "version": "2"}
    assert client.get_model_version("text-hf", "2").tags[TRIAL_TAG] == loser.trial_id
    with fluent_mlflow(summary.tracking_uri):
        merged = merged_llama("models:/text-hf/2")
    assert (llama_logits(merged, tokens) - expected).abs().max().item() < 1e-5
    run = client.get_run(loser.mlflow_run_id).info
    assert run.status == "FINISHED" and run.end_time == ended_ms
