"""Continuous-training row (failure.mode continue): a digits run with one Ray Train worker
SIGKILLed once it has trained a while, against its failure-free twin in the same Ray cluster, the
two run interleaved (twin, chaos, twin, chaos ...). Measured:
- kill -> next step of a surviving worker: from the kill to the survivor's first step without the
  dead group (the `replica_lost` event the survivor records, at the time it committed that step);
- short steps and samples skipped, from the run's own summary;
- the final validation loss against the twin's (a ratio per pair: median, min, max).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from bench.common import interleaved, median, paired_ratios, run_service, service_job
from bench.recovery import train_worker_pids  # (this cluster's own workers only)
from training.metrics import mlflow_name


def _kill_one_after(run_dir: Path, first_checkpoint: str, kills: list[float], stop: threading.Event) -> None:
    while not (run_dir / first_checkpoint / "meta.json").exists():
        if stop.wait(0.1):
            return
    pids = sorted(train_worker_pids())
    if pids:
        os.kill(pids[0], signal.SIGKILL)
        kills.append(time.time())


def kill_to_next_step_s(kill_s: float, lost_timestamps_ms: list[int]) -> float | None:
    """Seconds from the kill to the first `replica_lost` event after it (None: none came)."""
    after = [t / 1000 for t in lost_timestamps_ms if t / 1000 >= kill_s]
    return min(after) - kill_s if after else None


def continuous(quick: bool) -> dict:
    from mlflow.tracking import MlflowClient  # (lazy: mlflow)

    steps, every, rounds = (200, 50, 1) if quick else (2000, 200, 3)
    overrides = ["failure.mode=continue", "scaling.num_workers=2", "scaling.cpus_per_worker=0.5",
                 "train.torch_threads=1", f"train.max_steps={steps}", f"checkpoint.every_n_steps={every}",
                 f"train.eval_every_n_steps={every}", "train.log_every_n_steps=10",
                 "train.global_batch_size=64", "failure.max_failures=-1", "tracking.register_model=false"]
    per_kill: list[dict] = []
    counter = {"twin": 0, "chaos": 0}

    def twin() -> float:
        counter["twin"] += 1
        summary, _ = run_service(service_job("digits.yaml", overrides, f"continuous-twin-{counter['twin']}"))
        return summary.metrics["val_loss"]

    def chaos() -> float:
        counter["chaos"] += 1
        name = f"continuous-chaos-{counter['chaos']}"
        run_dir = Path(os.environ.get("TRAINING_BASE_DIR", ".")) / "runs" / name
        kills: list[float] = []
        stop = threading.Event()
        killer = threading.Thread(target=_kill_one_after, args=(run_dir, f"checkpoint-{every:08d}", kills, stop),
                                  daemon=True)
        killer.start()
        try:
            summary, _ = run_service(service_job("digits.yaml", overrides, name))
        finally:
            stop.set()
            killer.join(timeout=5)
        client = MlflowClient(summary.tracking_uri)
        lost = client.get_metric_history(summary.mlflow_run_id, mlflow_name("replica_lost"))
        rejoined = client.get_metric_history(summary.mlflow_run_id, mlflow_name("replica_rejoined"))
        per_kill.append({"kill_to_next_step_s": kill_to_next_step_s(kills[0], [m.timestamp for m in lost])
                         if kills else None,
                         # the replacement's start, restore and heal, while the survivor trains alone
                         "kill_to_rejoin_s": kill_to_next_step_s(kills[0], [m.timestamp for m in rejoined])
                         if kills else None,
                         "short_steps": summary.metrics.get("short_steps"),
                         "samples_skipped": summary.metrics.get("samples_skipped"), "wall_s": summary.wall_s})
        return summary.metrics["val_loss"]

    twin_losses, chaos_losses = interleaved(twin, chaos, rounds)
    measured = [k["kill_to_next_step_s"] for k in per_kill if k["kill_to_next_step_s"] is not None]
    rejoins = [k["kill_to_rejoin_s"] for k in per_kill if k["kill_to_rejoin_s"] is not None]
    return {"steps": steps, "rounds": rounds,
            "kill_to_next_step_s_median": median(measured) if measured else None,
            "kill_to_next_step_s_max": max(measured) if measured else None,
            "kill_to_rejoin_s_median": median(rejoins) if rejoins else None,
            "val_loss_chaos_vs_twin": paired_ratios(chaos_losses, twin_losses),
            "per_kill": per_kill}
