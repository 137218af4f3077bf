"""The benchmark table in Markdown, and its copy in README.md between two markers."""

from __future__ import annotations

import statistics
from pathlib import Path

START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def _f(value, digits=2):
    return "n/a" if value is None else f"{value:.{digits}f}"


def _took(results: dict) -> str:
    if not results.get("elapsed_s"):
        return ""
    runs = results.get("row_runs") or {}
    this_run = {k: v for k, v in results.get("row_seconds", {}).items()
                if runs.get(k, results)["date"] == results["date"]}  # (a merged file: this run's rows)
    rows = ", ".join(f"{k} {v / 60:.1f}" for k, v in sorted(this_run.items(), key=lambda kv: -kv[1]) if v >= 60)
    return f" The run took {results['elapsed_s'] / 60:.0f} min{f' ({rows} min)' if rows else ''}."


def _later(results: dict) -> str:
    """Rows measured by other runs than this one (a file that merges runs: bench/__main__.py)."""
    others: dict = {}
    for row, run in (results.get("row_runs") or {}).items():
        if run["date"] != results["date"] or run["machine"] != results["machine"]:
            others.setdefault(f"{run['date']} on {run['machine'].get('cpu') or 'unknown CPU'}", []).append(row)
    return "".join(f" Rows {', '.join(sorted(rows))}: the run of {when}." for when, rows in sorted(others.items()))


def spread(pairs: dict) -> str:
    """The per-pair min and max of a ratio, and what they allow: pairs on both sides of 1 measured
    no difference; pairs on one side whose spread is wider than the median's gap from 1 measured
    a difference of uncertain size."""
    low, high, middle = pairs["ratio_min"], pairs["ratio_max"], pairs.get("ratio_median", pairs["ratio_min"])
    text = f"min {low:.2f}, max {high:.2f}"
    if pairs.get("rounds", 1) > 1:
        if low <= 1 <= high:
            text += "; pairs on both sides of 1: no measured difference"
        elif high - low > abs(1 - middle):
            text += "; the spread is wider than the gap from 1: its size is uncertain"
    return text


def median_of(values: list) -> float:
    return statistics.median(values)


def _overhead_line(key: str, v: dict) -> str:
    """Service vs plain Ray Train vs the baseline, with the ratio of each two; a result from before
    the plain Ray Train side had only the service and the baseline."""
    pairs = v.get("pairs") or {"ratio_min": v["overhead_ratio"], "ratio_max": v["overhead_ratio"], "rounds": 1}
    how = (f"steady-state samples/s (first {v.get('warmup_steps', v['steps'] // 5)} of {v['steps']} steps excluded), "
           f"service on Ray Train vs ")
    if v.get("vs_raytrain") is None:
        return (f"| overhead {key} | {v['service_samples_per_s']:.0f} vs {v['baseline_samples_per_s']:.0f} samples/s "
                f"| **{v['overhead_ratio']:.3f}** ({spread(pairs)}; {pairs['rounds']} interleaved pair(s)) | {how}"
                f"{v['baseline']}, same model, data, batch, threads |")
    ours, theirs = v["vs_raytrain_pairs"], v["raytrain_vs_baseline_pairs"]
    return (f"| overhead {key} | service {v['service_samples_per_s']:.0f} vs plain Ray Train "
            f"{v['raytrain_samples_per_s']:.0f} vs {v['baseline']} {v['baseline_samples_per_s']:.0f} samples/s "
            f"| vs plain Ray Train **{v['vs_raytrain']:.3f}** (target >= 0.97; {spread(ours)}); "
            f"vs {v['baseline']} **{v['overhead_ratio']:.3f}** ({spread(pairs)}); plain Ray Train vs "
            f"{v['baseline']} {v['raytrain_vs_baseline']:.3f} ({spread(theirs)}); {pairs['rounds']} interleaved "
            f"round(s) | {how}a plain Ray Train V2 loop (TorchTrainer, DDP through `prepare_model`, "
            f"bench/baseline_raytrain.py) vs {v['baseline']}, same model, data, batch, workers, threads |")


def _llama(v: dict) -> str:
    m = v["model"]
    return (f"a pretrained Llama (hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, vocab {m['vocab']}), "
            f"{v['workers']} workers DDP, {v['threads_per_worker']} thread each, global batch {v['global_batch']}, "
            f"seq_len {v['seq_len']}, the first {v['warmup_steps']} of {v['steps']} steps excluded")


def _lora_line(v: dict) -> str:
    b, o, n = v["checkpoint_bytes"], v["optimizer_state_bytes"], v["trained_parameters"]
    return (f"| LoRA vs full fine-tuning | checkpoint {b['lora'] / 2**20:.2f} vs {b['full'] / 2**20:.1f} MB, "
            f"optimizer state {o['lora'] / 2**20:.2f} vs {o['full'] / 2**20:.1f} MB; {v['lora_tokens_per_s']:.0f} vs "
            f"{v['full_tokens_per_s']:.0f} tokens/s | checkpoint **{v['checkpoint_bytes_ratio']:.3f}**, optimizer "
            f"state **{v['optimizer_state_bytes_ratio']:.3f}**, tokens/s **{v['tokens_per_s_ratio']:.2f}** "
            f"({spread(v['pairs'])}; {v['rounds']} interleaved pair(s)) | {_llama(v)}; LoRA `{v['adapter']}` on the "
            f"attention and MLP projections ({n['lora'] / 1e3:.0f}K trained parameters vs {n['full'] / 1e6:.2f}M) "
            "vs every weight trained, AdamW, the same packed stdlib chat rows; the final checkpoint's bytes |")


def markdown(results: dict) -> str:
    m, r = results["machine"], results["rows"]
    lines = [f"Run of {results['date']}{' (quick mode: harness check, not numbers)' if results['quick'] else ''} on "
             f"{m['cpu'] or 'unknown CPU'}, {m['cores']} cores, torch {m['torch']}, Ray {m['ray']}, "
             f"Python {m['python']}"
             f"{', ' + m['cuda'] if m.get('cuda') else ''}.{_took(results)}{_later(results)}", "",
             "| row | measured | ratio (same run) | how |", "|---|---|---|---|"]
    for key, v in r.get("overhead", {}).items():
        lines.append(_overhead_line(key, v))
    if "cold_start" in r:
        c = r["cold_start"]
        lines.append(f"| cold start | {c['command_to_first_step_s']:.1f} s to first step | — | `python -m training` "
                     f"starting its own Ray: python+config+data {c['python_config_and_data_s']:.1f} s, Ray start "
                     f"{c['ray_start_s']:.1f} s, tracking {c['tracking_s']:.1f} s, worker group "
                     f"{c['worker_group_start_s']:.1f} s, first step {c['first_step_s']:.1f} s |")
    if "checkpoint" in r:
        c = r["checkpoint"]
        asynchronous = "n/a" if c["async_step_overhead"] is None else f"{100 * c['async_step_overhead']:.1f}%"
        synchronous = "n/a" if c["sync_step_overhead"] is None else f"{100 * c['sync_step_overhead']:.1f}%"
        lines.append(f"| checkpoint stall | sync {synchronous}, async "
                     f"{asynchronous} of throughput | — | tinylm 3.2M params, "
                     f"{c['checkpoint_mb']} MB checkpoint every {c['every_n_steps']} steps, 2 workers, "
                     "vs no checkpoint "
                     "(all three evaluate at that cadence, as a scored checkpoint does) |")
        lines.append(f"| checkpoint write | {c['checkpoint_write_mb_per_s']:.0f} MB/s vs disk "
                     f"{c['disk_write_mb_per_s']:.0f} MB/s "
                     f"| **{c['write_throughput_ratio']:.2f}** | serialize + copy to storage (blocking time of a sync "
                     f"checkpoint) vs raw write+fsync of the same bytes |")
    for task, v in r.get("data_path", {}).items():
        lines.append(f"| data path {task} | {v['loader_rows_per_s_per_worker']:.0f} rows/s per worker vs raw read "
                     f"{v['raw_parquet_rows_per_s']:.0f} rows/s | **{v['loader_vs_raw_read']:.2f}** of raw; "
                     f"{_f(v['loader_vs_training_consumption'], 0)}x training's need | Parquet -> this worker's "
                     f"tensor batches for an epoch vs `pyarrow.parquet.read_table` of the same files |")
    if "streaming" in r:
        v = r["streaming"]
        lines.append(f"| streaming loader | {v['loader_rows_per_s']:.0f} rows/s (rank 0 of 2) vs raw "
                     f"{v['raw_iter_batches_rows_per_s']:.0f} rows/s | **{v['loader_vs_raw_read']:.2f}** of raw "
                     f"(spread {v['loader_spread'][0]:.2f}-{v['loader_spread'][1]:.2f}); reads "
                     f"{v['read_fraction_per_worker']:.2f} of the row groups; CPU per row "
                     f"{_f(v.get('loader_cpu_per_row_vs_raw'), 2)}x raw's"
                     + (" (spread {:.2f}-{:.2f})".format(*v["loader_cpu_per_row_spread"])
                        if "loader_cpu_per_row_spread" in v else "")
                     + f" on {_f(v.get('loader_cores_busy'), 2)} cores "
                     f"busy (raw {_f(v.get('raw_cores_busy'), 2)}); RSS growth "
                     f"{v['rss_growth_vs_budget']:.2f}x its {v['budget_mb']} MB budget | the `parquet` source's loader "
                     f"on {v['dataset_mb']} MB of generated rows ({v['dataset_vs_budget']:.1f}x the budget), one "
                     f"worker's part, vs `ParquetFile.iter_batches` of the same files, interleaved |")
    if "tokenizing" in r:
        v = r["tokenizing"]
        lines.append(f"| tokenizing | Ray Data {v['ray_data_rows_per_s']:.0f} rows/s vs one process "
                     f"{v['one_process_rows_per_s']:.0f} rows/s | **{v['ray_data_vs_one_process']:.2f}** (spread "
                     f"{v['ratio_spread'][0]:.2f}-{v['ratio_spread'][1]:.2f}) | the `text` source's Ray Data "
                     "pipeline on "
                     f"{v['cluster_cpus']} CPUs vs Hugging Face `tokenizers` in one process, {v['text_mb']} MB of "
                     f"generated text in {v['files']} files, packed into {v['rows']} rows and written as Parquet |")
    if "system_metrics" in r:
        v = r["system_metrics"]
        pair = v.get("throughput")
        measured = (f"digits 2 workers {median_of(v['sampled_samples_per_s']):.0f} vs "
                    f"{median_of(v['unsampled_samples_per_s']):.0f} "
                    f"samples/s; " if pair else "") + f"one sample {1000 * v['sample_cpu_s']:.2f} ms CPU"
        ratio = f"**{pair['ratio_median']:.3f}** ({spread(pair)}); " if pair else ""
        how = (f"throughput with a sample every {v['sampled_interval_s']:.0f} s on each node vs sampling off, "
               f"interleaved, {pair['rounds']} rounds (first {v['warmup_steps']} of {v['steps']} steps excluded); "
               if pair else "") + ("one sample's CPU time (the node's series under MLflow's names, throughput, RSS) "
                                   "over the interval")
        lines.append(f"| system metrics | {measured} | {ratio}{100 * v['core_share_at_default_interval']:.3f}% "
                     "of a core "
                     f"at the default {v['default_interval_s']:.0f} s | {how} |")
    for source, v in r.get("driver_memory", {}).items():
        lines.append(f"| driver memory, {source} | peak RSS {v['large_peak_rss_mb']} MB preparing {v['large_mb']} MB "
                     f"vs {v['small_peak_rss_mb']} MB preparing {v['small_mb']} MB | "
                     f"**{v['large_vs_small_peak_rss']:.2f}** | "
                     f"the driver's whole process, preparing generated data 10x larger than another (each in a fresh "
                     f"process; {'an index of Parquet footers' if source == 'parquet' else 'tokenized in the driver'}"
                     ") |")
    if "tokenize_memory" in r:
        v = r["tokenize_memory"]
        lines.append(f"| tokenizing memory, one document | peak RSS {v['large_peak_rss_mb']} MB tokenizing a "
                     f"{v['large_mb']} MB single-document .txt vs {v['small_peak_rss_mb']} MB for {v['small_mb']} MB "
                     f"(imports alone {v['imports_peak_rss_mb']} MB) | **{v['large_vs_small_peak_rss']:.2f}** "
                     "(target <= 1.2) | the preparing process's whole peak, each in a fresh process; a document "
                     "is encoded in pieces |")
    if "hf_load" in r:
        v = r["hf_load"]
        lines.append(f"| HF sharded load | peak RSS growth per worker {v['sharded_rss_growth_vs_checkpoint']:.2f}x the "
                     f"checkpoint ({v['checkpoint_mb']:.0f} MB) sharded vs {v['whole_rss_growth_vs_checkpoint']:.2f}x "
                     f"whole; load {v['sharded_load_s']:.1f} s vs raw read {v['raw_read_s']:.1f} s | "
                     f"**{v['sharded_rss_growth_vs_checkpoint']:.2f}** (target <= 0.6); time vs raw read "
                     f"**{v['sharded_load_vs_raw_read']:.2f}** (min {v['sharded_load_vs_raw_read_min']:.2f}, max "
                     f"{v['sharded_load_vs_raw_read_max']:.2f}) | a Llama of {v['parameters_m']:.0f}M fp32 parameters, "
                     f"{v['workers']} workers (gloo), FSDP2 per layer + root, each rank reading its rows "
                     f"(load_sharded) vs each loading it whole (from_pretrained); medians of {v['rounds']} "
                     "interleaved rounds, fresh processes |")
    if "hf_throughput" in r:
        v = r["hf_throughput"]
        lines.append(f"| HF Llama throughput | service {v['service_tokens_per_s']:.0f} vs torchrun DDP "
                     f"{v['baseline_tokens_per_s']:.0f} tokens/s | **{v['ratio']:.3f}** (target >= 0.95; "
                     f"{spread(v['pairs'])}; {v['rounds']} interleaved pair(s)) | `model.name: hf`, a Llama of "
                     f"{v['parameters_m']:.2f}M parameters (vocab {v['vocab_size']}, seq_len {v['seq_len']}), "
                     f"{v['workers']} workers DDP, {v['threads_per_worker']} thread each, global batch "
                     f"{v['global_batch']}; steady state: the first {v['warmup_steps']} of {v['steps']} steps excluded "
                     "on both sides; vs the same model, data, batch and optimizer in a plain torchrun loop "
                     "(bench/hf_baseline_ddp.py) |")
    if "lora_vs_full" in r:
        v = r["lora_vs_full"]
        lines.append(_lora_line(v))
    if "packing" in r:
        v = r["packing"]
        lines.append(f"| packed chat rows | useful tokens/s packed {v['packed_useful_tokens_per_s']:.0f} vs one a row "
                     f"{v['padded_useful_tokens_per_s']:.0f} | **{v['ratio']:.2f}** (target >= 1.5; "
                     f"{spread(v['pairs'])}; {v['rounds']} interleaved pair(s)) | the stdlib chat set "
                     f"({v['conversations']} conversations, mean {v['mean_length']:.0f} tokens = "
                     f"{v['mean_length_vs_seq_len']:.2f} of seq_len {v['seq_len']}), LoRA on {_llama(v)}: rows/s times "
                     f"the rows' real tokens ({v['real_tokens_per_row']['packed']:.0f} vs "
                     f"{v['real_tokens_per_row']['padded']:.0f} per row), `chat.packing` true vs false |")
    if "memory" in r:
        v = r["memory"]
        lines.append(f"| memory per worker | FSDP {v['fsdp_bytes_per_worker'] / 2**20:.1f} MB vs DDP "
                     f"{v['ddp_bytes_per_worker'] / 2**20:.1f} MB | **{v['fsdp_vs_ddp_ratio']:.3f}** (ideal "
                     f"{1 / v['workers']:.3f}) | parameters + AdamW state each worker holds, {v['model']}, "
                     f"{v['workers']} workers (gloo), after one step |")
    if r.get("continuous"):
        v = r["continuous"]
        loss = v["val_loss_chaos_vs_twin"]
        lines.append(f"| continuous (failure.mode continue) | kill -> a survivor's next step "
                     f"{_f(v['kill_to_next_step_s_median'], 2)} s "
                     f"(max {_f(v['kill_to_next_step_s_max'], 2)}); the replacement back after "
                     f"{_f(v.get('kill_to_rejoin_s_median'), 1)} s | val_loss vs failure-free twin "
                     f"**{_f(loss['ratio_median'])}** "
                     f"(min {_f(loss['ratio_min'])}, max {_f(loss['ratio_max'])}) | digits, 2 workers, "
                     f"{v['steps']} steps, "
                     "one worker SIGKILLed after the first checkpoint; twin and chaos runs interleaved, "
                     f"{v['rounds']} of each |")
    for name in ("recovery", "recovery_continue", "sweep", "gpu"):
        v = r.get(name)
        if v and "skipped" in v:
            lines.append(f"| {name} | skipped | — | {v['skipped']} |")
        elif name in ("recovery", "recovery_continue") and v:
            pairs = v.get("efficiency_pairs") or (
                {"ratio_min": v["efficiency"], "ratio_max": v["efficiency"], "rounds": 1}
                if v["efficiency"] is not None else None)
            plain = v.get("plain_ray_train") or {}
            if plain:
                lines.append(f"| restart vs plain Ray Train | kill -> next step "
                             f"{_f(v['kill_to_next_step_s_median'], 1)} s "
                             f"vs {_f(plain['kill_to_next_step_s_median'], 1)} s (medians of "
                             f"{v['recoveries_measured']} "
                             f"and {plain['recoveries_measured']}); of which kill -> the train function starting "
                             f"{_f(v.get('kill_to_train_function_s_median'), 1)} vs "
                             f"{_f(plain.get('kill_to_train_function_s_median'), 1)} s, its start -> first step "
                             f"{_f(v.get('train_function_to_first_step_s_median'), 1)} vs "
                             f"{_f(plain.get('train_function_to_first_step_s_median'), 1)} s "
                             f"| **{_f(v['kill_to_next_step_vs_plain_ray_train'])}** "
                             f"(target <= 1) | the same kills of a plain Ray Train loop (TorchTrainer, DDP, a "
                             f"checkpoint every {v['checkpoint_every_n_steps']} steps, bench/baseline_raytrain.py) in "
                             f"the same run |")
            label = "recovery" if v.get("mode", "restart") == "restart" else "recovery (failure.mode continue)"
            if v.get("mode") == "continue" and v.get("goodput_pairs"):
                pairs = v["goodput_pairs"]
                skipped = v.get("samples_skipped_fraction") or [0]
                lines.append(f"| {label} | samples skipped {100 * median_of(skipped):.2f}% "
                             f"(median of {len(skipped)} runs) "
                             f"| **{_f(v['goodput_efficiency'])}** goodput efficiency ({spread(pairs)}; wall time "
                             f"alone {_f(v['efficiency'])}) | digits, 2 workers, {v['steps']} steps with a worker "
                             f"SIGKILLed every {v['failure_every_s']:.0f} s ({v['kills']} kills) vs a "
                             "failure-free twin, "
                             f"both failure.mode continue, interleaved, {pairs['rounds']} pair(s): samples trained per "
                             "second, the skipped ones counted as lost |")
                continue
            extrapolated = "clean_steps" in v and "efficiency_pairs" not in v  # (a row from before the twin)
            lines.append(f"| {label} | kill -> next step {_f(v['kill_to_next_step_s_median'], 1)} s, steps lost "
                         f"{_f(v['steps_lost_median'], 0)} (median of {v['recoveries_measured']}; checkpoint every "
                         f"{v['checkpoint_every_n_steps']} steps) | **{_f(v['efficiency'])}** efficiency "
                         + ("" if extrapolated else f"({spread(pairs) if pairs else 'quick mode: no twin'}) ")
                         + "| digits, 2 workers, "
                         f"{v['steps']} steps "
                         f"with a worker SIGKILLed every {v['failure_every_s']:.0f} s ({v['kills']} kills) vs "
                         + (f"without failures (a failure-free run of {v['clean_steps']} steps, the rest at its steady "
                            "rate): wall-time ratio |" if extrapolated else
                            "a failure-free twin of the same steps, interleaved, "
                            f"{pairs['rounds'] if pairs else 0} pair(s): wall-time ratio per pair |"))
        elif name == "sweep" and v:
            runs = "; ".join(f"seed {s['seed']}: {s['asha']['steps_to_target']} vs {s['fifo']['steps_to_target']}"
                             for s in v["seeds"])
            lines.append(f"| sweep ASHA vs random | trial-steps to val_acc {v['target_val_accuracy']}: {runs} | "
                         f"**{_f(v['steps_to_target_ratio'])}** (whole sweep {_f(v['total_steps_ratio'])}) | "
                         f"{v['trials']} trials of digits (same draws), up to {v['max_steps']} steps each, 1 worker; "
                         "trial-steps of all trials in wall-clock order until the first evaluation at target |")
        elif v:
            lines.append(f"| {name} | {v} | — | |")
    return "\n".join(lines) + "\n"


def update_readme(readme: Path, table: str) -> None:
    text = readme.read_text()
    if START not in text or END not in text:
        return
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{table}{END}{tail}")
