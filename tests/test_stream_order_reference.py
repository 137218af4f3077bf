"""The streaming order and the data digest, checked row by row against their definitions (the
docstring of training/data/stream.py; splitmix64 in training/data/order.py) written out plainly:
the loader's vectorised, chunked form must give exactly these rows, whatever it does for speed."""

import numpy as np
import pytest

from training.data.order import DIGEST_MODULUS, batch_digests, part_bounds
from training.data.stream import EpochPlan, RowGroup, batch_parts, deal, steps_per_epoch


def reference_row(segments, seed, epoch, partition, window, position):
    """(row group id, row within it) of a partition's stream position, one position at a time."""
    counts = [n for _, _, n in segments]
    starts = np.concatenate([[0], np.cumsum(counts)])
    segment = int(np.searchsorted(starts, position, side="right") - 1)
    w = segment // window
    lo, hi = int(starts[w * window]), int(starts[min((w + 1) * window, len(segments))])
    flat = int(np.random.default_rng([seed, epoch, partition, w, 0x5EED]).permutation(hi - lo)[position - lo]) + lo
    held = int(np.searchsorted(starts, flat, side="right") - 1)
    group, first, _ = segments[held]
    return group, first + flat - int(starts[held])


@pytest.mark.parametrize("trial", range(12))
def test_chunks_of_global_batches_are_the_defined_rows(trial):
    rng = np.random.default_rng(trial)
    sizes = rng.integers(1, 40, int(rng.integers(2, 30)))
    groups = [RowGroup(0, i, int(n)) for i, n in enumerate(sizes)]
    partitions = int(rng.integers(1, 7))
    batch = int(rng.integers(partitions, 4 * partitions + 1))
    window, seed, epoch = int(rng.integers(1, 4)), int(rng.integers(0, 99)), int(rng.integers(0, 3))
    steps = steps_per_epoch(groups, partitions, batch)
    if steps < 1:
        pytest.skip("no whole step in this layout")
    world = int(rng.integers(1, 5))
    rank = int(rng.integers(0, world))
    lo, hi = part_bounds(batch, world, rank)
    dealt, parts = deal(groups, seed, epoch, partitions), batch_parts(batch, partitions)
    offsets = np.concatenate([[0], np.cumsum(parts)])
    plan = EpochPlan(groups, seed, epoch, partitions, window, batch)
    first = 0
    while first < steps:  # chunks of varying length, as the loader's are
        count = min(int(rng.integers(1, 6)), steps - first)
        got_groups, got_rows = plan.rows_of(first, count, lo, hi)
        for i, step in enumerate(range(first, first + count)):
            expected = [reference_row(dealt[p], seed, epoch, p, window, step * int(parts[p]) + column - int(offsets[p]))
                        for column in range(lo, hi) for p in [int(np.searchsorted(offsets, column, side="right") - 1)]]
            assert list(zip(got_groups[i].tolist(), got_rows[i].tolist())) == expected, (trial, step)
        first += count


def test_digests_are_splitmix64_of_each_id_summed():
    rng = np.random.default_rng(5)
    ids, steps = rng.integers(0, 2**40, (6, 9)), rng.integers(0, 10**9, 6)
    mask = 2**64 - 1

    def splitmix(z):
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & mask
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & mask
        return z ^ (z >> 31)

    expected = [sum(splitmix((int(i) + int(s) * 0x9E3779B97F4A7C15) & mask) >> 24 for i in row) % DIGEST_MODULUS
                for s, row in zip(steps, ids)]
    assert batch_digests(steps, ids).tolist() == expected
