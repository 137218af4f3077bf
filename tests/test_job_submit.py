"""`ray job submit --working-dir . -- python -m training ...` against a local head with token
authentication on, exactly as a user submits from a laptop."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from aws import free_port
from conftest import REPO

pytestmark = [pytest.mark.ray, pytest.mark.slow]
BIN = os.path.dirname(sys.executable)


@pytest.fixture
def head(tmp_path):
    port, dashboard_port = free_port(), free_port()
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token",
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
    process = subprocess.Popen(
        [f"{BIN}/ray", "start", "--head", "--block", f"--port={port}", f"--dashboard-port={dashboard_port}",
         "--dashboard-host=127.0.0.1", "--num-cpus=2", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard_port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{address}/api/version", timeout=2)
            break
        except OSError as exc:
            if getattr(exc, "code", None) in (401, 403):  # up, and asking for the token
                break
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the Ray head did not start")
            time.sleep(1)
    yield address, env
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=60)


def test_job_submit_runs_training_on_the_cluster(head, tmp_path):
    address, env = head
    client_env = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
    refused = subprocess.run([f"{BIN}/ray", "job", "list", "--address", address], env=client_env,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0  # token authentication is on: no token mode, no access

    runtime_env = {"env_vars": {"TRAINING_BASE_DIR": str(tmp_path)}}
    result = subprocess.run(
        [f"{BIN}/ray", "job", "submit", "--address", address, "--working-dir", ".",
         "--runtime-env-json", json.dumps(runtime_env), "--",
         "python", "-m", "training", "training/configs/digits.yaml", "--name", "submitted",
         "--set", "train.max_steps=60", "--set", "checkpoint.every_n_steps=30", "--set", "train.eval_every_n_steps=30"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "run submitted finished: 60 steps" in output and "succeeded" in output.lower()

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["training.run_name"] == "submitted"
    assert (tmp_path / "runs" / "submitted" / "checkpoint-00000060" / "state.pt").is_file()
