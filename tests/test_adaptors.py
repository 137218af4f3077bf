"""Contract tests of the private Ray and MLflow APIs behind training/adaptors: a version bump that
moves or changes one fails here, by name, instead of deep inside a run or a sweep."""

import inspect
import logging

import pytest
from conftest import wait_for

from training.adaptors import mlflow_private, ray_private


def test_ray_train_controller_callback_has_the_hooks_the_tracker_uses():
    base = ray_private.controller_callback_base()
    assert inspect.isclass(base)
    for hook in ("after_controller_finish", "before_controller_abort"):
        assert callable(getattr(base, hook, None)), f"ControllerCallback.{hook} is gone"


def test_ray_train_controller_state_names_are_what_run_events_read():
    """training/observe/callback.py turns state changes into restarted/preempted notifications."""
    from ray.train.v2._internal.execution.controller import state

    assert callable(getattr(ray_private.controller_callback_base(), "after_controller_state_update", None))
    assert ray_private.controller_state_name(state.RunningState()) == "RUNNING"
    assert ray_private.controller_state_name(state.RestartingState(training_failed_error=None)) == "RESTARTING"
    assert ray_private.controller_state_name(state.ReschedulingState(training_failed_error=None)) == "RESCHEDULING"
    preempting = state.PreemptingState(preemption_info=None, detected_at_s=0.0)
    assert ray_private.controller_state_name(preempting) == "PREEMPTING"


def test_ray_train_preemption_deadline_default_is_a_positive_number():
    assert ray_private.default_preemption_deadline_s() > 0


def test_ray_train_upload_retry_markers_are_what_ray_trains_upload_retry_matches():
    """training/checkpoint/upload.py keeps these texts out of the error it gives up with, so that
    Ray Train's retry of `_upload_checkpoint` does not start a failed upload over."""
    from ray._common.retry import format_exception, matches_error

    markers = ray_private.checkpoint_upload_retry_markers()
    assert markers and all(isinstance(m, str) for m in markers)
    retried = OSError(f"When uploading: {markers[0]} during PutObject operation")
    assert any(matches_error(m, format_exception(retried)) for m in markers)
    lowered = OSError(str(retried).replace(markers[0], markers[0].lower()))
    assert not any(matches_error(m, format_exception(lowered)) for m in markers)


def test_ray_train_report_logger_is_found_and_quieted():
    from ray.train.v2._internal.execution import context

    ray_private.quiet_report_logs()
    assert logging.getLogger(context.__file__).level == logging.WARNING


def test_ray_train_fit_hands_its_failure_policy_to_the_controller_where_it_is_wrapped():
    """training/run/fit.py's trainer swaps the `failure_policy` that DataParallelTrainer.fit builds
    and passes to `_initialize_and_run_controller`, which the controller then asks; a FailurePolicy
    is its one method, `make_decision(training_failed_error)`."""
    from ray.train.v2._internal.execution.controller.controller import TrainController
    from ray.train.v2._internal.execution.failure_handling import FailurePolicy
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    assert "failure_policy=create_failure_policy(" in inspect.getsource(DataParallelTrainer.fit)
    assert "**controller_init_kwargs" in str(inspect.signature(DataParallelTrainer._initialize_and_run_controller))
    assert "failure_policy" in inspect.signature(TrainController.__init__).parameters
    assert FailurePolicy.__abstractmethods__ == {"make_decision"}
    assert list(inspect.signature(FailurePolicy.make_decision).parameters) == ["self", "training_failed_error"]
    trainer = ray_private.torch_trainer_class()
    assert issubclass(trainer, DataParallelTrainer) and "_initialize_and_run_controller" in vars(trainer)


def failure_policy(max_failures: int, clock=None, placement_timeout_s: float = 600.0):
    import ray.train
    from ray.train.v2._internal.execution.failure_handling import create_failure_policy

    from training.errors import DataError

    inner = create_failure_policy(ray.train.FailureConfig(max_failures=max_failures))
    return ray_private.BoundedFailurePolicy(inner, (DataError,), placement_timeout_s,
                                            **({"clock": clock} if clock else {}))


def test_a_worker_data_error_is_raised_at_once_whatever_the_failure_budget():
    """A worker's exception reaches the policy as Ray Train's poll hands it over (unwrapped from its
    UserExceptionWithTraceback); a DataError among them, or one another error was raised from,
    ends the run at once; anything else is Ray Train's to retry."""
    from ray.exceptions import RayTaskError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus

    from training.errors import DataError

    def group_error(*errors):
        statuses = {rank: WorkerStatus(running=False, error=UserExceptionWithTraceback(e, f"Traceback: {e}"))
                    for rank, e in enumerate(errors)}
        return WorkerGroupPollStatus(statuses).get_worker_group_error()

    gone = DataError("/data/part-0.parquet is gone: deleted or moved during the run")
    policy = failure_policy(max_failures=-1)
    failure = group_error(RuntimeError("gloo: connection reset"), gone)
    assert ray_private.worker_failures(failure)[1] is gone
    assert policy.make_decision(failure) is FailureDecision.RAISE
    wrapped = RuntimeError("while reading")
    wrapped.__cause__ = gone
    assert policy.make_decision(group_error(wrapped)) is FailureDecision.RAISE
    task_error = RayTaskError("read", "Traceback ...", gone)
    assert ray_private.caused_by(task_error, (DataError,)) is not None
    assert policy.make_decision(group_error(RuntimeError("worker died"))) is FailureDecision.RETRY
    assert failure_policy(max_failures=0).make_decision(group_error(RuntimeError("x"))) is FailureDecision.RAISE


def test_an_unplaceable_worker_group_is_retried_until_the_placement_timeout():
    """Ray Train retries a group whose placement group is not placed in time without end
    (controller_failure_limit -1); the policy ends it once unplaceable for placement_timeout_s in a
    row, counted again after any other failure."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

    now = [0.0]
    policy = failure_policy(max_failures=-1, clock=lambda: now[0], placement_timeout_s=150)
    unplaceable = ControllerError(WorkerGroupStartupTimeoutError(num_workers=3))
    assert ray_private.unplaceable_workers(unplaceable) == 3
    assert ray_private.unplaceable_workers(ControllerError(RuntimeError("x"))) is None
    for now[0] in (60, 120):
        assert policy.make_decision(unplaceable) is FailureDecision.RETRY
    assert policy.make_decision(WorkerGroupError("died", {0: RuntimeError("x")})) is FailureDecision.RETRY
    for now[0] in (180, 240, 300):
        assert policy.make_decision(unplaceable) is FailureDecision.RETRY
    now[0] = 330
    assert policy.make_decision(unplaceable) is FailureDecision.RAISE


def test_ray_recorded_address_helpers_exist(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # a private /tmp/ray: nothing recorded there
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_private.recorded_local_address() is None
    ray_private.forget_recorded_address()  # nothing to forget: must not raise


@pytest.mark.ray
def test_ray_placement_group_table_fields(ray_cluster):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([{"CPU": 0.01}])
    try:
        ray.get(group.ready(), timeout=60)  # created before it is removed: a removal racing its creation
        found = {g.placement_group_id.hex(): g for g in ray_private.placement_groups()}
        mine = found[group.id.hex()]
        # The fields tuning/resources.py reads to find a dead trial's group.
        for name in ("creator_job_id", "creator_actor_id", "creator_actor_dead", "is_detached", "state"):
            assert hasattr(mine, name), f"PlacementGroupTableData.{name} is gone"
        assert mine.state != ray_private.placement_group_removed_state()
        assert mine.creator_job_id.hex() == ray_cluster.get_runtime_context().get_job_id()
    finally:
        remove_placement_group(group)
        # and its 0.01 CPU given back: the next test on this shared cluster places 2 workers of 1 CPU
        # (once left at 1.99 CPUs, a Ray Train group waited for placement forever)
        wait_for(lambda: ray.available_resources().get("CPU", 0) >= ray.cluster_resources()["CPU"], 60,
                 "the placement group's CPU given back")


@pytest.mark.ray
def test_ray_actor_table_records_and_the_gcs_kill(ray_cluster):
    import ray

    @ray.remote(num_cpus=0)
    class Idle:
        def ping(self):
            return 1

    actor = Idle.remote()
    ray.get(actor.ping.remote(), timeout=60)
    actor_id = actor._actor_id.hex()
    job_id = ray_cluster.get_runtime_context().get_job_id()
    mine = {r.actor_id.hex(): r for r in ray_private.actor_records(job_id)}[actor_id]
    # The fields tuning/resources.py reads to find a sweep's left-over Train controllers.
    for name in ("class_name", "state", "address", "owner_address"):
        assert hasattr(mine, name), f"ActorTableData.{name} is gone"
    assert mine.class_name.endswith("Idle") and mine.state != ray_private.actor_dead_state()
    assert mine.address.worker_id and mine.owner_address.worker_id
    ray_private.kill_actor_by_id(actor_id)
    wait_for(lambda: {r.actor_id.hex(): r.state for r in ray_private.actor_records(job_id)}[actor_id]
             == ray_private.actor_dead_state(), 30, "the killed actor dead in the GCS table")


@pytest.mark.ray
def test_tune_result_grid_gives_its_trials(ray_cluster, tmp_path):
    from ray import tune

    grid = tune.Tuner(lambda config: {"score": config["x"]}, param_space={"x": tune.grid_search([1, 2])},
                      run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0)).fit()
    trials = ray_private.result_grid_trials(grid)
    assert len(trials) == len(grid) == 2
    assert {t.config["x"] for t in trials} == {1, 2} and all(t.trial_id for t in trials)


def test_mlflow_local_store_has_no_host_creds(tmp_path):
    from mlflow.tracking import MlflowClient

    assert mlflow_private.host_creds(MlflowClient(f"sqlite:///{tmp_path}/m.db")) is None


def test_mlflow_rest_store_host_creds_and_one_shot_request():
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    creds = mlflow_private.host_creds(MlflowClient("http://127.0.0.1:9"))  # nothing listens on port 9
    assert creds is not None and creds.host == "http://127.0.0.1:9"
    # One attempt, no retries: the tracker's outage handling depends on this answering at once.
    with pytest.raises(MlflowException, match="NewConnectionError"):
        mlflow_private.rest_once(creds, "GET", "/api/2.0/mlflow/experiments/search", 1.0, params={"max_results": 1})


def test_mlflow_messages_carry_run_metrics_and_status():
    from mlflow.entities import Metric

    batch = mlflow_private.log_batch_message("r1", [Metric("loss", 0.5, 1000, 3)])
    assert batch.run_id == "r1" and batch.metrics[0].key == "loss" and batch.metrics[0].step == 3
    update = mlflow_private.update_run_message("r1", "FINISHED", 2000)
    assert update.run_id == "r1" and update.end_time == 2000 and update.status != 0



def test_mlflow_event_output_is_written_through_its_one_stream(monkeypatch):
    """training/run/console.py tells MLflow's events from other output by the module that writes
    them to sys.stderr: MLflow's loggers must write through that stream."""
    import io
    import sys

    import mlflow  # noqa: F401  (configures MLflow's loggers)

    class Recorder(io.StringIO):
        def write(self, text):
            callers.append(mlflow_private.written_by_mlflow_stream(sys._getframe(1)))
            return super().write(text)

    callers = []
    monkeypatch.setattr(sys, "stderr", Recorder())
    logging.getLogger("mlflow.tracking").warning("an event of MLflow's")
    assert "an event of MLflow's" in sys.stderr.getvalue()
    assert callers and all(callers)
    print("not MLflow's", file=sys.stderr)
    assert not callers[-1]

SECRETS = ["mlflow-cluster.db", "slurm-1234.out", "deploy.pem", ".env", ".ray/session_latest/logs/raylet.out",
           "nested/.env", "nested/key.pem"]


def working_copy(tmp_path, gitignore: bool):
    """A working directory as a user's, with the files that must stay on their machine."""
    from pathlib import Path

    root = tmp_path / "repo"
    for name in ["training/__init__.py", "train.yaml", *SECRETS]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x")
    if gitignore:
        (root / ".gitignore").write_text((Path(__file__).parents[1] / ".gitignore").read_text())
    return root


def test_ray_working_dir_packing_honours_gitignore_and_excludes(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", raising=False)
    root = working_copy(tmp_path, gitignore=False)
    (root / ".gitignore").write_text("train.yaml\n")
    shipped = ray_private.working_dir_upload_files(str(root), excludes=["*.pem"])
    assert "training/__init__.py" in shipped and "train.yaml" not in shipped
    assert "deploy.pem" not in shipped and "nested/key.pem" not in shipped and ".env" in shipped


def test_a_job_upload_leaves_out_the_mlflow_store_slurm_logs_keys_and_ray_state(tmp_path, monkeypatch):
    """`ray job submit --working-dir .` ships what .gitignore lets through; plug-in source shipped
    by the driver (py_modules) goes with UPLOAD_EXCLUDES, which hold even where .gitignore is off."""
    from training.run.session import UPLOAD_EXCLUDES

    monkeypatch.delenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", raising=False)
    shipped = ray_private.working_dir_upload_files(str(working_copy(tmp_path, gitignore=True)), excludes=[])
    assert "training/__init__.py" in shipped and "train.yaml" in shipped
    assert not set(SECRETS) & set(shipped), set(SECRETS) & set(shipped)

    monkeypatch.setenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "1")
    shipped = ray_private.working_dir_upload_files(str(working_copy(tmp_path / "bare", gitignore=False)),
                                                   excludes=UPLOAD_EXCLUDES)
    assert "training/__init__.py" in shipped and not set(SECRETS) & set(shipped)


def test_ray_recorded_address_file_follows_ray_tmpdir(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert ray_private.recorded_address_file() == os.path.join(str(tmp_path), "ray", "ray_current_cluster")


def test_ray_gcs_probe_gives_up_in_time_on_what_is_not_ray(tmp_path):
    import socket
    import time

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    try:
        started = time.monotonic()
        answer = ray_private.ask_gcs_session_name(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=1)
        assert not answer.answered and answer.session_name is None and time.monotonic() - started < 5
    finally:
        listener.close()


@pytest.mark.ray
def test_ray_gcs_answers_the_session_name_probe_with_its_session_directory(ray_cluster):
    """What training/run/session.py checks before joining a recorded cluster: a live GCS names its
    session, and that session's directory is where Ray keeps it."""
    import os

    node = ray_cluster._private.worker.global_worker.node
    answer = ray_private.ask_gcs_session_name(ray_cluster.get_runtime_context().gcs_address, timeout_s=10)
    assert answer.answered and answer.session_name == os.path.basename(node.get_session_dir_path())
    assert os.path.isdir(node.get_session_dir_path())


@pytest.mark.ray
def test_ray_train_report_barrier_is_released_by_a_replica_group_replacement(ray_cluster):
    """failure.mode continue relies on it (docs/continuous-training.md): a survivor waiting in
    `ray.train.report`'s barrier for a peer that died is released when the controller replaces
    the peer's replica group, which resets the barrier; the report then raises
    SynchronizationBarrierResetError, which `report` catches and skips."""
    import inspect

    import ray
    from ray.train.v2._internal.execution.checkpoint.sync_actor import (
        SynchronizationActor,
        SynchronizationBarrierResetError,
    )
    from ray.train.v2._internal.execution.context import TrainContext
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    assert "sync_actor.reset.remote()" in inspect.getsource(WorkerGroup._replace_replica_group_impl)
    assert "SynchronizationBarrierResetError" in inspect.getsource(TrainContext.report)
    actor = SynchronizationActor.remote()
    waiting = actor.broadcast_from_rank_zero.remote(world_rank=0, world_size=2, data="dir",
                                                    caller_method_name="ray.train.report", collective_seq=1,
                                                    relaxable=True)
    wait_for(lambda: ray.get(actor.get_counter.remote()) == 1, 60, "rank 0 inside the barrier")
    ready, _ = ray.wait([waiting], timeout=1.0)
    assert not ready  # rank 1 never comes: the survivor waits
    ray.get(actor.reset.remote())
    with pytest.raises(ray.exceptions.RayTaskError) as caught:
        ray.get(waiting, timeout=30)
    assert isinstance(caught.value.cause, SynchronizationBarrierResetError)
    ray.kill(actor)
