"""The fine-tuning rows' arithmetic (bench/finetune.py), without Ray: the bytes of an optimizer's
state, and the useful (real, not padding) tokens per row of chat rows laid out by the service's own
packing (training/data/packing.py), packed and one a row; the parameters a saved state dict holds,
tied embeddings counted once."""

import io

import numpy as np
import torch

from bench.finetune import mean_sample_length, parameter_count, real_tokens_per_row, state_bytes
from training.data.packing import lay_out

PAD = 0


def test_state_bytes_counts_every_tensor_of_an_adamw_state_and_nothing_else():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    steps = sum(s["step"].numel() * s["step"].element_size() for s in state["state"].values())
    parameters = sum(p.numel() * 4 for p in model.parameters())
    assert state_bytes(state["state"]) == 2 * parameters + steps  # exp_avg and exp_avg_sq of each (fp32)
    assert state_bytes(state) == state_bytes(state["state"])  # (param_groups: numbers, no tensors)
    assert state_bytes({"a": [torch.zeros(3, dtype=torch.float16), (torch.zeros(2, dtype=torch.int64), 7)]}) == 22


def test_parameter_count_counts_tied_weights_once_after_a_save_and_load():
    embed, head = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False)
    head.weight = embed.weight  # (tied, as a Llama with tie_word_embeddings)
    model = torch.nn.ModuleDict({"embed": embed, "norm": torch.nn.LayerNorm(8), "head": head})
    model.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert len(loaded) == 5 and parameter_count(loaded) == 50 * 8 + 2 * 8 == sum(p.numel() for p in model.parameters())


def test_real_tokens_per_row_are_the_rows_non_padding_positions_packed_and_one_a_row():
    rng = np.random.default_rng(0)
    seq_len = 64
    lengths = rng.integers(5, 30, size=40)  # a mean under half of seq_len
    samples = [(rng.integers(1, 100, size=n).astype(np.int32), np.ones(n, dtype=np.int8)) for n in lengths]
    found = {}
    for pack in (True, False):
        rows = lay_out(samples, seq_len, PAD, pack)
        counts = {"conversations": len(samples), "dropped": 0, "tokens": int(lengths.sum()), "rows": rows.count}
        assert real_tokens_per_row(counts) * rows.count == (rows.tokens != PAD).sum()
        assert mean_sample_length(counts) == lengths.mean()
        found[pack] = real_tokens_per_row(counts)
    assert found[False] == lengths.mean()  # one a row: a row holds one sample
    assert found[True] / found[False] == len(samples) / lay_out(samples, seq_len, PAD, True).count > 1.5
    dropped = {"conversations": 42, "dropped": 2, "tokens": int(lengths.sum()), "rows": 40}
    assert mean_sample_length(dropped) == lengths.mean()  # (a dropped conversation has no tokens in the rows)
