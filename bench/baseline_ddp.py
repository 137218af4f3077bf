"""The baseline: a plain PyTorch DDP loop as one would write it by hand, no Ray.

Same model, data (the same Parquet files), global batch, worker count and threads as the service;
run with `torchrun --nproc_per_node=W bench/baseline_ddp.py ...`, or with plain `python` for a
single-process loop. Prints one JSON line (rank 0) with the steady-state throughput.
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

    manifest = json.load(open(os.path.join(args.manifest, "manifest.json")))
    table = pq.read_table([os.path.join(args.manifest, s["path"]) for s in manifest["splits"]["train"]["shards"]])
    if manifest["task"] == "classification":
        column = table.column("x").combine_chunks()
        inputs = torch.from_numpy(column.flatten().to_numpy().reshape(-1, column.type.list_size).copy())
        targets = torch.from_numpy(table.column("y").to_numpy().copy())
    else:
        column = table.column("tokens").combine_chunks()
        tokens = torch.from_numpy(column.flatten().to_numpy().reshape(-1, column.type.list_size).astype(np.int64))
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    from training.models import build_model  # the same nn.Module classes the service trains

    torch.manual_seed(args.seed)
    model = build_model(args.model, json.loads(args.model_options), {"task": manifest["task"], **manifest["spec"]})
    ddp = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    n, B = len(inputs), args.global_batch
    steps_per_epoch = n // B
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(n, generator=generator)
    start = None
    for step in range(args.steps):
        if step % steps_per_epoch == 0:
            order = torch.randperm(n, generator=generator)
        batch = order[(step % steps_per_epoch) * B:(step % steps_per_epoch + 1) * B].tensor_split(world)[rank]
        logits = ddp(inputs[batch])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[batch].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step + 1 == args.warmup_steps:
            if distributed:
                dist.barrier()
            start = time.perf_counter()
    if distributed:
        dist.barrier()
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"samples_per_s": (args.steps - args.warmup_steps) * B / elapsed, "elapsed_s": elapsed}))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
