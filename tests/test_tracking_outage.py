"""Tracking outage: a real `mlflow server` is SIGKILLed while metrics are logged, then started again
on the same port with the same store. Training never waits on it, every metric arrives exactly
once, and what the server never took stays in the run's storage until a later run delivers it."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import CONFIGS, REPO, wait_for
from mlflow.tracking import MlflowClient

from training import config as config_lib
from training.metrics import mlflow_name
from training.tracking.backlog import BACKLOG_FILE, read_backlog, replay_backlogs
from training.tracking.policy import SendPolicy
from training.tracking.tracker import MlflowTracker

MLFLOW = str(Path(sys.executable).parent / "mlflow")
# Short attempts and backoff so that the tests run in seconds; the defaults are in SendPolicy.
FAST = SendPolicy(attempt_timeout_s=2.0, first_backoff_s=0.2, max_backoff_s=1.0, persist_every_s=1.0, end_wait_s=3.0)


PASSWORD = "S3cretPassw0rd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` on loopback over a sqlite store, in its own process group (it forks uvicorn)."""

    def __init__(self, root: Path, empty_store: Path):
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        shutil.copy(empty_store, root / "mlflow.db")  # (the server's first start needs no migrations)
        self.database_uri = f"sqlite:///{root}/mlflow.db"
        self.process = None
        self.starts = 0

    def start(self, timeout_s: float = 180) -> float:
        started = time.monotonic()
        self.starts += 1
        log = open(self.root / f"server-{self.starts}.log", "w")
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job runner: starts faster
        self.process = subprocess.Popen(
            [MLFLOW, "server", "--backend-store-uri", self.database_uri, "--artifacts-destination",
             str(self.root / "artifacts"), "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        while time.monotonic() - started < timeout_s:
            assert self.process.poll() is None, (self.root / f"server-{self.starts}.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=2) as response:
                    if response.status == 200:
                        return time.monotonic() - started
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"mlflow server did not answer within {timeout_s} s")

    def kill(self) -> None:
        if self.process is None:
            return
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None
        while True:  # until nothing listens on the port any more (the uvicorn child dies with the group)
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                time.sleep(0.1)
            except OSError:
                return

    @property
    def up(self) -> bool:
        return self.process is not None


@pytest.fixture(scope="module")
def server(tmp_path_factory, empty_mlflow_db):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"), empty_mlflow_db)
    yield server
    server.kill()


def steps_of(client, run_id, key):
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def new_run(client, experiment: str) -> str:
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    return client.create_run(experiment_id).info.run_id


@pytest.mark.chaos
def test_metrics_logged_through_an_outage_arrive_exactly_once(server, tmp_path, caplog):
    caplog.set_level("WARNING", logger="training.tracking")
    if not server.up:
        server.start()
    client = MlflowClient(server.uri)
    run_id = new_run(client, "outage-tracker")
    run_dir = tmp_path / "runs" / "r1"
    tracker = MlflowTracker(server.uri, run_id, str(run_dir), FAST)

    for step in range(1, 11):
        tracker.log_metrics({"loss": 1.0 / step, "acc": step / 100}, step)
    wait_for(lambda: steps_of(client, run_id, "loss") == list(range(1, 11)), 10, "steps 1-10 delivered")

    server.kill()
    slowest = 0.0
    for step in range(11, 41):
        started = time.perf_counter()
        tracker.log_metrics({"loss": 1.0 / step, "acc": step / 100}, step)
        if step == 25:
            tracker.on_checkpoint()
        slowest = max(slowest, time.perf_counter() - started)
        time.sleep(0.05)  # the sender meanwhile fails, backs off, tries again
    assert slowest < 0.25, f"log_metrics blocked {slowest:.3f} s during the outage"
    assert f"MLflow at {server.uri} is unreachable" in caplog.text and "training continues" in caplog.text

    # While MLflow is away the queue is in the run's storage too: a crash now would lose nothing.
    backlog = run_dir / BACKLOG_FILE
    wait_for(lambda: backlog.is_file() and {m.step for m in read_backlog(str(backlog))[1]} >= set(range(11, 26)),
             5, "the backlog file holds steps 11-25")

    restart_s = server.start()
    for step in range(41, 51):
        tracker.log_metrics({"loss": 1.0 / step, "acc": step / 100}, step)
    wait_for(lambda: steps_of(client, run_id, "loss") == list(range(1, 51)), 15, "all 50 steps delivered")
    for key in ("loss", "acc"):  # every step exactly once, with the value it was logged with
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == list(range(1, 51))
        assert [m.value for m in history] == [1.0 / s if key == "loss" else s / 100 for s in range(1, 51)]
    assert "answers again" in caplog.text
    wait_for(lambda: not backlog.exists(), 5, "the backlog file removed once delivered")

    tracker.finish("FINISHED")
    assert client.get_run(run_id).info.status == "FINISHED"
    print(f"server restart took {restart_s:.1f} s")


CRASHING_DRIVER = """
import sys, time
from training.tracking.policy import SendPolicy
from training.tracking.tracker import MlflowTracker
uri, run_id, run_dir = sys.argv[1:4]
tracker = MlflowTracker(uri, run_id, run_dir, SendPolicy(attempt_timeout_s=1, first_backoff_s=0.2, max_backoff_s=0.5,
                                                          persist_every_s=60))
for step in range(1, 21):
    tracker.log_metrics({"loss": 1.0 / step}, step)
tracker.on_checkpoint()
print("logged", flush=True)
time.sleep(600)
"""


@pytest.mark.chaos
def test_a_server_that_never_returns_leaves_a_backlog_that_a_later_run_delivers(server, workdir, caplog, capsys):
    from training.run.driver import start_tracking
    from training.run.paths import resolve_paths
    from training.run.record import Record

    caplog.set_level("WARNING", logger="training.tracking")
    server.kill()
    # The runs exist (created before the outage): made here straight in the server's own store.
    store = MlflowClient(server.database_uri)
    crashed_id, finished_id = new_run(store, "outage-backlog"), new_run(store, "outage-backlog")
    tmp_path = workdir
    runs = workdir / "runs"

    # A driver SIGKILLed during the outage, right after a checkpoint: its metrics are on disk.
    crashed = subprocess.Popen([sys.executable, "-c", CRASHING_DRIVER, server.uri, crashed_id, str(runs / "crashed")],
                               cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert crashed.stdout.readline().strip() == "logged"
    crashed_backlog = runs / "crashed" / BACKLOG_FILE
    wait_for(lambda: crashed_backlog.is_file() and len(read_backlog(str(crashed_backlog))[1]) == 20, 10,
             "the crashed driver's backlog")
    crashed.kill()
    crashed.wait()

    # A run that ends while MLflow is away: finalize and finish return, nothing is lost.
    job, manifest, result, summary = finished_run(tmp_path, runs / "finished", finished_id, server.uri)
    tracker = MlflowTracker(server.uri, finished_id, str(runs / "finished"), FAST)
    for step in range(1, 21):
        tracker.log_metrics({"loss": 1.0 / step, "acc": step / 100}, step)
    from training.run.finalize import finalize

    lines = []
    started = time.monotonic()
    finalize(job, manifest, result, result.checkpoint, tracker, summary, lines.append)
    tracker.finish("FINISHED")
    assert time.monotonic() - started < 15
    assert any(line.startswith(f"warning: MLflow at {server.uri} is unreachable: the final model is not logged")
               for line in lines), lines
    saved = json.loads((runs / "finished" / "summary.json").read_text())
    assert saved["mlflow_model_logged"] is False and saved["checkpoint"] == summary.checkpoint_path
    finished_backlog = runs / "finished" / BACKLOG_FILE
    header, metrics = read_backlog(str(finished_backlog))
    assert header["status"] == "FINISHED" and header["run_id"] == finished_id and len(metrics) == 40
    assert str(finished_backlog) in caplog.text

    server.start()
    client = MlflowClient(server.uri)
    capsys.readouterr()
    # Another run starts in the same storage: the finished run's backlog is delivered and its status
    # set; the crashed run's is left for its own resume (it may still be running elsewhere).
    other = config_lib.load(CONFIGS / "digits.yaml", [f"tracking.tracking_uri={server.uri}",
                                                      "tracking.experiment=outage-backlog"], name="other")
    start_tracking(other, resolve_paths(other, "other"), None, "other")
    assert steps_of(client, finished_id, "loss") == list(range(1, 21)) == steps_of(client, finished_id, "acc")
    assert client.get_run(finished_id).info.status == "FINISHED" and not finished_backlog.exists()
    assert f"tracking: sent 40 metrics kept in {finished_backlog}" in capsys.readouterr().out
    assert crashed_backlog.exists() and steps_of(client, crashed_id, "loss") == []

    # The crashed run resumed (same name, so same run directory and MLflow run): its backlog is
    # delivered, once, however often it is replayed.
    crashed_job = config_lib.load(CONFIGS / "digits.yaml", [f"tracking.tracking_uri={server.uri}"], name="crashed")
    resumed = start_tracking(crashed_job, resolve_paths(crashed_job, "crashed"),
                              Record("crashed", {}, crashed_id, server.uri), "crashed")
    assert resumed.run_id == crashed_id and client.get_run(crashed_id).info.status == "RUNNING"
    assert steps_of(client, crashed_id, "loss") == list(range(1, 21)) and not crashed_backlog.exists()
    crashed_backlog.write_text(json.dumps({"run_id": crashed_id, "tracking_uri": server.uri, "status": None}) + "\n"
                               + "".join(json.dumps({"key": m.key, "value": m.value, "timestamp": m.timestamp,
                                                     "step": m.step}) + "\n"
                                         for m in client.get_metric_history(crashed_id, "loss")))
    replay_backlogs(str(runs), resumed)  # the same metrics once more: still once each in MLflow
    assert steps_of(client, crashed_id, "loss") == list(range(1, 21)) and not crashed_backlog.exists()
    assert steps_of(client, finished_id, "loss") == list(range(1, 21))


def finished_run(tmp_path, run_dir: Path, run_id: str, tracking_uri: str):
    """What finalize gets at the end of a run: the job, its data, a real final checkpoint, a summary."""
    import ray.train
    import torch

    from training.checkpoint import format as ckpt
    from training.data.registry import prepare
    from training.models.registry import build_model
    from training.run.driver import RunSummary

    job = config_lib.load(CONFIGS / "digits.yaml", [f"tracking.tracking_uri={tracking_uri}"], name=run_dir.name)
    manifest = prepare(job.data, str(tmp_path / "datasets"), log=lambda line: None)
    model = build_model(job.model, {"task": manifest.task, **manifest.spec})
    directory = run_dir / "checkpoint-00000020"
    directory.mkdir(parents=True)
    ckpt.save(directory, model_state=model.state_dict(), optimizer_state={}, scheduler_state={},
              loop=ckpt.LoopState(step=20), config=job.model_dump(mode="json"), steps_per_epoch=10, world_size=1,
              metrics={"val_accuracy": 0.5})
    metrics = {"step": 20, "train_loss": 0.5, "val_loss": 0.6, "val_accuracy": 0.5, "samples_per_s": 100.0,
               "world_size": 1}
    registered = ray.train.Checkpoint.from_directory(str(directory))
    result = SimpleNamespace(checkpoint=registered, metrics=metrics, best_checkpoints=[(registered, metrics)])
    summary = RunSummary(name=run_dir.name, run_dir=str(run_dir), steps=20, metrics=metrics, wall_s=1.0, resumed=False,
                         checkpoint_path=str(directory), mlflow_run_id=run_id, tracking_uri=tracking_uri)
    assert torch.is_tensor(next(iter(model.state_dict().values())))
    return job, manifest, result, summary


def test_a_local_store_gets_every_metric_once_and_the_final_status(tmp_path, empty_mlflow_db):
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path}/mlflow.db"  # no server: the same tracker over MLflow's local store
    client = MlflowClient(uri)
    run_id = new_run(client, "local")
    tracker = MlflowTracker(uri, run_id, str(tmp_path / "runs" / "local"), FAST)
    for step in range(1, 31):
        tracker.log_metrics({"loss": 1.0 / step, "flag": True, "name": "x"}, step)  # only numbers are metrics
    tracker.finish("FAILED")
    assert steps_of(client, run_id, "loss") == list(range(1, 31))
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and set(run.data.metrics) == {"loss"}
    assert not (tmp_path / "runs" / "local" / BACKLOG_FILE).exists()


def test_the_controller_gets_one_tracker_for_both_callbacks():
    """The callbacks travel to the Train controller in one pickle: the one that closes the tracker
    at the end must close the tracker the reports were queued on."""
    import ray.cloudpickle

    from training.tracking.callback import run_callbacks

    report, shutdown = ray.cloudpickle.loads(ray.cloudpickle.dumps(
        run_callbacks(MlflowTracker("http://127.0.0.1:1", "run", "/tmp/runs/r", FAST))))
    assert report.tracker is shutdown.tracker and report.tracker.policy == FAST
    assert [FAST.backoff_s(n) for n in (1, 2, 3, 4, 9)] == [0.2, 0.4, 0.8, 1.0, 1.0]


def test_unreachable_mlflow_at_start_is_a_user_error_and_starts_nothing(workdir):
    from training.errors import UserError
    from training.run.driver import run_training

    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    job = config_lib.load(CONFIGS / "digits.yaml", [f"tracking.tracking_uri={uri}"], name="no-mlflow")
    started = time.monotonic()
    with pytest.raises(UserError, match=f"cannot reach MLflow at {uri}"):
        run_training(job, log=lambda line: None)
    assert time.monotonic() - started < 30  # one short attempt, not MLflow's minutes of retries
    assert not (workdir / "runs" / "no-mlflow").exists()


@pytest.mark.ray
@pytest.mark.chaos
@pytest.mark.slow
def test_a_training_run_survives_mlflow_killed_and_restarted(server, ray_cluster, workdir, capfd):
    from training.run.driver import run_training

    if not server.up:
        server.start()
    # Long enough to outlast a restart of the server here (10-30 s on a busy 2-core machine); if the
    # server comes back only after the last step, the end of the run still waits a little for it.
    max_steps = 600
    # The server asks for no password; the run is given one in the URI, as one with basic auth
    # would need, and it must show up nowhere: not in the output, the run's files or MLflow.
    secret_uri = server.uri.replace("http://", f"http://alice:{PASSWORD}@")
    job = config_lib.load(CONFIGS / "digits.yaml", [
        "scaling.num_workers=1", f"train.max_steps={max_steps}", "train.log_every_n_steps=10",
        "train.eval_every_n_steps=50", "checkpoint.every_n_steps=50", "train.min_report_interval_s=0",
        f"tracking.tracking_uri={secret_uri}", "tracking.experiment=outage-e2e"], name="outage")
    first_checkpoint = workdir / "runs" / "outage" / "checkpoint-00000050"
    events = {}

    def chaos():
        wait_for(first_checkpoint.is_dir, 240, "the first checkpoint")
        server.kill()
        events["killed"] = time.monotonic()
        time.sleep(3)
        server.start()
        events["back"] = time.monotonic()

    monkey = threading.Thread(target=chaos, daemon=True)
    monkey.start()
    started = time.monotonic()
    summary = run_training(job)
    ended = time.monotonic()
    monkey.join(240)
    output = capfd.readouterr()
    text = output.out + output.err

    assert summary.steps == max_steps and events["killed"] < ended
    shown_uri = server.uri.replace("http://", "http://alice:***@")
    assert f"MLflow at {shown_uri} is unreachable" in text and "training continues" in text
    client = MlflowClient(server.uri)
    run = client.get_run(summary.mlflow_run_id)
    assert PASSWORD not in text
    assert run.data.params["tracking.tracking_uri"] == shown_uri and PASSWORD not in json.dumps(run.data.params)
    assert not [str(p) for p in [*workdir.rglob("*"), *server.root.rglob("*")]
                if p.is_file() and PASSWORD.encode() in p.read_bytes()]
    assert run.info.status == "FINISHED"
    reported = list(range(10, max_steps + 1, 10))
    assert steps_of(client, run.info.run_id, "train_loss") == reported  # every report, exactly once
    assert steps_of(client, run.info.run_id, mlflow_name("samples_per_s")) == reported
    assert summary.extra.get("mlflow_model_logged", True), text[-3000:]
    model = client.get_logged_model(summary.extra["model_id"])  # the model the run's end logged
    assert (model.source_run_id, model.experiment_id) == (run.info.run_id, run.info.experiment_id)
    assert summary.registered_model and client.get_model_version(
        summary.registered_model, summary.extra["registered_version"]).run_id == run.info.run_id
    logged = client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                         filter_string=f"source_run_id = '{run.info.run_id}'")
    assert [m.model_id for m in logged] == [model.model_id], (logged, text[-3000:])
    assert not (workdir / "runs" / "outage" / BACKLOG_FILE).exists()
    print(f"run {ended - started:.0f} s; MLflow killed at {events['killed'] - started:.0f} s, "
          f"answering again at {events['back'] - started:.0f} s")
