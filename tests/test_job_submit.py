"""`ray job submit --working-dir . -- python -m training ...` (and `python -m tuning ...`) against a
local head with token authentication on, exactly as a user submits from a laptop."""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from aws import free_port
from conftest import REPO

pytestmark = [pytest.mark.ray, pytest.mark.slow]
BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    # Every port of its own: the defaults (the job agent's 52365 among them) may be another Ray's on
    # this machine, and an agent that cannot bind leaves the head unable to take jobs.
    port, dashboard_port, agent_port = free_port(), free_port(), free_port()
    # A token of the test's own (what `ray get-auth-token --generate` writes), shared by the head and
    # its clients: `ray start` in token mode does not start without one, and ~/.ray is not the test's.
    token = tmp_path_factory.mktemp("token") / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(token),
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"]}
    process = subprocess.Popen(
        [f"{BIN}/ray", "start", "--head", "--block", f"--port={port}", f"--dashboard-port={dashboard_port}",
         "--dashboard-host=127.0.0.1", f"--dashboard-agent-listen-port={agent_port}", "--num-cpus=2",
         "--disable-usage-stats"],
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
    yield address, env, process.pid
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:  # (it once took 34 s to stop gracefully): the head's whole group
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    # a head killed this way leaves its address as "the current cluster" for every later Ray client
    from training.run.session import live_local_cluster

    live_local_cluster()


def test_job_submit_runs_training_on_the_cluster(head, tmp_path, empty_mlflow_db):
    address, env, _ = head
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
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


SWEEP = """
base: training/configs/digits.yaml
set: [train.max_steps=400, train.eval_every_n_steps=200, checkpoint.every_n_steps=200, \
tracking.experiment=submitted-sweeps, tracking.export_onnx=false]
space:
  optim.lr: {loguniform: [0.01, 0.05]}
search: {algorithm: optuna, seed: 0}
num_samples: 2
trial:
  driver_cpus: 0.25
  scaling: {num_workers: 1, cpus_per_worker: 1}
"""


def monitor_log(head_pid):
    """The monitor.log of the head started as head_pid (its monitor process says where its logs go)."""
    import psutil

    for child in psutil.Process(head_pid).children(recursive=True):
        command = child.cmdline()
        if any(os.path.basename(part) == "monitor.py" for part in command):
            (logs_dir,) = [part.split("=", 1)[1] for part in command if part.startswith("--logs-dir=")]
            return Path(logs_dir) / "monitor.log"
    raise AssertionError("the head has no autoscaler monitor process")


def launcher_config(path):
    """What `ray up cluster.yaml` leaves on the head, for a head of 2 CPUs (this one) whose
    autoscaler may add one worker node of 2 CPUs."""
    import yaml

    config = yaml.safe_load((REPO / "cluster.yaml").read_text())
    types = config["available_node_types"]
    types[config["head_node_type"]]["resources"] = {"CPU": 2, "GPU": 0}
    worker = next(name for name in types if name != config["head_node_type"])
    types[worker].update(min_workers=0, max_workers=1, resources={"CPU": 2})
    for name in [n for n in types if n not in (worker, config["head_node_type"])]:
        del types[name]
    config["max_workers"] = 1
    path.write_text(yaml.safe_dump(config))


def test_a_submitted_sweep_plans_for_the_autoscalers_largest_cluster(head, tmp_path, empty_mlflow_db):
    """Two trials (suggested by Optuna's TPE) of 1.25 CPUs on a head of 2: one fits now, but the
    launcher config says the cluster grows to 4 CPUs, so both start and the second one's workers
    wait as demand the autoscaler reports (`ray status`), until the first trial gives its CPU back."""
    address, env, head_pid = head
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    (tmp_path / "sweep.yaml").write_text(SWEEP)
    launcher_config(tmp_path / "launcher.yaml")
    runtime_env = {"env_vars": {"TRAINING_BASE_DIR": str(tmp_path),
                                "TRAINING_CLUSTER_CONFIG": str(tmp_path / "launcher.yaml")}}
    submit = subprocess.Popen(
        [f"{BIN}/ray", "job", "submit", "--address", address, "--working-dir", ".",
         "--runtime-env-json", json.dumps(runtime_env), "--",
         "python", "-m", "tuning", str(tmp_path / "sweep.yaml"), "--name", "submitted"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = submit.communicate(timeout=600)
    (tmp_path / "job-output.txt").write_text(output)  # for a look when something below fails
    assert submit.returncode == 0, output[-4000:]
    # What `ray status` prints is the autoscaler's report, made every 5 s and logged each time to the
    # head's monitor.log: read there after the sweep, it cannot be missed between two polls of the
    # CLI (on a loaded machine one `ray status` took longer than the second trial waited).
    reports = monitor_log(head_pid).read_text().split("Autoscaler status:")
    demands = [line for report in reports for line in report.split("Demands:", 1)[-1].splitlines()
               if "{'CPU': 1.0}" in line and "pending placement group" in line]
    assert demands, "the second trial's workers never showed as demand in the autoscaler's reports"
    assert "its autoscaler may grow it to CPU 4" in output and "up to 2 trial(s) at once" in output

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("submitted-sweeps").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("tune.role") == "sweep"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in children + [parent])
