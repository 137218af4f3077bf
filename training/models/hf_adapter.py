"""LoRA adapters for the `hf` family (`model.adapter`), through `peft`: the section (checked on the
driver), and on the workers the adapter put into the transformers model in place, its weights
drawn, the pretrained base's digest, and the adapter folder and merged model an export writes.

    model:
      name: hf
      options: {pretrained: runs/llama/hf}
      adapter: {kind: lora, r: 8, alpha: 16, dropout: 0.05}

The adapter goes into the model in place (`peft.inject_adapter_in_model`), not into a PeftModel
wrapper: the model keeps its class, its forward and its names (`...q_proj.base_layer.weight` for a
base weight, `...q_proj.lora_A.default.weight` for an adapter's), so FSDP's layers, activation
checkpointing and export see the model they know. The base is frozen; a checkpoint holds only what
trains (training/models/family.py `checkpoints_frozen`), the base is read again from its folder, and
its digest, recorded when the run starts, is checked when it resumes (`pinned`).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import math
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional

from pydantic import Field

from training.errors import UserError
from training.schema import Section

if TYPE_CHECKING:  # (types alone: torch is imported where a model is built)
    from torch import nn

    from training.models.hf import HFOptions

# Bounds of a meant rank and scale: the largest LoRA ranks in use are a few hundred; a rank is at
# most a weight's smaller side (checked against the model), a scale alpha / r far above 1 a typo.
MAX_RANK = 4096
MAX_ALPHA = 65536.0
ADAPTER_NAME = "default"  # peft's name of a model's only adapter
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"  # peft's folder
PEFT_PREFIX = "base_model.model."  # what peft's folder puts before a model's own names


class AdapterSection(Section):
    # lora: a low-rank update beside each targeted weight; qlora: the same over a 4-bit base (CUDA).
    kind: Literal["lora", "qlora"] = "lora"
    r: int = Field(8, ge=1, le=MAX_RANK)
    alpha: float = Field(16.0, gt=0, le=MAX_ALPHA)  # the update is scaled by alpha / r
    dropout: float = Field(0.0, ge=0, lt=1)  # on the adapter's input, in training
    # Names of the linear layers to adapt (the last part of a module's name: q_proj, down_proj); left
    # out, every linear layer but the output head: attention's and the MLP's projections.
    target_modules: Optional[list[str]] = Field(None, min_length=1)
    bias: Literal["none", "all", "lora_only"] = "none"  # which biases train as well
    # The export writes the merged model (the update added into the base: a plain transformers
    # folder) beside the adapter folder; false: the adapter folder alone.
    merge: bool = True


def check_fits(adapter: AdapterSection, options: HFOptions) -> None:
    """ValueError (the config's error, naming model.adapter) for an adapter the options cannot take."""
    if options.pretrained is None:
        raise ValueError("an adapter (model.adapter) trains on top of pretrained weights, and model.options.config "
                         "builds random ones; set model.options.pretrained (a folder written by save_pretrained), or "
                         "drop model.adapter to train the whole model")
    if options.task != "causal_lm":
        raise ValueError(f"an adapter (model.adapter) is for model.options.task causal_lm, not {options.task} (whose "
                         "new head would train in full); drop model.adapter to train the whole model")


# --- on the model ---------------------------------------------------------------------------------

def linear_names(model: nn.Module) -> dict[str, tuple[int, int]]:
    """The model's linear layers an adapter may target, by the last part of their names, with the
    smallest (in, out) among those of that name; the output head is not one."""
    from torch import nn  # (lazy: torch)

    head = model.get_output_embeddings()
    found: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not head:
            leaf, sides = name.rsplit(".", 1)[-1], (module.in_features, module.out_features)
            found[leaf] = min(found.get(leaf, sides), sides, key=min)
    return found


def apply(adapter: AdapterSection, model: nn.Module, options: HFOptions) -> None:
    """Put the adapter into `model` (built by hf_nn.build, on a device or on the meta device) in
    place and freeze the rest; UserError naming the option for what the model does not have."""
    from peft import LoraConfig, inject_adapter_in_model  # (lazy: peft imports transformers)

    if adapter.kind == "qlora" and is_meta(model):  # (the driver's check: what the workers will need)
        check_qlora()
    if is_quantized(model):
        prepare_quantized(model)
        if torch_rank() == 0:
            print(quantized_line(model), flush=True)  # (the run's log says the base is 4-bit, once)
    available = linear_names(model)
    targets = list(adapter.target_modules or available)
    missing = [name for name in targets if name not in available]
    if missing:
        raise UserError(f"model.adapter.target_modules: the {model.config.model_type} model has no linear layer "
                        f"named {', '.join(missing)}; its linear layers: {', '.join(sorted(available))}")
    narrowest = min(targets, key=lambda name: min(available[name]))
    if adapter.r > min(available[narrowest]):
        raise UserError(f"model.adapter.r: {adapter.r} is more than the rank of the smallest targeted weight "
                        f"({narrowest}: {available[narrowest][0]} -> {available[narrowest][1]}); use at most "
                        f"{min(available[narrowest])}")
    # (the option as given, not this node's copy of the folder: the adapter folder names its base by
    # it; a Hub id as PEFT and from_pretrained name it, ORG/NAME)
    base = options.pretrained.removeprefix("hf://")
    config = LoraConfig(r=adapter.r, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout, target_modules=targets,
                        bias=adapter.bias, task_type="CAUSAL_LM", base_model_name_or_path=base)
    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)


# --- qlora: the base in 4 bits ----------------------------------------------------------------------

# The 4-bit base as QLoRA's paper and peft's guide load it: NormalFloat4 weights, their scales
# quantized too ("double quant", ~0.4 bit per weight less), matrix multiplies in bf16.
QUANTIZATION = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                "bnb_4bit_compute_dtype": "bfloat16"}


def check_qlora() -> None:
    """UserError naming model.adapter.kind and all that this machine lacks for qlora."""
    import torch  # (lazy: torch)

    problem = qlora_problem(torch.cuda.is_available(), importlib.util.find_spec("bitsandbytes") is not None)
    if problem:
        raise UserError(problem)


def qlora_problem(cuda: bool, bitsandbytes: bool) -> Optional[str]:
    """What a machine with (or without) CUDA and bitsandbytes lacks for qlora, as the error says it."""
    needs = ["a CUDA GPU"] * (not cuda) + ["the bitsandbytes package"] * (not bitsandbytes)
    if not needs:
        return None
    install = "pip install bitsandbytes, or " if not bitsandbytes else ""
    return (f"model.adapter.kind: qlora keeps the base in 4 bits with bitsandbytes, which needs "
            f"{' and '.join(needs)}; this machine lacks {'both' if len(needs) > 1 else 'it'}: {install}use kind: lora")


def qlora_refusal(adapter: Optional[AdapterSection], strategy: str, use_gpu: bool | str) -> Optional[str]:
    """Why the job's other settings cannot train `adapter` (None: they can). The 4-bit base is
    loaded whole onto each worker's GPU (DDP): sharding it with FSDP2 would need its packed weights
    stored in a float dtype and each shard's quantization state kept with it, which is not done here."""
    if adapter is None or adapter.kind != "qlora":
        return None
    if strategy == "fsdp":
        return ("model.adapter.kind: qlora (a 4-bit base) trains with parallel.strategy: ddp, not fsdp; use "
                "parallel.strategy: ddp, or model.adapter.kind: lora to shard the base with fsdp")
    if use_gpu is False:
        return ("model.adapter.kind: qlora loads the 4-bit base onto each worker's GPU, and scaling.use_gpu is "
                "false; set scaling.use_gpu: true (or auto), or use model.adapter.kind: lora")
    return None


def load_kwargs(adapter: Optional[AdapterSection]) -> dict:
    """from_pretrained's extra arguments for `adapter`'s base: for qlora in a training worker (a
    process of Ray Train's process group), the 4-bit quantization onto the worker's GPU (its current
    device, which Ray Train sets); {} otherwise. A lone process (the driver's final model at a run's
    end, `python -m training export`) reads a qlora base unquantized (model.options.dtype), on the
    CPU: the adapter is merged there, never into 4-bit weights, and no GPU is needed. UserError in a worker without
    CUDA or bitsandbytes (scaling.use_gpu auto on a cluster without GPUs)."""
    import torch  # (lazy: torch)

    if adapter is None or adapter.kind != "qlora" or torch.get_default_device().type == "meta":
        return {}  # (on the meta device, the driver's check: apply() asks what the workers will need)
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return {}
    check_qlora()
    return quantized_load(torch.cuda.current_device())


def quantized_load(device: int) -> dict:
    """from_pretrained's arguments for a 4-bit base (QUANTIZATION) whole on the GPU `device`."""
    from transformers import BitsAndBytesConfig  # (lazy: transformers; bitsandbytes only when it loads)

    return {"quantization_config": BitsAndBytesConfig(**QUANTIZATION), "device_map": {"": device}}


def is_meta(model: nn.Module) -> bool:
    return next(model.parameters()).device.type == "meta"


def is_quantized(model: nn.Module) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False))


def prepare_quantized(model: nn.Module) -> None:
    """peft's preparation of a k-bit base, before the adapter goes in: every base weight frozen, the
    norms and embeddings (left in 16 bits by the load) in fp32 for a stable backward. No gradient
    checkpointing here: parallel.activation_checkpointing decides that, as for any model."""
    from peft import prepare_model_for_kbit_training  # (lazy: peft)

    prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model.register_state_dict_post_hook(drop_quant_states)


def torch_rank() -> int:
    import torch  # (lazy: torch)

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def quantized_line(model: nn.Module) -> str:
    packed = [p for p in model.parameters() if type(p).__name__ == "Params4bit"]
    device = packed[0].device if packed else "?"
    return (f"model.adapter.kind qlora: {len(packed)} base weights 4-bit ({QUANTIZATION['bnb_4bit_quant_type']}, "
            f"{sum(p.numel() for p in packed) * 2:,} values in {sum(p.numel() for p in packed):,} bytes) on {device}")


def drop_quant_states(model: nn.Module, state: dict, prefix: str, _metadata) -> None:
    """A state-dict hook of a 4-bit model: bitsandbytes adds each 4-bit weight's quantization state
    (`<weight>.absmax`, `.quant_map`, `.nested_*`, `.quant_state.*`) beside it, entries that are no
    parameter; left in, a checkpoint of the adapter alone would carry the base's scales, which no
    model built from the folder (a resume's, an export's in full precision) takes back. The base,
    frozen, is read again from its folder."""
    quantized = [prefix + name for name, param in model.named_parameters() if type(param).__name__ == "Params4bit"]
    for key in quant_state_keys(state, quantized):
        del state[key]


def quant_state_keys(keys, weights: list[str]) -> list[str]:
    """The keys that lie under one of the `weights` (their quantization state), not the weights."""
    under = tuple(name + "." for name in weights)
    return [key for key in keys if under and key.startswith(under)]


def has_adapter(model: nn.Module) -> bool:
    return bool(getattr(model, "peft_config", None))


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer  # (lazy: peft)

    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]


def init_weights(model: nn.Module, seed: int) -> None:
    """Draw the adapter's weights as peft does (A uniform as Kaiming's, B zeros: the model starts as
    its base), from a generator of `seed` alone, whole tensors in the model's order: the same
    adapter on every worker, sharded (FSDP, each worker's slice of the whole) or not, at any world
    size. Done after a meta-device build has been given memory, and after a build on a device too:
    DDP and FSDP start from the same adapter."""
    import torch  # (lazy: torch)
    from torch.distributed.tensor import DTensor, distribute_tensor  # (lazy: torch)

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            for name in sorted(layer.lora_A):
                for linear, random in ((layer.lora_A[name], True), (layer.lora_B[name], False)):
                    param = linear.weight
                    whole = torch.zeros(param.shape, dtype=torch.float32)
                    if random:
                        torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=generator)
                    whole = whole.to(device=param.device, dtype=param.dtype)
                    if isinstance(param, DTensor):
                        whole = distribute_tensor(whole, param.device_mesh, param.placements)
                    param.copy_(whole)


def base_key(name: str) -> Optional[str]:
    """A state-dict name of the adapted model -> the name of its weight in the base's files (None:
    an adapter's own weight, in no file)."""
    if ".lora_" in name:
        return None
    return name.replace(".base_layer.", ".")


# --- the base's digest ----------------------------------------------------------------------------

def base_digest(folder: str) -> str:
    """SHA-256 over the base folder's config and weight files (names and contents): the base an
    adapter was trained on. Read whole, once per start of an adapter run (~1 s per GB)."""
    from training.models.hf_nn import weight_files  # (lazy: torch)

    digest = hashlib.sha256()
    root = Path(folder)
    for path in [root / "config.json", *weight_files(folder, folder)]:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as file:
            for block in iter(lambda: file.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


# --- export ---------------------------------------------------------------------------------------

def adapter_state(model: nn.Module) -> dict:
    """The adapter's weights under the names peft's folder gives them (`base_model.model.` before
    the model's own, the adapter's name dropped)."""
    from peft import get_peft_model_state_dict  # (lazy: peft)

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME)
    return {PEFT_PREFIX + name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}


def save_folder(model: nn.Module, directory: Path) -> list[str]:
    """The PEFT adapter folder of `model` (unsharded, the adapter not merged): adapter_config.json
    and adapter_model.safetensors, which `peft.PeftModel.from_pretrained(base, directory)` loads.
    Its base is the pretrained option as the run was given it (a URI, or the driver's path)."""
    from safetensors.torch import save_file  # (lazy: safetensors)

    directory.mkdir(parents=True, exist_ok=True)
    config = model.peft_config[ADAPTER_NAME]
    config.save_pretrained(str(directory))
    save_file(adapter_state(model), str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return sorted(p.name for p in directory.iterdir())


def merge(model: nn.Module) -> nn.Module:
    """The adapter added into the base weights, in place, and taken out: `model` is a plain
    transformers model again (its base weights the same Parameters), for save_pretrained and
    MLflow's transformers flavor. Merging again is a no-op. A 4-bit base is not merged into (the
    sum would be rounded to 4 bits): the merged model is a full-precision copy (merged_copy)."""
    if is_quantized(model):
        return merged_copy(model)
    for name, layer in lora_layers(model):
        layer.merge(safe_merge=True)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer.get_base_layer())
    if has_adapter(model):
        del model.peft_config
    model._hf_peft_config_loaded = False  # (else save_pretrained writes an adapter folder)
    return model


def merged_copy(model: nn.Module) -> nn.Module:
    """The adapted `model` merged into its base read again, on the CPU, unquantized (fp32 or bf16,
    as it was loaded), from the folder it was loaded from: the merge of a model whose base is 4-bit
    (a run's final model is built unquantized, load_kwargs, and takes merge's own path). `model` is
    left as it is."""
    import torch  # (lazy: torch)
    from peft import get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict  # (lazy: peft)
    from transformers import AutoModelForCausalLM  # (lazy: transformers)

    dtype = getattr(model.config, "dtype", None)
    dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32  # (hf's options.dtype)
    base = AutoModelForCausalLM.from_pretrained(model.config._name_or_path, dtype=dtype, device_map={"": "cpu"})
    inject_adapter_in_model(copy.deepcopy(model.peft_config[ADAPTER_NAME]), base, adapter_name=ADAPTER_NAME)
    # (the adapter's weights and the biases it trained, bias: all or lora_only; the base's own are the folder's)
    trained = get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME)
    loaded = set_peft_model_state_dict(base, {n: t.detach().to("cpu", dtype) for n, t in trained.items()},
                                       adapter_name=ADAPTER_NAME)
    assert not loaded.unexpected_keys, f"the adapter's weights have no place in the base: {loaded.unexpected_keys[:3]}"
    return merge(base.eval())
