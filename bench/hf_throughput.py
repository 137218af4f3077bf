"""The hf_throughput row (the driver, Ray started): an HF Llama (`model.name: hf`, the architecture of
training/configs/llama_stdlib.yaml) trained through the service with DDP on 2 workers, against the same
model, data, global batch, optimizer and threads in a plain torchrun DDP loop with no Ray
(bench/hf_baseline_ddp.py): steady-state tokens/s, the two sides interleaved round after round.

Steady state: the first third of the steps is warm-up on both sides (Ray's worker group, the helper
actors that share the cores at a run's start, the first steps' allocations). The service's rate is
read from its reported `wall_time` metric between the first report at or after the warm-up and the
last one; the baseline's from its own clock over the same steps. The evaluation, checkpoint and
export happen once, after the last step: outside the window on both sides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import (
    REPO,
    free_port,
    interleaved,
    median,
    paired_ratios,
    run_service,
    service_job,
    steady_samples_per_s,
)
from bench.rows import _throughput_overrides
from training.data.registry import prepare

CONFIG = "llama_stdlib.yaml"
WORKERS = 2
# Quick mode (a harness check): a tinier Llama on a small slice of the byte-level tinylm source (no
# BPE to train), as tests/test_hf_run.py's runs.
QUICK_MODEL = ["data.source=tinylm", "data.options={seq_len: 32, max_bytes: 60000}",
               "model.options.config={model_type: llama, hidden_size: 32, intermediate_size: 64, "
               "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, tie_word_embeddings: true}",
               "train.global_batch_size=16"]


def baseline_samples_per_s(manifest_root: str, job, steps: int, warmup_steps: int) -> float:
    """The same steps in bench/hf_baseline_ddp.py under torchrun, the same threads per worker."""
    optim = job.optim
    script = [str(REPO / "bench" / "hf_baseline_ddp.py"), "--manifest", manifest_root,
              "--config", json.dumps(job.model.options.config), "--steps", str(steps),
              "--warmup-steps", str(warmup_steps), "--global-batch", str(job.train.global_batch_size),
              "--lr", str(optim.lr), "--weight-decay", str(optim.weight_decay),
              "--clip", str(optim.grad_clip_norm), "--threads", str(job.train.torch_threads), "--seed", str(job.seed)]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORKERS),
               "--master_port", str(free_port()), *script]
    env = {**os.environ, "OMP_NUM_THREADS": str(job.train.torch_threads), "PYTHONPATH": str(REPO)}
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"the torchrun baseline exited {out.returncode}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["samples_per_s"]


def hf_throughput(quick: bool, rounds: int | None = None, steps: int | None = None) -> dict:
    """Service vs plain torchrun DDP tokens/s for an HF Llama, 2 workers (target >= 0.95)."""
    rounds = rounds or (1 if quick else 3)
    steps = steps or (12 if quick else 240)
    warmup = max(2, steps // 3)
    overrides = _throughput_overrides(steps, WORKERS, quick) + (QUICK_MODEL if quick else [])
    job = service_job(CONFIG, overrides, "hf-throughput")
    manifest = []

    def service() -> float:
        summary, history = run_service(service_job(CONFIG, overrides, f"hf-throughput-{time.monotonic_ns()}"))
        if not manifest:  # (the service prepared the data: the baseline reads the same files)
            manifest.append(prepare(job.data, str(Path(summary.run_dir).parent / "datasets"), log=lambda _: None))
        return steady_samples_per_s(history, warmup, job.train.global_batch_size)

    def baseline() -> float:
        return baseline_samples_per_s(manifest[0].root, job, steps, warmup)

    served, plain = interleaved(service, baseline, rounds=rounds)
    seq_len = manifest[0].spec["seq_len"]  # tokens a sample trains on (inputs = its row of seq_len + 1, shifted)
    pairs = paired_ratios(served, plain)
    vocab_size = manifest[0].spec["vocab_size"]
    parameters = _parameters(job, vocab_size)
    return {"service_tokens_per_s": median(served) * seq_len, "baseline_tokens_per_s": median(plain) * seq_len,
            "ratio": pairs["ratio_median"], "pairs": pairs,
            "tokens_per_s_per_round": {"service": [s * seq_len for s in served],
                                       "baseline": [b * seq_len for b in plain]},
            "parameters_m": round(parameters / 1e6, 2), "seq_len": seq_len, "vocab_size": vocab_size,
            "global_batch": job.train.global_batch_size, "workers": WORKERS,
            "threads_per_worker": job.train.torch_threads, "steps": steps, "warmup_steps": warmup, "rounds": rounds,
            "data": job.data.source, "baseline": "torchrun DDP (gloo), bench/hf_baseline_ddp.py"}


def _parameters(job, vocab_size: int) -> int:
    """The model's parameter count, from a meta-device build of the same config."""
    import torch  # (lazy: torch)
    import transformers  # (lazy: transformers)

    raw = {"vocab_size": vocab_size, **job.model.options.config}
    config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())

