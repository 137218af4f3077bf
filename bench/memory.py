"""Per-worker memory for parameters and optimizer state: FSDP (FSDP2, sharded) vs DDP (replicated),
2 workers on CPU with gloo. Measured from the tensors each worker holds (a DTensor's local shard),
after one AdamW step so that the optimizer state exists; no Ray needed."""

from __future__ import annotations

import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from training.config import ParallelConfig
from training.models.gpt import FAMILY, GPTOptions
from training.models.gpt_nn import GPT
from training.worker.parallel import local_bytes, wrap

WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _held_bytes(strategy: str, options: dict, seq_len: int, rank: int) -> dict:
    torch.manual_seed(0)
    model = GPT(256, seq_len, GPTOptions(**options))
    device = torch.device("cpu")
    if strategy == "ddp":  # Ray's prepare_model is DDP; built directly here, outside Ray Train
        train_model = DistributedDataParallel(model)
    else:
        train_model = wrap(model, ParallelConfig(strategy="fsdp"), device, blocks=FAMILY.blocks(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (2, seq_len + 1), generator=torch.Generator().manual_seed(rank))
    logits = train_model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
    optimizer.step()
    return local_bytes(model, optimizer)


def _worker(rank: int, strategies: tuple, options: dict, seq_len: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:  # each strategy on a model and optimizer of its own, one after the other
        for strategy in strategies:
            torch.save(_held_bytes(strategy, options, seq_len, rank), os.path.join(out_dir, f"{strategy}-{rank}.pt"))
    finally:
        dist.destroy_process_group()


def measure(strategies: tuple, options: dict, seq_len: int) -> dict[str, list[dict]]:
    """{strategy: [{param_bytes, optimizer_bytes} of each of the 2 workers]}, every strategy measured
    by the same 2 processes (starting them is most of the cost)."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(strategies, options, seq_len, _free_port(), out_dir), nprocs=WORLD_SIZE,
                           join=True, start_method="spawn")
        return {strategy: [torch.load(os.path.join(out_dir, f"{strategy}-{rank}.pt")) for rank in range(WORLD_SIZE)]
                for strategy in strategies}


def memory(quick: bool) -> dict:
    """Largest per-worker parameter + optimizer bytes under DDP and FSDP at 2 workers, and their ratio
    (ideal: 1/2). Quick: the tiny preset; else the small one (~19M parameters)."""
    preset, seq_len = ("tiny", 64) if quick else ("small", 128)
    row: dict = {"model": f"gpt preset {preset}", "workers": WORLD_SIZE}
    measured = measure(("ddp", "fsdp"), {"preset": preset}, seq_len)
    for strategy, workers in measured.items():
        row[f"{strategy}_bytes_per_worker"] = max(w["param_bytes"] + w["optimizer_bytes"] for w in workers)
        row[f"{strategy}_param_bytes_per_worker"] = max(w["param_bytes"] for w in workers)
    row["fsdp_vs_ddp_ratio"] = row["fsdp_bytes_per_worker"] / row["ddp_bytes_per_worker"]
    return row


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(memory(quick="--quick" in sys.argv), indent=2))
