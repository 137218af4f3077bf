"""The failure-mode seam (driver and workers): how a run survives a dead worker, a lost node or a preemption
(`failure.mode: NAME`). Each mode is one module (restart, continue) registered by name in
training/failure/registry.py; nothing else in the tree names it.

Driver side (torch-free, the config path):

    refuses(job)           why the mode cannot serve a job (a message naming the fields), or None
    torch_config(use_gpu)  the Ray Train backend config it needs (None: Ray Train's default)

Worker side, `worker(context)`: a `WorkerMode` the training loop calls at fixed points, so that the
loop reads the same whatever the mode (training/worker/loop.py):

    wrap(model)                    the module to train (DDP, FSDP, or a replica group's DDP)
    start(state, model, optimizer, scheduler, progress)  (`state`: the loop's LoopState)
                                   the run starts (restored): what a healing peer takes
    more_steps(state, total)        whether the loop goes on
    begin_step(step)               before the step's forward
    commit_step(state, batch, step_fn)  after its backward: TAKEN (the optimizer stepped), RETRY (the
                                   step is taken again) or SYNC (no update: a round that brings a
                                   replaced worker in)
    plan_report(due, state, ...)    whether a report happens now, and what it consists of
    report_metrics()               what the mode adds to a report's metrics
    upload_deadline_s(decision)    a checkpoint upload's deadline (a preemption's), if any
    after_report(decision, ...)    what follows a report (a preemption notice, holding for a deadline)
    close()
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional


class Outcome(enum.Enum):
    TAKEN = "taken"  # the optimizer stepped: one more step done
    RETRY = "retry"  # the step did not commit: taken again, in a new quorum
    SYNC = "sync"  # no update: a round that only brings a replaced worker in


@dataclass(frozen=True)
class Report:
    """A report a mode lets happen now: what it consists of, the window's totals, and the run's
    data digest through this step (None where the mode keeps none)."""

    decision: Any  # training.worker.policy.StepDecision
    totals: Any  # training.worker.progress.WindowTotals
    data_digest: Optional[int]


@dataclass(frozen=True)
class WorkerContext:
    """What a worker's mode is built with (the loop's pieces it drives are injected, not imported:
    this package stays free of torch and Ray at import, and its policies testable without them)."""

    rank: int
    world_size: int
    global_batch_size: int
    total_steps: int
    device: Any
    policy: Any  # training.worker.policy.StepPolicy
    wrap: Callable[[Any], Any]  # the model -> the module to train (DDP, FSDP: training.worker.parallel.wrap)
    preemption_info: Callable[[], Any]  # ray.train.get_preemption_info (a collective)


class FailureMode:
    name: str
    # Every worker restores, evaluates and reduces its metrics in lockstep with the others (their
    # collectives span the group); False: each worker on its own (no collective across workers).
    lockstep: bool = True

    def refuses(self, job: Any) -> Optional[str]:
        return None

    def torch_config(self, use_gpu: bool) -> Any:
        return None

    def worker(self, context: WorkerContext):
        """This worker's side of the mode (see the module's docstring)."""
        raise NotImplementedError
