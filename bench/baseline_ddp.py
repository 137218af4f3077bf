"""The baseline: a plain PyTorch DDP loop as one would write it by hand, no Ray.

Same model, data (the same Parquet files), global batch, worker count and threads as the service;
run with `torchrun --nproc_per_node=W bench/baseline_ddp.py ...`, or with plain `python` for a
single-process loop. Prints one JSON line (rank 0) with the steady-state throughput.

Its pieces (the training split in memory, the batches, one step, the steady-state clock) are the
plain Ray Train loop's too (bench/baseline_raytrain.py): both baselines do the same work per step.
"""

import argparse
import json
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F

from training.models.registry import build_model, model_section  # the same nn.Module classes the service trains


def training_split(root: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The manifest and the whole training split of the prepared Parquet shards under `root`, in
    memory: (manifest, inputs, targets). A language model's rows of tokens give inputs
    tokens[:, :-1] and targets tokens[:, 1:]."""
    manifest = json.load(open(os.path.join(root, "manifest.json")))
    table = pq.read_table([os.path.join(root, s["path"]) for s in manifest["splits"]["train"]["shards"]])
    if manifest["task"] == "classification":
        column = table.column("x").combine_chunks()
        inputs = torch.from_numpy(column.flatten().to_numpy().reshape(-1, column.type.list_size).copy())
        targets = torch.from_numpy(table.column("y").to_numpy().copy())
    else:
        column = table.column("tokens").combine_chunks()
        tokens = torch.from_numpy(column.flatten().to_numpy().reshape(-1, column.type.list_size).astype(np.int64))
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return manifest, inputs, targets


def batches(n: int, global_batch: int, world: int, rank: int, seed: int, start: int, steps: int):
    """(step, this rank's sample indices) for steps start .. steps-1: each epoch a permutation seeded
    by seed + epoch (the same after a restart from a checkpoint), cut into global batches."""
    per_epoch = n // global_batch
    order, order_epoch = None, -1
    for step in range(start, steps):
        epoch, index = divmod(step, per_epoch)
        if epoch != order_epoch:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
            order_epoch = epoch
        yield step, order[index * global_batch:(index + 1) * global_batch].tensor_split(world)[rank]


def train_step(model: torch.nn.Module, optimizer, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One step (`model` wrapped in DDP when distributed): cross-entropy over the last dimension (a
    language model's logits as (-1, vocab)), backward, gradients clipped to norm 1.0, optimizer step."""
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


class SteadyClock:
    """Steady-state samples/s: the first `warmup` steps excluded, a barrier (all ranks) before each
    reading of `time.perf_counter()`, after step `warmup` and after the last step."""

    def __init__(self, warmup: int):
        self.warmup, self.start = warmup, None

    @staticmethod
    def barrier() -> None:
        if dist.is_initialized():
            dist.barrier()

    def step_done(self, step: int) -> None:
        if step + 1 == self.warmup:
            self.barrier()
            self.start = time.perf_counter()

    def result(self, steps: int, global_batch: int) -> dict:
        self.barrier()
        elapsed = time.perf_counter() - self.start
        return {"samples_per_s": (steps - self.warmup) * global_batch / elapsed, "elapsed_s": elapsed}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--manifest", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--model-options", default="{}")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup-steps", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.set_num_threads(args.threads)
    manifest, inputs, targets = training_split(args.manifest)


    torch.manual_seed(args.seed)
    model = build_model(model_section({"name": args.model, "options": json.loads(args.model_options)}),
                        {"task": manifest["task"], **manifest["spec"]})
    ddp = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    clock = SteadyClock(args.warmup_steps)
    for step, batch in batches(len(inputs), args.global_batch, world, rank, args.seed, 0, args.steps):
        train_step(ddp, optimizer, inputs[batch], targets[batch])
        clock.step_done(step)
    measured = clock.result(args.steps, args.global_batch)
    if rank == 0:
        print(json.dumps(measured))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
