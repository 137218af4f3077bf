"""How the task calls an hf model (training/models/hf_nn.py sets one of these as the model's
`forward`, on the instance): tokens, a padding mask, packed rows' positions, or pixel values in;
the transformers output (its `.logits`) out. No wrapper module, so parameter and state-dict names
stay the transformers model's own."""

from __future__ import annotations

import torch


def causal_lm_forward(self, tokens, attention=None):
    """`model(tokens)`. No key/value cache in training: it would hold every layer's keys and values,
    and a layer recomputed by activation checkpointing would append to it a second time."""
    if tokens.shape[0] == 0:
        return _on_no_rows(self, tokens, attention)
    return type(self).forward(self, input_ids=tokens, attention_mask=attention, use_cache=False)


def sequence_classification_forward(self, tokens, attention=None):
    """`model(tokens, attention)`: 1 where a token is real, 0 where it pads (none: every token is)."""
    if tokens.shape[0] == 0:
        return _on_no_rows(self, tokens, attention)
    return type(self).forward(self, input_ids=tokens, attention_mask=None if attention is None else attention.long())


def _on_no_rows(self, tokens, attention):
    """The output for no rows, from a forward on one row of zeros: transformers' attention cannot
    reshape an empty batch, and under FSDP a worker with no validation rows left still runs every
    layer (each gathers its parameters with the other workers)."""
    one = tokens.new_zeros((1, *tokens.shape[1:]))
    output = self.forward(one, None if attention is None else attention.new_ones((1, *attention.shape[1:])))
    output.logits = output.logits[:0]
    return output


def packed_causal_lm_forward(self, tokens, positions=None):
    """`model(tokens, positions)`: rows of several samples, each starting where its position is 0,
    each attending only to itself: a block-diagonal causal mask (4D, 0 where a token may attend, the
    dtype's minimum elsewhere: sdpa and eager take it alike), the positions restarting per sample.
    flash_attention_2 takes no such mask: there the restarting positions alone tell transformers
    the samples' bounds (its variable-length kernel). No positions: one sample a row."""
    if positions is None or tokens.shape[0] == 0:
        return causal_lm_forward(self, tokens)
    mask = None
    if self.config._attn_implementation != "flash_attention_2":
        mask = block_causal_mask(positions, self.get_input_embeddings().weight.dtype)
    return type(self).forward(self, input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=False)


def block_causal_mask(positions, dtype):
    """[rows, 1, T, T] additive mask: 0 where query i may see key j (same sample, j <= i), else the
    dtype's minimum. Memory: rows * T * T values (T = 2048, 8 rows, float32: 128 MiB)."""
    sample = torch.cumsum(positions == 0, dim=1)  # (each sample's number within its row)
    length = positions.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    allowed = (sample[:, :, None] == sample[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def image_classification_forward(self, pixel_values):
    """`model(pixel_values)`: [rows, channels, height, width] as the data's image processor made them.
    No rows (a worker with no validation rows left): a forward on one black image, cut to none."""
    if pixel_values.shape[0] == 0:
        output = type(self).forward(self, pixel_values=pixel_values.new_zeros((1, *pixel_values.shape[1:])))
        output.logits = output.logits[:0]
        return output
    return type(self).forward(self, pixel_values=pixel_values)


TASK_FORWARD = {"causal_lm": causal_lm_forward, "sequence_classification": sequence_classification_forward,
                "image_classification": image_classification_forward}
# A data task whose rows the model is called on otherwise than its task's (training/tasks.py).
DATA_FORWARD = {"packed_language_model": packed_causal_lm_forward}
