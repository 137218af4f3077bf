"""Shared pieces of the benchmarks: running the service in-process, reading its throughput back."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
from pathlib import Path

from training import config as config_lib
from training.metrics import mlflow_name
from training.run.driver import run_training

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "training" / "configs"


def machine() -> dict:
    import ray  # (lazy: ray)
    import torch  # (lazy: torch)

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "ray": ray.__version__,
            "python": platform.python_version(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def service_job(config: str, overrides: list[str], name: str):
    return config_lib.load(CONFIGS / config, overrides, name=name)


def run_service(job):
    """Run a training job in this process (Ray already started) and return (summary, history)."""
    from mlflow.tracking import MlflowClient  # (lazy: mlflow)


    summary = run_training(job, log=lambda line: None)
    client = MlflowClient(summary.tracking_uri)
    wall_times = client.get_metric_history(summary.mlflow_run_id, mlflow_name("wall_time"))
    history = sorted((m.step, m.value) for m in wall_times)
    return summary, history


def steady_samples_per_s(history: list[tuple[int, float]], warmup_steps: int, global_batch: int) -> float:
    """Samples/s between the first report at or after the warm-up and the last report."""
    points = [(step, wall) for step, wall in history if step >= warmup_steps]
    if len(points) < 2:
        raise RuntimeError(f"too few reports after warm-up to measure throughput: {history}")
    (s0, w0), (s1, w1) = points[0], points[-1]
    return (s1 - s0) * global_batch / (w1 - w0)


def run_baseline(manifest_root: str, model: str, model_options: dict, steps: int, warmup_steps: int,
                 global_batch: int, workers: int, threads: int = 1) -> float:
    script = [str(REPO / "bench" / "baseline_ddp.py"), "--manifest", manifest_root, "--model", model,
              "--model-options", json.dumps(model_options), "--steps", str(steps), "--warmup-steps", str(warmup_steps),
              "--global-batch", str(global_batch), "--threads", str(threads)]
    if workers > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(workers),
                   "--master_port", str(free_port()), *script]
    else:
        command = [sys.executable, *script]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["samples_per_s"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def median(values):
    return statistics.median(values)


def interleaved(*sides, rounds: int | None = None) -> tuple[list[float], ...]:
    """A B A B ... (or A B C A B C ... for three sides): `rounds` measurements of each side, in turn,
    so that a drift in the machine's speed (another job starting, a CPU throttling) weighs on every
    side alike. `interleaved(a, b, c, rounds=3)`; `interleaved(a, b, 3)` reads the last argument as
    the rounds. One list of measurements per side, in the order given."""
    if rounds is None:
        *sides, rounds = sides
    assert len(sides) >= 2 and all(callable(side) for side in sides), "two or more measuring functions"
    found: tuple[list[float], ...] = tuple([] for _ in sides)
    for _ in range(rounds):
        for measure, measured in zip(sides, found):
            measured.append(measure())
    return found


def paired_ratios(a: list[float], b: list[float]) -> dict:
    """a[i] / b[i] for each interleaved pair: the median ratio with its min and max (the spread a
    single ratio of medians hides)."""
    assert len(a) == len(b) > 0, "one measurement of each side per round"
    ratios = [x / y for x, y in zip(a, b)]
    return {"ratio_median": median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratios": ratios, "rounds": len(ratios)}
