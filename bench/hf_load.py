"""The hf_load row: a Llama-architecture checkpoint loaded by 2 worker processes (gloo, fresh each
time) under FSDP2 with training/models/hf_load.py's `load_sharded`, against each worker loading the
whole model (`from_pretrained`, what a DDP worker does): the peak growth of each worker's RSS over
the checkpoint's size; and the sharded load's time against one raw `safetensors` read of the same
file. The three sides interleaved, round after round."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, free_port, median

# ~1.0 GiB in fp32 (271M parameters); quick: ~19 MiB
FULL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
            num_key_value_heads=16, vocab_size=32000, max_position_embeddings=512)
QUICK = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=8000, max_position_embeddings=256)

# argv: side (sharded | whole | raw), folder, rank, world, port. Prints JSON: the RSS before loading,
# the peak during it (VmHWM, reset first through clear_refs so that the imports' peak is not it)
# and the load's seconds.
_WORKER = """
import json, os, sys, time
import torch
side, folder, rank, world, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))
if side == "raw":
    from safetensors.torch import load
else:
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import fully_shard
    from training.models.hf_load import load_sharded
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = transformers.AutoConfig.from_pretrained(folder)
    dist.barrier()
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")
before, began = status("VmRSS"), time.perf_counter()
if side == "raw":
    with open(os.path.join(folder, "model.safetensors"), "rb") as handle:
        state = load(handle.read())  # every byte read and made tensors (load_file maps the file lazily)
elif side == "whole":
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    sum(float(p.detach().sum()) for p in model.parameters())  # every weight read (from_pretrained maps the file)
else:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    load_sharded(model, folder)
seconds = time.perf_counter() - began
print(json.dumps({"before": before, "peak": status("VmHWM"), "seconds": seconds}))
if side != "raw":
    dist.barrier()
    dist.destroy_process_group()
"""


def write_checkpoint(folder: Path, sizes: dict) -> int:
    """A Llama folder of random fp32 weights (config.json + model.safetensors), written tensor by
    tensor from a meta-device model's shapes; returns the weights file's size in bytes."""
    import torch  # (lazy: torch)
    import transformers  # (lazy: transformers)
    from safetensors.torch import save_file  # (lazy: safetensors, torch)

    config = transformers.LlamaConfig(**sizes, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    state = {name: torch.randn(p.shape, generator=generator) * 0.02 for name, p in model.state_dict().items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    return (folder / "model.safetensors").stat().st_size


def _run(side: str, folder: Path, workers: int) -> list[dict]:
    port = str(free_port())
    processes = [subprocess.Popen([sys.executable, "-c", _WORKER, side, str(folder), str(rank), str(workers), port],
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(workers)]
    found = []
    for process in processes:
        out, err = process.communicate(timeout=600)
        if process.returncode != 0:
            raise RuntimeError(f"{side} worker exited {process.returncode}: {err[-2000:]}")
        found.append(json.loads(out.strip().splitlines()[-1]))
    return found


def hf_load(quick: bool, rounds: int | None = None) -> dict:
    """Peak RSS growth per worker over the checkpoint's size, sharded (target <= 0.6) and whole
    (>= 1.0), and the sharded load's time over a raw safetensors read's."""
    rounds, workers = rounds or (1 if quick else 3), 2
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        size = write_checkpoint(folder, QUICK if quick else FULL)
        sides = {"sharded": [], "whole": [], "raw": []}
        for _ in range(rounds):  # interleaved: a drift in the machine weighs on every side alike
            for side in sides:
                begun = time.perf_counter()
                sides[side].append((_run(side, folder, 1 if side == "raw" else workers), time.perf_counter() - begun))
    growth = {side: [max(w["peak"] - w["before"] for w in run) / size for run, _ in runs]
              for side, runs in sides.items()}
    seconds = {side: [max(w["seconds"] for w in run) for run, _ in runs] for side, runs in sides.items()}
    time_ratios = [s / r for s, r in zip(seconds["sharded"], seconds["raw"])]
    return {"checkpoint_mb": round(size / 2**20, 1), "workers": workers, "rounds": rounds,
            "parameters_m": round(size / 4 / 1e6, 1),
            "sharded_rss_growth_vs_checkpoint": median(growth["sharded"]),
            "sharded_rss_growth_vs_checkpoint_all": growth["sharded"],
            "whole_rss_growth_vs_checkpoint": median(growth["whole"]),
            "whole_rss_growth_vs_checkpoint_all": growth["whole"],
            "sharded_load_s": median(seconds["sharded"]), "whole_load_s": median(seconds["whole"]),
            "raw_read_s": median(seconds["raw"]),
            "sharded_load_vs_raw_read": median(time_ratios),
            "sharded_load_vs_raw_read_min": min(time_ratios), "sharded_load_vs_raw_read_max": max(time_ratios)}


if __name__ == "__main__":
    print(json.dumps(hf_load("--quick" in sys.argv, rounds=int(sys.argv[-1]) if sys.argv[-1].isdigit() else None),
                     indent=2))
