"""`python -m training status` without Ray: real run directories written by the real code (the
driver's DriverStatus, the controller's RunEvents, the checkpoint format, run.json), read back by
the real command, locally and on S3 (moto_server on loopback); restart posts to a real receiver."""

import json
import os
import re
import subprocess
import sys

from conftest import REPO
from webhook import receiver

from training.checkpoint import format as ckpt
from training.observe.callback import RunEvents
from training.observe.driver_status import DriverStatus
from training.observe.notify import Target
from training.observe.state import decide_state, stale_after_s
from training.observe.status_cli import main as status_main
from training.observe.webhook import Notifier, PostPolicy
from training.run.record import Record


def write_checkpoint(run_dir, step, complete=True):
    directory = run_dir / ckpt.checkpoint_dir_name(step)
    directory.mkdir(parents=True)
    ckpt.save(directory, model_state={}, optimizer_state={}, scheduler_state={}, loop=ckpt.LoopState(step=step),
              config={"seed": 0}, steps_per_epoch=10, world_size=2, metrics={"val_loss": 0.5})
    if not complete:  # an upload cut short: state.pt shorter than meta.json records
        (directory / ckpt.STATE_FILE).write_bytes(b"cut")


def status(*args):
    lines = []
    code = status_main(list(args), out=lines.append)
    return code, "\n".join(lines)


def started_run(storage, name="r1", targets=()):
    run_dir = storage / name
    Record(name, {"seed": 0}, "abc123", "http://alice:pw@mlflow.example:5000").write(str(run_dir / "run.json"))
    driver = DriverStatus(str(run_dir), name, heartbeat_every_s=0.2, warn=print).start(
        mlflow_run_id="abc123", mlflow_url="http://mlflow.example:5000/#/experiments/1/runs/abc123",
        tracking_uri="http://alice:pw@mlflow.example:5000")
    events = RunEvents(name, str(run_dir), Notifier(list(targets), PostPolicy(backoff_s=0.01)), mlflow_run_id="abc123")
    return run_dir, driver, events


def test_a_running_then_restarted_then_finished_run(tmp_path):
    storage = tmp_path / "runs"
    with receiver() as hook:
        run_dir, driver, events = started_run(storage,
                                              targets=[Target("tracking.notify.0", hook.url(), ("restarted",))])
        write_checkpoint(run_dir, 20)
        write_checkpoint(run_dir, 40, complete=False)
        events.on_state("SCHEDULING", "RUNNING")
        events.on_report({"step": 30, "total_steps": 100, "train_loss": 0.25, "val_loss": 0.5, "lr": 0.01,
                          "world_size": 2}, checkpointed=True)
        code, text = status("r1", "--storage", str(storage))
        assert code == 0, text
        assert "run r1: running" in text and "step 30/100 | train_loss 0.25 | val_loss 0.5" in text
        assert "checkpoints (step): 40 (incomplete), 20 (complete)" in text
        assert "restarts: 0 worker-group restart(s)" in text
        assert "MLflow run abc123: http://mlflow.example:5000/#/experiments/1/runs/abc123" in text

        events.on_state("RUNNING", "RESTARTING")  # a worker died: the controller restarts the group
        events.on_state("RESTARTING", "SCHEDULING")
        events.on_state("SCHEDULING", "RUNNING")
        events.on_end()  # waits for the post in flight
        assert hook.events() == ["restarted"]
        post = hook.posts[0]["body"]
        assert post["step"] == 30 and post["restarts"] == 1 and post["mlflow_run_id"] == "abc123"
        code, text = status("r1", "--storage", str(storage), "--json")
        report = json.loads(text)
        assert report["state"] == "running" and report["restarts"] == 1 and report["step"] == 30

    driver.end("finished")
    code, text = status("r1", "--storage", str(storage))
    assert "run r1: finished" in text
    code, text = status("--storage", str(storage))  # the list
    assert code == 0 and text.split()[:3] == ["r1", "finished", "step"]
    everything = "".join(p.read_text(errors="replace") for p in run_dir.rglob("*.json"))
    assert "pw@" not in everything  # the tracking URI's password is not stored


def test_a_failed_run_shows_its_error_and_how_to_resume(tmp_path):
    storage = tmp_path / "runs"
    run_dir, driver, events = started_run(storage)
    write_checkpoint(run_dir, 20)
    driver.end("failed", "training run r1 failed: RuntimeError: forward exploded")
    code, text = status("r1", "--storage", str(storage))
    assert "run r1: failed" in text
    assert re.search(r"failed \d+ s ago: training run r1 failed: RuntimeError: forward exploded; run the same "
                     r"command with the same --name to resume it from step 20", text), text


def test_a_driver_that_stopped_without_an_end_leaves_a_resumable_run():
    beat = {"state": "running", "heartbeat": 1000.0, "heartbeat_every_s": 10.0, "host": "h"}
    assert decide_state(beat, 1000.0 + stale_after_s(10.0), False, 20).state == "running"
    gone = decide_state(beat, 1001.0 + stale_after_s(10.0), False, 20)
    assert gone.state == "resumable" and "from step 20" in gone.detail and "last heard" in gone.detail
    assert decide_state({"state": "stopped", "heartbeat": 1.0}, 2.0, False, None).state == "interrupted"  # (resumable)
    assert decide_state(None, 0.0, True, 40).state == "finished"  # a run from before status files
    assert decide_state(None, 0.0, False, None).state == "resumable"


def test_watch_refreshes_until_the_run_ends(tmp_path):
    storage = tmp_path / "runs"
    run_dir, driver, events = started_run(storage)
    events.on_report({"step": 10, "total_steps": 20, "train_loss": 0.5}, checkpointed=True)
    lines, sleeps = [], []

    def sleep(seconds):
        sleeps.append(seconds)
        events.on_report({"step": 20, "total_steps": 20, "train_loss": 0.4}, checkpointed=True)
        driver.end("finished")

    code = status_main(["r1", "--storage", str(storage), "--watch", "--interval", "2"], out=lines.append, sleep=sleep)
    text = "\n".join(lines)
    assert code == 0 and sleeps == [2.0]
    assert text.index("run r1: running") < text.index("step 10/20") < text.index("run r1: finished") \
        < text.index("step 20/20")


def test_unknown_run_or_storage_exits_2_naming_it(tmp_path):
    storage = tmp_path / "runs"
    started_run(storage)[1].end("finished")
    code, _ = status("nope", "--storage", str(storage))
    assert code == 2
    result = subprocess.run([sys.executable, "-m", "training", "status", "nope", "--storage", str(storage)],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2 and "run 'nope' is not in" in result.stderr and "runs there: r1" in result.stderr
    assert "Traceback" not in result.stderr
    result = subprocess.run([sys.executable, "-m", "training", "status", "--storage", str(tmp_path / "none")],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_status_from_a_laptop_against_s3(moto_endpoint, monkeypatch):
    from aws import create_bucket, s3_env

    env = s3_env(moto_endpoint)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    create_bucket(moto_endpoint, "status-runs")
    storage = "s3://status-runs/runs"
    run_dir = f"{storage}/s3run"
    Record("s3run", {"seed": 0}, "abc123", None).write(f"{run_dir}/run.json")
    driver = DriverStatus(run_dir, "s3run", heartbeat_every_s=0.2).start(mlflow_run_id="abc123")
    RunEvents("s3run", run_dir).on_report({"step": 7, "total_steps": 9, "train_loss": 1.5}, checkpointed=True)
    command = [sys.executable, "-m", "training", "status", "s3run", "--storage", storage]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    assert "run s3run: running" in result.stdout and "step 7/9 | train_loss 1.5" in result.stdout
    driver.end("finished")
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120, env={**os.environ, **env})
    assert "run s3run: finished" in result.stdout
