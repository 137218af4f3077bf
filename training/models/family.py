"""The model-family seam (driver and workers): what one kind of model (`model.name: NAME`) provides. Each family is one
module (digits_mlp and digits_cnn, gpt, and plug-ins by import string) registered by name in
training/models/registry.py; nothing else in the tree names it. Torch-free at import (the config
path): a family imports its network where it builds it.

    build(section, spec)     the nn.Module for data described by `spec` (the task's keys: input_dim
                             and num_classes, or vocab_size and seq_len), identical on every worker
                             for a given torch seed; UserError if the data does not suit it
    tasks                    the tasks it learns (training/tasks.py); empty: any
    blocks(model)            the repeated units FSDP shards one by one and activation
                             checkpointing recomputes (none: only the root is sharded)
    check_shardable(model)   UserError if FSDP cannot shard the model as the family means it to
                             (the driver asks, on the meta device, before a run with fsdp starts)
    loads_after_sharding(section), load_after_sharding(section, model, device)
                             for weights read from files under FSDP: the workers build the model on
                             the meta device, shard it, then the family allocates it on the device
                             and has each worker read only its shards (a pretrained model)
    flops_per_token(model)   training FLOPs per token, for MFU (None: unknown)
    checkpoints_frozen(section)
                             whether a checkpoint holds the parameters that do not train (False:
                             only the trainable ones and their optimizer state; the frozen ones
                             are read again from where the family read them, a pretrained base)
    pinned(section)          {option: digest} of what the run reads besides its data, recorded when
                             it starts and checked when it resumes (check_pinned): a frozen base
                             that checkpoints do not hold must not change under a run
    plugins(section)         import strings Ray ships to the cluster
    exports_onnx             whether its final model is exported to ONNX by default

Its forward takes the task's input (training/tasks.py) and returns logits, or an object with
`.logits` (as Hugging Face models do).
"""

from __future__ import annotations

from typing import Any, Optional

from training.errors import UserError
from training.schema import OptionsSection

# Sizes of a built-in family's options, far beyond real use (the largest open models have ~128
# layers, a width of ~16k and ~128 heads): a bigger one is a typo, and building it even on the meta
# device (the driver's check) would take hours.
MAX_LAYERS = 1024
MAX_WIDTH = 65536
MAX_HEADS = 1024

# The most a model's head or table is built for, from the data (any family, plug-ins too): the
# meta-device check allocates nothing, so a head of 2^40 classes would pass it and fail every worker.
MAX_SPEC = {"num_classes": 10_000_000, "vocab_size": 10_000_000, "seq_len": 1_048_576}
_SPEC_SOURCE = {"num_classes": "the largest label + 1, or data.options.num_classes",
                "vocab_size": "the largest token id + 1, or data.options.vocab_size",
                "seq_len": "data.options.seq_len, or the width of the token rows"}


def check_spec(spec: dict) -> None:
    """UserError if the data asks for a model too large to be meant (MAX_SPEC)."""
    for key, most in MAX_SPEC.items():
        value = spec.get(key)
        if isinstance(value, int) and value > most:
            raise UserError(f"the data needs a model with {key} {value:,} ({_SPEC_SOURCE[key]}); a model is "
                            f"built for at most {most:,}")


class ModelSection(OptionsSection):
    """The `model` section of a job config; each family's section sets `name` and `options`."""

    name: str
    options: Any = None  # the family's own options model


class ModelFamily:
    name: str
    Config: type[ModelSection]
    tasks: tuple[str, ...] = ()
    exports_onnx: bool = True

    def build(self, section: ModelSection, spec: dict):
        raise NotImplementedError

    def blocks(self, model) -> list:
        return []

    def check_shardable(self, model) -> None:
        return None

    def loads_after_sharding(self, section: ModelSection) -> bool:
        return False

    def load_after_sharding(self, section: ModelSection, model, device) -> None:
        raise NotImplementedError

    def flops_per_token(self, model) -> Optional[float]:
        return None

    def plugins(self, section: ModelSection) -> list[str]:
        return []

    def checkpoints_frozen(self, section: ModelSection) -> bool:
        return True

    def pinned(self, section: ModelSection) -> dict[str, str]:
        return {}


def check_pinned(recorded: Optional[dict], now: dict[str, str]) -> None:
    """UserError (on the driver, before a resumed run starts) if what the run read besides its data
    changed since it started (`recorded`: the family's `pinned` then; None: a run that recorded none)."""
    for option, digest in (recorded or {}).items():
        if option in now and now[option] != digest:
            raise UserError(f"{option}: its files changed since the run started (SHA-256 {digest[:12]}... then, "
                            f"{now[option][:12]}... now); the run's checkpoints hold only what trained on top of "
                            "them: restore the original files, or start a new run (--name)")
