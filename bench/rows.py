"""The benchmark rows. Each returns a dict: measured values, and ratios against a baseline measured
in the same run (never absolute timings to compare across machines)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from bench.common import (
    CONFIGS,
    REPO,
    interleaved,
    median,
    paired_ratios,
    run_baseline,
    run_service,
    service_job,
    steady_samples_per_s,
)
from bench.recovery import recovery  # noqa: F401  (the recovery row: a worker killed every 60 s)
from bench.sweep import sweep  # noqa: F401  (the sweep row: ASHA vs random search)
from bench.tokenize_memory import tokenize_memory  # noqa: F401  (peak RSS tokenizing a 64 MB document vs 4 MB)
from training.data.order import BatchPlan
from training.data.registry import prepare
from training.data.shards import SplitReader, TrainShard

# task -> (config, model options used by both the service and the baseline)
TASKS = {
    "digits": ("digits.yaml", {"hidden": [256, 128], "dropout": 0.1}),
    "tinylm": ("tinylm.yaml", {"n_layer": 2, "n_head": 4, "d_model": 128, "dropout": 0.0}),
}


# Quick mode (a harness check): language-model rows on a small slice of the corpus, and no ONNX
# export of the final model (after the measured window: it only costs wall time).
QUICK_TINYLM_DATA = "data.options={seq_len: 32, max_bytes: 60000}"
QUICK = ["tracking.export_onnx=false"]


def _throughput_overrides(steps: int, workers: int, quick: bool = False) -> list[str]:
    # Evaluate and checkpoint only at the end, so that both sides do the same work per step. Quick
    # runs are too short for the default report interval: report every few steps instead.
    cadence = ([f"train.log_every_n_steps={max(2, steps // 6)}", "train.min_report_interval_s=0", *QUICK]
               if quick else [])
    return cadence + [f"train.max_steps={steps}", f"train.eval_every_n_steps={steps}",
                      f"checkpoint.every_n_steps={steps}", f"scaling.num_workers={workers}",
                      "scaling.cpus_per_worker=1", "train.torch_threads=1", "tracking.register_model=false"]


def overhead(quick: bool) -> dict:
    """Service loop on Ray Train vs a plain Ray Train V2 loop vs plain torchrun DDP (and, at 1 worker,
    vs Ray Train with 1 worker vs a plain loop): the service's own cost (vs_raytrain), Ray Train's
    (raytrain_vs_baseline) and both together (overhead_ratio).

    The first third of the steps is warm-up, excluded on every side: for its first few seconds a
    Ray Train run shares the cores with the helper actors it starts beside the workers (dataset
    manager, preemption watcher), and a 20% warm-up at 600 steps measured that start-up rather
    than the loop (digits, 2 workers: 0.45 then, about 0.85 with the longer warm-up)."""
    from bench import baseline_raytrain  # (lazy: torch)

    steps = {"digits": 40 if quick else 9000, "tinylm": 12 if quick else 150}
    rounds = 1 if quick else 3
    row = {}
    # Quick mode checks the harness: one case, against both baselines (every case runs the same code).
    cases = [("digits", 2)] if quick else [(task, workers) for task in TASKS for workers in (2, 1)]
    for task, workers in cases:
        config, model_options = TASKS[task]
        n = steps[task]
        warmup = max(2, n // 3)
        data = [QUICK_TINYLM_DATA] if quick and task == "tinylm" else []
        overrides = _throughput_overrides(n, workers, quick) + data
        job = service_job(config, overrides, f"overhead-{task}-{workers}")
        root = []

        def service() -> float:
            name = f"overhead-{task}-{workers}-{time.monotonic_ns()}"
            summary, history = run_service(service_job(config, overrides, name))
            if not root:
                root.append(prepare(job.data, str(Path(summary.run_dir).parent / "datasets"), log=lambda _: None).root)
            return steady_samples_per_s(history, warmup, job.train.global_batch_size)

        def raytrain() -> float:  # the same data, model, batch, workers and steps in a plain Ray Train loop
            return baseline_raytrain.throughput(root[0], job.model.name, model_options, n, warmup,
                                                job.train.global_batch_size, workers)

        def baseline() -> float:
            return run_baseline(root[0], job.model.name, model_options, n, warmup, job.train.global_batch_size, workers)

        # service, Ray Train, baseline, service, Ray Train, baseline ...: a drift in the machine's
        # speed weighs on every side alike, and each round gives a ratio of each two sides (the
        # spread a ratio of medians hides)
        served, ray_trained, plain = interleaved(service, raytrain, baseline, rounds=rounds)
        pairs = paired_ratios(served, plain)
        vs_raytrain, raytrain_vs_baseline = paired_ratios(served, ray_trained), paired_ratios(ray_trained, plain)
        row[f"{task}_{workers}w"] = {
            "service_samples_per_s": median(served), "raytrain_samples_per_s": median(ray_trained),
            "baseline_samples_per_s": median(plain),
            # the service vs a plain Ray Train loop: its own cost (target >= 0.97)
            "vs_raytrain": vs_raytrain["ratio_median"], "vs_raytrain_pairs": vs_raytrain,
            # plain Ray Train vs the baseline: what Ray Train itself costs
            "raytrain_vs_baseline": raytrain_vs_baseline["ratio_median"],
            "raytrain_vs_baseline_pairs": raytrain_vs_baseline,
            # the service vs the baseline, as before the Ray Train side (old results stay comparable)
            "overhead_ratio": pairs["ratio_median"], "pairs": pairs,
            "samples_per_s_per_round": {"service": served, "raytrain": ray_trained, "baseline": plain},
            "steps": n, "warmup_steps": warmup, "repeats": rounds,
            "ray_train_health_check_interval_s": os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"),
            "raytrain": f"plain Ray Train V2 loop, {workers} worker(s) (bench/baseline_raytrain.py)",
            "baseline": "torchrun DDP (gloo)" if workers > 1 else "plain single-process loop"}
    return row


def cold_start(quick: bool, address: str | None = None) -> dict:
    """Command -> first training step, in phases, for `python -m training` starting its own Ray.
    With `address` (quick mode) it joins that cluster instead: the same phases, with "Ray start"
    the time to connect."""
    with tempfile.TemporaryDirectory() as base:
        # RAY_ADDRESS=local: start a new cluster even if another one runs on this machine.
        env = {**os.environ, "RAY_ADDRESS": address or "local", "TRAINING_BASE_DIR": base}
        started = time.time()
        subprocess.run([sys.executable, "-m", "training", str(CONFIGS / "digits.yaml"), "--name", "cold",
                        "--set", "train.max_steps=20", "--set", "tracking.enabled=false"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=True)
        t = json.loads(Path(base, "runs", "cold", "summary.json").read_text())["timings"]
    phases = {"python_config_and_data_s": t["data_ready"] - started, "ray_start_s": t["ray_ready"] - t["data_ready"],
              "tracking_s": t["tracking_ready"] - t["ray_ready"],
              "worker_group_start_s": t["worker_start"] - t["tracking_ready"],
              "first_step_s": t["first_step"] - t["worker_start"]}
    return {**{k: round(v, 2) for k, v in phases.items()},
            "command_to_first_step_s": round(t["first_step"] - started, 2)}


def checkpoint_cost(quick: bool) -> dict:
    """Step-time overhead of checkpointing (sync vs async upload) and write throughput vs the disk."""
    # quick: the overhead row's tinylm model (a 5 MB checkpoint) on the small slice of the corpus
    model = "{n_layer: 2, n_head: 4, d_model: 128}" if quick else "{n_layer: 4, n_head: 4, d_model: 256}"
    steps, every = (12, 4) if quick else (90, 15)
    warmup = steps // 3  # as in the overhead row: past the helper actors' start
    results = {}
    # quick: the sync run only (the harness is the same for every mode; async upload has its own
    # tests), so no stall is measured
    for mode in ("sync",) if quick else ("none", "sync", "async"):
        # A checkpoint is scored by its validation loss, so it evaluates first; every mode evaluates
        # at the checkpoint cadence, and the difference is the checkpoint alone (evaluating at
        # this cadence took ~12% of step time in a py-spy profile, more than the checkpoint itself).
        overrides = _throughput_overrides(steps, 2, quick) + [
            f"model.options={model}", f"train.eval_every_n_steps={every}",
            f"checkpoint.every_n_steps={steps if mode == 'none' else every}",
            f"checkpoint.upload={'sync' if mode == 'none' else mode}",
            "checkpoint.keep=1"] + ([QUICK_TINYLM_DATA] if quick else [])
        job = service_job("tinylm.yaml", overrides, f"ckpt-{mode}")
        summary, history = run_service(job)
        results[mode] = {"samples_per_s": steady_samples_per_s(history, warmup, job.train.global_batch_size),
                         "metrics": summary.metrics, "run_dir": summary.run_dir}
    sync = results["sync"]["metrics"]
    size = sync["checkpoint_bytes"]
    disk = raw_disk_write_bytes_per_s(Path(results["sync"]["run_dir"]), size)
    return {"checkpoint_mb": round(size / 1e6, 1), "every_n_steps": every,
            "sync_step_overhead": (1 - results["sync"]["samples_per_s"] / results["none"]["samples_per_s"]
                                   if "none" in results else None),
            "async_step_overhead": (1 - results["async"]["samples_per_s"] / results["none"]["samples_per_s"]
                                    if "async" in results else None),
            "sync_blocking_s": sync["checkpoint_blocking_s"], "save_s": sync["checkpoint_save_s"],
            "checkpoint_write_mb_per_s": size / sync["checkpoint_blocking_s"] / 1e6,
            "disk_write_mb_per_s": disk / 1e6,
            "write_throughput_ratio": (size / sync["checkpoint_blocking_s"]) / disk}


def raw_disk_write_bytes_per_s(directory: Path, size: int) -> float:
    """The physical limit: write `size` bytes and fsync, in the same directory, best of three."""
    payload = os.urandom(min(size, 64 << 20))
    best = 0.0
    for attempt in range(3):
        path = directory / f".disk-probe-{attempt}"
        start = time.perf_counter()
        with open(path, "wb") as f:
            written = 0
            while written < size:
                f.write(payload[: size - written])
                written += min(len(payload), size - written)
            f.flush()
            os.fsync(f.fileno())
        best = max(best, size / (time.perf_counter() - start))
        path.unlink()
    return best


def data_path(quick: bool, train_rate: dict) -> dict:
    """Parquet -> per-worker tensor batches vs a raw pyarrow read of the same files."""

    row = {}
    with tempfile.TemporaryDirectory() as cache:
        for task, (config, _) in TASKS.items():
            job = service_job(config, [], "data")
            manifest = prepare(job.data, cache, log=lambda _: None)
            files = [u for u in manifest.shard_uris("train")]
            raw, loader = [], []
            for _ in range(1 if quick else 3):
                start = time.perf_counter()
                rows = pq.read_table(files).num_rows
                raw.append(rows / (time.perf_counter() - start))
                start = time.perf_counter()  # opening the reader counts: a small split is read whole there
                shard = TrainShard(SplitReader(manifest, "train"), BatchPlan(job.train.global_batch_size, 2, 0),
                                   job.seed)
                produced = sum(len(next(iter(shard.batch(s).values()))) for s in range(shard.steps_per_epoch))
                loader.append(produced / (time.perf_counter() - start))
            per_worker_training = train_rate.get(task, 0) / 2
            row[task] = {"raw_parquet_rows_per_s": max(raw), "loader_rows_per_s_per_worker": max(loader),
                         "loader_vs_raw_read": max(loader) / max(raw),
                         "loader_vs_training_consumption":
                             max(loader) / per_worker_training if per_worker_training else None}
    return row


# Dense bf16 peak FLOP/s by device name (vendor datasheets), for model FLOPs utilisation.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def gpu(quick: bool) -> dict:
    """tinylm in bf16 on 1 GPU (and on all of them if more): tokens/s and MFU. CUDA machines only."""
    import torch  # (lazy: torch)

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine"}
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    n_layer, d_model, seq_len, steps = 8, 512, 256, (20 if quick else 200)
    row = {"device": name}
    for workers in sorted({1, torch.cuda.device_count()}):
        overrides = _throughput_overrides(steps, workers, quick) + [
            "scaling.use_gpu=true", "scaling.cpus_per_worker=1", "train.precision=bf16", "train.global_batch_size=64",
            f"model.options={{n_layer: {n_layer}, n_head: 8, d_model: {d_model}}}",
            f"data.options={{seq_len: {seq_len}, max_bytes: 4000000}}", "train.torch_threads=4"]
        job = service_job("tinylm.yaml", overrides, f"gpu-{workers}")
        summary, history = run_service(job)
        tokens_per_s = steady_samples_per_s(history, steps // 5, 64) * seq_len
        params = 12 * n_layer * d_model ** 2 + 256 * d_model + seq_len * d_model
        flops_per_token = 6 * params + 12 * n_layer * d_model * seq_len  # weights + attention (PaLM appendix B)
        row[f"{workers}_gpu"] = {"tokens_per_s": tokens_per_s,
                                 "mfu": tokens_per_s * flops_per_token / (peak * workers) if peak else None}
    return row
