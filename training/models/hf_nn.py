"""The `hf` family's network (on the workers, and the driver's checks on the meta device): a
`transformers` model built from an inline config or a pretrained folder, checked against the data
and the folder's files before anything starts. Options: training/models/hf.py.

Built on the meta device (the driver's check, and FSDP's sharded load), a pretrained model is
built from its config alone, and its weights are checked against the safetensors files' headers
(names and shapes; no tensor is read).
"""

from __future__ import annotations

import importlib.util
import json
import struct
import types
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from training.errors import UserError
from training.models import hf_load
from training.models.hf_forward import DATA_FORWARD, TASK_FORWARD

if TYPE_CHECKING:  # (the family's options, for the types alone: the family imports this module)
    from training.models.hf import HFOptions

WEIGHT_INDEX = "model.safetensors.index.json"


# --- the folder -----------------------------------------------------------------------------------

def local_folder(options: HFOptions) -> str:
    """The pretrained folder on this node: the folder itself, or a URI's files copied once per node
    (training/models/hf_load.py); UserError naming model.options.pretrained if it is not a folder."""
    uri = options.pretrained
    if uri.startswith(hf_load.HUB):
        uri = hf_load.hub_folder(uri)
    elif "://" in uri and not uri.startswith("file://"):
        uri = hf_load.node_local_folder(uri)
    folder = Path(uri.removeprefix("file://")).expanduser()
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise UserError(f"model.options.pretrained: {options.pretrained} {what} (a folder written by "
                        "save_pretrained, an s3:// URI of one, or a Hub id: hf://ORG/NAME)")
    if not (folder / "config.json").is_file():
        raise UserError(f"model.options.pretrained: {options.pretrained} has no config.json: is it a folder "
                        "written by save_pretrained?")
    return str(folder)


def weight_files(folder: str, shown: str) -> list[Path]:
    """The folder's safetensors files (those its index names, if it has one)."""
    root = Path(folder)
    index = root / WEIGHT_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as exc:
            raise UserError(f"model.options.pretrained: {shown}/{WEIGHT_INDEX} is not a weight index: "
                            f"{type(exc).__name__}: {exc}") from None
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise UserError(f"model.options.pretrained: {shown}/{WEIGHT_INDEX} names {missing[0]}, which is not "
                            "in the folder")
        return [root / n for n in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt*"))
        raise UserError(f"model.options.pretrained: {shown} has no weights (no *.safetensors file, no "
                        f"{WEIGHT_INDEX})" + (f"; {found[0]} is a pickle, which is not loaded: save the model with "
                                              "save_pretrained(safe_serialization=True)" if found else ""))
    return files


def safetensors_header(path: Path, shown: str) -> dict[str, tuple[int, ...]]:
    """A safetensors file's tensor names and shapes, from its header alone (8 bytes of length, then
    JSON): the weights are not read."""
    try:
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if length > path.stat().st_size - 8:
                raise ValueError(f"a header of {length} bytes in a file of {path.stat().st_size}")
            header = json.loads(file.read(length))
        return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise UserError(f"model.options.pretrained: {shown}/{path.name} is not a safetensors file: "
                        f"{type(exc).__name__}: {exc}") from None


def check_weights(model: nn.Module, folder: str, shown: str) -> None:
    """UserError if the folder's weights do not fit the model its config.json describes: a tensor of
    another shape, or one of the model's own (its base, not a task head the model adds) missing; keys
    the file has beyond the model are refused only inside its base (more layers than the config)."""
    stored: dict[str, tuple[int, ...]] = {}
    for path in weight_files(folder, shown):
        stored.update(safetensors_header(path, shown))
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    buffers = {name for name, _ in model.named_buffers()}  # (non-persistent ones: old files may hold them)
    prefix = getattr(model, "base_model_prefix", "") or ""
    if prefix and not any(k.startswith(prefix + ".") for k in stored) and any(k.startswith(prefix + ".")
                                                                              for k in expected):
        stored = {f"{prefix}.{k}": v for k, v in stored.items()}  # a base model's file under a task's head
    in_base = (lambda name: name.startswith(prefix + ".")) if prefix else (lambda name: True)
    for name, shape in expected.items():  # (in the model's order: the first layer's first tensor first)
        if name in stored and stored[name] != shape and in_base(name):
            raise UserError(f"model.options.pretrained: {shown}: the weights do not match its config.json: "
                            f"{name} has shape {list(stored[name])} in the files, {list(shape)} in the model")
    tied = tied_names(model)
    missing = [n for n in expected if n not in stored and n not in tied and in_base(n)]
    if missing:
        raise UserError(f"model.options.pretrained: {shown}: the weights do not match its config.json: "
                        f"{len(missing)} of the model's {len(expected)} tensors are not in the files "
                        f"(first: {missing[0]})")
    extra = [n for n in stored if n not in expected and n not in buffers and in_base(n)]
    if extra:
        raise UserError(f"model.options.pretrained: {shown}: the weights do not match its config.json: the files "
                        f"hold {len(extra)} tensors the model does not have (first: {extra[0]})")


def tied_names(model: nn.Module) -> set[str]:
    """The state-dict names of tied copies (the output embedding tied to the input's): not in files."""
    try:
        inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    except NotImplementedError:  # (a model with no embeddings: a ResNet)
        return set()
    if outputs is None or inputs is None or outputs.weight is not inputs.weight:
        return set()
    return {f"{name}.weight" for name, module in model.named_modules() if module is outputs}


# --- the config -----------------------------------------------------------------------------------

def auto_class(task: str):
    import transformers  # (lazy: transformers, seconds to import)

    return {"causal_lm": transformers.AutoModelForCausalLM,
            "sequence_classification": transformers.AutoModelForSequenceClassification,
            "image_classification": transformers.AutoModelForImageClassification}[task]


def head_mapping(task: str) -> dict:
    from transformers.models.auto import modeling_auto  # (lazy: transformers, seconds to import)

    return {"causal_lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            "sequence_classification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
            "image_classification": modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES}[task]


def known_model_types() -> dict:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # (lazy: transformers)

    return CONFIG_MAPPING_NAMES


def model_config(options: HFOptions, folder: Optional[str], spec: dict):
    """The transformers config: the inline one with the data's sizes filled in, or the folder's;
    UserError for an architecture transformers does not have, or sizes the data does not fit."""
    import transformers  # (lazy: transformers, seconds to import)

    if folder is None:
        raw = dict(options.config)
        where, model_type = "model.options.config", raw.pop("model_type")
        if model_type not in known_model_types():
            raise UserError(f"model.options.config.model_type: {model_type!r} is not an architecture of transformers "
                            f"{transformers.__version__} (e.g. llama, qwen2, gpt2, bert)")
        check_head(model_type, options.task, "model.options.config.model_type")
        if "vocab_size" in spec:
            raw.setdefault("vocab_size", spec["vocab_size"])
        if "num_classes" in spec:
            raw.setdefault("num_labels", spec["num_classes"])
        if "channels" in spec:  # (images: their channels from the data)
            raw.setdefault("num_channels", spec["channels"])
        try:
            config = transformers.AutoConfig.for_model(model_type, **raw)
        except (TypeError, ValueError, KeyError) as exc:
            raise UserError(f"{where}: {type(exc).__name__}: {exc}") from None
        if "channels" in spec and hasattr(config, "image_size") and "image_size" not in raw:
            # (a model of fixed size, ViT: its patch grid from the data)
            config.image_size = spec["height"] if spec["height"] == spec["width"] else [spec["height"], spec["width"]]
    else:
        where = f"model.options.pretrained ({options.pretrained})"
        model_type = json_config(folder, options.pretrained).get("model_type")
        if model_type not in known_model_types() and not options.trust_remote_code:
            raise UserError(f"model.options.pretrained: {options.pretrained} is a {model_type!r} model, which is not "
                            f"in transformers {transformers.__version__}: its code is in the folder, and running it "
                            "needs model.options.trust_remote_code: true")
        if options.trust_remote_code:
            warnings.warn(f"model.options.trust_remote_code: the Python code in {options.pretrained} will run on the "
                          "driver and on every worker", stacklevel=2)
        if model_type in known_model_types():
            check_head(model_type, options.task, f"model.options.pretrained ({options.pretrained})")
        try:
            config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=options.trust_remote_code)
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(f"model.options.pretrained: {options.pretrained}/config.json: {exc}") from None
        if "num_classes" in spec:
            config.num_labels = spec["num_classes"]  # (a fresh head where the folder's has other labels)
    check_sizes(config, spec, where)
    return config


def json_config(folder: str, shown: str) -> dict:
    try:
        return json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"model.options.pretrained: {shown}/config.json is not JSON: {exc}") from None


def check_head(model_type: str, task: str, where: str) -> None:
    if model_type not in head_mapping(task):
        heads = sorted(t for t in ("causal_lm", "sequence_classification", "image_classification")
                       if model_type in head_mapping(t))
        raise UserError(f"{where}: a {model_type} model has no head for model.options.task {task} in transformers"
                        + (f"; it has one for {', '.join(heads)}" if heads else ""))


def check_sizes(config, spec: dict, where: str) -> None:
    """The data's token ids fit the embeddings, its classes the head; a decoder's classifier knows
    the pad id by which it finds each row's last token."""
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if vocab is not None and spec.get("vocab_size", 0) > vocab:
        raise UserError(f"{where}: the model's embeddings hold vocab_size {vocab} tokens, but the data's vocab_size "
                        f"is {spec['vocab_size']} (its largest token id + 1, or its tokenizer's size)")
    if "num_classes" in spec and config.num_labels != spec["num_classes"]:
        raise UserError(f"{where}: num_labels {config.num_labels}, but the data has num_classes {spec['num_classes']}")
    if "num_classes" in spec and spec.get("pad_id") is not None and config.get_text_config().pad_token_id is None:
        config.pad_token_id = spec["pad_id"]
    if "channels" in spec:
        check_image_sizes(config, spec, where)


def check_image_sizes(config, spec: dict, where: str) -> None:
    """The data's images have the model's channels, and the size a model of fixed size (ViT's patch
    grid) takes; a convolutional model (ResNet) takes any size."""
    channels = getattr(config, "num_channels", None)
    if channels is not None and channels != spec["channels"]:
        raise UserError(f"{where}: num_channels {channels}, but the data's images have {spec['channels']} "
                        "(data.options.image_processor.channels: 3 converts each image to RGB, 1 to grayscale)")
    size = getattr(config, "image_size", None)
    if size is not None:
        expected = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        if expected != (spec["height"], spec["width"]):
            raise UserError(f"{where}: image_size {size}, but the data's image processor makes images of "
                            f"{spec['height']} x {spec['width']} (data.options.image_processor.size)")


# --- the model ------------------------------------------------------------------------------------

def check_attention(options: HFOptions) -> None:
    if options.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise UserError("model.options.attn_implementation: flash_attention_2 needs the flash-attn package, which is "
                        "not installed here; use sdpa")


def build(options: HFOptions, spec: dict, data_task: str, load_kwargs: Optional[dict] = None) -> nn.Module:
    """The model for the data `spec` describes (`data_task`: the data's task that options.task
    learns). On the meta device (the driver's check, FSDP's sharded load) a pretrained model is built
    from its config and checked against its files; on a device, loaded from them, with `load_kwargs`
    for from_pretrained besides (a qlora base's quantization: training/models/hf_adapter.py)."""
    import transformers  # (lazy: transformers, seconds to import)

    if spec.get("task", data_task) != data_task:
        raise UserError(f"model.options.task: {options.task} learns {data_task} data, but the data is {spec['task']}")
    check_attention(options)
    folder = local_folder(options) if options.pretrained else None
    config = model_config(options, folder, spec)
    check_positions(config, spec, options)
    dtype = getattr(torch, options.dtype)
    kwargs = {"dtype": dtype, "attn_implementation": options.attn_implementation,
              "trust_remote_code": options.trust_remote_code}
    auto = auto_class(options.task)
    if options.attn_implementation == "sdpa" and not has_sdpa(auto, config):
        kwargs.pop("attn_implementation")  # (the default, for a model with no attention: a ResNet)
    on_meta = torch.get_default_device().type == "meta"
    if folder is None or on_meta:
        try:
            model = auto.from_config(config, **kwargs)
        except (KeyError, ValueError, TypeError, AttributeError) as exc:  # (sizes that do not fit together)
            where = "model.options.config" if folder is None else f"model.options.pretrained: {options.pretrained}"
            raise UserError(f"{where}: the {config.model_type} model cannot be built: {type(exc).__name__}: "
                            f"{exc}") from None
        if folder is not None:
            check_weights(model, folder, options.pretrained)
    else:
        weight_files(folder, options.pretrained)
        transformers.utils.logging.disable_progress_bar()  # (a bar per load in every worker's log)
        model = auto.from_pretrained(folder, config=config, ignore_mismatched_sizes=options.task != "causal_lm",
                                     **kwargs, **(load_kwargs or {}))
    model.seq_len = spec.get("seq_len")  # (FLOPs per token: the attention term)
    # The forward as the task calls it, set on the instance (as activation checkpointing does): no
    # wrapper module, so parameter and state-dict names stay the transformers model's own.
    model.forward = types.MethodType(DATA_FORWARD.get(data_task, TASK_FORWARD[options.task]), model)
    return model


def check_positions(config, spec: dict, options: HFOptions) -> None:
    """A row longer than the model's positions (learned ones would index past their table; rotary
    ones were never trained that far) is refused."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if isinstance(limit, int) and spec.get("seq_len") and spec["seq_len"] > limit:
        where = (f"model.options.pretrained {options.pretrained} (config.json)" if options.pretrained
                 else "model.options.config (set its max_position_embeddings)")
        raise UserError(f"data.options.seq_len: {spec['seq_len']} is longer than the model's position limit, "
                        f"max_position_embeddings {limit} of {where}; lower data.options.seq_len")


def has_sdpa(auto, config) -> bool:
    """Whether the architecture's model class takes attn_implementation sdpa (transformers refuses it
    for one without: a convolutional network has no attention)."""
    try:
        return getattr(auto._model_mapping[type(config)], "_supports_sdpa", True)
    except (KeyError, ValueError):  # (remote code: its class is the folder's)
        return True


def layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated layers: members of a ModuleList whose class the model's
    `_no_split_modules` names (LlamaDecoderLayer, BertLayer), else those of the ModuleList as long as
    config.num_hidden_layers."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    listed = [m for list_ in model.modules() if isinstance(list_, nn.ModuleList) for m in list_]
    found = [m for m in listed if type(m).__name__ in names]
    if found:
        return found
    count = getattr(model.config, "num_hidden_layers", None)
    return next((list(m) for m in model.modules() if isinstance(m, nn.ModuleList) and count and len(m) == count), [])


def check_layers(model: nn.Module) -> None:
    if not layers(model):
        raise UserError(f"parallel.strategy fsdp: the {type(model).__name__} model has no layers to shard: none of "
                        f"the classes its _no_split_modules names ({sorted(model._no_split_modules or [])}) is in a "
                        "ModuleList, and no ModuleList is as long as config.num_hidden_layers; use parallel.strategy: "
                        "ddp")


def load_sharded(options: HFOptions, model: nn.Module, device: torch.device) -> None:
    """After FSDP has sharded a model built on the meta device: its memory allocated on `device`, and
    each worker's shards read from the pretrained folder (training/models/hf_load.py)."""
    model.to_empty(device=device)
    hf_load.load_sharded(model, local_folder(options))


def flops_per_token(model: nn.Module) -> Optional[float]:
    """Training FLOPs per token, as the built-in GPT counts them: 6 per weight of every matrix
    multiply (the input embedding is a lookup, counted only when it is the tied output layer) plus
    12 * layers * width * seq_len for the attention scores and their weighted sum."""
    config = model.config.get_text_config()
    seq_len = getattr(model, "seq_len", None)
    if seq_len is None:
        return None
    weights = sum(p.numel() for p in model.parameters())  # (a tied weight counted once)
    if not tied_names(model):
        weights -= model.get_input_embeddings().weight.numel()
    return 6.0 * weights + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len

