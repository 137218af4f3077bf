"""Plug-ins as a user would write them, outside the training package."""

import numpy as np
import torch
from torch import nn


def blobs(n: int = 400, dim: int = 6, classes: int = 3, seed: int = 0):
    """A dataset plug-in: Gaussian blobs, one per class."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 4, size=(classes, dim))
    labels = rng.integers(0, classes, size=n)
    features = (centers[labels] + rng.normal(0, 1, size=(n, dim))).astype(np.float32)
    cut = int(n * 0.8)
    return {"train": {"x": features[:cut], "y": labels[:cut]},
            "validation": {"x": features[cut:], "y": labels[cut:]}}


def bad_columns():
    return {"train": {"a": [1, 2]}, "validation": {"a": [3]}}


class Linear(nn.Module):
    def __init__(self, input_dim: int, num_classes: int):
        super().__init__()
        self.layer = nn.Linear(input_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def linear(spec: dict, scale: float = 1.0):
    """A model plug-in: a linear classifier for whatever the data's spec says."""
    assert spec["task"] == "classification"
    return Linear(spec["input_dim"], spec["num_classes"])


def not_a_module(spec: dict):
    return "nope"


class Exploding(nn.Module):
    def __init__(self, input_dim: int, num_classes: int):
        super().__init__()
        self.layer = nn.Linear(input_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            raise RuntimeError("forward exploded")
        return self.layer(x)


def explodes(spec: dict):
    """Builds fine (the pre-flight check passes) and fails in the first training step."""
    return Exploding(spec["input_dim"], spec["num_classes"])
