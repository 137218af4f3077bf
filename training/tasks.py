"""What a task computes from a batch: summed loss, the units it sums over, and correct predictions.

Losses are sums, not means, so a global batch split unevenly across workers and micro-batches
still yields exactly the mean over the global batch (see the loop's loss scaling).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from training.metrics import VALIDATION_METRICS


def units_per_sample(task: str, spec: dict) -> int:
    return spec["seq_len"] if task == "language_model" else 1


def model_input(task: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["x"] if task == "classification" else batch["tokens"][:, :-1]


def forward_loss(task: str, model, batch: dict[str, torch.Tensor],
                 count_correct: bool = False) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """Summed loss, units, and (for evaluation) correct predictions; training skips the argmax."""
    if task == "classification":
        logits, targets = model(batch["x"]), batch["y"]
    else:
        logits, targets = model(batch["tokens"][:, :-1]), batch["tokens"][:, 1:]
        logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    loss_sum = F.cross_entropy(logits.float(), targets, reduction="sum")
    correct = (logits.argmax(dim=-1) == targets).sum() if count_correct else None
    return loss_sum, targets.numel(), correct


def validation_metrics(task: str, loss_sum: float, units: float, correct: float) -> dict[str, float]:
    loss, accuracy = loss_sum / max(units, 1), correct / max(units, 1)
    values = {"val_loss": loss, "val_accuracy": accuracy, "val_perplexity": math.exp(min(loss, 50.0)),
              "val_token_accuracy": accuracy}
    return {name: values[name] for name in VALIDATION_METRICS[task]}
