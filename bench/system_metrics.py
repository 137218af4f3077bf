"""The system_metrics row: what sampling a node costs the training it watches.

Two measures. The sampler's own cost: the CPU seconds of one sample of this machine (MLflow's
CPU, disk and network monitors, the throughput one and a worker's RSS), as a fraction of the
sampling interval; that is the share of one core it takes. And (full runs) digits throughput,
2 workers, with samples every second (ten times the default rate) vs none, interleaved, as a
paired ratio with its spread.
"""

from __future__ import annotations

import time

from bench.common import interleaved, median, paired_ratios, run_service, service_job, steady_samples_per_s
from training.observe.system import SystemSampler, node_monitors, process_monitor

DEFAULT_INTERVAL_S = 10.0
FAST_INTERVAL_S = 1.0


def sampler_cost_s(samples: int) -> float:
    """Median CPU seconds of one sample of this node and this process."""

    sampler = SystemSampler(DEFAULT_INTERVAL_S, "node-bench", node_monitors() + [process_monitor(0)])
    costs = []
    for _ in range(samples):
        begun = time.process_time()
        sampler.sample_now()
        costs.append(time.process_time() - begun)
        time.sleep(0.01)
    sampler.take()
    return median(costs)


def system_metrics(quick: bool) -> dict:
    cost = sampler_cost_s(20 if quick else 200)
    row = {"sample_cpu_s": cost, "core_share_at_default_interval": cost / DEFAULT_INTERVAL_S,
           "core_share_at_1s": cost / FAST_INTERVAL_S, "default_interval_s": DEFAULT_INTERVAL_S}
    if quick:  # the throughput pairs start 2 worker groups per round: full runs only
        return row
    steps, warmup = 1200, 400
    overrides = [f"train.max_steps={steps}", f"train.eval_every_n_steps={steps}", f"checkpoint.every_n_steps={steps}",
                 "scaling.num_workers=2", "scaling.cpus_per_worker=1", "train.torch_threads=1",
                 "tracking.register_model=false", "tracking.export_onnx=false"]

    def throughput(interval_s: float):
        def measure() -> float:
            job = service_job("digits.yaml", overrides + [f"tracking.system_metrics_interval_s={interval_s}"],
                              f"system-metrics-{interval_s:g}-{time.monotonic_ns()}")
            _, history = run_service(job)
            return steady_samples_per_s(history, warmup, job.train.global_batch_size)
        return measure

    sampled, unsampled = interleaved(throughput(FAST_INTERVAL_S), throughput(0), rounds=3)
    return {**row, "steps": steps, "warmup_steps": warmup, "sampled_interval_s": FAST_INTERVAL_S,
            "sampled_samples_per_s": sampled, "unsampled_samples_per_s": unsampled,
            "throughput": paired_ratios(sampled, unsampled)}
