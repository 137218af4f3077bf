"""The console of `python -m tuning`: one line per trial event and the result, everything else
(Tune's tables, Ray's and the trials' own output) in the sweep's log file. The same sweep's trials
that ASHA stopped keep what they reported (tests/test_sweep_stopped_trials.py)."""

import pytest
from test_sweep_stopped_trials import SWEEP, assert_stopped_trials_keep_their_metrics_and_end_finished

from tuning import cli
from tuning import config as sweep_config
from tuning.console import SweepRouter
from tuning.schedule import tune_config
from tuning.sweep import run_sweep

CYAN, RESET = "\x1b[36m", "\x1b[0m"
TABLE = ("╭", "│", "├", "╰", "Trial status:", "Trial train_trial_")


def test_what_a_sweep_prints_goes_to_its_log_but_this_projects_warnings():
    router = SweepRouter()
    log_only = ["╭──────────╮", "│ Trial name    status │", "Trial status: 2 RUNNING | 1 PENDING",
                f"{CYAN}(TrainController pid=7188){RESET} step 10/40 (25%) | loss 2.3088 | 1 worker",
                f"{CYAN}(TrainController pid=7188){RESET} [2026-12-05 01:34:53,170 E 7188 7332] core_worker.cc:2465: "
                "Actor with class name: 'PreemptionWatcher' and ID: 'b4' has constructor arguments in the object store",
                "(train_trial pid=5934) run s1-f1f3f_00000: starting; storage /tmp/runs/s1-f1f3f_00000",
                "2026-12-05 01:33:59,781\tWARNING tune.py:819 -- `max_concurrent_trials` will be ignored."]
    assert all(router.route(line, is_err).place.value == "log" for line in log_only for is_err in (False, True))
    own = f"{CYAN}(TrainController pid=7){RESET} tracking: MLflow at http://h:5000 is unreachable"
    routed = router.route(own, is_err=True)
    assert routed.place.value == "console" and routed.text == "tracking: MLflow at http://h:5000 is unreachable"


@pytest.mark.parametrize("algorithm, limit", [("random", None), ("optuna", 2)])
def test_tune_is_given_max_concurrent_trials_only_where_it_applies_it(tmp_path, algorithm, limit):
    # (Tune applies it only to a Searcher; given with the random generator, it warns that it ignores it)
    path = tmp_path / "sweep.yaml"
    path.write_text(SWEEP.replace("{grid: [0.03, 0.00001, 0.00001, 0.00002]}", "{loguniform: [1.0e-5, 3.0e-2]}"))
    sweep = sweep_config.load(path, [f"search.algorithm={algorithm}"])
    config = tune_config(sweep, 2)
    assert config.max_concurrent_trials == limit
    if algorithm == "random":
        assert config.search_alg.max_concurrent == 2


@pytest.mark.ray
@pytest.mark.timeout(420)
def test_a_sweeps_console_is_its_trial_events_and_its_result(ray_cluster, workdir, capsys, monkeypatch):
    """`python -m tuning` on an ASHA sweep of 4 trials; the same sweep's stopped trials then keep what
    they reported (one sweep for both checks: a sweep costs about a minute)."""
    path = workdir / "sweep.yaml"
    path.write_text(SWEEP)
    summaries = []  # what the command's sweep returned, for the checks of its stopped trials

    def run_and_keep(*args, **kwargs):
        summaries.append(run_sweep(*args, **kwargs))
        return summaries[-1]

    monkeypatch.setattr(cli, "run_sweep", run_and_keep)
    assert cli.main([str(path), "--name", "quiet"]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert not [line for line in lines if line.startswith(TABLE) or "pid=" in line], "\n".join(lines)
    trials = {line.split()[1] for line in lines if line.startswith("trial ")}
    assert len(trials) == 4
    for trial in trials:
        assert f"trial {trial} started: optim.lr=" in "\n".join(lines)
    events = [line for line in lines if line.startswith("trial ")]
    stopped = [line for line in events if " stopped by ASHA at step " in line]
    finished = [line for line in events if " finished at step 40: val_accuracy " in line]
    evaluated = [line for line in events if ": val_accuracy " in line and " step " in line and line not in finished]
    assert stopped and finished and evaluated and len(stopped) + len(finished) == 4
    # opening line, the sweep's own lines, the events, one result line per trial, the best, MLflow, the end
    assert lines[0].startswith("sweep quiet: 1 sample(s) of optim.lr ~ grid(")
    assert lines[-2].startswith("sweep quiet finished in ") and lines[-2].endswith(
        f"{len(finished)} finished, {len(stopped)} stopped, 0 failed")
    log_path = workdir / "runs" / "sweeps" / "quiet" / "sweep.log"
    assert lines[-1] == f"log: {log_path}"
    # the rest: the opening line, the data, the start and the concurrency, one result line per trial, the
    # best trial, its MLflow run and model, the end and the log (29 lines in all, measured)
    results = [line for line in lines if line.startswith("  trial ")]
    assert len(results) == 4 and len(lines) - len(events) - len(results) <= 11, "\n".join(lines)
    log = log_path.read_text()
    assert "Trial status:" in log and "╭" in log  # Tune's tables, in the log
    assert all(line in log for line in events)
    assert "max_concurrent_trials` will be ignored" not in log
    assert_stopped_trials_keep_their_metrics_and_end_finished(summaries[0], workdir)
