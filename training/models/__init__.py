"""Built-in models and plug-ins by import string.

Plug-in contract: `def my_model(spec: dict, **options) -> torch.nn.Module`. `spec` describes the
prepared data: `task` ("classification" or "language_model") plus `input_dim` and `num_classes`
(classification) or `vocab_size` and `seq_len` (language model). `options` come from
`model.options`. The module's `forward` takes a batch of inputs (float features of shape
[batch, input_dim], or int64 token ids of shape [batch, seq]) and returns logits
([batch, num_classes], or [batch, seq, vocab_size]).
"""

from __future__ import annotations

from pydantic import ValidationError

from training.errors import ConfigError, UserError
from training.models.digits import CNNOptions, MLPOptions, build_cnn, build_mlp
from training.models.gpt import GPTOptions, build_gpt
from training.plugins import call_plugin, is_import_string, load_callable
from training.schema import format_validation_error

# name -> (options type, builder, task it serves)
BUILTIN_MODELS = {
    "digits_mlp": (MLPOptions, build_mlp, "classification"),
    "digits_cnn": (CNNOptions, build_cnn, "classification"),
    "gpt": (GPTOptions, build_gpt, "language_model"),
}


def validate_builtin_model_options(name: str, options: dict) -> None:
    if is_import_string(name):
        return
    if name not in BUILTIN_MODELS:
        raise ConfigError(f"model.name: unknown model {name!r}; built-in: {', '.join(BUILTIN_MODELS)}, "
                          "or a plug-in 'package.module:function'")
    try:
        BUILTIN_MODELS[name][0].model_validate(options)
    except ValidationError as exc:

        raise ConfigError(format_validation_error(exc, "model.options", BUILTIN_MODELS[name][0]).strip()) from None


def check_model_fits_task(name: str, task: str) -> None:
    if not is_import_string(name) and BUILTIN_MODELS[name][2] != task:
        fits = [n for n, (_, _, t) in BUILTIN_MODELS.items() if t == task]
        raise UserError(f"model.name: {name} is for {BUILTIN_MODELS[name][2]} data, but the data is "
                        f"{task}; use one of {', '.join(fits)} or a plug-in")


def build_model(name: str, options: dict, spec: dict):
    """Build the model for data described by `spec` (see the module docstring)."""
    import torch

    if not is_import_string(name):
        options_type, builder, _ = BUILTIN_MODELS[name]
        try:
            return builder(spec, options_type.model_validate(options))
        except ValueError as exc:  # the data does not suit the model (digits_cnn on non-square images)
            raise UserError(f"model.name {name}: {exc}") from None
    function = load_callable(name, "model.name")
    model = call_plugin(function, name, "model.name", "model.options", dict(spec), **options)
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"model.name {name} returned {type(model).__name__}, not a torch.nn.Module")
    return model
