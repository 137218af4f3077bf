"""Plug-ins as a user would write them, outside the training package."""

import os
import signal
import time

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


# Plug-ins that go wrong in the ways a user's might; each must be refused before anything starts.
# (The data plug-ins take any options: the default job's data.options are digits'.)

def source_fails(**options):
    raise ValueError("bucket 'corpus' not found\nsecond line of detail")


def source_exits(**options):
    raise SystemExit(3)


def model_fails(spec: dict):
    raise ValueError("hidden sizes must be positive")


def _blobs_with(x=None, y=None, validation_x=None):
    data = blobs(n=200)
    if x is not None:
        data["train"]["x"] = x(data["train"]["x"])
    if y is not None:
        data["train"]["y"] = y(data["train"]["y"])
    if validation_x is not None:
        data["validation"]["x"] = validation_x(data["validation"]["x"])
    return data


def _set(array, row, value):
    array = array.copy()
    array[row] = value
    return array


def nan_features(**options):
    return _blobs_with(x=lambda x: _set(x, 7, np.nan))


def inf_features(**options):
    return _blobs_with(x=lambda x: _set(x, 3, np.inf))


def nan_labels(**options):
    return _blobs_with(y=lambda y: _set(y.astype(np.float64), 5, np.nan))


def negative_labels(**options):
    return _blobs_with(y=lambda y: _set(y, 2, -1))


def fractional_labels(**options):
    return _blobs_with(y=lambda y: _set(y.astype(np.float64), 4, 1.5))


def narrow_validation(**options):
    """Validation rows with one feature fewer than the train rows."""
    return _blobs_with(validation_x=lambda x: x[:, :-1])


def tokens(validation_high: int = 100, validation_width: int = 17, **options):
    """Language-model data whose validation split may hold ids the train split never has."""
    rng = np.random.default_rng(0)
    return {"train": {"tokens": rng.integers(0, 100, size=(256, 17))},
            "validation": {"tokens": rng.integers(0, validation_high, size=(16, validation_width))}}


def wide_output(spec: dict):
    """Logits for one class more than the data has."""
    return Linear(spec["input_dim"], spec["num_classes"] + 1)


def fixed_input(spec: dict):
    """A model written for 10 features, whatever the data has."""
    return Linear(10, spec["num_classes"])


class _Itemizing(Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().sum().item() > 1e9:  # data-dependent: cannot run on the meta device
            x = x / 2
        return self.layer(x)


def itemizing(spec: dict):
    return _Itemizing(spec["input_dim"], spec["num_classes"])


class _DiesInEvaluation(Linear):
    """A Ray Train worker running this model SIGKILLs itself in its first evaluation, once per
    marker file: the first worker to create `marker` dies there (after the step every worker took,
    before that step's report), writing the time it died; the others and any replacement go on."""

    def __init__(self, input_dim: int, num_classes: int, marker: str):
        super().__init__(input_dim, num_classes)
        self.marker = marker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and _in_a_train_worker():
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.write(fd, f"{os.getpid()} {time.time()}".encode())
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
        return self.layer(x)


def _in_a_train_worker() -> bool:
    with open("/proc/self/cmdline", "rb") as cmdline:
        return b"RayTrainWorker" in cmdline.read()


def dies_in_evaluation(spec: dict, marker: str, **digits_options):  # (the digits config's options: unused)
    return _DiesInEvaluation(spec["input_dim"], spec["num_classes"], marker)
