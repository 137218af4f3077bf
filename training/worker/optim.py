"""The optimizer and its learning-rate schedule, built on every worker."""

from __future__ import annotations

import math

import torch

from training.config import OptimConfig


def build_optimizer(optim: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Over the parameters that train (a frozen base under an adapter holds no optimizer state)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if optim.name == "sgd":
        return torch.optim.SGD(params, lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    return torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)


def lr_factor(optim: OptimConfig, total_steps: int):
    """Linear warmup, then cosine decay to min_lr_ratio: a pure function of the step."""

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        progress = (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * cosine

    return factor

