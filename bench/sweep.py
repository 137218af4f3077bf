"""Sweep row: ASHA against random search (FIFO: every trial to the end) with the same trial budget and
the same draws on digits. Measured: trial-steps spent, over all trials in wall-clock order, until the
first evaluation at or above a target validation accuracy, and in the whole sweep; ASHA / random as
a ratio (below 1: ASHA gets there with less work), over a few seeds."""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.common import CONFIGS, median
from tuning import config as sweep_config
from tuning.sweep import run_sweep

SPACE = """space:
  optim.lr: {loguniform: [1.0e-5, 3.0e-2]}
  model.options.dropout: {uniform: [0.0, 0.5]}
  model.options.hidden: {choice: [[32], [128, 64]]}
"""


def steps_to_target(rows, target: float):
    """Trial-steps spent by all trials until the first evaluation >= target (None if never)."""
    events = sorted((wall, row.trial_id, step, value) for row in rows for step, value, wall in row.timeline)
    spent: dict[str, int] = {}
    for wall, trial_id, step, value in events:
        spent[trial_id] = max(spent.get(trial_id, 0), step)
        if value >= target:
            return sum(spent.values())
    return None


def sweep_file(scheduler: str, seed: int, samples: int, steps: int, base: Path) -> Path:
    """The sweep file of one side of a seed: digits, `samples` trials of up to `steps` steps."""
    body = (f"base: {CONFIGS / 'digits.yaml'}\nset: [train.max_steps={steps}, train.eval_every_n_steps={steps // 8},"
            f" checkpoint.every_n_steps={steps // 2}, checkpoint.keep=1, train.log_every_n_steps={steps // 8},"
            " train.min_report_interval_s=0, tracking.experiment=bench-sweep, tracking.register_model=false]\n"
            f"{SPACE}search: {{algorithm: random, seed: {seed}}}\n"
            f"scheduler: {{name: {scheduler}, grace_period_steps: {steps // 8}, reduction_factor: 2}}\n"
            f"num_samples: {samples}\n"
            "trial: {driver_cpus: 0.25, scaling: {num_workers: 1, cpus_per_worker: 0.5}}\n")
    path = base / f"{scheduler}-{seed}.yaml"
    path.write_text(body)
    return path


def _run(scheduler: str, seed: int, samples: int, steps: int, base: Path) -> tuple[list, int]:
    path = sweep_file(scheduler, seed, samples, steps, base)
    summary = run_sweep(sweep_config.load(path, name=f"bench-{scheduler}-{seed}"), log=lambda line: None)
    return summary.rows, sum(row.steps for row in summary.rows)


def sweep(quick: bool, seeds=None, samples=None, steps=None) -> dict:
    # A trial costs ~20 s here whatever its length (a Ray Train run starts ~8 processes), so a full
    # run is one seed of 6 trials (`python -m bench --wide-sweep`: 3 seeds of 8 trials of 240 steps).
    seeds = seeds or [0]
    samples, steps = samples or (1 if quick else 6), steps or (16 if quick else 160)
    target = 0.3 if quick else 0.95
    per_seed = []
    with tempfile.TemporaryDirectory() as base:
        for seed in seeds:
            result = {"seed": seed}
            for scheduler in ("asha", "fifo"):
                rows, total = _run(scheduler, seed, samples, steps, Path(base))
                result[scheduler] = {"steps_to_target": steps_to_target(rows, target), "total_steps": total,
                                     "stopped": sum(r.status == "stopped" for r in rows)}
            per_seed.append(result)
    return summarise(per_seed, target, samples, steps)


def summarise(per_seed: list[dict], target: float, samples: int, steps: int) -> dict:
    """The row from each seed's two sides: ASHA / random, steps to the target and in all."""
    reached = [r for r in per_seed if r["asha"]["steps_to_target"] and r["fifo"]["steps_to_target"]]
    return {"target_val_accuracy": target, "trials": samples, "max_steps": steps, "seeds": per_seed,
            "steps_to_target_ratio": median([r["asha"]["steps_to_target"] / r["fifo"]["steps_to_target"]
                                             for r in reached]) if reached else None,
            "total_steps_ratio": median([r["asha"]["total_steps"] / r["fifo"]["total_steps"] for r in per_seed])}
