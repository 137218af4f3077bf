"""FSDP2 (parallel.strategy: fsdp): config, model sizes and FLOPs, sharded checkpoints (complete
only when every shard landed, resumable at another world size), ONNX export; then real runs on a
local Ray cluster: FSDP's loss curve against DDP's, and a resume at another world size."""

import json

import pytest
import torch
import torch.utils.checkpoint
from conftest import CONFIGS

from training import config as config_lib
from training import storage
from training.checkpoint import format as ckpt
from training.errors import ConfigError
from training.models.gpt import FAMILY as GPT_FAMILY
from training.models.gpt import PRESETS, GPTOptions
from training.models.gpt_nn import GPT
from training.worker.parallel import peak_flops_of, peak_flops_per_s

TINY = ["data.options={seq_len: 32, max_bytes: 60000}", "model.options={n_layer: 1, n_head: 2, d_model: 32}"]


# --- config ---------------------------------------------------------------------------------------

def test_parallel_section_is_typed_and_strict():
    job = config_lib.load(CONFIGS / "tinylm.yaml", ["parallel.strategy=fsdp", "parallel.activation_checkpointing=true"])
    assert job.parallel.strategy == "fsdp" and job.parallel.mixed_precision == "auto"
    assert config_lib.load(CONFIGS / "tinylm.yaml").parallel.strategy == "ddp"  # the default is unchanged
    for override, expected in [("parallel.strategy=zero3", "parallel.strategy: must be 'ddp' or 'fsdp'"),
                               ("parallel.shard=true",
                                "parallel.shard: unknown key; allowed: activation_checkpointing"),
                               ("parallel.mixed_precision=fp16", "parallel.mixed_precision"),
                               ("parallel.cpu_offload=true", "parallel.cpu_offload needs parallel.strategy: fsdp"),
                               ("model.options={preset: huge}", "model.options.preset"),
                               ("train.compile=maybe", "train.compile")]:
        with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
            config_lib.load(CONFIGS / "tinylm.yaml", [override])


def test_bad_parallel_config_exits_2_naming_the_field(capsys):
    from training.run.cli import main

    assert main([str(CONFIGS / "tinylm.yaml"), "--set", "parallel.strategy=zero3"]) == 2
    assert "parallel.strategy" in capsys.readouterr().err


# --- model sizes, FLOPs, peak ---------------------------------------------------------------------

def gpt_num_params(vocab_size: int, seq_len: int, options: GPTOptions) -> int:
    """Parameters of GPT(vocab_size, seq_len, options) from the architecture alone."""
    d, n = options.d_model, options.n_layer
    per_block = 12 * d * d + 13 * d  # qkv, proj, two MLP matrices with biases, two LayerNorms
    return vocab_size * d + seq_len * d + n * per_block + 2 * d  # tied head, positions, final LayerNorm


def test_presets_span_a_laptop_to_a_gpu():
    counts = {}
    for preset in PRESETS:
        options = GPTOptions(preset=preset)
        with torch.device("meta"):
            model = GPT(256, 256, options)
        counts[preset] = model.num_params()
        assert counts[preset] == gpt_num_params(256, 256, options)  # the formula matches the module
    assert 2e5 < counts["tiny"] < 1e6 and 1e7 < counts["small"] < 3e7 and counts["base"] > 1e8
    # Explicit options override a preset's.
    assert GPTOptions.model_validate({"preset": "small", "n_layer": 2}).n_layer == 2
    assert GPTOptions.model_validate({"preset": "small"}).d_model == 512


def test_flops_per_token_formula():
    options = GPTOptions(n_layer=2, n_head=4, d_model=128)
    model = GPT(256, 64, options)
    weights = sum(p.numel() for p in model.parameters()) - 64 * 128  # position embeddings are lookups
    assert model.flops_per_token() == 6 * weights + 12 * 2 * 128 * 64
    # Dominated by 6 * parameters for a wide model with a short context.
    big = GPT(256, 16, GPTOptions(n_layer=2, n_head=4, d_model=512))
    assert abs(big.flops_per_token() / (6 * big.num_params()) - 1) < 0.01


def test_peak_flops_table():
    assert peak_flops_per_s(torch.device("cpu")) is None
    assert peak_flops_of("NVIDIA H200") == peak_flops_of("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_of("NVIDIA A100-SXM4-80GB") == 312e12 and peak_flops_of("NVIDIA A10G") == 125e12
    assert peak_flops_of("NVIDIA L4") == 121e12 and peak_flops_of("NVIDIA L40S") == 362e12
    assert peak_flops_of("Some Future GPU") is None


# --- sharded checkpoints, in one process -----------------------------------------------------------

def _sharded_checkpoint(directory):
    torch.manual_seed(0)
    model = GPT(256, 16, GPTOptions(n_layer=1, n_head=2, d_model=16))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    optimizer.step()
    ckpt.save_sharded(directory, model=model, optimizer=optimizer, scheduler_state={}, loop=ckpt.LoopState(step=7),
                      config={"seed": 0}, steps_per_epoch=5, world_size=1, metrics={"val_loss": 1.0})
    return model


def test_a_sharded_checkpoint_is_complete_only_with_every_file_at_its_size(tmp_path):
    import pyarrow.fs as pafs

    fs = pafs.LocalFileSystem()
    directory = tmp_path / "checkpoint-00000007"
    directory.mkdir()
    model = _sharded_checkpoint(directory)
    meta = json.loads((directory / "meta.json").read_text())
    assert meta["layout"] == "sharded" and {".metadata", "__0_0.distcp", "train_state.pt"} <= set(meta["files"])
    assert ckpt.is_complete(fs, str(directory))
    state = ckpt.load_model_state(directory, GPT(256, 16, GPTOptions(n_layer=1, n_head=2, d_model=16)))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # consolidated, exact

    shard = directory / "__0_0.distcp"
    whole = shard.read_bytes()
    shard.write_bytes(whole[:-1])  # an upload cut short
    assert not ckpt.is_complete(fs, str(directory))
    shard.unlink()  # another worker's shard not there yet
    assert not ckpt.is_complete(fs, str(directory))
    shard.write_bytes(whole)
    assert ckpt.is_complete(fs, str(directory))
    (directory / "meta.json").unlink()  # rank 0 not done
    assert not ckpt.is_complete(fs, str(directory))
    assert ckpt.newest_complete(fs, str(tmp_path)) is None
    # The one-file format is still read and judged as before.
    full = tmp_path / "checkpoint-00000003"
    full.mkdir()
    ckpt.save(full, model_state=model.state_dict(), optimizer_state={}, scheduler_state={}, loop=ckpt.LoopState(step=3),
              config={"seed": 0}, steps_per_epoch=5, world_size=1, metrics={})
    assert ckpt.newest_complete(fs, str(tmp_path)) == (3, str(full))
    with pytest.raises(ValueError, match="sharded"):
        ckpt.load(directory)


# --- FSDP2 wrapping, in one process (a gloo group of one) ----------------------------------------

@pytest.fixture
def process_group_of_one():
    import socket

    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _one_step(model, train_model, tokens):
    from training.tasks import logits_of

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logits = logits_of(train_model(tokens[:, :-1]))
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), tokens[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()


def _model_and_blocks(kind: str):
    """The built-in GPT (dropout 0.1) or an HF Llama built by the hf family, and its blocks."""
    from training.models.registry import build_model, family_of, model_section

    if kind == "gpt":
        model = GPT(256, 16, GPTOptions(n_layer=2, n_head=2, d_model=32, dropout=0.1))
        return model, GPT_FAMILY.blocks(model)
    section = model_section({"name": "hf", "options": {"config": {
        "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "intermediate_size": 64}}})
    model = build_model(section, {"task": "language_model", "vocab_size": 256, "seq_len": 16})
    return model, family_of("hf").blocks(model)


@pytest.mark.parametrize("kind", ["gpt", "hf"])
@pytest.mark.parametrize("options", [{"activation_checkpointing": True}, {"mixed_precision": "bf16"}])
def test_fsdp_wrapping_trains_like_the_plain_model(process_group_of_one, options, kind):
    """Activation checkpointing and bf16 apply to an HF model's layers as to the built-in GPT's."""
    from torch.distributed.tensor import DTensor

    from training.config import ParallelConfig
    from training.worker.parallel import wrap

    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    plain, _ = _model_and_blocks(kind)
    torch.manual_seed(1)
    expected_loss = _one_step(plain, plain, tokens)
    torch.manual_seed(0)
    sharded, blocks = _model_and_blocks(kind)
    names = list(sharded.state_dict())
    assert len(blocks) == 2
    assert wrap(sharded, ParallelConfig(strategy="fsdp", **options), torch.device("cpu"), blocks=blocks) is sharded
    assert list(sharded.state_dict()) == names  # checkpoints keep the model's own names
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    recomputed = [getattr(b.forward, "func", None) is torch.utils.checkpoint.checkpoint for b in blocks]
    assert recomputed == [bool(options.get("activation_checkpointing"))] * 2
    assert all(p.dtype == torch.float32 for p in sharded.parameters())  # (bf16: computed in, kept in fp32)
    torch.manual_seed(1)  # the same dropout draws (recomputed ones replay the RNG state)
    loss = _one_step(sharded, sharded, tokens)
    after = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in sharded.state_dict().items()}
    if options.get("mixed_precision") == "bf16":
        assert loss != expected_loss and abs(loss - expected_loss) < 0.05 * expected_loss
    else:
        assert loss == pytest.approx(expected_loss, rel=1e-6)
        for name, tensor in plain.state_dict().items():
            torch.testing.assert_close(after[name], tensor, rtol=1e-5, atol=1e-6)


# --- ONNX -----------------------------------------------------------------------------------------

def test_onnx_export_round_trips(tmp_path):
    from training.models.registry import build_model, model_section
    from training.run.export import export_onnx

    gpt = build_model(model_section({"name": "gpt", "options": {"n_layer": 1, "n_head": 2, "d_model": 32}}),
                      {"task": "language_model", "vocab_size": 256, "seq_len": 32})
    result = export_onnx(gpt, torch.randint(0, 256, (3, 32)), tmp_path / "gpt.onnx")
    assert result["onnx_max_abs_diff"] < 1e-3 and result["onnx_bytes"] > 0
    mlp = build_model(model_section({"name": "digits_mlp"}),
                      {"task": "classification", "input_dim": 64, "num_classes": 10})
    assert export_onnx(mlp, torch.rand(4, 64), tmp_path / "mlp.onnx")["onnx_max_abs_diff"] < 1e-3

    class Drifting(torch.nn.Module):  # traced once, a constant in ONNX; PyTorch's answer moves on
        calls = 0

        def forward(self, x):
            self.calls += 1
            return x * self.calls

    with pytest.raises(ValueError, match="differs from PyTorch"):
        export_onnx(Drifting(), torch.rand(2, 3), tmp_path / "drifting.onnx")


# --- memory ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_fsdp_halves_parameter_and_optimizer_memory_at_two_workers():
    from bench.memory import memory

    row = memory(quick=True)
    assert row["ddp_bytes_per_worker"] > 0
    assert 0.49 < row["fsdp_vs_ddp_ratio"] < 0.52, row


# --- real runs on a local Ray cluster --------------------------------------------------------------

RUN = TINY + ["train.max_steps=20", "train.global_batch_size=16", "train.eval_every_n_steps=10",
              "checkpoint.every_n_steps=10", "train.log_every_n_steps=2", "train.min_report_interval_s=0",
              "tracking.register_model=false", "checkpoint.keep=2"]


def _history(workdir, run_id, key="train_loss"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}, client


def _full_state_at(checkpoint_dir, workers: int, out) -> None:
    """Load a sharded checkpoint into an FSDP-sharded model on `workers` workers, then write the
    model's full state as the workers hold it (gathered from their shards). 2 workers: Ray Train
    workers; 1: this process in a gloo group of its own (the same load at world size 1, without
    starting a worker group)."""
    import ray.train
    from ray.train.torch import TorchTrainer

    def load_and_gather(config, rank=None):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from training.config import ParallelConfig
        from training.models.gpt import FAMILY, GPTOptions
        from training.models.gpt_nn import GPT
        from training.worker.parallel import wrap

        torch.manual_seed(123)  # weights unlike the checkpoint's: loading must replace every one
        model = GPT(256, 32, GPTOptions(n_layer=1, n_head=2, d_model=32))
        wrap(model, ParallelConfig(strategy="fsdp"), torch.device("cpu"), blocks=FAMILY.blocks(model))
        optimizer = torch.optim.AdamW(model.parameters())
        state = ckpt.load_sharded(config["dir"], model, optimizer)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if (ray.train.get_context().get_world_rank() if rank is None else rank) == 0:
            torch.save({"model": full, "step": state["loop"].step,
                        "optimizer_steps": [int(s["step"]) for s in optimizer.state.values()]}, config["out"])

    config = {"dir": str(checkpoint_dir), "out": str(out)}
    if workers == 1:
        import socket

        import torch.distributed as dist

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        try:
            load_and_gather(config, rank=0)
        finally:
            dist.destroy_process_group()
        return
    TorchTrainer(load_and_gather, train_loop_config=config,
                 scaling_config=ray.train.ScalingConfig(num_workers=workers),
                 run_config=ray.train.RunConfig(name=f"gather-{workers}", storage_path=str(out.parent / "ray"))).fit()


@pytest.mark.ray
@pytest.mark.slow
def test_fsdp_matches_ddp_and_its_sharded_checkpoints_resume_at_another_world_size(ray_cluster, workdir):
    from training.run.driver import run_training

    ddp = run_training(config_lib.load(CONFIGS / "tinylm.yaml", RUN, name="ddp"), log=print)
    fsdp = run_training(config_lib.load(CONFIGS / "tinylm.yaml",
                                        RUN + ["parallel.strategy=fsdp", "checkpoint.upload=async"], name="fsdp"),
                        log=print)

    # The same seed and global batch: the same loss curve (only the order of float sums differs).
    ddp_curve, client = _history(workdir, ddp.mlflow_run_id)
    fsdp_curve, _ = _history(workdir, fsdp.mlflow_run_id)
    assert sorted(ddp_curve) == sorted(fsdp_curve) and len(ddp_curve) == 10
    worst = max(abs(ddp_curve[s] - fsdp_curve[s]) / ddp_curve[s] for s in ddp_curve)
    print(f"FSDP vs DDP train_loss: largest relative difference {worst:.2e} over {len(ddp_curve)} points")
    assert worst < 1e-3
    assert ddp_curve[20] < ddp_curve[2]  # and it learned

    # Every checkpoint left by the asynchronous uploads is complete, with both workers' shards.
    run_dir = workdir / "runs" / "fsdp"
    fs, _ = storage.filesystem(str(run_dir))
    checkpoints = sorted(run_dir.glob("checkpoint-*"))
    assert [c.name for c in checkpoints] == ["checkpoint-00000010", "checkpoint-00000020"]
    for directory in checkpoints:
        meta = json.loads((directory / "meta.json").read_text())
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "train_state.pt"} <= set(meta["files"])
        assert meta["world_size"] == 2 and ckpt.is_complete(fs, str(directory))

    # The final model, consolidated from the shards, is logged to MLflow and exported to ONNX.
    assert fsdp.extra["onnx_exported"] is True and fsdp.extra["onnx_max_abs_diff"] < 1e-3
    assert {a.path for a in client.list_artifacts(fsdp.mlflow_run_id, "onnx")} == {"onnx/model.onnx"}
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    logged = mlflow.pytorch.load_model(fsdp.extra["model_uri"])
    consolidated = ckpt.load_model_state(checkpoints[-1], GPT(256, 32, GPTOptions(n_layer=1, n_head=2, d_model=32)))
    assert all(torch.equal(logged.state_dict()[k], v) for k, v in consolidated.items())

    # Written by 2 workers, loaded by 1 and by 2: the same model, exactly, and the optimizer's step.
    for workers in (1, 2):
        out = workdir / f"gathered-{workers}.pt"
        _full_state_at(checkpoints[-1], workers, out)
        gathered = torch.load(out, weights_only=True)
        assert gathered["step"] == 20 and set(gathered["optimizer_steps"]) == {20}
        assert gathered["model"].keys() == consolidated.keys()
        for name, tensor in consolidated.items():
            assert torch.equal(gathered["model"][name], tensor), f"{name} differs at {workers} worker(s)"

    # The run itself continues at world size 1 from its sharded checkpoint, in the same MLflow run.
    resumed = run_training(config_lib.load(CONFIGS / "tinylm.yaml", RUN + [
        "parallel.strategy=fsdp", "scaling.num_workers=1", "train.max_steps=24"], name="fsdp"), log=print)
    assert resumed.resumed and resumed.steps == 24 and resumed.metrics["start_step"] == 20
    assert resumed.metrics["world_size"] == 1
