"""The benchmark harness in quick mode: every row runs for a few steps, so the harness cannot rot.
Timings are never asserted: only that each row measured something and the files were written."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_quick_bench_runs_every_row(tmp_path):
    result = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    rows = results["rows"]
    assert {"cold_start", "overhead", "checkpoint", "data_path", "streaming", "recovery", "sweep", "memory",
            "gpu"} <= set(rows)
    assert 0 < rows["memory"]["fsdp_vs_ddp_ratio"] < 1
    assert set(rows["overhead"]) == {"digits_2w"}  # quick mode: one case
    assert rows["recovery"]["kills"] >= 1 and rows["recovery"]["efficiency"] > 0
    assert "continuous" not in rows  # (quick mode leaves it out unless asked: see bench/__main__.py)
    assert all(v["overhead_ratio"] > 0 for v in rows["overhead"].values())
    assert rows["cold_start"]["command_to_first_step_s"] > 0
    assert rows["checkpoint"]["checkpoint_mb"] > 1 and rows["checkpoint"]["disk_write_mb_per_s"] > 0
    assert all(v["loader_rows_per_s_per_worker"] > 0 for v in rows["data_path"].values())
    streaming = rows["streaming"]
    assert streaming["loader_rows_per_s"] > 0 and 0.4 < streaming["read_fraction_per_worker"] <= 1
    assert 0 < streaming["row_groups_held_max"] <= streaming["budget_mb"] * 2**20 / (8192 * 264)
    assert "overhead_ratio_digits_2w" in results["ratios"] and results["machine"]["cores"] >= 1
    table = (tmp_path / "results.md").read_text()
    assert "| overhead digits_2w |" in table and "quick mode" in table
