"""The built-in `digits` source (driver): scikit-learn's bundled 8x8 digit images, 64 features and a
label each, split into train and validation by a seeded permutation."""

from __future__ import annotations

import hashlib
from typing import Literal

import numpy as np
from pydantic import Field

from training.data.source import DataSection
from training.data.tables import SourceData, TableSource, classification_table
from training.schema import Section
from training.tasks import CLASSIFICATION


class DigitsOptions(Section):
    val_fraction: float = Field(0.2, gt=0, lt=1)
    # Seeds the train/validation split (numpy's generator takes seeds from 0).
    split_seed: int = Field(0, ge=0, lt=2 ** 32)


class DigitsData(DataSection):
    source: Literal["digits"] = "digits"
    options: DigitsOptions = Field(default_factory=DigitsOptions)


class Digits(TableSource):
    name = "digits"
    Config = DigitsData
    task = CLASSIFICATION.name

    def load(self, section: DigitsData) -> SourceData:
        from sklearn.datasets import load_digits  # (scikit-learn: only when the data is prepared)

        options = section.options
        bunch = load_digits()
        features = (bunch.data / 16.0).astype(np.float32)
        labels = bunch.target.astype(np.int64)
        order = np.random.default_rng(options.split_seed).permutation(len(labels))
        n_val = int(round(len(labels) * options.val_fraction))
        parts = {"validation": order[:n_val], "train": order[n_val:]}
        splits = {name: classification_table(features[idx], labels[idx]) for name, idx in parts.items()}
        digest = hashlib.sha256(features.tobytes() + labels.tobytes()).hexdigest()
        spec = {"input_dim": features.shape[1], "num_classes": int(labels.max()) + 1}
        return SourceData(CLASSIFICATION.name, splits, spec, digest)


SOURCE = Digits()
