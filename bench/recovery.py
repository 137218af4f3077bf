"""Recovery row: a digits run with a Ray Train worker SIGKILLed every `interval_s`, against the same
run with no failures, and against a plain Ray Train loop under the same kills, in the same Ray
cluster. Measured from the run's own metrics in MLflow:
- kill -> next step: seconds from each kill to the first step of the restarted worker group; the
  plain Ray Train loop's (bench/baseline_raytrain.py) beside it, the floor a restart cannot beat;
- steps lost: the step the run had reached at the kill minus the step the new group resumed from;
- efficiency: failure-free wall time / wall time with failures, for the same steps: a real
  failure-free twin of the same run, interleaved with the chaotic one (twin, chaos, plain, twin,
  chaos, plain), as per-pair ratios with their median, min and max.
A failure comes `interval_s` of training after the previous recovery (60 s in a full run)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import psutil
import pyarrow.fs as pafs

from bench.common import median, paired_ratios, run_service, service_job
from training.data.registry import prepare
from training.metrics import mlflow_name
from training.run.paths import resolve_paths


def train_worker_pids() -> list[int]:
    """The Ray Train workers of the cluster this process started (its raylet is this process's child,
    the workers the raylet's): never a worker of another Ray on the machine."""

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = child.cmdline()
        except psutil.Error:  # gone meanwhile
            continue
        if cmdline and cmdline[0].startswith("ray::RayTrainWorker"):
            found.append(child.pid)
    return found


def _newest_checkpoint(run_dir: Path) -> int:
    from training.checkpoint.format import newest_complete  # (lazy: torch)

    newest = newest_complete(pafs.LocalFileSystem(), str(run_dir))
    return newest[0] if newest else -1


def _killer(progress, interval_s: float, stop: threading.Event, kills: list[float], max_kills: int,
            seed: int = 0) -> None:
    """Kill a random training worker `interval_s` after the worker group (re)started training (seen
    by its first new checkpoint: `progress()`, the newest checkpoint's step), up to max_kills times."""
    rng, seen = random.Random(seed), -1
    while len(kills) < max_kills:
        while progress() <= seen:  # wait for the (new) group to train
            if stop.wait(0.2):
                return
        if stop.wait(interval_s):
            return
        pids = train_worker_pids()
        if pids:
            seen = progress()
            try:
                os.kill(rng.choice(pids), signal.SIGKILL)
                kills.append(time.time())
            except ProcessLookupError:
                pass


def under_kills(train, progress, interval_s: float, max_kills: int):
    """train() with a killer thread beside it; returns (its result, the kill times)."""
    kills: list[float] = []
    stop = threading.Event()
    killer = threading.Thread(target=_killer, args=(progress, interval_s, stop, kills, max_kills), daemon=True)
    killer.start()
    try:
        return train(), kills
    finally:
        stop.set()
        killer.join(timeout=5)


def _metrics(summary) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient  # (lazy: mlflow)

    client = MlflowClient(summary.tracking_uri)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(summary.mlflow_run_id, mlflow_name(key)))
            for key in ("wall_time", "first_step_time", "start_step", "worker_start_time")}


def analyse(kills: list[float], metrics: dict) -> list[dict]:
    """Per kill: seconds to the next group's first step, in two parts (kill -> the train function
    starting on the new group: Ray Train's detection, teardown, new actors and process group; the
    function's start -> its first step: data, model, restore, the step), and steps lost."""
    progress = metrics["wall_time"]  # (step, wall clock of that report)
    worker_starts = [value for _, value in metrics.get("worker_start_time", [])]
    groups = sorted({(first, start, worker_start) for (_, first), (_, start), worker_start in
                     zip(metrics["first_step_time"], metrics["start_step"],
                         worker_starts or [None] * len(metrics["first_step_time"]))},
                    key=lambda group: group[0])
    found = []
    for kill in kills:
        after = [group for group in groups if group[0] > kill]
        before = [(step, wall) for step, wall in progress if wall <= kill]
        if not after or not before:
            continue
        first, start, worker_start = after[0]
        # the step reached at the kill: the last report before it, plus the rate of the reports before that
        (s1, w1), (s0, w0) = before[-1], (before[-2] if len(before) > 1 else before[-1])
        rate = (s1 - s0) / (w1 - w0) if w1 > w0 else 0.0
        reached = s1 + rate * (kill - w1)
        found.append({"kill_to_next_step_s": first - kill, "steps_lost": max(0.0, reached - start),
                      "kill_to_train_function_s": worker_start - kill if worker_start else None,
                      "train_function_to_first_step_s": first - worker_start if worker_start else None})
    return found


def _median_of(per_kill: list[dict], key: str):
    values = [k[key] for k in per_kill if k.get(key) is not None]
    return median(values) if values else None


def recovery(quick: bool, mode: str = "restart") -> dict:
    """`mode`: the job's failure.mode. In continue mode the survivors train on while the killed
    group is replaced, and there is no plain Ray Train run to compare (it can only restart)."""
    from bench import baseline_raytrain  # (lazy: torch)

    # A full run trains ~2.5 minutes, so two failures land, against a failure-free twin of the same
    # steps; two rounds. Quick: one round, the kill 1 s after the first checkpoint (step 40), well
    # before the end (with 5 s it came at the last step once), and no twin (a run without kills,
    # through the same `run_service`: it would check nothing the chaos run does not, and it costs a
    # worker group's start). Each round: the twin, the service under kills, and a plain Ray Train
    # loop (bench/baseline_raytrain.py) under the same kills.
    interval_s, steps, max_kills, every, rounds = (1.0, 160, 1, 40, 1) if quick else (60.0, 24000, 100, 500, 2)
    if mode == "continue" and not quick:
        # a torchft quorum every step: digits on 2 CPU workers takes ~19 steps/s in continue mode
        # (24000 steps: 21 minutes a run, against ~2.5 in restart mode), so 3000 steps, ~2.5 minutes
        steps = 3000
    overrides = [f"train.eval_every_n_steps={steps // 10}", f"checkpoint.every_n_steps={every}",
                 "train.log_every_n_steps=10", "train.min_report_interval_s=0.5", "train.global_batch_size=32",
                 "scaling.num_workers=2", "scaling.cpus_per_worker=1", "train.torch_threads=1",
                 "failure.max_failures=-1", "checkpoint.keep=1", "tracking.register_model=false",
                 f"train.max_steps={steps}", f"failure.mode={mode}"]
    per_kill: list[dict] = []
    plain_per_kill: list[dict] = []
    kills_total = [0, 0]
    clean_walls, chaos_walls, plain_walls = [], [], []
    skipped_fraction: list[float] = []

    def clean() -> float:
        summary, _ = run_service(service_job("digits.yaml", overrides, f"recovery-clean-{time.monotonic_ns()}"))
        return summary.wall_s

    def chaos() -> float:
        name = f"recovery-chaos-{time.monotonic_ns()}"
        job = service_job("digits.yaml", overrides, name)
        run_dir = Path(resolve_paths(job, name).run_dir)
        (chaotic, _), kills = under_kills(lambda: run_service(job), lambda: _newest_checkpoint(run_dir),
                                          interval_s, max_kills)
        per_kill.extend(analyse(kills, _metrics(chaotic)))
        kills_total[0] += len(kills)
        # (failure.mode continue: the samples of the steps the dead group missed are not trained on)
        skipped_fraction.append(float(chaotic.metrics.get("samples_skipped", 0))
                                / (steps * job.train.global_batch_size))
        return chaotic.wall_s

    def plain() -> float:
        name = f"recovery-plain-{time.monotonic_ns()}"
        job = service_job("digits.yaml", overrides, name)
        run_dir = Path(resolve_paths(job, name).run_dir)
        root = prepare(job.data, str(run_dir.parent / "datasets"), log=lambda _: None).root
        events = run_dir.parent / f"{name}.events.jsonl"
        wall, kills = under_kills(
            lambda: baseline_raytrain.fit(root, events, str(run_dir.parent), name, job.model.name,
                                          job.model.options_as_written(), steps, every, job.train.global_batch_size,
                                          lr=job.optim.lr, seed=job.seed),
            # (quick: at its first checkpoint; the plain loop trains 160 steps in about a second)
            lambda: baseline_raytrain.newest_checkpoint(events), 0.0 if quick else interval_s, max_kills)
        plain_per_kill.extend(analyse(kills, baseline_raytrain.as_metrics(events)))
        kills_total[1] += len(kills)
        return wall

    for _ in range(rounds):  # twin, service, plain Ray Train; again: a drift weighs on all alike
        if not quick:
            clean_walls.append(clean())
        chaos_walls.append(chaos())
        if mode == "restart":
            plain_walls.append(plain())
    efficiency = paired_ratios(clean_walls, chaos_walls) if clean_walls else {"ratio_median": None}
    # goodput: the same ratio per sample trained on (wall time per useful sample), which is the
    # wall-time ratio in restart mode and counts a continue run's skipped samples as lost work
    goodput = paired_ratios(clean_walls, [wall / max(1e-9, 1 - f) for wall, f in zip(chaos_walls, skipped_fraction)]) \
        if clean_walls else {"ratio_median": None}
    ours = [k["kill_to_next_step_s"] for k in per_kill]
    theirs = [k["kill_to_next_step_s"] for k in plain_per_kill]
    return {
        "mode": mode, "steps": steps, "failure_every_s": interval_s, "kills": kills_total[0],
        "recoveries_measured": len(per_kill),
        "kill_to_next_step_s_median": median(ours) if ours else None,
        "steps_lost_median": median([k["steps_lost"] for k in per_kill]) if per_kill else None,
        "checkpoint_every_n_steps": every, "clean_wall_s": clean_walls, "chaos_wall_s": chaos_walls,
        "efficiency": efficiency["ratio_median"], "efficiency_pairs": efficiency if clean_walls else None,
        "goodput_efficiency": goodput["ratio_median"], "goodput_pairs": goodput if clean_walls else None,
        "samples_skipped_fraction": skipped_fraction,
        "per_kill": per_kill,
        "kill_to_train_function_s_median": _median_of(per_kill, "kill_to_train_function_s"),
        "train_function_to_first_step_s_median": _median_of(per_kill, "train_function_to_first_step_s"),
        # the same kills of a plain Ray Train loop: the floor a restart cannot go under
        "plain_ray_train": None if mode != "restart" else {
                            "kills": kills_total[1], "recoveries_measured": len(plain_per_kill),
                            "kill_to_next_step_s_median": median(theirs) if theirs else None,
                            "kill_to_train_function_s_median": _median_of(plain_per_kill, "kill_to_train_function_s"),
                            "train_function_to_first_step_s_median":
                                _median_of(plain_per_kill, "train_function_to_first_step_s"),
                            "kill_to_next_step_s": theirs, "wall_s": plain_walls, "per_kill": plain_per_kill},
        "kill_to_next_step_vs_plain_ray_train": (median(ours) / median(theirs)) if ours and theirs else None,
    }
