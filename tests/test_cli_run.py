"""`python -m training` end to end as a user runs it: own plug-ins in the working directory, a local
Ray started and stopped by the command, exit codes 0 and 1."""

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO

pytestmark = pytest.mark.ray

PLUGIN_CONFIG = {
    "model": {"name": "my_plugins:linear", "options": {"scale": 1.0}},
    "data": {"source": "my_plugins:blobs", "options": {"n": 600}},
    "optim": {"lr": 0.05},
    "train": {"max_steps": 40, "global_batch_size": 32, "eval_every_n_steps": 20},
    "scaling": {"num_workers": 2, "cpus_per_worker": 0.5},
    "tracking": {"experiment": "plugins"},
}


def cli(*args, cwd, timeout=400):
    env = {"PATH": f"{sys.executable.rsplit('/', 1)[0]}:/usr/bin:/bin", "HOME": str(cwd),
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"],
           "RAY_TMPDIR": os.environ["RAY_TMPDIR"]}  # this session's own (conftest): joins no other Ray
    return subprocess.run([sys.executable, "-m", "training", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def test_user_plugins_from_the_working_directory(tmp_path):
    shutil.copy(REPO / "tests" / "plugins" / "examples.py", tmp_path / "my_plugins.py")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(PLUGIN_CONFIG))
    result = cli("job.yaml", "--name", "mine", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "run mine finished: 40 steps" in result.stdout
    assert "registered model: blobs-linear version 1" in result.stdout
    assert "step 40/40 (100%)" in result.stdout + result.stderr  # the live progress line
    assert (tmp_path / "mlflow.db").is_file() and (tmp_path / "runs" / "mine" / "checkpoint-00000040").is_dir()


def test_a_run_that_fails_exits_1_with_one_message(tmp_path):
    shutil.copy(REPO / "tests" / "plugins" / "examples.py", tmp_path / "my_plugins.py")
    config = {**PLUGIN_CONFIG, "model": {"name": "my_plugins:explodes"}, "failure": {"max_failures": 0}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    result = cli("job.yaml", "--name", "boom", cwd=tmp_path)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training run boom failed") and "forward exploded" in last
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("plugins").experiment_id])
    assert run.info.status == "FAILED"
