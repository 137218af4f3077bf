"""What a trial holds, how many trials run at once, and giving back what stopped trials held.

A trial is two things on the cluster: its driver (a Tune actor that runs the training run's driver)
and the training run's workers, which Ray Train V2 reserves in a placement group of its own, outside
Tune's accounting. Two ways a sweep can hang follow, and both are handled here:

1. Trial drivers hold so much that no trial's workers can be placed: `concurrency` keeps
   `trials * driver + one trial's workers` within the cluster, so at least one trial always runs.
2. A trial that Tune stops (ASHA, PBT's exploit, the end of a sweep) ends its actor; the Train
   controller it owns dies with it, but the controller's placement group outlives it (Ray keeps an
   actor-created group until its job ends). Ray Train's own cleaner removes it only while the
   state API answers. `release_orphaned_groups` removes such groups from the GCS table directly.
3. A trial's controller that outlives its trial would hold its worker group for ever, and the next
   run on the cluster would wait for placement without end. When Tune returns,
   `end_sweep_controllers` ends every controller the sweep's trials started that is still alive,
   and removes every group they made that is left.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Optional

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from training.adaptors.ray_private import (
    NIL_ACTOR,
    actor_dead_state,
    actor_records,
    kill_actor_by_id,
    placement_group_removed_state,
    placement_groups,
    trial_actor_id,
)
from training.config import JobConfig
from training.run.resources import WorkerResources, describe, within

log = logging.getLogger(__name__)

# The class of Ray Train V2's controller actor (`ray.train.v2._internal.execution.controller`).
TRAIN_CONTROLLER_CLASS = "TrainController"


@dataclass(frozen=True)
class TrialResources:
    driver: dict[str, float]
    min_workers: dict[str, float]  # what the training run needs to start (elastic: its minimum)
    max_workers: dict[str, float]

    def total(self) -> dict[str, float]:
        return _add(self.driver, self.max_workers)


@dataclass(frozen=True)
class ConcurrencyDecision:
    trials: int
    fits: bool  # one trial fits on the cluster as it is now
    note: Optional[str] = None
    fits_at_largest: bool = True  # one trial fits on the cluster at the largest its autoscaler makes it


def trial_resources(job: JobConfig, driver_cpus: float, workers: WorkerResources) -> TrialResources:
    """`workers`: what each of the trial's training workers holds (`training.run.resources`)."""
    per_worker = workers.per_worker
    return TrialResources(driver={"CPU": driver_cpus},
                          min_workers={k: v * job.scaling.min_workers for k, v in per_worker.items()},
                          max_workers={k: v * job.scaling.max_workers for k, v in per_worker.items()})


def concurrency(requested: Optional[int], resources: TrialResources, cluster: dict[str, float],
                total_trials: int, largest: Optional[dict[str, float]] = None) -> ConcurrencyDecision:
    """How many trials run at once. Default: as many as fit whole on the cluster at its largest (the
    autoscaler's limit when its config is known, else the cluster as it is now): the trials beyond
    what fits now wait as demand the autoscaler sees. A request above what is safe is lowered:
    trial drivers would leave no room for any trial's workers, and every trial would wait."""
    one = _add(resources.driver, resources.min_workers)
    fits = within(one, cluster)
    capacity = {k: max(cluster.get(k, 0.0), (largest or {}).get(k, 0.0)) for k in set(cluster) | set(largest or {})}
    need = ", ".join(f"{k} {v:g}" for k, v in resources.total().items())
    if largest is not None and not within(one, capacity):
        return ConcurrencyDecision(1, fits, f"one trial needs {need}; the cluster's autoscaler grows it to at most "
                                   f"{describe(capacity)}", fits_at_largest=False)
    if not within(one, capacity):
        return ConcurrencyDecision(requested or 1, False,
                                   f"one trial needs {need}; the cluster has {describe(cluster)} now: trials wait "
                                   "for the autoscaler to add nodes")
    note = None if fits else (f"one trial needs {need}; the cluster has {describe(cluster)} now and grows to "
                              f"{describe(capacity)}: trials wait for the autoscaler to add nodes")
    whole = min(math.floor(capacity.get(k, 0.0) / v + 1e-9) for k, v in resources.total().items() if v > 0)
    safe = min((math.floor((capacity.get(k, 0.0) - resources.min_workers.get(k, 0.0)) / v + 1e-9)
                for k, v in resources.driver.items() if v > 0), default=total_trials)
    if requested is None:
        return ConcurrencyDecision(max(1, min(whole, total_trials)), fits, note)
    if requested > max(safe, 1):
        lowered = (f"max_concurrent_trials lowered from {requested} to {max(safe, 1)}: more trial drivers would "
                   "leave no room for a trial's workers")
        return ConcurrencyDecision(max(safe, 1), fits, "; ".join(filter(None, (note, lowered))))
    return ConcurrencyDecision(requested, fits, note)


def _add(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in set(a) | set(b)}


def orphaned_groups(job_id: str) -> list[str]:
    """Placement groups of this job whose creating actor is dead and which Ray has not removed.
    Groups made by the driver itself (Tune's trial groups: no creating actor) are never included."""

    removed = placement_group_removed_state()
    found = []
    for group in placement_groups():
        creator = group.creator_actor_id.hex()
        if (group.creator_job_id.hex() == job_id and creator and creator != NIL_ACTOR and group.creator_actor_dead
                and not group.is_detached and group.state != removed):
            found.append(group.placement_group_id.hex())
    return found


def release_orphaned_groups(job_id: str) -> list[str]:
    released = []
    for group_id in orphaned_groups(job_id):
        try:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))
            released.append(group_id)
        except Exception as exc:  # removed meanwhile by Ray Train's own cleaner
            log.debug("placement group %s: %s", group_id, exc)
    return released


def sweep_controllers(actors: list, trial_actor_ids: set[str]) -> list:
    """Of `actors` (GCS actor records of the sweep's job), the Ray Train controllers its trials
    started: a trial runs its training run's driver in its own Tune actor, so the run's controller
    is owned by that actor's worker. A trial's actor is known by its id when Tune reported its start
    (`on_trial_start`), and otherwise by its class, the trainable's, which the sweep's other trial
    actors share (a trial Tune restarted on an actor it did not report, once left a controller
    alive). Controllers of a training run's driver, or of any other actor, are not included."""
    trials = [a for a in actors if a.actor_id.hex() in trial_actor_ids]
    classes = {a.class_name for a in trials}
    trial_workers = {a.address.worker_id for a in actors
                     if a.address.worker_id and (a in trials or a.class_name in classes)}
    return [a for a in actors if a.class_name == TRAIN_CONTROLLER_CLASS and a.owner_address.worker_id in trial_workers]


def groups_created_by(groups: list, creators: set[str]) -> list[str]:
    """Of `groups` (GCS placement group records), those that an actor of `creators` made and that
    are not removed, whether or not Ray marked their creator dead."""
    removed = placement_group_removed_state()
    return [g.placement_group_id.hex() for g in groups
            if g.creator_actor_id.hex() in creators and not g.is_detached and g.state != removed]


@dataclass(frozen=True)
class EndedControllers:
    controllers: list[str]  # the sweep's controllers that were still alive, now ended
    groups: list[str]       # the placement groups those and the sweep's other controllers left, now removed


def end_sweep_controllers(job_id: str, trial_actor_ids: set[str], grace_s: float = 5.0,
                          timeout_s: float = 30.0) -> EndedControllers:
    """After Tune returned: end every Ray Train controller the sweep's trials started that is still
    alive `grace_s` later (those of the last trials end with their actors, a moment after them), then
    remove every placement group the sweep's controllers made that is left."""
    mine = sweep_controllers(actor_records(job_id), trial_actor_ids)
    alive = _still_alive(job_id, [a.actor_id.hex() for a in mine], grace_s)
    for actor_id in alive:
        try:
            kill_actor_by_id(actor_id)
        except Exception as exc:  # it ended meanwhile
            log.debug("controller %s: %s", actor_id, exc)
    # (dead first: a group that a controller was still making would be missed)
    _still_alive(job_id, alive, timeout_s)
    released = []
    for group_id in groups_created_by(placement_groups(), {a.actor_id.hex() for a in mine}):
        try:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))
            released.append(group_id)
        except Exception as exc:  # removed meanwhile by Ray Train
            log.debug("placement group %s: %s", group_id, exc)
    return EndedControllers(alive, released)


def _still_alive(job_id: str, actor_ids: list[str], timeout_s: float) -> list[str]:
    """Those of `actor_ids` not dead within timeout_s."""
    dead = actor_dead_state()
    deadline = time.monotonic() + timeout_s
    while True:
        states = {a.actor_id.hex(): a.state for a in actor_records(job_id)} if actor_ids else {}
        alive = [actor_id for actor_id in actor_ids if states.get(actor_id, dead) != dead]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.2)


def _current_job_id() -> str:
    return ray.get_runtime_context().get_job_id()


try:
    from ray.tune import Callback as _TuneCallback
except ImportError:  # Ray without Tune: the policy above still imports
    _TuneCallback = object


class ReleaseStoppedTrials(_TuneCallback):
    """A Tune callback that gives back the workers of stopped trials: at each trial's end and at least
    every `every_s` seconds while the sweep runs (PBT's exploit also ends a trial's actor). It asks
    for the current job when it runs, so that a resumed sweep (Tune unpickles its callbacks) cleans
    up its own job's groups."""

    # In this driver process, for the sweep that runs now (Tune unpickles the callbacks of a resumed
    # sweep, so the instances it calls are not the one the sweep made): groups released, and the
    # actor of every trial started (the owners of the sweep's Train controllers).
    total_released = 0
    trial_actor_ids: set[str] = set()

    @classmethod
    def begin_sweep(cls) -> None:
        cls.total_released, cls.trial_actor_ids = 0, set()

    def __init__(self, every_s: float = 1.0):
        self.every_s = every_s
        self._last = 0.0

    def _release(self) -> None:
        self._last = time.monotonic()
        freed = release_orphaned_groups(_current_job_id())
        if freed:
            print(f"sweep: released {len(freed)} placement group(s) of stopped trials", flush=True)
        ReleaseStoppedTrials.total_released += len(freed)

    def on_step_end(self, iteration, trials, **info):
        if time.monotonic() - self._last >= self.every_s:
            self._release()

    def on_trial_start(self, iteration, trials, trial, **info):
        actor_id = trial_actor_id(trial)
        if actor_id is not None:
            ReleaseStoppedTrials.trial_actor_ids.add(actor_id)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._release()

    def on_trial_error(self, iteration, trials, trial, **info):
        self._release()
