"""The digits families' networks (on the workers, and the driver's checks): small classifiers for
8x8 images as 64 features."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # (the family's options, for the types alone: the family imports this module)
    from training.models.digits import CNNOptions, MLPOptions



def build_mlp(spec: dict, options: MLPOptions) -> nn.Module:
    layers: list[nn.Module] = []
    width = spec["input_dim"]
    for hidden in options.hidden:
        layers += [nn.Linear(width, hidden), nn.GELU(), nn.Dropout(options.dropout)]
        width = hidden
    layers.append(nn.Linear(width, spec["num_classes"]))
    return nn.Sequential(*layers)


class SquareImageCNN(nn.Module):
    def __init__(self, side: int, num_classes: int, channels: list[int], dropout: float):
        super().__init__()
        self.side = side
        blocks: list[nn.Module] = []
        in_channels = 1
        for out_channels in channels:
            blocks += [nn.Conv2d(in_channels, out_channels, 3, padding=1), nn.GELU()]
            in_channels = out_channels
        blocks += [nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Dropout(dropout),
                   nn.Linear(in_channels * 4, num_classes)]
        self.net = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.view(-1, 1, self.side, self.side))


def build_cnn(spec: dict, options: CNNOptions) -> nn.Module:
    side = math.isqrt(spec["input_dim"])
    if side * side != spec["input_dim"]:
        raise ValueError(f"digits_cnn needs square images; input_dim is {spec['input_dim']}")
    return SquareImageCNN(side, spec["num_classes"], list(options.channels), options.dropout)
