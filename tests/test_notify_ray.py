"""Notifications and status of real runs on the shared local Ray cluster, with a real webhook
receiver (http.server on loopback): a good run posts `finished` once (and a receiver that is down
changes nothing; it also logs the step-time breakdown and a profiler trace), a run whose worker is \
SIGKILLed posts `restarted` once, and `failed` once when a
second kill exhausts its budget; `status` shows each run running, then finished or failed; the
webhook URL is in no file, MLflow record or output line."""

import os
import signal
import threading
import time

import pytest
from aws import free_port
from conftest import CONFIGS, train_worker_pids, wait_for
from webhook import receiver

from training import config as config_lib
from training.errors import RunFailed
from training.metrics import mlflow_name
from training.observe.status_cli import main as status_main
from training.run.driver import run_training

pytestmark = pytest.mark.ray

SECRET = "hooks-T0KEN-9f8e7d"
FAST = ["train.eval_every_n_steps=10", "train.log_every_n_steps=5", "train.min_report_interval_s=0",
        "checkpoint.every_n_steps=10", "scaling.cpus_per_worker=0.5"]


def status_of(storage, name):
    lines = []
    status_main([name, "--storage", str(storage)], out=lines.append)
    return "\n".join(lines)


def secret_in_files(root) -> list:
    return [str(p) for p in root.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


def test_a_good_run_posts_finished_once_and_its_url_is_nowhere(ray_cluster, workdir, monkeypatch, capfd):
    down = f"http://127.0.0.1:{free_port()}/down/{SECRET}"  # nothing listens there
    with receiver() as hook:
        monkeypatch.setenv("NOTIFY_HOOK", hook.url(f"/hook/{SECRET}"))
        targets = [{"url": "${NOTIFY_HOOK}", "on": ["finished", "failed", "restarted"]}, {"url": down}]
        job = config_lib.load(CONFIGS / "digits.yaml", FAST + [
            "train.max_steps=60", "tracking.register_model=false", "tracking.export_onnx=false",
            "train.profile={steps: [2, 3]}",
            f"tracking.notify={targets}"], name="good")
        seen = {}

        def watch():  # `status` while the run trains
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and "running" not in seen:
                text = status_of(workdir / "runs", "good") if (workdir / "runs" / "good" / "run.json").exists() else ""
                if "run good: running" in text and "step " in text and "no step" not in text:
                    seen["running"] = text
                time.sleep(0.3)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        summary = run_training(job)  # returns: the receiver that is down did not fail it
        watcher.join(timeout=5)
        assert summary.steps == 60
        assert hook.events() == ["finished"]
        body = hook.posts[0]["body"]
        assert body["name"] == "good" and body["step"] == 60 and body["total_steps"] == 60
        assert body["mlflow_run_id"] == summary.mlflow_run_id and "val_accuracy" in body["metrics"]
        assert body["text"].startswith("run good finished at step 60/60")

    assert "step 60/60" not in seen.get("running", "missing"), seen
    assert "run good: running" in seen.get("running", "")
    final = status_of(workdir / "runs", "good")
    assert "run good: finished" in final and "step 60/60" in final and "60 (complete)" in final
    assert f"MLflow run {summary.mlflow_run_id}" in final
    from mlflow.tracking import MlflowClient  # the step-time breakdown, by step, as any metric

    client = MlflowClient(summary.tracking_uri)
    for phase in ("data_wait", "forward_backward", "optimizer"):
        history = client.get_metric_history(summary.mlflow_run_id, mlflow_name(f"time_{phase}_ms"))
        assert history and all(m.value >= 0 for m in history) and history[-1].step == 60, phase
    assert client.get_metric_history(summary.mlflow_run_id, mlflow_name("time_forward_backward_ms"))[-1].value > 0
    assert client.get_metric_history(summary.mlflow_run_id, mlflow_name("checkpoint_blocking_s"))
    # rank 0's profiler trace of steps 2-3, in the run's storage and in MLflow
    assert (workdir / "runs" / "good" / "profile" / "trace-steps-2-3.json").is_file()
    assert [a.path for a in client.list_artifacts(summary.mlflow_run_id, "profile")] == ["profile/trace-steps-2-3.json"]
    out, err = capfd.readouterr()
    assert "tracking.notify.1 (127.0.0.1) did not take the finished notification" in out + err
    assert SECRET not in out + err
    assert secret_in_files(workdir) == []  # run storage, checkpoints, mlflow.db, MLflow artifacts
    assert "${NOTIFY_HOOK}" in (workdir / "runs" / "good" / "config.yaml").read_text()


def test_a_killed_worker_posts_restarted_and_a_second_kill_posts_failed(ray_cluster, workdir, monkeypatch, capfd):
    with receiver() as hook:
        monkeypatch.setenv("NOTIFY_HOOK", hook.url(f"/hook/{SECRET}"))
        job = config_lib.load(CONFIGS / "digits.yaml", FAST + [
            "train.max_steps=100000", "failure.max_failures=1", "tracking.enabled=false", "scaling.num_workers=1",
            "tracking.notify=[{url: '${NOTIFY_HOOK}', on: [finished, failed, restarted, preempted]}]"], name="killed")
        run_dir = workdir / "runs" / "killed"
        kills = []

        def progress_step():
            from training.observe.files import read_progress

            return (read_progress(str(run_dir)) or {}).get("step") or 0

        def chaos():
            try:
                wait_for(lambda: progress_step() >= 10 and train_worker_pids(), 180, "a first report")
                os.kill(train_worker_pids()[0], signal.SIGKILL)
                kills.append(1)
                wait_for(lambda: hook.events() == ["restarted"], 60, "the restarted post")
                before = progress_step()
                wait_for(lambda: progress_step() > before and train_worker_pids(), 180,
                         "a report of the restarted group")
                kills.append(status_of(workdir / "runs", "killed"))
                os.kill(train_worker_pids()[0], signal.SIGKILL)
                kills.append(1)
            except Exception as exc:  # shown by the assertions below
                kills.append(exc)

        killer = threading.Thread(target=chaos, daemon=True)
        killer.start()
        with pytest.raises(RunFailed):
            run_training(job)
        killer.join(timeout=10)
        assert len(kills) == 3, kills
        assert hook.events() == ["restarted", "failed"]
        restarted, failed = (p["body"] for p in hook.posts)
        assert restarted["restarts"] == 1 and restarted["step"] >= 10
        assert failed["error"].startswith("training run killed failed") and failed["restarts"] == 1

    running = kills[1]
    assert "run killed: running" in running and "restarts: 1 worker-group restart(s)" in running
    final = status_of(workdir / "runs", "killed")
    assert "run killed: failed" in final and "run the same command with the same --name to resume it from step" in final
    out, err = capfd.readouterr()
    assert SECRET not in out + err
    assert secret_in_files(workdir) == []
