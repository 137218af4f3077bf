"""A run's life as the user meets it, with real processes: `python -m training` started as a user
starts it (its own local Ray, its own storage and MLflow store), stopped with Ctrl-C (SIGINT to its
process group, as a terminal sends it) or SIGTERM (to the driver, as a supervisor sends it) once it
has a checkpoint; `python -m training status` then says interrupted and resumable, and the same
command resumes it. A run whose worker group this machine cannot hold exits 2 before it starts."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from conftest import REPO, wait_for

from training.observe import files
from training.observe.status_cli import main as status_main

pytestmark = pytest.mark.ray

CONFIG = {
    "model": {"name": "my_plugins:linear"},
    "data": {"source": "my_plugins:blobs", "options": {"n": 600}},
    "optim": {"lr": 0.05},
    # Long enough never to end by itself in these tests: each stop is a signal's.
    "train": {"max_steps": 1_000_000, "global_batch_size": 32, "eval_every_n_steps": 20, "log_every_n_steps": 20},
    "checkpoint": {"every_n_steps": 20},
    "scaling": {"num_workers": 2, "cpus_per_worker": 0.5},
    "tracking": {"experiment": "lifecycle"},
}
# The promise: a signal stops any run within this many seconds (the driver says "interrupted" at
# once; taking its Ray down took more than 10 s on a loaded 2-core machine).
STOPS_WITHIN_S = 20


@contextmanager
def own_ray_dir():
    """A RAY_TMPDIR for the runs of one test (short: Ray's socket paths), and at the end every
    process that inherited it stopped by its pid: what a run's own Ray left, if it left anything."""
    # Directly under /tmp: inside the session's RAY_TMPDIR the dashboard's socket paths grow past the
    # 107 bytes a Unix socket's path may have, and each run's Ray waits a minute for a dashboard that
    # never starts ("Module MetricsHead failed to start").
    directory = Path(tempfile.mkdtemp(prefix="lc-", dir="/tmp"))
    try:
        yield directory
    finally:
        for pid in processes_with(f"RAY_TMPDIR={directory}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(directory, ignore_errors=True)


def processes_with(variable: str) -> list[int]:
    marker, found = variable.encode(), []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def env_for(workdir: Path, ray_dir: Path) -> dict:
    """A bare environment, as tests/test_cli_run.py gives the command: it starts a Ray of its own."""
    return {"PATH": f"{sys.executable.rsplit('/', 1)[0]}:/usr/bin:/bin", "HOME": str(workdir),
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1"),
            "RAY_TMPDIR": str(ray_dir)}


def start(workdir: Path, ray_dir: Path, name: str, *more: str, tag: str) -> subprocess.Popen:
    """The command in a session of its own (a process group, as a terminal's foreground job)."""
    out = open(workdir / f"{tag}.out", "w")
    err = open(workdir / f"{tag}.err", "w")
    return subprocess.Popen([sys.executable, "-m", "training", "job.yaml", "--name", name, *more], cwd=workdir,
                            env=env_for(workdir, ray_dir), stdout=out, stderr=err, start_new_session=True)


def text(workdir: Path, tag: str) -> tuple[str, str]:
    return (workdir / f"{tag}.out").read_text(), (workdir / f"{tag}.err").read_text()


def newest_complete(run_dir: Path, beyond: int = 0):
    steps = [c["step"] for c in files.checkpoints(str(run_dir)) if c["complete"]]
    return max(steps) if steps and max(steps) > beyond else None


def status_of(storage: Path, name: str) -> tuple[int, str]:
    lines = []
    code = status_main([name, "--storage", str(storage)], out=lines.append)
    return code, "\n".join(lines)


def stop(process: subprocess.Popen, how: signal.Signals) -> int:
    """Send `how` as it comes in life; the exit code, once the command has ended (within the promise)."""
    if how == signal.SIGINT:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground job
    else:
        os.kill(process.pid, how)
    try:
        return process.wait(timeout=STOPS_WITHIN_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise AssertionError(f"{how.name}: the run did not stop within {STOPS_WITHIN_S} s") from None


def stopped_after_a_checkpoint(job: Path, ray_dir: Path, tag: str, how: signal.Signals, beyond: int = 0):
    """The run `life` started, sent `how` once it has a complete checkpoint after step `beyond`:
    the command's exit code, stdout and stderr."""
    process = start(job, ray_dir, "life", tag=tag)

    def checkpointed():
        if process.poll() is not None:
            raise AssertionError(f"the command ended ({process.returncode}) before a checkpoint after step "
                                 f"{beyond}: {text(job, tag)[1][-2000:]}")
        return newest_complete(job / "runs" / "life", beyond=beyond)

    try:
        wait_for(checkpointed, 300, f"a checkpoint after step {beyond} ({text(job, tag)[1][-2000:]})")
        code = stop(process, how)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return (code, *text(job, tag))


@pytest.fixture
def job(tmp_path):
    shutil.copy(REPO / "tests" / "plugins" / "examples.py", tmp_path / "my_plugins.py")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(CONFIG))
    return tmp_path


def test_ctrl_c_and_sigterm_stop_a_run_that_the_same_command_resumes(job, empty_mlflow_db):
    shutil.copy(empty_mlflow_db, job / "mlflow.db")  # (a new store's migrations take seconds)
    run_dir = job / "runs" / "life"
    with own_ray_dir() as ray_dir:
        code, out, err = stopped_after_a_checkpoint(job, ray_dir, "first", signal.SIGINT)
        assert code == 130, out[-2000:] + err[-3000:]
        assert err.strip().splitlines()[-1] == "interrupted; run the same command with the same --name to resume"
        assert "KeyboardInterrupt" not in err and "SystemExit" not in err, err[-3000:]
        shown, detail = status_of(job / "runs", "life")
        assert shown == 0 and "run life: interrupted" in detail, detail
        assert "interrupted by SIGINT" in detail and "run the same command with the same --name to resume it" in detail
        step = newest_complete(run_dir)
        assert step is not None and f"from step {step}" in detail  # its newest complete checkpoint, intact

        # the same command
        code, out, err = stopped_after_a_checkpoint(job, ray_dir, "second", signal.SIGTERM, beyond=step)
        assert "run life: resuming" in out and f"resumed from step {step}" in out + err, out[-2000:]
        assert code == 143, out[-2000:] + err[-3000:]
        assert err.strip().splitlines()[-1] == "interrupted; run the same command with the same --name to resume"
        assert "KeyboardInterrupt" not in err and "SystemExit" not in err and "*** SIG" not in err, err[-3000:]
        shown, detail = status_of(job / "runs", "life")
        assert "run life: interrupted" in detail and "interrupted by SIGTERM" in detail, detail
        assert f"from step {newest_complete(run_dir)}" in detail


def test_a_worker_group_this_machine_cannot_hold_exits_2_before_the_run_starts(job):
    """On a local Ray (no autoscaler) workers of 1000 CPUs never fit: said at once, with what the run
    asked for and what the cluster has; no run directory, MLflow store or log is written."""
    with own_ray_dir() as ray_dir:
        result = subprocess.run([sys.executable, "-m", "training", "job.yaml", "--name", "huge",
                                 "--set", "scaling.cpus_per_worker=1000"],
                                cwd=job, env=env_for(job, ray_dir), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: scaling.num_workers 2: the run asks for 2 workers x 1000 CPU each (2000 CPU); "
                           "the cluster has "), last
    assert "its largest node" in last and "no autoscaler (a local Ray of this machine)" in last, last
    assert "UserError" not in result.stderr
    assert not (job / "runs" / "huge").exists() and not (job / "mlflow.db").exists()
    assert not (job / "logs").exists()
