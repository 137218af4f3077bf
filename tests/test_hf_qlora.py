"""QLoRA (`model.adapter.kind: qlora`, training/models/hf_adapter.py) where no GPU is: the refusals,
before Ray starts, naming what is missing and the options that cannot go together; the 4-bit
quantization the workers pass to from_pretrained; a worker without CUDA refusing; and the final model
a qlora run's driver and exports build: the adapter over the base read unquantized on the CPU, merged
there, never into 4-bit weights.

Covered here without CUDA: every decision (what is refused, what from_pretrained is given, where),
the export's model and merge (the lora path's, which a qlora run's final model takes), `merged_copy`
(the guard that merges a model whose base is 4-bit into a copy read again from its folder) run over a
plain base, and the quantization state a checkpoint leaves out. Not covered here: bitsandbytes' 4-bit
load, peft's k-bit preparation of it, DDP training over it and its checkpoint; bench/gpu_check.sh's
`qlora` part runs those on a GPU (a few steps, the export, the merged folder loaded)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.config import validate
from training.errors import ConfigError, UserError
from training.models import hf_adapter
from training.models.registry import build_model, model_section

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300}
SPEC = {"task": "language_model", "vocab_size": 300, "seq_len": 16}
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals are for a machine without CUDA")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("llama") / "base"
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA)).save_pretrained(folder)
    return folder


def adapted(folder, **adapter):
    return model_section({"name": "hf", "options": {"pretrained": str(folder)}, "adapter": {"r": 4, **adapter}})


@no_gpu
def test_qlora_without_cuda_is_refused_by_the_drivers_check_naming_all_that_is_missing(base):
    from training.run.preflight import check_model_builds

    spec = {k: v for k, v in SPEC.items() if k != "task"}
    with pytest.raises(UserError, match="^model.adapter.kind: qlora keeps the base in 4 bits with bitsandbytes, "
                                        "which needs a CUDA GPU"):
        check_model_builds(adapted(base, kind="qlora"), "language_model", spec)
    # what each machine lacks, all of it named at once
    assert hf_adapter.qlora_problem(cuda=False, bitsandbytes=False).endswith(
        "which needs a CUDA GPU and the bitsandbytes package; this machine lacks both: pip install bitsandbytes, "
        "or use kind: lora")
    assert hf_adapter.qlora_problem(cuda=False, bitsandbytes=True).endswith(
        "which needs a CUDA GPU; this machine lacks it: use kind: lora")
    assert hf_adapter.qlora_problem(cuda=True, bitsandbytes=False).endswith(
        "which needs the bitsandbytes package; this machine lacks it: pip install bitsandbytes, or use kind: lora")
    assert hf_adapter.qlora_problem(cuda=True, bitsandbytes=True) is None


def job(base, **sections):
    return {"model": {"name": "hf", "options": {"pretrained": str(base)}, "adapter": {"kind": "qlora"}},
            "data": {"source": "tinylm"}, **sections}


def test_qlora_with_fsdp_or_without_gpus_is_refused_by_the_config_naming_both_options(base):
    with pytest.raises(ConfigError, match=r"model.adapter.kind: qlora \(a 4-bit base\) trains with "
                                          r"parallel.strategy: ddp, not fsdp; use parallel.strategy: ddp, or "
                                          r"model.adapter.kind: lora"):
        validate(job(base, parallel={"strategy": "fsdp"}))
    with pytest.raises(ConfigError, match="model.adapter.kind: qlora loads the 4-bit base onto each worker's GPU, "
                                          "and scaling.use_gpu is false"):
        validate(job(base, scaling={"use_gpu": False}))
    for fine in ({"parallel": {"strategy": "ddp"}, "scaling": {"use_gpu": True}}, {}):  # (use_gpu auto: GPUs if any)
        assert validate(job(base, **fine)).model.adapter.kind == "qlora"
    lora = job(base, parallel={"strategy": "fsdp"}, scaling={"use_gpu": False})
    lora["model"]["adapter"]["kind"] = "lora"
    assert validate(lora).parallel.strategy == "fsdp"


def test_the_workers_load_the_base_as_nf4_with_double_quantization_and_bf16_compute():
    from transformers import BitsAndBytesConfig

    kwargs = hf_adapter.quantized_load(3)
    assert kwargs["device_map"] == {"": 3}  # (the worker's own GPU, whole)
    config = kwargs["quantization_config"]
    assert isinstance(config, BitsAndBytesConfig)
    assert (config.load_in_4bit, config.load_in_8bit) == (True, False)
    assert config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant is True
    assert config.bnb_4bit_compute_dtype == torch.bfloat16
    # what a lora adapter, no adapter, the driver's meta-device check and a lone process (the driver's
    # final model, an export) pass: nothing
    qlora = hf_adapter.AdapterSection(kind="qlora")
    assert hf_adapter.load_kwargs(None) == {} and hf_adapter.load_kwargs(hf_adapter.AdapterSection()) == {}
    assert hf_adapter.load_kwargs(qlora) == {}
    with torch.device("meta"):
        assert hf_adapter.load_kwargs(qlora) == {}


@no_gpu
def test_a_training_worker_without_cuda_refuses_qlora_rather_than_train_a_full_precision_base():
    """A worker is a process of Ray Train's process group (one of gloo here, of this process alone)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(UserError, match="model.adapter.kind: qlora .* which needs a CUDA GPU"):
            hf_adapter.load_kwargs(hf_adapter.AdapterSection(kind="qlora"))
        assert hf_adapter.load_kwargs(hf_adapter.AdapterSection()) == {}
    finally:
        dist.destroy_process_group()


def test_a_checkpoint_of_a_4bit_model_leaves_out_the_quantization_state_of_its_frozen_weights():
    """The names bitsandbytes (0.45) gives a 4-bit weight's state in a state dict: left out, as the
    frozen weight itself is (training/checkpoint/format.py), the adapter's and the norms' kept."""
    weight = "model.layers.0.self_attn.q_proj.base_layer.weight"
    keys = [weight, *(f"{weight}.{k}" for k in ("absmax", "quant_map", "nested_absmax", "nested_quant_map",
                                                  "quant_state.bitsandbytes__nf4")),
            "model.layers.0.self_attn.q_proj.lora_A.default.weight", "model.layers.0.input_layernorm.weight",
            "model.layers.0.self_attn.q_proj.base_layer.weightless"]
    assert hf_adapter.quant_state_keys(keys, [weight]) == keys[1:6]
    assert hf_adapter.quant_state_keys(keys, []) == []


def test_a_qlora_runs_final_model_is_its_adapter_over_the_full_precision_base(base):
    """What the driver and an export build outside the workers (training/run/final_model.py), with
    CUDA or without: no 4-bit load, no refusal; the lora adapter's model and names, into which the
    checkpoint (the adapter alone) loads, then merged by the lora path."""
    torch.manual_seed(0)
    qlora = build_model(adapted(base, kind="qlora"), SPEC)
    torch.manual_seed(0)
    lora = build_model(adapted(base), SPEC)
    assert not hf_adapter.is_quantized(qlora)
    assert {n: p.dtype for n, p in qlora.state_dict().items()} == {n: p.dtype for n, p in lora.state_dict().items()}
    assert all(torch.equal(qlora.state_dict()[n], t) for n, t in lora.state_dict().items())


def test_merged_copy_merges_the_adapter_into_the_base_read_again_in_full_precision(base):
    torch.manual_seed(0)
    model = build_model(adapted(base, bias="lora_only"), SPEC)
    with torch.no_grad():  # a trained adapter: B no longer zero, a bias moved
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(5))
    vars(model).pop("forward")  # (the class's forward, as the export calls it)
    with torch.no_grad():
        adapted_logits = model.eval()(tokens).logits
    merged = hf_adapter.merged_copy(model)
    assert hf_adapter.has_adapter(model) and hf_adapter.lora_layers(model)  # (the trained model left as it was)
    assert not hf_adapter.has_adapter(merged) and not hf_adapter.lora_layers(merged)
    assert merged is not model and next(merged.parameters()).device.type == "cpu"
    assert {p.dtype for p in merged.parameters()} == {torch.float32}
    assert not any(".lora_" in n or ".base_layer." in n for n in merged.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, adapted_logits, rtol=1e-5, atol=1e-5)


def gpu_check(*args):
    return subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_gpu_check_has_a_qlora_part_and_refuses_it_without_a_gpu():
    shown = gpu_check("--help")
    assert shown.returncode == 0 and "qlora    QLoRA on 1 GPU" in shown.stdout
    assert "a subset of tinylm,llama1b,vllm,qlora (default: all four" in shown.stdout
    for args, message in [(["--cpu", "--only", "qlora"], "--cpu runs only the vllm part"),
                          (["--only", "vllm,qlora4"], "--only: unknown part 'qlora4' (parts: tinylm, llama1b, vllm, "
                                                      "qlora)")]:
        refused = gpu_check(*args)
        assert refused.returncode == 2 and message in refused.stderr, (args, refused.stderr)
        assert "nvidia-smi" not in refused.stderr


def test_gpu_check_merged_step_accepts_a_merged_export_and_refuses_a_quantized_or_adapterless_one(base, tmp_path):
    import json
    import shutil

    step = [sys.executable, str(REPO / "bench" / "gpu_check_parts.py"), "merged"]
    folder = tmp_path / "hf"
    shutil.copytree(base, folder)
    no_adapter = subprocess.run([*step, str(folder)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert no_adapter.returncode == 1 and "has no adapter/adapter_config.json" in no_adapter.stderr
    model = build_model(adapted(base), SPEC)
    hf_adapter.save_folder(model, folder / "adapter")
    fine = subprocess.run([*step, str(folder)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert fine.returncode == 0 and "finite logits; adapter folder: adapter_config.json, adapter_model.safetensors" \
        in fine.stdout, fine.stderr
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"load_in_4bit": True}}))
    quantized = subprocess.run([*step, str(folder)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert quantized.returncode == 1 and "merged into a quantized base" in quantized.stderr
    empty = subprocess.run([*step, str(tmp_path / "none")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and "has no config.json" in empty.stderr
