"""The one way workers and the driver open prepared data, whichever its layout: shards this service
wrote (read in memory or by index: `loader`) or files read where they are (streamed: `external`)."""

from __future__ import annotations

from training.data import external, loader
from training.data.loader import BatchPlan, SplitReader, TrainShard


def train_batches(manifest, plan: BatchPlan, seed: int):
    """This worker's part of every global batch: `.steps_per_epoch` and `.batch(step)`."""
    if external.is_external(manifest):
        return external.train_stream(manifest, plan, seed)
    return TrainShard(SplitReader(manifest, "train"), plan, seed)


def split_rows(manifest, split: str):
    """Rows of a split by position: `.num_rows` and `.take(indices)`."""
    if external.is_external(manifest):
        return external.ExternalSplit(manifest, split)
    return SplitReader(manifest, split)


def validation_part(manifest, world_size: int, rank: int):
    return loader.validation_part(split_rows(manifest, "validation"), world_size, rank)
