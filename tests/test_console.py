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
