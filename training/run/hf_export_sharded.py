"""On the driver (`python -m training export`) or wherever a run's storage is readable: the weights of
a sharded (fsdp) checkpoint of a `transformers` model written into an HF folder one safetensors file
at a time. The process holds one file's tensors at most (STREAMED_MAX_SHARD_SIZE by default), never
the whole model: a CPU head node exports a model larger than its memory.

The layout is save_pretrained's own, from its own pieces: the model's state-dict names without the
tied copies (transformers' choice of which name stays), split into files by huggingface_hub's
split_torch_state_dict_into_shards (what save_pretrained calls) from the checkpoint's sizes and
dtypes, each file written by safetensors' save_file with {"format": "pt"}, and
model.safetensors.index.json (above one file) with save_pretrained's fields. Names come from the
model built on the meta device (no memory), sizes from the checkpoint's manifest; each file's tensors
are read by a DCP load of those names alone, from whichever shards hold their slices.

DCP's HuggingFaceStorageWriter does not write the files: called once per file it would write its
index anew each time (that call's tensors only) and name a lone file model-00001-of-00001; its
consolidation joins the files it wrote on the workers during a save, not a checkpoint in storage.

Left to the whole-model path (hf_export.py): a checkpoint that is not sharded, an adapter run (merged
into its base on the way out), a model converted into a `transformers` one (the built-in gpt as
GPT-2), an architecture whose files hold another layout than its modules (fused mixture-of-experts
weights, which transformers converts on save) and a model with remote code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs
import torch

from training.adaptors import transformers_private
from training.checkpoint import format as ckpt
from training.models.registry import build_model, family_of

# transformers 4's default max_shard_size: most Hub models come in files of this size. The export's
# peak memory is about one file, so the streamed path does not take save_pretrained's 50GB default.
STREAMED_MAX_SHARD_SIZE = "5GB"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"


def is_sharded(checkpoint) -> bool:
    """Whether `checkpoint` (a ray.train.Checkpoint, local or remote) has the sharded layout, read
    without copying it."""
    info = checkpoint.filesystem.get_file_info(f"{checkpoint.path}/{ckpt.TRAIN_STATE_FILE}")
    return info.type == pafs.FileType.File


def streamable_model(section, manifest, checkpoint):
    """The section's model built on the meta device when its `checkpoint` can be written file by
    file (see the module's docstring); else None."""
    if getattr(section, "adapter", None) is not None or not is_sharded(checkpoint):
        return None
    from transformers import GenerationConfig, PreTrainedModel  # (lazy: transformers)

    with torch.device("meta"):
        model = build_model(section, {"task": manifest.task, **manifest.spec})
    if not isinstance(model, PreTrainedModel) or model.is_remote_code():
        return None
    folder_of = getattr(family_of(section.name), "hf_folder", None)
    folder = folder_of(section) if callable(folder_of) else None
    if folder and model.can_generate() and (Path(folder) / GENERATION_CONFIG_FILE).is_file():
        # (as from_pretrained reads it: built from its config alone, the model has the config's defaults)
        model.generation_config = GenerationConfig.from_pretrained(folder)
    state = transformers_private.saved_state(model)
    try:
        renamed = transformers_private.file_names_of(state, model) != list(state)
    except Exception:  # (a conversion that needs real tensors: the whole-model path converts them)
        renamed = True
    return None if renamed else model


def plan(model, stored: dict, max_shard_size: str | int):
    """huggingface_hub's StateDictSplit of the model's weights as save_pretrained lays them out, sized
    from `stored` (name -> the checkpoint's TensorStorageMetadata); ValueError naming a tensor the
    checkpoint lacks or holds in another shape."""
    from huggingface_hub import split_torch_state_dict_into_shards  # (lazy: huggingface_hub)

    state = transformers_private.saved_state(model)
    missing = [name for name in state if name not in stored]
    wrong = [f"{name} {tuple(stored[name].size)} in the checkpoint, {tuple(state[name].shape)} in the model"
             for name in state if name in stored and tuple(stored[name].size) != tuple(state[name].shape)]
    if missing or wrong:
        raise ValueError("the checkpoint does not fit the model: "
                         + "; ".join(([f"missing {', '.join(missing[:5])}"] if missing else []) + wrong[:3]))
    shapes = {name: _empty(stored[name], "meta") for name in state}
    return split_torch_state_dict_into_shards(shapes, filename_pattern="model{suffix}.safetensors",
                                              max_shard_size=max_shard_size)


def _empty(item, device: str = "cpu") -> torch.Tensor:
    return torch.empty(item.size, dtype=item.properties.dtype, device=device)


def save_weights(model, checkpoint_dir: str | Path, directory: Path, max_shard_size: str | int) -> None:
    """The weights of the sharded checkpoint in `checkpoint_dir` into `directory`, one file at a time."""
    from safetensors.torch import save_file  # (lazy: safetensors)

    stored = ckpt.sharded_model_tensors(checkpoint_dir)
    split = plan(model, stored, max_shard_size)
    for file_name, names in split.filename_to_tensors.items():
        tensors = {name: _empty(stored[name]) for name in names}
        ckpt.load_model_tensors(checkpoint_dir, tensors)
        save_file(tensors, directory / file_name, metadata={"format": "pt"})
        del tensors  # (before the next file's are read)
    if split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def save_config(model, directory: Path) -> None:
    """config.json and (a generating model) generation_config.json, with the fields save_pretrained
    sets on the way: the weights' dtype and the architecture's class."""
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)


def save_local(model, tokenizer, checkpoint, directory: str | Path,
               max_shard_size: str | int | None = None) -> list[str]:
    """The HF folder of `model` (built on the meta device: streamable_model) with the weights of
    `checkpoint` (a ray.train.Checkpoint) into the local `directory`; returns its file names."""
    directory = Path(directory)
    with checkpoint.as_directory() as checkpoint_dir:
        save_weights(model, checkpoint_dir, directory, max_shard_size or STREAMED_MAX_SHARD_SIZE)
    save_config(model, directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return sorted(p.name for p in directory.iterdir())
