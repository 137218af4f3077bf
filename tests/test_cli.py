"""The command line's bad-input paths: exit 2, one clear message naming the field, no Ray started."""

import subprocess
import sys

import pytest

from conftest import REPO

PROBE = """
import sys
from training.run.cli import main
code = main(sys.argv[1:])
assert "ray" not in sys.modules, "Ray was imported on a bad-input path"
sys.exit(code)
"""


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=cwd,
                          env={"PATH": "/usr/bin:/bin", "TRAINING_BASE_DIR": str(cwd),
                               "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["--set", "optim.lr=-1"], "optim.lr: Input should be greater than 0"),
    (["--set", "train.precsion=bf16"], "train.precsion: unknown key"),
    (["missing.yaml"], "config file missing.yaml does not exist"),
    (["--set", "model.name=nomodule:fn"], "model.name: cannot import module 'nomodule'"),
    (["--set", "data.source=nomodule:fn"], "data.source: cannot import module 'nomodule'"),
    (["--set", "model.name=gpt", "--set", "model.options={}"], "model.name: gpt is for language_model data"),
    (["--set", "checkpoint.score_metric=val_perplexity"], "checkpoint.score_metric: 'val_perplexity' is not a validation metric"),
    (["--set", "train.global_batch_size=5000"], "train.global_batch_size 5000 is larger than the"),
    (["--set", "checkpoint.storage_path=/proc/nope"], "checkpoint.storage_path /proc/nope is not writable"),
    (["--name", "bad name!"], "name: String should match pattern"),
])
def test_bad_input_exits_2_before_ray(tmp_path, args, message):
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr + result.stdout
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written: no data, no runs, no mlflow.db


def test_resuming_with_a_different_model_is_refused(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text('{"identity": {"seed": 5}, "mlflow_run_id": null}')
    result = run_cli("--name", "r1", cwd=tmp_path)
    assert result.returncode == 2
    assert "run 'r1' already exists with a different seed" in result.stderr


def test_help_documents_the_command():
    result = subprocess.run([sys.executable, "-m", "training", "--help"], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    assert result.returncode == 0
    for text in ("--set KEY=VALUE", "--name", "RAY_ADDRESS", "exit codes", "MLFLOW_TRACKING_URI"):
        assert text in result.stdout


def test_print_config_shows_the_resolved_config():
    result = subprocess.run([sys.executable, "-m", "training", "training/configs/tinylm.yaml", "--print-config",
                             "--set", "optim.lr=0.01"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0 and "lr: 0.01" in result.stdout and "source: tinylm" in result.stdout
