"""Runs in the driver: samples (token ids and which of them the loss learns) laid out in rows of
seq_len for the `packed_language_model` task (training/tasks.py): several whole samples per row,
each with positions that restart at 0, so the model keeps each to itself (a block-diagonal causal
mask, training/models/hf_nn.py) and a packed row's loss is the sum of its samples' losses alone.

A sample of n tokens fills n positions; position i's label is token i + 1 where the loss learns
that token, else IGNORE, and the sample's last position has none (its next token is another
sample's). Padding (after a row's last sample) is a sample of its own with no labels.

Which samples share a row is decided here, once, by best fit in order of decreasing length (a row
is the sample the training stream shuffles, checkpoints and splits across workers, so exact resume
and world-size invariance hold as for any other rows). Deterministic: the same samples, the same
rows.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from training.tasks import PackedLanguageModel

IGNORE = PackedLanguageModel.IGNORE


@dataclass(frozen=True)
class Rows:
    tokens: np.ndarray  # [rows, seq_len] int32
    labels: np.ndarray  # [rows, seq_len] int32, IGNORE where nothing is learnt
    positions: np.ndarray  # [rows, seq_len] int32

    @property
    def count(self) -> int:
        return len(self.tokens)


def labels_of(ids: np.ndarray, learn: np.ndarray) -> np.ndarray:
    """Each position's target within one sample: the next token where `learn` marks it, else IGNORE."""
    labels = np.full(len(ids), IGNORE, dtype=np.int32)
    labels[:-1] = np.where(learn[1:].astype(bool), ids[1:], IGNORE)
    return labels


def pack_order(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Sample indices per row: best fit (the fullest row the sample still fits in), the longest
    samples placed first; rows in the order they were opened, samples in the order placed."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, row), sorted
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        assert 0 < length <= seq_len, (length, seq_len)
        at = bisect.bisect_left(free, (length, -1))
        if at < len(free):
            space, row = free.pop(at)
        else:
            space, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(index)
        if space - length:
            bisect.insort(free, (space - length, row))
    return rows


def lay_out(samples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int, pack: bool) -> Rows:
    """Rows of seq_len from (ids, learn mask) samples, each at most seq_len long: packed, or one sample a row."""
    order = pack_order([len(ids) for ids, _ in samples], seq_len) if pack else [[i] for i in range(len(samples))]
    tokens = np.full((len(order), seq_len), pad_id, dtype=np.int32)
    labels = np.full((len(order), seq_len), IGNORE, dtype=np.int32)
    positions = np.zeros((len(order), seq_len), dtype=np.int32)
    for row, members in enumerate(order):
        start = 0
        for index in members:
            ids, learn = samples[index]
            end = start + len(ids)
            tokens[row, start:end] = ids
            labels[row, start:end] = labels_of(ids, learn)
            positions[row, start:end] = np.arange(len(ids))
            start = end
        positions[row, start:] = np.arange(seq_len - start)  # (padding: a sample of its own)
    return Rows(tokens, labels, positions)
