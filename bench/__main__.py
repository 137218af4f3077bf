"""`python -m bench [--quick]`: every benchmark row in one run, written to bench/results.json and
bench/results.md (and, for a full run, the table in README.md)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

from bench import rows
from bench.common import REPO, machine
from bench.continuous import continuous
from bench.finetune import lora_vs_full, packing
from bench.hf_load import hf_load
from bench.hf_throughput import hf_throughput
from bench.report import markdown, update_readme
from bench.streaming import driver_memory, streaming
from bench.system_metrics import system_metrics
from bench.tokenizing import tokenizing
from training.run.session import ray_session

ROWS = ("cold_start", "overhead", "checkpoint", "data_path", "streaming", "driver_memory", "tokenize_memory",
        "hf_load", "hf_throughput", "tokenizing", "recovery",
        "recovery_continue", "continuous", "sweep", "memory", "gpu", "system_metrics", "lora_vs_full", "packing")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a few steps per row: checks the harness, not the numbers")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    p.add_argument("--out", default=str(REPO / "bench"), help="folder for results.json and results.md")
    p.add_argument("--wide-sweep", action="store_true",
                   help="the sweep row over 3 seeds of 8 trials of 240 steps (about 17 min on 2 cores) "
                        "instead of 1 seed of 6 trials of 160 steps")
    args = p.parse_args(argv)
    # Quick mode (the test suite's harness check) leaves out the continuous row unless asked for:
    # its two Ray Train runs add about 2 minutes to a suite already near its budget, and
    # tests/test_chaos_continue.py runs the same path (`--quick --rows continuous` checks its harness).
    wanted = args.rows.split(",")
    # The same for recovery_continue: the recovery row's path (tested in quick mode) with
    # failure.mode continue, whose kill and replacement test_chaos_continue.py runs; and for the
    # sweep row: two Tune sweeps (a minute here) whose ASHA path tests/test_tuning_ray.py runs, its
    # sweep files and arithmetic checked without Ray (tests/test_bench_math.py).
    # And for the fine-tuning rows: six service runs of a pretrained Llama each (minutes here), whose
    # paths tests/test_hf_lora.py and tests/test_hf_sft.py run and whose arithmetic
    # tests/test_bench_finetune.py checks.
    if args.quick and args.rows == ",".join(ROWS):
        for row in ("continuous", "recovery_continue", "sweep", "lora_vs_full", "packing"):
            wanted.remove(row)
    results: dict = {"machine": machine(), "date": datetime.date.today().isoformat(), "quick": args.quick, "rows": {},
                     "row_seconds": {}}
    started = time.monotonic()

    def timed(row: str, measure) -> None:
        begun = time.monotonic()
        results["rows"][row] = measure()
        results["row_seconds"][row] = round(time.monotonic() - begun, 1)

    with tempfile.TemporaryDirectory() as base:
        if "memory" in wanted:  # two gloo processes, no Ray
            from bench.memory import memory  # (lazy: torch)

            timed("memory", lambda: memory(args.quick))
        if "streaming" in wanted:  # one process, no Ray
            timed("streaming", lambda: streaming(args.quick))
        if "driver_memory" in wanted:  # fresh processes, no Ray
            timed("driver_memory", lambda: driver_memory(args.quick))
        if "tokenize_memory" in wanted:  # fresh processes, no Ray
            timed("tokenize_memory", lambda: rows.tokenize_memory(args.quick))
        if "hf_load" in wanted:  # fresh gloo processes, no Ray
            timed("hf_load", lambda: hf_load(args.quick))
        if "cold_start" in wanted and not args.quick:  # first: it starts its own Ray, and must find none running
            timed("cold_start", lambda: rows.cold_start(args.quick))
        import ray  # (lazy: ray)


        os.environ["TRAINING_BASE_DIR"] = base
        # a cluster of this machine's CPUs that nothing else uses, stopped at the end
        with ray_session(own_cluster=True, log_to_driver=False):
            if "cold_start" in wanted and args.quick:  # quick: one Ray start for every row
                timed("cold_start", lambda: rows.cold_start(args.quick, address=ray.get_runtime_context().gcs_address))
            if "overhead" in wanted:
                timed("overhead", lambda: rows.overhead(args.quick))
            if "checkpoint" in wanted:
                timed("checkpoint", lambda: rows.checkpoint_cost(args.quick))
            if "data_path" in wanted:
                rates = {task: results["rows"].get("overhead", {}).get(f"{task}_2w", {}).get("service_samples_per_s", 0)
                         for task in rows.TASKS}
                timed("data_path", lambda: rows.data_path(args.quick, rates))
            if "system_metrics" in wanted:  # quick: the sampler's own cost only, no Ray
                timed("system_metrics", lambda: system_metrics(args.quick))
            if "hf_throughput" in wanted:  # an HF Llama: the service vs plain torchrun DDP
                timed("hf_throughput", lambda: hf_throughput(args.quick))
            if "lora_vs_full" in wanted:  # LoRA vs full fine-tuning of a pretrained Llama, DDP 2 workers
                timed("lora_vs_full", lambda: lora_vs_full(args.quick))
            if "packing" in wanted:  # packed vs one-a-row chat rows: useful tokens/s
                timed("packing", lambda: packing(args.quick))
            if "tokenizing" in wanted:
                timed("tokenizing", lambda: tokenizing(args.quick))
            if "gpu" in wanted:
                timed("gpu", lambda: rows.gpu(args.quick))
            if "recovery" in wanted:
                timed("recovery", lambda: rows.recovery(args.quick))
            if "recovery_continue" in wanted:  # the same kills every 60 s, failure.mode continue
                timed("recovery_continue", lambda: rows.recovery(args.quick, mode="continue"))
            if "continuous" in wanted:  # failure.mode continue: a worker killed, the survivor goes on
                timed("continuous", lambda: continuous(args.quick))
            if "sweep" in wanted:
                wide = dict(seeds=[0, 1, 2], samples=8, steps=240) if args.wide_sweep and not args.quick else {}
                timed("sweep", lambda: rows.sweep(args.quick, **wide))
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    out = Path(args.out)
    if not args.quick and (out / "results.json").is_file():  # a subset: the other rows stay as measured
        results = merged(json.loads((out / "results.json").read_text()), results)
    results["ratios"] = ratios(results["rows"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=float) + "\n")
    table = markdown(results)
    (out / "results.md").write_text(table)
    print(table)
    if not args.quick and out.resolve() == (REPO / "bench").resolve():
        update_readme(REPO / "README.md", table)
    return 0


def merged(before: dict, now: dict) -> dict:
    """The rows measured now over those of earlier runs (each row with the date and machine of the
    run that measured it, in `row_runs`): the file holds every row the README quotes."""
    if now["quick"] or before.get("quick"):
        return now
    runs = {row: {"date": before["date"], "machine": before["machine"]} for row in before["rows"]}
    runs.update(before.get("row_runs") or {})
    runs.update({row: {"date": now["date"], "machine": now["machine"]} for row in now["rows"]})
    return {**now, "rows": {**before["rows"], **now["rows"]},
            "row_seconds": {**before.get("row_seconds", {}), **now["row_seconds"]}, "row_runs": runs}


def ratios(rows_: dict) -> dict:
    found = {}
    for key, value in rows_.get("overhead", {}).items():
        found[f"overhead_ratio_{key}"] = value["overhead_ratio"]
        if value.get("vs_raytrain") is not None:  # (results from before the plain Ray Train side: none)
            found[f"overhead_vs_raytrain_{key}"] = value["vs_raytrain"]
            found[f"overhead_raytrain_vs_baseline_{key}"] = value["raytrain_vs_baseline"]
    if "checkpoint" in rows_:
        for key in ("sync_step_overhead", "async_step_overhead", "write_throughput_ratio"):
            if rows_["checkpoint"][key] is not None:  # (quick mode: neither stall is measured)
                found[f"checkpoint_{key}"] = rows_["checkpoint"][key]
    for task, value in rows_.get("data_path", {}).items():
        found[f"data_loader_vs_raw_read_{task}"] = value["loader_vs_raw_read"]
        if value["loader_vs_training_consumption"] is not None:
            found[f"data_loader_vs_training_{task}"] = value["loader_vs_training_consumption"]
    if "streaming" in rows_:
        found["streaming_loader_vs_raw_read"] = rows_["streaming"]["loader_vs_raw_read"]
        found["streaming_read_fraction_per_worker"] = rows_["streaming"]["read_fraction_per_worker"]
        found["streaming_rss_growth_vs_budget"] = rows_["streaming"]["rss_growth_vs_budget"]
    if "system_metrics" in rows_:
        v = rows_["system_metrics"]
        found["system_metrics_core_share_at_default_interval"] = v["core_share_at_default_interval"]
        if "throughput" in v:
            found["system_metrics_sampled_every_1s_vs_off"] = v["throughput"]["ratio_median"]
    if "tokenizing" in rows_:
        found["tokenizing_ray_data_vs_one_process"] = rows_["tokenizing"]["ray_data_vs_one_process"]
    for source, value in rows_.get("driver_memory", {}).items():
        found[f"driver_prepare_peak_rss_10x_vs_1x_{source}"] = value["large_vs_small_peak_rss"]
    if "tokenize_memory" in rows_:
        found["tokenize_single_document_peak_rss_64mb_vs_4mb"] = rows_["tokenize_memory"]["large_vs_small_peak_rss"]
    if "hf_load" in rows_:
        found["hf_sharded_load_rss_growth_vs_checkpoint"] = rows_["hf_load"]["sharded_rss_growth_vs_checkpoint"]
        found["hf_whole_load_rss_growth_vs_checkpoint"] = rows_["hf_load"]["whole_rss_growth_vs_checkpoint"]
        found["hf_sharded_load_vs_raw_safetensors_read"] = rows_["hf_load"]["sharded_load_vs_raw_read"]
    if "hf_throughput" in rows_:
        found["hf_llama_service_vs_torchrun_ddp_tokens_per_s"] = rows_["hf_throughput"]["ratio"]
    if "lora_vs_full" in rows_:
        v = rows_["lora_vs_full"]
        found["lora_vs_full_checkpoint_bytes"] = v["checkpoint_bytes_ratio"]
        found["lora_vs_full_optimizer_state_bytes"] = v["optimizer_state_bytes_ratio"]
        found["lora_vs_full_tokens_per_s"] = v["tokens_per_s_ratio"]
    if "packing" in rows_:
        found["packed_vs_padded_useful_tokens_per_s"] = rows_["packing"]["ratio"]
    if "memory" in rows_:
        found["memory_fsdp_vs_ddp_per_worker"] = rows_["memory"]["fsdp_vs_ddp_ratio"]
    if rows_.get("recovery", {}).get("efficiency") is not None:
        found["recovery_efficiency_failure_every_60s"] = rows_["recovery"]["efficiency"]
    if (rows_.get("recovery_continue") or {}).get("efficiency") is not None:
        found["recovery_continue_goodput_efficiency_failure_every_60s"] = \
            rows_["recovery_continue"]["goodput_efficiency"]
    if rows_.get("recovery", {}).get("kill_to_next_step_vs_plain_ray_train") is not None:
        found["restart_kill_to_next_step_vs_plain_ray_train"] = \
            rows_["recovery"]["kill_to_next_step_vs_plain_ray_train"]
    if rows_.get("continuous", {}).get("kill_to_next_step_s_median") is not None:
        found["continuous_kill_to_survivor_next_step_s"] = rows_["continuous"]["kill_to_next_step_s_median"]
        found["continuous_val_loss_vs_failure_free_twin"] = \
            rows_["continuous"]["val_loss_chaos_vs_twin"]["ratio_median"]
    if rows_.get("sweep", {}).get("steps_to_target_ratio") is not None:
        found["sweep_asha_vs_random_steps_to_target"] = rows_["sweep"]["steps_to_target_ratio"]
    return found


if __name__ == "__main__":
    raise SystemExit(main())
