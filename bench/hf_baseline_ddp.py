"""The hf_throughput row's baseline (torchrun processes, no Ray): a Hugging Face Llama trained in a
plain PyTorch DDP loop as one writes it by hand from transformers' own docs.

Same architecture (the transformers config the service builds: the inline keys, vocab_size from the
data), data (the same prepared Parquet files), global batch, optimizer, gradient clipping, worker
count and threads as the service; `python -m torch.distributed.run --nproc_per_node=W
bench/hf_baseline_ddp.py ...`. Prints one JSON line (rank 0) with the steady-state samples/s, timed as
bench/baseline_ddp.py times its own (SteadyClock: warm-up steps excluded, barriers around the clock).
"""

import argparse
import json
import os

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.baseline_ddp import SteadyClock, batches


def token_rows(root: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The manifest and the whole training split of prepared token rows, in memory: (manifest,
    inputs tokens[:, :-1], targets tokens[:, 1:]). The split is shards the data source wrote or an
    index of Parquet files (the `text` source's), streamed by the service a row group at a time."""
    manifest = json.load(open(os.path.join(root, "manifest.json")))
    split = manifest["splits"]["train"]
    paths = ([os.path.join(root, s["path"]) for s in split["shards"]] if "shards" in split
             else [f["uri"].removeprefix("file://") for f in split["files"]])
    column = pq.read_table(paths, columns=["tokens"]).column("tokens").combine_chunks()
    tokens = torch.from_numpy(column.flatten().to_numpy().reshape(-1, column.type.list_size).astype(np.int64))
    return manifest, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def build(config: dict, vocab_size: int, seed: int) -> torch.nn.Module:
    """The model from an inline config (`model_type` and sizes; vocab_size the data's unless given)."""
    import transformers  # (lazy: seconds to import, after the process group is up)

    raw = dict(config)
    raw.setdefault("vocab_size", vocab_size)
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    return transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)


def train_step(model, optimizer, inputs: torch.Tensor, targets: torch.Tensor, clip: float) -> None:
    logits = model(input_ids=inputs, use_cache=False).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--manifest", required=True)
    p.add_argument("--config", required=True, help="the transformers config as JSON, model_type among its keys")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup-steps", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.set_num_threads(args.threads)
    manifest, inputs, targets = token_rows(args.manifest)
    model = build(json.loads(args.config), manifest["spec"]["vocab_size"], args.seed)
    model.train()
    ddp = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    clock = SteadyClock(args.warmup_steps)
    for step, batch in batches(len(inputs), args.global_batch, world, rank, args.seed, 0, args.steps):
        train_step(ddp, optimizer, inputs[batch], targets[batch], args.clip)
        clock.step_done(step)
    measured = clock.result(args.steps, args.global_batch)
    if rank == 0:
        print(json.dumps(measured))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
