"""cluster/slurm/ray_job.sbatch under a real Slurm (one node: munged, slurmctld and slurmd on this
machine, tests/slurm.py): the job starts its Ray head and MLflow's basic-auth server inside the
allocation and trains the digits job; `scancel` mid-run (Slurm's preemption path) ends it with every
Ray process of the allocation; the job resubmitted with the same --name resumes from its checkpoint,
finishes, and MLflow has the one run with every step; nothing of Ray outlives either allocation."""

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from aws import free_port
from conftest import RAY_TMPDIR, REPO, wait_for
from slurm import missing, one_node_slurm

from training.checkpoint import format as ckpt

pytestmark = [pytest.mark.ray, pytest.mark.slow]

NAME = "slurm-digits"
MAX_STEPS = 1200


def processes_of(marker: bytes) -> list[int]:
    """Live processes whose environment has `marker` (a VAR=value of the job's)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def job_state(env: dict, job: str) -> str:
    line = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True).stdout
    fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
    return f"{fields.get('JobState')} {fields.get('ExitCode')}"


def ended(env: dict, job: str) -> bool:
    return not subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def slurm():
    reason = missing()
    if reason:
        pytest.skip(reason)
    with one_node_slurm() as env:
        yield env


def test_a_slurm_job_trains_is_cancelled_and_resumes_by_name(slurm, tmp_path, empty_mlflow_db):
    from mlflow.tracking import MlflowClient

    home, shared = tmp_path / "home", tmp_path / "shared"
    (home / ".raytrain").mkdir(parents=True)
    shared.mkdir()
    shutil.copy(empty_mlflow_db, shared / "mlflow.db")  # (a new store's migrations: seconds per start)
    password = secrets.token_urlsafe(24)
    auth = home / ".raytrain" / "mlflow-auth.ini"
    auth.write_text(f"[mlflow]\ndefault_permission = NO_PERMISSIONS\ndatabase_uri = sqlite:///{shared}/basic_auth.db\n"
                    f"admin_username = admin\nadmin_password = {password}\nmlflow_tracking_username = admin\n"
                    f"mlflow_tracking_password = {password}\n")
    auth.chmod(0o600)
    job_tmp = tempfile.mkdtemp(prefix="s", dir=RAY_TMPDIR)  # (short: Ray's socket paths)
    env = {**os.environ, **slurm, "HOME": str(home), "RAYTRAIN_VENV": sys.prefix,
           "RAYTRAIN_STORAGE": str(shared / "runs"),
           "RAYTRAIN_RAY_PORT": str(free_port()), "RAYTRAIN_MLFLOW_PORT": str(free_port()),
           "RAYTRAIN_DASHBOARD_PORT": str(free_port()), "RAYTRAIN_MLFLOW_WORKERS": "1", "RAY_TMPDIR": job_tmp}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("RAY_ADDRESS", None)
    (home / ".ray").mkdir()  # Ray's token, as `ray get-auth-token --generate` writes it (in 10 s here)
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    (home / ".ray" / "auth_token").chmod(0o600)

    def submit() -> str:
        # One node of this machine's CPUs, no GPUs: the script's #SBATCH lines give a 3-node GPU job.
        return subprocess.run(
            ["sbatch", "--parsable", "--nodes=1", f"--cpus-per-task={os.cpu_count()}", "--gpus-per-node=0",
             f"--output={tmp_path}/job-%j.log", f"--chdir={REPO}", "cluster/slurm/ray_job.sbatch",
             "training/configs/digits.yaml", "--name", NAME, "--set", f"train.max_steps={MAX_STEPS}",
             "--set", "scaling.num_workers=1", "--set", "train.eval_every_n_steps=100",
             "--set", "tracking.register_model=false", "--set", "tracking.export_onnx=false",
             "--set", "tracking.model_format=pickle"],  # (torch.export of the final model: ~10 s the test needs not)
            env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]

    def log(job: str) -> str:
        path = tmp_path / f"job-{job}.log"
        return path.read_text() if path.exists() else ""

    first = submit()
    run_dir = shared / "runs" / NAME
    try:
        wait_for(lambda: ckpt.newest_complete(pafs.LocalFileSystem(), str(run_dir))
                 if run_dir.exists() else None, 300, f"a checkpoint of job {first}\n{log(first)[-3000:]}")
    finally:
        subprocess.run(["scancel", first], env=env, check=True)
    wait_for(lambda: ended(env, first), 120, f"job {first} gone after scancel")
    assert job_state(env, first).startswith("CANCELLED"), job_state(env, first)
    cut_at = ckpt.newest_complete(pafs.LocalFileSystem(), str(run_dir))[0]
    assert cut_at < MAX_STEPS, f"job {first} finished before it was cancelled"
    wait_for(lambda: not processes_of(f"SLURM_JOB_ID={first}".encode()), 30, f"job {first}'s processes gone")

    second = submit()
    wait_for(lambda: ended(env, second), 420, f"job {second} to end")
    output = log(second)
    assert job_state(env, second) == "COMPLETED 0:0", output[-4000:]
    assert "resumed from step" in output, output[-4000:]
    assert not processes_of(f"SLURM_JOB_ID={second}".encode()) and not processes_of(f"RAY_TMPDIR={job_tmp}".encode())
    assert password not in log(first) + output

    client = MlflowClient(f"sqlite:///{shared}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id],
                                filter_string=f"tags.`training.run_name` = '{NAME}'")
    assert run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert steps[-1] == MAX_STEPS and steps == sorted(set(steps))  # each step once, across both jobs
    assert ckpt.newest_complete(pafs.LocalFileSystem(), str(run_dir))[0] == MAX_STEPS
