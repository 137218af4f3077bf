"""The built-in `gpt` family (built on the workers, checked on the driver): a decoder-only
transformer (GPT-style) for language modelling, sized by a preset (tiny: ~0.4M parameters, a CPU
laptop; small: ~19M; base: ~114M, a GPU) or by explicit options. Its network:
training/models/gpt_nn.py."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from training.models.family import MAX_HEADS, MAX_LAYERS, MAX_WIDTH, ModelFamily, ModelSection
from training.schema import Section
from training.tasks import LANGUAGE_MODEL

# Sizes by name; options given next to a preset override its values.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_head": 4, "d_model": 128},
    "small": {"n_layer": 6, "n_head": 8, "d_model": 512},
    "base": {"n_layer": 16, "n_head": 12, "d_model": 768},
}


class GPTOptions(Section):
    preset: Optional[Literal["tiny", "small", "base"]] = None
    n_layer: int = Field(2, ge=1, le=MAX_LAYERS)
    n_head: int = Field(4, ge=1, le=MAX_HEADS)
    d_model: int = Field(128, ge=8, le=MAX_WIDTH)
    dropout: float = Field(0.0, ge=0, lt=1)

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("preset"), str) and data["preset"] in PRESETS:
            return {**PRESETS[data["preset"]], **data}
        return data

    @model_validator(mode="after")
    def _heads_divide(self) -> "GPTOptions":
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")
        return self


class GPTModel(ModelSection):
    name: Literal["gpt"] = "gpt"
    options: GPTOptions = Field(default_factory=GPTOptions)


class GPTFamily(ModelFamily):
    name = "gpt"
    Config = GPTModel
    tasks = (LANGUAGE_MODEL.name,)

    def build(self, section: GPTModel, spec: dict):
        from training.models.gpt_nn import GPT  # (torch: see training/models/family.py)

        return GPT(spec["vocab_size"], spec["seq_len"], section.options)

    def blocks(self, model) -> list:
        return list(model.blocks)

    def flops_per_token(self, model) -> Optional[float]:
        return model.flops_per_token()

    def hf_model(self, model):
        """The trained network as a `transformers` GPT2LMHeadModel, for an HF folder (exact: see to_gpt2)."""
        from training.models.gpt_nn import to_gpt2  # (torch: see training/models/family.py)

        return to_gpt2(model)


FAMILY = GPTFamily()
