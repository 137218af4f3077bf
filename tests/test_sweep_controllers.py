"""A sweep ends the Ray Train controllers its trials left alive, and only those: which controllers
are a sweep's (from the GCS's own records, no Ray), and the ending itself on the shared test cluster,
with a real Ray Train run started from a thread of an actor, as a trial starts its run."""

import threading
import time

import pytest
from conftest import wait_for
from ray.core.generated import gcs_pb2

from tuning import resources

TRIAL, OTHER_TRIAL, DRIVER = "a1" * 16, "b2" * 16, "01000000"


def _actor(actor_id: str, class_name: str, worker: str, owner: str, state=gcs_pb2.ActorTableData.ALIVE):
    record = gcs_pb2.ActorTableData(actor_id=bytes.fromhex(actor_id), class_name=class_name, state=state)
    record.address.worker_id = bytes.fromhex(worker)
    record.owner_address.worker_id = bytes.fromhex(owner)
    return record


def _group(group_id: str, creator: str, state=gcs_pb2.PlacementGroupTableData.CREATED, detached=False):
    return gcs_pb2.PlacementGroupTableData(placement_group_id=bytes.fromhex(group_id),
                                           creator_actor_id=bytes.fromhex(creator), state=state,
                                           is_detached=detached)


def test_the_sweeps_controllers_are_those_its_trials_actors_own():
    actors = [_actor(TRIAL, "ImplicitFunc", "aa" * 28, DRIVER, state=gcs_pb2.ActorTableData.DEAD),
              _actor(OTHER_TRIAL, "ImplicitFunc", "bb" * 28, DRIVER),
              _actor("c3" * 16, "TrainController", "cc" * 28, "aa" * 28),         # started by TRIAL's actor
              _actor("d4" * 16, "TrainController", "dd" * 28, "bb" * 28),         # by a trial Tune did not report
              _actor("e5" * 16, "TrainController", "ee" * 28, DRIVER),            # by a training run's driver
              _actor("f6" * 16, "_QueueActor", "ff" * 28, "aa" * 28),             # TRIAL's, not a controller
              _actor("a7" * 16, "Launcher", "77" * 28, DRIVER),                   # a user's actor
              _actor("b8" * 16, "TrainController", "88" * 28, "77" * 28)]         # whose run is not the sweep's
    assert [a.actor_id.hex() for a in resources.sweep_controllers(actors, {TRIAL})] == ["c3" * 16, "d4" * 16]
    assert resources.sweep_controllers(actors, set()) == []


def test_the_groups_left_are_those_the_controllers_made_and_ray_kept():
    removed = gcs_pb2.PlacementGroupTableData.REMOVED
    groups = [_group("01" * 18, "c3" * 16), _group("02" * 18, "c3" * 16, state=removed),
              _group("03" * 18, "d4" * 16), _group("04" * 18, "c3" * 16, detached=True),
              _group("05" * 18, "ff" * 16)]  # Tune's own trial groups: no creator actor
    assert resources.groups_created_by(groups, {"c3" * 16}) == ["01" * 18]


def _controllers_of(job_id: str, owner_actor_id: str) -> list:
    from training.adaptors.ray_private import actor_records

    return resources.sweep_controllers(actor_records(job_id), {owner_actor_id})


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_controller_left_alive_by_a_trial_is_ended_with_its_workers_group(ray_cluster, tmp_path):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class StandInTrial:
        """Starts a Ray Train run from a thread, as tuning/trial.py does, whose workers never end."""

        def start(self, storage: str) -> str:
            from ray.train import RunConfig, ScalingConfig
            from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

            def blocks(config):
                time.sleep(3600)

            trainer = DataParallelTrainer(blocks, scaling_config=ScalingConfig(num_workers=1,
                                                                                resources_per_worker={"CPU": 0.5}),
                                          run_config=RunConfig(name="left-alive", storage_path=storage))
            threading.Thread(target=lambda: trainer.fit(), daemon=True).start()
            return ray.get_runtime_context().get_actor_id()

    job_id = ray.get_runtime_context().get_job_id()
    trial = StandInTrial.remote()
    trial_id = ray.get(trial.start.remote(str(tmp_path)))
    try:
        wait_for(lambda: ray.available_resources().get("CPU", 0) <= ray.cluster_resources()["CPU"] - 0.5, 120,
                 "the run's worker group placed")
        (controller,) = wait_for(lambda: _controllers_of(job_id, trial_id), 30, "the run's controller")
        # what the sweep did before: a group whose creator lives is no orphan, and it was left
        assert resources.orphaned_groups(job_id) == []

        assert resources.end_sweep_controllers(job_id, set()) == resources.EndedControllers([], [])  # not the sweep's
        ended = resources.end_sweep_controllers(job_id, {trial_id})
        assert ended.controllers == [controller.actor_id.hex()] and len(ended.groups) == 1

        (after,) = _controllers_of(job_id, trial_id)
        assert after.state == gcs_pb2.ActorTableData.DEAD
        wait_for(lambda: ray.available_resources().get("CPU", 0) >= ray.cluster_resources()["CPU"], 60,
                 "every CPU given back")
    finally:
        ray.kill(trial)
