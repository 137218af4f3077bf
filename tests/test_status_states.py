"""What `python -m training status` says of a run in each of its ends, and whether a run's worker
group can be placed, decided without Ray (pure: decide_state / describe, decide_placement /
decide_wait with the clock passed in). The real processes are tests/test_run_lifecycle.py's."""

import math
import signal

import pytest

from training.config import ScalingConfig
from training.observe.driver_status import DriverStatus
from training.observe.state import decide_state
from training.observe.status_cli import describe, list_line
from training.observe.status_cli import main as status_main
from training.run import interrupt
from training.run.placement import WAIT_SAY_EVERY_S, bundles_that_fit, decide_placement, decide_wait
from training.run.record import Record
from training.run.resources import NodeGroup, launcher_node_groups

RESUME = "run the same command with the same --name to resume it from step 40"


def ended(state, error=None, at=1000.0):
    return {"state": state, "error": error, "heartbeat": at, "ended": at, "heartbeat_every_s": 10.0}


def test_an_interrupted_run_is_resumable_and_says_how():
    for signame in ("SIGINT", "SIGTERM"):
        state = decide_state(ended("interrupted", f"interrupted by {signame}"), 1005.0, False, 40)
        assert state.state == "interrupted"
        assert state.detail == f"interrupted by {signame} 5 s ago, resumable; {RESUME}"
    # what drivers wrote for Ctrl-C before ("stopped"): the same
    assert decide_state(ended("stopped", "interrupted"), 1005.0, False, 40).state == "interrupted"


def test_a_failed_run_shows_its_error_in_one_line():
    state = decide_state(ended("failed", "training run r failed: boom\nTraceback ..."), 1005.0, False, 40)
    assert state.state == "failed" and state.detail == f"failed 5 s ago: training run r failed: boom; {RESUME}"


def test_a_trial_its_scheduler_stopped_is_shown_as_such_and_not_offered_for_resume():
    reason = "ASHA stopped it at step 40 (val_loss 0.41, below the rung's top 1/2)"
    state = decide_state(ended("scheduler_stopped", reason), 1005.0, False, 40)
    assert state.state == "scheduler_stopped"
    assert state.detail.startswith(f"stopped by the sweep's scheduler: {reason} (5 s ago")
    assert "--name" not in state.detail and "not to be resumed" in state.detail


def test_finished_running_and_vanished_drivers_are_unchanged():
    assert decide_state(ended("finished"), 1005.0, True, 40).state == "finished"
    beat = {"state": "running", "heartbeat": 1000.0, "heartbeat_every_s": 10.0, "host": "h"}
    assert decide_state(beat, 1010.0, False, 40).state == "running"
    gone = decide_state(beat, 2000.0, False, 40)
    assert gone.state == "resumable" and RESUME in gone.detail


def status_lines(storage, name):
    lines = []
    assert status_main([name, "--storage", str(storage)], out=lines.append) == 0
    return lines


@pytest.mark.parametrize("state, error, shown", [
    ("interrupted", "interrupted by SIGTERM", "interrupted by SIGTERM"),
    ("scheduler_stopped", "PBT stopped it at step 80", "stopped by the sweep's scheduler: PBT stopped it at step 80"),
    ("failed", "training run r1 failed: RuntimeError: exploded", "failed"),
])
def test_the_command_shows_each_end_as_the_driver_or_the_sweep_recorded_it(tmp_path, state, error, shown):
    """Real files: run.json and status.json as DriverStatus writes them (contract: a sweep's trial
    ends through DriverStatus.end("scheduler_stopped", reason))."""
    run_dir = tmp_path / "r1"
    Record("r1", {"seed": 0}, None, None).write(str(run_dir / "run.json"))
    driver = DriverStatus(str(run_dir), "r1", heartbeat_every_s=60).start()
    driver.end(state, error)
    lines = status_lines(tmp_path, "r1")
    assert lines[0] == f"run r1: {state}" and lines[1].strip().startswith(shown), lines
    resumable = state != "scheduler_stopped"
    assert ("--name" in lines[1]) == resumable
    report = {"name": "r1", "state": state, "step": None, "total_steps": None, "restarts": 0}
    assert list_line(report).split()[:2] == ["r1", state]
    assert describe({**report, "detail": lines[1].strip(), "metrics": {}, "progress_updated_s_ago": None,
                     "preemptions": 0, "attempts": 1, "checkpoints": [], "mlflow_run_id": None,
                     "run_dir": str(run_dir)})[:2] == lines[:2]


def test_a_signal_is_recorded_and_mapped_to_the_shells_exit_code():
    """The handlers a run installs, with real signals sent to this process; put back after."""
    import os
    import time

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        with pytest.raises(KeyboardInterrupt), interrupt.stop_on_signals():
            os.kill(os.getpid(), sig)
            time.sleep(5)  # (the handler raises in this thread at once)
        assert interrupt.received() == sig and interrupt.exit_code() == code
        assert interrupt.reason(KeyboardInterrupt()) == f"interrupted by {sig.name}"
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


# --- placement ---------------------------------------------------------------------------------

def scaling(workers, cpus=1.0):
    return ScalingConfig(num_workers=workers, cpus_per_worker=cpus, use_gpu=False)


LAPTOP = [{"CPU": 2.0, "memory": 1e9, "node:10.0.0.1": 1.0}]


def test_a_group_that_fits_starts():
    assert decide_placement(scaling(2), {"CPU": 1.0}, LAPTOP, None, local_only=True).action == "start"


def test_a_group_a_local_ray_cannot_hold_is_refused_saying_what_it_asked_for_and_what_there_is():
    decision = decide_placement(scaling(4), {"CPU": 1.0}, LAPTOP, None, local_only=True)
    assert decision.action == "refuse"
    assert decision.message == (
        "scaling.num_workers 4: the run asks for 4 workers x 1 CPU each (4 CPU); the cluster has 2 CPU in 1 "
        "node(s), its largest node 2 CPU and no autoscaler (a local Ray of this machine): lower scaling.num_workers "
        "or what each worker holds (scaling.cpus_per_worker, scaling.use_gpu, scaling.resources_per_worker), or run "
        "on a larger cluster")


def test_an_elastic_group_needs_only_its_minimum():
    assert decide_placement(scaling((2, 8)), {"CPU": 1.0}, LAPTOP, None, local_only=True).action == "start"
    refused = decide_placement(scaling((3, 8)), {"CPU": 1.0}, LAPTOP, None, local_only=True)
    assert refused.action == "refuse" and "scaling.num_workers [3, 8]: the run asks for 3 workers (its minimum" \
        in refused.message


def test_each_worker_is_placed_whole_on_one_node():
    """Two nodes of 1.5 CPUs hold 3 CPUs, but only two workers of 1 CPU."""
    nodes = [{"CPU": 1.5}, {"CPU": 1.5}]
    assert bundles_that_fit({"CPU": 1.0}, [NodeGroup(n, 1) for n in nodes]) == 2
    assert decide_placement(scaling(3), {"CPU": 1.0}, nodes, None, local_only=True).action == "refuse"
    gpu = decide_placement(scaling(1), {"CPU": 1.0, "GPU": 1.0}, nodes, None, local_only=True)
    assert gpu.action == "refuse" and "x 1 CPU, 1 GPU each" in gpu.message


def test_an_autoscaler_too_small_refuses_and_one_large_enough_waits():
    config = {"max_workers": 3, "head_node_type": "head",
              "available_node_types": {"head": {"resources": {"CPU": 2}},
                                       "gpu": {"max_workers": 2, "resources": {"CPU": 4, "GPU": 1}}}}
    largest = launcher_node_groups(config)
    per_worker = {"CPU": 1.0, "GPU": 1.0}
    refused = decide_placement(scaling(3), per_worker, LAPTOP, largest, local_only=False)
    assert refused.action == "refuse"
    assert "its autoscaler grows it to at most 10 CPU, 2 GPU, its largest node 4 CPU, 1 GPU" in refused.message
    waits = decide_placement(scaling(2), per_worker, LAPTOP, largest, local_only=False)
    assert waits.action == "wait" and "the cluster has 2 CPU in 1 node(s)" in waits.message
    unbounded = [NodeGroup({"CPU": 8.0, "GPU": 1.0}, math.inf)]  # an autoscaler that sets no bound (max_count -1)
    assert decide_placement(scaling(64), per_worker, LAPTOP, unbounded, local_only=False).action == "wait"
    # joined by address, and nothing says how the cluster grows: the autoscaler may add nodes
    assert decide_placement(scaling(64), per_worker, LAPTOP, None, local_only=False).action == "wait"


def test_a_wait_for_nodes_is_said_at_once_then_every_30_s_until_the_group_fits():
    """The clock passed in: what the console would show over two minutes of waiting."""
    said, last = [], None
    for now in range(0, 121, 5):
        decision = decide_wait("the run asks for 4 workers", 0.0, last, float(now), fits_now=now >= 100)
        if decision.say:
            said.append((now, decision.say))
            last = float(now)
        if decision.done:
            break
    assert [t for t, _ in said] == [0, 30, 60, 90] and WAIT_SAY_EVERY_S == 30
    assert said[1][1] == "waiting for the autoscaler to add nodes (30 s so far): the run asks for 4 workers"
    assert decision.done and now == 100
