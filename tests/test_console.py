"""The console of `python -m training` without Ray: lines as Ray forwards them (its own prefix and
colours) routed by the real router through real stdout/stderr swaps, the log file behind them."""

import sys
import warnings

from training.run.console import ConsoleRouter, Place, RunLog, console_log, opening_line, warning_place

CYAN, RESET = "\x1b[36m", "\x1b[0m"


def test_progress_lines_lose_rays_prefix_and_rays_own_actors_go_to_the_log():
    router = ConsoleRouter()
    line = "step 300/400 (75%) | loss 0.0428 | 2 workers"
    for prefixed in (f"{CYAN}(TrainController pid=4242){RESET} {line}", f"(TrainController pid=7, ip=10.0.0.2) {line}",
                     f"(TrainController.run pid=7) {line}"):
        routed = router.route(prefixed)
        assert routed.place is Place.CONSOLE and routed.text == line
    # the controller's stderr is Ray Train's own logging (the PreemptionWatcher's constructor warning,
    # a resource request that timed out), but for this project's warnings
    ray_train = f"{CYAN}(TrainController pid=4242){RESET} [2026-12-03 07:19:22,244 E 1 2] core_worker.cc:2465: " \
                "Actor with class name: 'PreemptionWatcher' has constructor arguments in the object store"
    assert router.route(ray_train, is_err=True).place is Place.LOG
    own = f"{CYAN}(TrainController pid=4242){RESET} tracking: MLflow at http://h:5000 is unreachable"
    assert router.route(own, is_err=True) == type(router.route(own))(
        Place.CONSOLE, "tracking: MLflow at http://h:5000 is unreachable")
    assert router.route("Successfully registered model 'digits-digits_mlp'.", is_err=True).place is Place.LOG
    watcher = f"{CYAN}(PreemptionWatcher pid=99){RESET} WARNING: constructor arguments are large"
    assert router.route(watcher).place is Place.LOG
    assert router.route("(PlacementGroupCleaner pid=5) "
                        "Failed to query Ray Train Controller actor state").place is Place.LOG
    worker = "(RayTrainWorker pid=12) my plug-in says hello"
    assert router.route(worker).place is Place.CONSOLE and router.route(worker).text == worker
    assert router.route("run r1 finished: 400 steps in 53 s").place is Place.CONSOLE
    ray_record = "2026-12-03 07:09:30,458\tWARNING authentication_token_setup.py:85 -- Token authentication is enabled"
    mlflow_record = "2026/12/03 07:08:58 WARNING mlflow.pytorch: Saving a model as a pickle"
    assert router.route(ray_record).place is Place.LOG and router.route(mlflow_record).place is Place.LOG
    assert router.route("2026/12/03 07:08:58 ERROR mlflow.store: cannot write").place is Place.CONSOLE


def test_warnings_from_inside_ray_and_mlflow_go_to_the_log():
    assert warning_place("/x/.venv/lib/python3.11/site-packages/mlflow/pytorch/__init__.py") is Place.LOG
    assert warning_place("/x/.venv/lib/python3.11/site-packages/ray/actor.py") is Place.LOG
    assert warning_place("/home/me/my_plugins.py") is Place.CONSOLE


def test_opening_line_is_one_line_with_what_a_run_needs():
    line = opening_line("r1", "job.yaml", [1, 4], "s3://b/runs/r1", "http://u:pw@mlflow:5000")
    assert line == "run r1 | config job.yaml | 1-4 workers | storage s3://b/runs/r1 | MLflow http://u:***@mlflow:5000"


def test_the_console_and_the_log_file(tmp_path, capsys):
    log = RunLog(tmp_path / "r1" / "driver.log")
    with console_log(log):
        print("checking the config")  # before the run starts: kept in memory, nothing written
        assert not (tmp_path / "r1").exists()
        log.start()
        print(f"{CYAN}(TrainController pid=4242){RESET} step 10/20 (50%)")
        print("(PreemptionWatcher pid=99) noise", file=sys.stderr)
        warnings.warn_explicit("pickle is unsafe", UserWarning, "/v/lib/python3.11/site-packages/mlflow/x.py", 1)
        sys.stdout.write("partial ")
        sys.stdout.write("line with password http://u:pw@h/\n")
    out, err = capsys.readouterr()
    assert out.splitlines() == ["checking the config", "step 10/20 (50%)", "partial line with password http://u:pw@h/"]
    assert err == ""
    text = log.path.read_text()
    assert text.index("checking the config") < text.index("(TrainController pid=4242)") < text.index("noise")
    assert "pickle is unsafe" in text and "u:***@h" in text and "pw@" not in text


def test_library_loggers_attached_to_the_console_are_routed_too(tmp_path, capsys):
    import logging

    logger = logging.getLogger("mlflow.fake_for_test")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y/%m/%d %H:%M:%S"))
    logger.addHandler(handler)
    try:
        log = RunLog(tmp_path / "driver.log")
        with console_log(log):
            log.start()
            logger.warning("a warning about pickles")
        assert handler.stream is sys.stderr  # put back
    finally:
        logger.removeHandler(handler)
    assert "a warning about pickles" not in capsys.readouterr().err
    assert "WARNING mlflow.fake_for_test: a warning about pickles" in log.path.read_text()


def test_a_run_that_never_starts_writes_no_log(tmp_path, capsys):
    log = RunLog(tmp_path / "r1" / "driver.log")
    with console_log(log):
        print("error: bad input", file=sys.stderr)
    assert not (tmp_path / "r1").exists() and "error: bad input" in capsys.readouterr().err


YELLOW, MAGENTA = "\x1b[33m", "\x1b[35m"
WORKER_DIED = (
    f"{YELLOW}(raylet){RESET} A worker died or was killed while executing a task by an unexpected system error. To "
    "troubleshoot the problem, check the logs for the dead worker. RayTask ID: ffffffffffffffff7b1e2d1c9a5c0f3e0d4a"
    "b3c201000000 Worker ID: 9c3f5e1f2a0b8d7c6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b0c9d8e7f Node ID: 4e1b0c2d3e4f5a6b7c8d9e0f"
    "1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d Worker IP address: 127.0.0.1 Worker port: 38643 Worker PID: 20941 Worker exit "
    "type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of file. "
    "There are some potential root causes. (1) The process is killed by SIGKILL by OOM killer due to high memory "
    "usage. (2) ray stop --force is called. (3) The worker is crashed unexpectedly due to SIGSEGV or other unexpected "
    "errors.")
# The surviving worker's 12 lines, as Ray Train's worker logs them (stderr) with Ray's prefix in colour.
SURVIVOR = [f"{MAGENTA}(RayTrainWorker pid=20942){RESET} {text}" for text in (
    "Error in training function:",
    "Traceback (most recent call last):",
    '  File "/work/main/training/worker/loop.py", line 23, in train_loop_per_worker',
    "    run(start_worker(config))",
    '  File "/work/main/training/worker/loop.py", line 37, in run',
    "    loss_sum.backward(w.loss_scale)",
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/_tensor.py", line 626, in backward',
    "    torch.autograd.backward(",
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/autograd/__init__.py", line 347, in backward',
    "    _engine_run_backward(",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
    "[127.0.0.1]:22017",
    "")]
RESUMED = (f"{MAGENTA}(RayTrainWorker pid=21377){RESET} resumed from step 500 with 2 workers "
           "(/runs/r1/checkpoint-00000500)")


def test_a_worker_failure_reads_one_line_each_on_the_console_and_all_of_it_in_the_log(tmp_path, capsys):
    """A worker killed mid-run, as the console got it: the raylet's line, the survivor's gloo
    traceback, the controller's line, the new group's resume (printed twice by Ray Train's print
    patch: stdout, and its logger on stderr), MLflow registering a new version, in Ray's colours."""
    from training.tracking.callback import failure_line

    log = RunLog(tmp_path / "driver.log")
    with console_log(log):
        log.start()
        print(WORKER_DIED, file=sys.stderr)
        for line in SURVIVOR:
            print(line, file=sys.stderr)
        print(f"{CYAN}(TrainController pid=4242){RESET} "
              + failure_line({0: RuntimeError("gloo"), 1: OSError("died")}, checkpoint_step=500))
        print(RESUMED)
        print(RESUMED, file=sys.stderr)
        print("Registered model 'digits-digits_mlp' already exists. Creating a new version of this model...",
              file=sys.stderr)
        print(f"{MAGENTA}(RayTrainWorker pid=21377){RESET} my plug-in: epoch 3")  # a worker's own line still shows
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        "a worker process (pid 20941) on 127.0.0.1 died (SYSTEM_ERROR); its message is in the run's log"]
    assert out.splitlines() == [
        "worker failure (rank 0: RuntimeError, rank 1: OSError); the group restarts from step 500 if the failure "
        "budget allows",
        "(RayTrainWorker pid=21377) resumed from step 500 with 2 workers (/runs/r1/checkpoint-00000500)",
        "(RayTrainWorker pid=21377) my plug-in: epoch 3"]
    assert "\x1b[" not in out + err
    text = log.path.read_text()
    assert "Worker exit detail: Worker unexpectedly exits" in text and "Connection closed by peer" in text
    assert text.count("resumed from step 500") == 2 and "already exists. Creating a new version" in text
    assert "\x1b[" not in text


def test_a_traceback_ends_with_its_exception_and_one_worker_count_is_singular():
    router = ConsoleRouter()
    lines = ["(RayTrainWorker pid=7) Traceback (most recent call last):", '(RayTrainWorker pid=7)   File "x.py"',
             "(RayTrainWorker pid=7)     boom()", "(RayTrainWorker pid=7) ValueError: boom"]
    assert [router.route(line, is_err=True).place for line in lines] == [Place.LOG] * 4
    assert router.route("(RayTrainWorker pid=7) step 3 of my plug-in").place is Place.CONSOLE
    # another process's lines are not taken for this one's traceback
    router.route("(RayTrainWorker pid=8) Error in training function:")
    assert router.route("(RayTrainWorker pid=7)   indented output of a plug-in").place is Place.CONSOLE
    assert router.route("(raylet, ip=10.0.0.2) A worker died or was killed while executing a task").text == \
        "a worker process on 10.0.0.2 died; its message is in the run's log"
    assert opening_line("r1", "job.yaml", 1, "/runs/r1", None).startswith("run r1 | config job.yaml | 1 worker |")

    from training.tracking.callback import progress_line

    metrics = {"step": 5, "total_steps": 10, "train_loss": 0.5, "samples_per_s": 100.0, "world_size": 1}
    assert progress_line(metrics, None).endswith("| 1 worker")
    assert progress_line({**metrics, "world_size": 2}, None).endswith("| 2 workers")
