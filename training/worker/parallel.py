"""How the model is spread over the workers (the `parallel` section), and what the device can do:
run on every worker (and in the benchmark's memory probe).

ddp: Ray Train's `prepare_model` (DistributedDataParallel): a full replica per worker.
fsdp: FSDP2, `torch.distributed.fsdp.fully_shard` applied to each transformer block, then to the
root. Parameters stay the model's own (now DTensors, sharded on dim 0 across the workers) under
their original names, so state-dict keys do not change and `torch.distributed.checkpoint` can
re-shard them at another world size. Ray's `prepare_model(parallel_strategy="fsdp")` wraps with
FSDP1 (`FullyShardedDataParallel`, flat parameters, its own state-dict modes), which PyTorch keeps
only for compatibility; FSDP2 is what the distributed-checkpoint and DTensor work builds on.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from typing import Iterator, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from training.config import ParallelConfig

# Dense bf16 peak FLOP/s per GPU (vendor datasheets, no sparsity), matched against the device name.
# MFU is measured against these whatever the run's precision, as torchtitan and nanoGPT do.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
                   "L40S": 362e12, "A10G": 125e12, "A10": 125e12, "L4": 121e12}


def peak_flops_per_s(device: torch.device) -> Optional[float]:
    """Peak bf16 FLOP/s of one device; None on CPU or for a GPU not in the table."""
    return peak_flops_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_flops_of(name: str) -> Optional[float]:
    # Longest key first: "A100" must not match "A10", "L40S" not "L4".
    return next((PEAK_BF16_FLOPS[k] for k in sorted(PEAK_BF16_FLOPS, key=len, reverse=True) if k in name), None)


def param_dtype(config: ParallelConfig, device: torch.device) -> Optional[torch.dtype]:
    """The dtype FSDP computes in; None keeps fp32 (no mixed-precision policy)."""
    if config.mixed_precision == "bf16" or (config.mixed_precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def _checkpoint_activations(block: nn.Module) -> None:
    """Recompute the block's activations in backward. The forward is replaced on the instance,
    not wrapped in another module, so parameter names (and checkpoints) stay the same."""

    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def wrap(model: nn.Module, config: ParallelConfig, device: torch.device, blocks: list[nn.Module] = (),
         compile: bool = False) -> nn.Module:
    """Prepare `model` (already on `device`, identical on every worker) for training; returns the
    module to call. For fsdp that is `model` itself, sharded in place; for ddp, Ray's DDP wrapper
    (or `model` with one worker). `blocks`: the model's repeated units (its family's), which FSDP
    shards one by one and activation checkpointing recomputes; none: only the root is sharded."""
    blocks = list(blocks)
    if config.activation_checkpointing:
        for block in blocks:
            _checkpoint_activations(block)
    if compile:  # in place (nn.Module.compile): parameter names unchanged
        for block in blocks or [model]:
            block.compile()
    if config.strategy == "ddp":
        import ray.train.torch  # (lazy: ray.train)

        return ray.train.torch.prepare_model(model)

    # (lazy: torch.distributed.fsdp)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    dtype = param_dtype(config, device)
    offload = CPUOffloadPolicy() if config.cpu_offload and device.type == "cuda" else OffloadPolicy()
    options = {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None),
               "offload_policy": offload}
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def shards_parameters(config: ParallelConfig) -> bool:
    """Each worker holds a shard of the parameters and optimizer state (FSDP), not a replica: every
    worker writes and loads its part of a checkpoint, and evaluates in lockstep."""
    return config.strategy == "fsdp"


def autocast(precision: str, device: torch.device):
    """The context a forward runs in for `train.precision`: bf16 autocast, or nothing (fp32)."""
    wants_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if wants_bf16 else nullcontext()


def gradient_sync(train_model: nn.Module, enabled: bool):
    """Skip the gradient reduction on all but the last micro-batch of a step (a context)."""
    return _SYNCED if enabled else _without_sync(train_model)


_SYNCED = nullcontext()  # (the last micro-batch: every step has one, so nothing is made for it)


@contextmanager
def _without_sync(train_model: nn.Module) -> Iterator[None]:
    if hasattr(train_model, "no_sync"):  # DDP
        with train_model.no_sync():
            yield
    elif hasattr(train_model, "set_requires_gradient_sync"):  # FSDP2
        train_model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            train_model.set_requires_gradient_sync(True)
    else:
        with nullcontext():
            yield


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this worker holds for parameters and optimizer state: a DTensor's local shard only."""

    def size(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return local.numel() * local.element_size()

    params = sum(size(p) for p in model.parameters())
    state = sum(size(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {"param_bytes": params, "optimizer_bytes": state}
