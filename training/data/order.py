"""The order a run reads its training data in, on the workers (and the driver's checks): each
worker's share of each global batch, in an order that is a pure function of (seed, epoch), and the
digest that proves which global batches a run trained on.

The sample order never depends on the world size: global batch `j` of epoch `e` is always
`epoch_order(seed, e, n)[j * B:(j + 1) * B]`. A worker of rank r in a group of W takes the r-th of
W near-equal contiguous parts of it (`part_bounds`). So a run that shrinks from 4 workers to 2 still
sees the same sequence of global batches, and a run resumed at step s reads exactly what it would
have read. The streaming loader (training/data/stream.py) keeps the same promise for data read a
row group at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def epoch_order(seed: int, epoch: int, num_rows: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 0x5EED]).permutation(num_rows)


def part_bounds(count: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of the `index`-th of `parts` near-equal contiguous parts of `count` items, the first
    `count % parts` one longer (numpy's array_split): a rank's share of a global batch, of the
    validation split, of a batch's partitions."""
    size, extra = divmod(count, parts)
    lo = index * size + min(index, extra)
    return lo, lo + size + (index < extra)


# The data digest: a running sum over steps of a hash of (step, sample id) for every sample of every
# global batch, kept below 2**40 (exact as a float64 metric, and as a float64 sum over 8192
# workers). Order-free within a step, so each worker hashes its own part and the parts add up to
# the global batch's; two runs with equal digests at a step saw the same global batches up to it,
# whatever their world sizes, restarts or resizes.
DIGEST_MODULUS = 1 << 40


def batch_digest(step: int, sample_ids: np.ndarray) -> int:
    """This part of global batch `step`'s contribution to the data digest (splitmix64 of each id)."""
    return int(batch_digests(np.array([step]), np.asarray(sample_ids).reshape(1, -1))[0])


def batch_digests(steps: np.ndarray, sample_ids: np.ndarray) -> np.ndarray:
    """`batch_digest` of many steps at once: row i of `sample_ids` is this part of global batch
    `steps[i]` (a loader computes a chunk's or an epoch's in one pass, not a step's at a time)."""
    with np.errstate(over="ignore"):
        z = (np.asarray(sample_ids, dtype=np.uint64)
             + np.asarray(steps, dtype=np.uint64)[:, None] * np.uint64(0x9E3779B97F4A7C15))
        scratch = np.empty_like(z)  # (then in place: a chunk's temporaries would each be new memory)
        for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            z ^= np.right_shift(z, np.uint64(shift), out=scratch)
            z *= np.uint64(factor)
        z ^= np.right_shift(z, np.uint64(31), out=scratch)
        z >>= np.uint64(24)
    return np.sum(z, axis=1, dtype=np.uint64) % np.uint64(DIGEST_MODULUS)


@dataclass(frozen=True)
class BatchPlan:
    """How one global batch is divided across workers and micro-batches."""

    global_batch_size: int
    world_size: int
    rank: int
    micro_batch_size: int | None = None

    @property
    def bounds(self) -> tuple[int, int]:
        """[lo, hi) of this rank's rows within a global batch."""
        return part_bounds(self.global_batch_size, self.world_size, self.rank)

    def rank_part(self, global_batch: np.ndarray) -> np.ndarray:
        lo, hi = part_bounds(len(global_batch), self.world_size, self.rank)
        return global_batch[lo:hi]

    def micro_batches(self, part_size: int) -> list[slice]:
        size = self.micro_batch_size or max(part_size, 1)
        return [slice(start, min(start + size, part_size)) for start in range(0, part_size, size)]

    def steps_per_epoch(self, num_rows: int) -> int:
        steps = num_rows // self.global_batch_size
        if steps < 1:
            raise ValueError(f"train.global_batch_size {self.global_batch_size} is larger than the "
                             f"{num_rows} training rows")
        return steps
