"""`python -m training` end to end as a user runs it: own plug-ins in the working directory, a local
Ray started and stopped by the command (exit code 0), and a run on a cluster it joins (`RAY_ADDRESS`,
the shared test cluster) that fails: exit code 1."""

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


def cli(*args, cwd, address=None, timeout=400):
    """The command in a bare environment: it starts a Ray of its own (in this session's RAY_TMPDIR,
    conftest: it joins no other), or joins the cluster at `address` (its token in ~/.ray: the real HOME)."""
    env = {"PATH": f"{sys.executable.rsplit('/', 1)[0]}:/usr/bin:/bin", "HOME": str(cwd),
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"],
           "RAY_TMPDIR": os.environ["RAY_TMPDIR"]}
    if address:
        env.update(RAY_ADDRESS=address, HOME=os.environ["HOME"], RAY_AUTH_MODE="token")
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


def test_a_run_that_fails_exits_1_with_one_message(ray_cluster, tmp_path):
    shutil.copy(REPO / "tests" / "plugins" / "examples.py", tmp_path / "my_plugins.py")
    config = {**PLUGIN_CONFIG, "model": {"name": "my_plugins:explodes"}, "failure": {"max_failures": 0}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    result = cli("job.yaml", "--name", "boom", cwd=tmp_path, address=ray_cluster.get_runtime_context().gcs_address)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training run boom failed") and "forward exploded" in last
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("plugins").experiment_id])
    assert run.info.status == "FAILED"


def test_a_cluster_that_refuses_the_driver_exits_2_and_nothing_is_written(ray_cluster, tmp_path):
    """A RAY_ADDRESS whose cluster wants a token this machine does not have: one line saying how to
    get it, exit 2, and no run directory, MLflow store or log (the data it prepared stays in its cache)."""
    shutil.copy(REPO / "tests" / "plugins" / "examples.py", tmp_path / "my_plugins.py")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(PLUGIN_CONFIG))
    address = ray_cluster.get_runtime_context().gcs_address
    env = {"PATH": f"{sys.executable.rsplit('/', 1)[0]}:/usr/bin:/bin", "HOME": str(tmp_path),  # (no ~/.ray/auth_token)
           "RAY_ADDRESS": address, "RAY_AUTH_MODE": "token", "RAY_TMPDIR": os.environ["RAY_TMPDIR"]}
    result = subprocess.run([sys.executable, "-m", "training", "job.yaml", "--name", "refused"], capture_output=True,
                            text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the Ray cluster at {address} (RAY_ADDRESS) refused this driver"), last
    assert "auth_token" in last and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") \
        == ["job.yaml", "my_plugins.py", "runs"]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["datasets"]


def test_a_ray_address_where_nothing_answers_exits_2_in_seconds(tmp_path):
    """ray.init would wait minutes on it; the command asks the address's GCS first, with a deadline."""
    from aws import free_port

    shutil.copy(REPO / "tests" / "plugins" / "examples.py", tmp_path / "my_plugins.py")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(PLUGIN_CONFIG))
    address = f"127.0.0.1:{free_port()}"
    env = {"PATH": f"{sys.executable.rsplit('/', 1)[0]}:/usr/bin:/bin", "HOME": str(tmp_path), "RAY_ADDRESS": address}
    result = subprocess.run([sys.executable, "-m", "training", "job.yaml", "--name", "nowhere"], capture_output=True,
                            text=True, cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: no Ray cluster answers at RAY_ADDRESS={address} (within 10 s): check the address and that the "
        "cluster is up (`ray status --address ADDRESS`), or unset RAY_ADDRESS to run on a local Ray of this machine")
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["datasets"] and not (tmp_path / "mlflow.db").exists()
