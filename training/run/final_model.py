"""On the driver (a run's end, a sweep's report) or wherever its storage is readable (`python -m
training export`): a run's trained model, loaded from one of its checkpoints."""

from __future__ import annotations

import torch

from training.checkpoint import format as ckpt
from training.models.family import ModelSection
from training.models.registry import build_model, family_of


def load_final_model(model_section: ModelSection, manifest, checkpoint) -> torch.nn.Module:
    """The section's model for the data `manifest` records, with the weights of `checkpoint` (a
    ray.train.Checkpoint), in eval mode. A sharded (fsdp) checkpoint is consolidated here, in this
    one process: the whole model in host memory once."""
    model = build_model(model_section, {"task": manifest.task, **manifest.spec})
    frozen = family_of(model_section.name).checkpoints_frozen(model_section)  # (else read with the model)
    with checkpoint.as_directory() as directory:
        ckpt.load_model_into(model, ckpt.load_model_state(directory, model, frozen), frozen, directory)
    return model.eval()
