"""The private `transformers` APIs this project needs, in one place (the driver imports it, when it
writes an HF folder). transformers 5 keeps these module-level functions out of its public API;
`tests/test_hf_export_sharded.py` checks each, so an upgrade that moves one fails there by name.
transformers is imported lazily: importing this module costs nothing."""

from __future__ import annotations


def saved_state(model) -> dict:
    """The model's state dict (meta tensors, on a model built on the meta device) as `save_pretrained`
    writes it: without the names its class never saves (`_keys_to_ignore_on_save`) and the tied
    copies (`lm_head.weight` tied to the embeddings), which `from_pretrained` re-ties. Which name of a
    tied pair stays is transformers' choice."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict  # (lazy: transformers)

    state = model.state_dict()
    for name in model._keys_to_ignore_on_save or ():
        state.pop(name, None)
    return remove_tied_weights_from_state_dict(state, model)


def file_names_of(state: dict, model) -> list[str]:
    """The names `save_pretrained` writes `state`'s tensors under: the model's own, except for an
    architecture whose files hold another layout (a mixture of experts' fused expert weights, which
    transformers converts on load and reverts on save)."""
    from transformers.core_model_loading import revert_weight_conversion  # (lazy: transformers)

    return list(revert_weight_conversion(model, dict(state)))
