"""The benchmark harness in quick mode: every row runs for a few steps, so the harness cannot rot.
Timings are never asserted: only that each row measured something and the files were written."""

import json
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = [pytest.mark.ray, pytest.mark.slow]


# Two runs of the harness, one per Ray test lane (tests/conftest.py): every row is in one of them,
# but the continuous and recovery_continue rows, whose failure.mode continue path
# tests/test_chaos_continue.py runs, and the sweep row, two Tune sweeps whose ASHA path
# tests/test_tuning_ray.py runs (its files and arithmetic: tests/test_bench_math.py). Quick mode
# leaves those out unless asked for (bench/__main__.py).
ROW_SETS = {"single": "memory,streaming,driver_memory,tokenize_memory,hf_load,cold_start,overhead,data_path,"
                      "tokenizing,gpu,system_metrics",
            "faults": "recovery,checkpoint"}  # (checkpoint: here for the two lanes' balance)
LEFT_TO_ITS_OWN_TEST = ["continuous", "recovery_continue", "sweep",
                        # an HF Llama through the service (tests/test_hf_run.py runs that path) vs a
                        # torchrun loop: 37 s of CI's time in quick mode, left out of it
                        "hf_throughput"]
# The fine-tuning rows (bench/finetune.py): six service runs of a pretrained Llama each, whose LoRA
# and packed chat paths tests/test_hf_lora.py and tests/test_hf_sft.py run; their arithmetic:
# tests/test_bench_finetune.py. Quick mode leaves them out unless asked for.
LEFT_TO_THE_FINE_TUNING_TESTS = ["lora_vs_full", "packing"]


def quick_bench(tmp_path, rows):
    result = subprocess.run([sys.executable, "-m", "bench", "--quick", "--rows", rows, "--out", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((tmp_path / "results.json").read_text()), (tmp_path / "results.md").read_text()


def test_the_row_sets_cover_every_row():
    from bench.__main__ import ROWS

    listed = [row for rows in ROW_SETS.values() for row in rows.split(",")] + LEFT_TO_ITS_OWN_TEST \
        + LEFT_TO_THE_FINE_TUNING_TESTS
    assert sorted(listed) == sorted(ROWS)


def test_quick_bench_runs_the_single_run_rows(tmp_path):
    results, table = quick_bench(tmp_path, ROW_SETS["single"])
    rows = results["rows"]
    assert set(ROW_SETS["single"].split(",")) == set(rows)
    assert 0 < rows["memory"]["fsdp_vs_ddp_ratio"] < 1
    assert set(rows["overhead"]) == {"digits_2w"}  # quick mode: one case
    assert all(v["overhead_ratio"] > 0 for v in rows["overhead"].values())
    assert rows["cold_start"]["command_to_first_step_s"] > 0
    assert all(v["loader_rows_per_s_per_worker"] > 0 for v in rows["data_path"].values())
    streaming = rows["streaming"]
    assert streaming["loader_rows_per_s"] > 0 and 0.4 < streaming["read_fraction_per_worker"] <= 1
    assert 0 < streaming["row_groups_held_max"] <= streaming["budget_mb"] * 2**20 / (8192 * 264)
    assert {"parquet", "text"} == set(rows["driver_memory"])
    assert rows["tokenize_memory"]["large_mb"] > 4 * rows["tokenize_memory"]["small_mb"]
    assert rows["tokenize_memory"]["large_vs_small_peak_rss"] > 0
    assert rows["hf_load"]["sharded_rss_growth_vs_checkpoint"] > 0 and rows["hf_load"]["sharded_load_vs_raw_read"] > 0
    assert "| HF sharded load |" in table
    assert all(0 < v["large_vs_small_peak_rss"] and v["large_mb"] > 5 * v["small_mb"]
               for v in rows["driver_memory"].values())
    tokenizing = rows["tokenizing"]
    assert tokenizing["rows"] > 0 and tokenizing["ray_data_vs_one_process"] > 0
    system = rows["system_metrics"]
    assert 0 < system["sample_cpu_s"] < 1 and "throughput" not in system  # quick: the sampler's cost only
    assert "| system metrics |" in table and "system_metrics_core_share_at_default_interval" in results["ratios"]
    assert "overhead_ratio_digits_2w" in results["ratios"] and results["machine"]["cores"] >= 1
    assert "| overhead digits_2w |" in table and "quick mode" in table


def test_quick_bench_runs_the_recovery_and_checkpoint_rows(tmp_path):
    results, table = quick_bench(tmp_path, ROW_SETS["faults"])
    rows = results["rows"]
    assert set(rows) == {"recovery", "checkpoint"}
    assert rows["checkpoint"]["checkpoint_mb"] > 1 and rows["checkpoint"]["disk_write_mb_per_s"] > 0
    assert rows["recovery"]["kills"] >= 1 and rows["recovery"]["recoveries_measured"] >= 1
    assert rows["recovery"]["efficiency"] is None and "quick mode: no twin" in table  # (no failure-free twin)
    plain = rows["recovery"]["plain_ray_train"]  # the same kills of a plain Ray Train loop
    assert plain["kills"] >= 1 and plain["recoveries_measured"] >= 1 and plain["kill_to_next_step_s_median"] > 0
    assert rows["recovery"]["kill_to_next_step_vs_plain_ray_train"] > 0
    assert "| recovery |" in table and "| restart vs plain Ray Train |" in table and "quick mode" in table


GPU_CHECK = REPO / "bench" / "gpu_check.sh"


def gpu_check(*args, timeout=60):
    return subprocess.run(["bash", str(GPU_CHECK), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_gpu_check_parses_and_refuses_bad_arguments_before_touching_a_gpu():
    assert subprocess.run(["bash", "-n", str(GPU_CHECK)], capture_output=True).returncode == 0
    shown = gpu_check("--help")
    assert shown.returncode == 0 and "llama1b" in shown.stdout and "--deadline-s" in shown.stdout
    for args, message in [(["--only", "tinylm,bogus"], "--only: unknown part 'bogus'"),
                          (["--cpu", "--only", "llama1b"], "--cpu runs only the vllm part"),
                          (["--deadline-s", "soon"], "--deadline-s: 'soon' is not a whole number"),
                          (["--python"], "--python needs a path"),
                          (["--fast"], "unknown argument '--fast'")]:
        refused = gpu_check(*args)
        assert refused.returncode == 2 and message in refused.stderr, (args, refused.stderr)
        assert "nvidia-smi" not in refused.stderr  # (refused before anything runs)


def test_gpu_check_vllm_step_skips_without_vllm_and_refuses_a_folder_that_is_not_a_model(tmp_path):
    import transformers

    folder = tmp_path / "llama"
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=64, max_position_embeddings=32)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    step = [sys.executable, str(REPO / "bench" / "gpu_check_parts.py"), "vllm"]
    found = subprocess.run([*step, str(folder)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert found.returncode == 0 and found.stdout.startswith(f"skipped: vLLM load-and-generate of {folder}: ")
    assert "vllm is not installed" in found.stdout or "no CUDA device" in found.stdout
    empty = subprocess.run([*step, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and "has no config.json: not an exported Hugging Face folder" in empty.stderr
