"""The `gpt` family's network (on the workers, and the driver's checks): a decoder-only transformer
for byte- or token-level language modelling, sized by GPTOptions (training/models/gpt.py)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # (the family's options, for the types alone: the family imports this module)
    from training.models.gpt import GPTOptions



class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln_1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                   dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(attention.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, options: GPTOptions):
        super().__init__()
        self.seq_len = seq_len
        self.token_embedding = nn.Embedding(vocab_size, options.d_model)
        self.position_embedding = nn.Embedding(seq_len, options.d_model)
        self.blocks = nn.ModuleList(Block(options.d_model, options.n_head, options.dropout)
                                    for _ in range(options.n_layer))
        self.ln_f = nn.LayerNorm(options.d_model)
        self.head = nn.Linear(options.d_model, vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # weight tying, as in GPT-2
        # GPT-2's initialisation: N(0, 0.02) weights, zero biases, and the projections into the
        # residual stream scaled by 1/sqrt(2 * n_layer). (PyTorch's default N(0, 1) embedding, tied
        # to the head, would start the logits at a standard deviation of about sqrt(d_model): a first
        # loss of ~86 per token on a 2k vocabulary instead of ln(2048) = 7.6.)
        self.apply(_init_weights)
        for block in self.blocks:
            for projection in (block.proj, block.mlp[2]):
                nn.init.normal_(projection.weight, mean=0.0, std=0.02 / math.sqrt(2 * options.n_layer))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # the tied head counted once

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward): 6 per weight of every matrix multiply
        (position embeddings are lookups, left out) plus the attention scores and their weighted
        sum, 12 * n_layer * d_model * seq_len (PaLM, appendix B; causal masking not discounted)."""
        d_model = self.token_embedding.embedding_dim
        weights = self.num_params() - self.position_embedding.weight.numel()
        return 6.0 * weights + 12.0 * len(self.blocks) * d_model * self.seq_len

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def to_gpt2(model: GPT):
    """The same network as a `transformers` GPT2LMHeadModel (weights copied): it maps exactly, so
    `from_pretrained` of its saved folder gives this model's logits. Learned position embeddings,
    pre-LayerNorm blocks with biases and PyTorch's LayerNorm eps (1e-5, GPT-2's `layer_norm_epsilon`),
    attention scaled by 1/sqrt(head dim), q, k, v split in that order, the exact (erf) GELU that
    nn.GELU() computes (GPT-2's `gelu`; its checkpoints use `gelu_new`, the tanh approximation, which
    would differ by up to ~1e-3), a head tied to the token embedding. GPT-2's Conv1D stores weights
    as [in, out]: every Linear's weight is transposed. Only training differs: this model drops out
    attention weights and the MLP's output, GPT-2 also the attention's output and the embeddings
    (the dropout rate is given to all; none in eval)."""
    from transformers import GPT2Config, GPT2LMHeadModel  # (lazy: transformers)

    d_model, blocks = model.token_embedding.embedding_dim, list(model.blocks)
    config = GPT2Config(vocab_size=model.token_embedding.num_embeddings, n_positions=model.seq_len, n_embd=d_model,
                        n_layer=len(blocks), n_head=blocks[0].n_head, n_inner=4 * d_model,
                        activation_function="gelu", layer_norm_epsilon=model.ln_f.eps,
                        resid_pdrop=blocks[0].dropout, embd_pdrop=blocks[0].dropout, attn_pdrop=blocks[0].dropout,
                        scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    assert all(isinstance(b.mlp[1], nn.GELU) and b.mlp[1].approximate == "none" for b in blocks)
    assert all(ln.eps == model.ln_f.eps for b in blocks for ln in (b.ln_1, b.ln_2))
    state = {"transformer.wte.weight": model.token_embedding.weight,
             "transformer.wpe.weight": model.position_embedding.weight,
             "transformer.ln_f.weight": model.ln_f.weight, "transformer.ln_f.bias": model.ln_f.bias}
    for i, block in enumerate(blocks):
        pairs = {"ln_1": block.ln_1, "ln_2": block.ln_2, "attn.c_attn": block.qkv, "attn.c_proj": block.proj,
                 "mlp.c_fc": block.mlp[0], "mlp.c_proj": block.mlp[2]}
        for name, module in pairs.items():
            linear = isinstance(module, nn.Linear)
            state[f"transformer.h.{i}.{name}.weight"] = module.weight.t() if linear else module.weight
            state[f"transformer.h.{i}.{name}.bias"] = module.bias
    hf = GPT2LMHeadModel(config)
    with torch.no_grad():
        missing, unexpected = hf.load_state_dict({k: v.detach() for k, v in state.items()},
                                                 strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # (tied to wte)
    return hf.eval()


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
