"""Model families by import string (built on the workers, checked on the driver):
`model.name: "package.module:function"`.

Plug-in contract: `def my_model(spec: dict, **options) -> torch.nn.Module`. `spec` describes the
prepared data: `task` ("classification" or "language_model") plus `input_dim` and `num_classes`
(classification) or `vocab_size` and `seq_len` (language model). `options` come from
`model.options`. The module's `forward` takes a batch of inputs (float features of shape
[batch, input_dim], or int64 token ids of shape [batch, seq]) and returns logits
([batch, num_classes], or [batch, seq, vocab_size]), or an object whose `.logits` they are.

Two conventions are read from the module when it follows them: a `blocks` ModuleList of repeated
units (sharded one by one by FSDP, recomputed by activation checkpointing), and a
`flops_per_token()` method (for MFU).
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from training.errors import UserError
from training.models.family import ModelFamily, ModelSection
from training.plugins import call_plugin, load_callable


class PluginModel(ModelSection):
    name: str  # "package.module:function"
    # Keyword arguments of the plug-in (checked by the plug-in itself when it is called).
    options: dict[str, Any] = Field(default_factory=dict)


class PluginFamily(ModelFamily):
    name = "plug-in"
    Config = PluginModel
    exports_onnx = False  # (opt in with tracking.export_onnx: a plug-in may not export)

    def build(self, section: PluginModel, spec: dict):
        import torch  # (torch: see training/models/family.py)

        function = load_callable(section.name, "model.name")
        model = call_plugin(function, section.name, "model.name", "model.options", dict(spec), **section.options)
        if not isinstance(model, torch.nn.Module):
            raise UserError(f"model.name {section.name} returned {type(model).__name__}, not a torch.nn.Module")
        return model

    def blocks(self, model) -> list:
        from torch import nn  # (torch: see training/models/family.py)

        blocks = getattr(model, "blocks", None)
        return list(blocks) if isinstance(blocks, nn.ModuleList) else []

    def flops_per_token(self, model) -> Optional[float]:
        count = getattr(model, "flops_per_token", None)
        return count() if callable(count) else None

    def plugins(self, section: PluginModel) -> list[str]:
        return [section.name]


FAMILY = PluginFamily()
