"""Validation on the workers: every worker scores its part of the validation split, the sums
are added across workers, and the early-stopping rule is applied to the result."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from training.checkpoint.format import LoopState
from training.tasks import Task


def sum_across_workers(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


def max_across_workers(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


@torch.no_grad()
def evaluate(model, task: Task, rows: dict[str, torch.Tensor], batch_size: int, device, autocast,
             lockstep: bool = False) -> dict:
    model.eval()
    loss_sum = units = correct = 0.0
    count = next(iter(rows.values())).shape[0] if rows else 0  # (a part of no rows: it adds zeros)
    batches = math.ceil(count / batch_size)
    if lockstep:  # FSDP: every forward all-gathers parameters, so every worker runs as many
        batches = int(max_across_workers(batches, device))
    for start in range(0, batches * batch_size, batch_size):
        if start >= count:  # this worker's rows are done: a forward the others need, not counted
            with autocast:
                task.forward_loss(model, {k: v[:1].to(device) for k, v in rows.items()})
            continue
        batch = {k: v[start:start + batch_size].to(device) for k, v in rows.items()}
        with autocast:
            batch_loss, batch_units, batch_correct = task.forward_loss(model, batch, count_correct=True)
        loss_sum += batch_loss.item()
        units += batch_units
        correct += batch_correct.item()
    model.train()
    return task.metrics_of(*sum_across_workers([loss_sum, units, correct], device))


def update_early_stopping(rule, state: LoopState, val_metrics: dict) -> None:
    """Count evaluations without improvement in `loop`, and stop it after `patience_evals` (`rule`:
    train.early_stopping, or None)."""
    if rule is None:
        return
    if rule.metric not in val_metrics:
        raise ValueError(f"train.early_stopping.metric {rule.metric!r} is not a validation metric; "
                         f"have {sorted(val_metrics)}")
    value = val_metrics[rule.metric]
    best = state.best_metric
    better = best is None or (value < best - rule.min_delta if rule.mode == "min" else value > best + rule.min_delta)
    if better:
        state.best_metric, state.evals_without_improvement = value, 0
    else:
        state.evals_without_improvement += 1
        state.stopped_early = state.evals_without_improvement >= rule.patience_evals
