"""Read on the driver with the job config: the `eval` section, whose generation check runs at the
end of a run (training/run/generate.py). No torch here."""

from __future__ import annotations

from typing import Annotated, Optional

from pydantic import Field

from training.errors import ConfigError
from training.models.registry import family_of
from training.schema import Section


class GenerateConfig(Section):
    # Texts the final model continues; with chat data (data.options.format: chat) each is a user's
    # message, rendered with the run's chat template.
    prompts: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1, max_length=64)
    # New tokens per prompt at most (greedy decoding, stopped early by the end token).
    max_new_tokens: int = Field(64, ge=1, le=2048)


class EvalConfig(Section):
    # A generation check at the end of the run, logged to MLflow as a table.
    generate: Optional[GenerateConfig] = None


def check_generates(model_section) -> None:
    """ConfigError naming eval.generate when the job's model cannot generate text: it needs a
    language model with a Hugging Face form (the hf family's causal_lm, the built-in gpt)."""
    has_hf_form = callable(getattr(family_of(model_section.name), "hf_model", None))
    task = getattr(getattr(model_section, "options", None), "task", "causal_lm")
    if not has_hf_form or task != "causal_lm":
        raise ConfigError(f"eval.generate: generation needs a language model with a Hugging Face form (model.name hf "
                          f"with task causal_lm, or gpt); this job's is {model_section.name}"
                          + (f" with task {task}" if has_hf_form else ""))
