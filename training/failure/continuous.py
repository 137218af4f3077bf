"""`failure.mode: continue` (driver and workers): a dead worker stops nobody. Every worker is a torchft replica group
(training/failure/replica_group.py); the others keep stepping without it, Ray Train replaces only
the lost one, and it takes the live state from a peer, not from storage (ddp, a fixed
scaling.num_workers >= 2; see README "Continuous training").

Each step starts with a quorum of the groups alive and commits only if the quorum agrees; a step
taken by fewer groups is recorded in the ledger (training/failure/replicas.py); reports happen only
at steps every group took, and restore, metrics and evaluation need no collective across workers.
Driver side: the refusals and Ray Train's torchft backend; worker side: `ContinueWorker`.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Callable, Optional

from training.failure.mode import FailureMode, Outcome, Report, WorkerContext
from training.failure.replicas import NOTHING_DUE, ReplicaLedger, ReportGate, carried_after
from training.worker.policy import StepDue

# What failure.mode continue serves, said whenever a job asks it for something else.
SUPPORTED = ("It serves parallel.strategy ddp with a fixed scaling.num_workers of 2 or more and "
             "failure.max_failures of 1 or more (or -1); use failure.mode: restart otherwise")
# How fast the lighthouse drops a dead replica group from the quorum. Replica groups heartbeat every
# 100 ms (torchft's default); torchft's default timeout (5 s) would leave the survivors waiting 5 s
# for a quorum after a kill.
LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS = 500
# The pause between two sync rounds while a finished group waits for a replaced one.
SYNC_ROUND_PAUSE_S = 0.2


class Continue(FailureMode):
    name = "continue"
    lockstep = False  # each worker is its own replica group: no collective across workers

    def refuses(self, job: Any) -> Optional[str]:
        problems = []
        if job.parallel.strategy != "ddp":
            # torchft's HSDP path (a replica group sharding with FSDP inside) is not wired into the loop.
            problems.append(f"needs parallel.strategy ddp, not {job.parallel.strategy} (each worker must hold a "
                            "full replica to heal a peer)")
        if not isinstance(job.scaling.num_workers, int):
            # Ray 2.60 replaces one replica group only at a fixed size; a resize restarts every group.
            problems.append(f"needs a fixed scaling.num_workers, not the elastic range {list(job.scaling.num_workers)}")
        elif job.scaling.num_workers < 2:
            problems.append(f"needs scaling.num_workers of 2 or more, not {job.scaling.num_workers} (with one "
                            "worker there is no peer to keep training or to heal from)")
        if job.failure.max_failures == 0:
            problems.append("needs failure.max_failures of 1 or more, or -1 (each replaced worker counts one "
                            "failure; with 0 the first dead worker ends the run)")
        return "failure.mode: continue " + "; ".join(problems) + ". " + SUPPORTED if problems else None

    def torch_config(self, use_gpu: bool) -> Any:
        """Ray Train's torchft backend: a lighthouse actor on the head and one replica group per worker,
        of which the controller replaces only the failed ones. min_replicas 1: any one group alive
        keeps training."""
        from ray.train.v2.torch.torchft_config import TorchftConfig  # (Ray: the driver's, once it runs)

        return TorchftConfig(lighthouse_kwargs={"min_replicas": 1,
                                                "heartbeat_timeout_ms": LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS},
                             backend="nccl" if use_gpu else "gloo")

    def worker(self, context: WorkerContext) -> "ContinueWorker":
        from training.failure.replica_group import ReplicaGroup  # (torch and torchft: this mode's alone)

        return ContinueWorker(context, ReplicaGroup(context.rank, context.world_size, context.global_batch_size,
                                                    context.device))


class ContinueWorker:
    def __init__(self, context: WorkerContext, group, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep):
        self.context, self.group, self.clock, self.sleep = context, group, clock, sleep
        self.ledger = ReplicaLedger(context.world_size, context.global_batch_size)
        self.gate = ReportGate(context.world_size)
        # The reports due at steps that not every group took, carried to the next full step (a
        # healing peer takes them too: both must make the same reports).
        self.carried: StepDue = NOTHING_DUE
        self.replicas = context.world_size  # the groups in the last step's quorum
        self.sync_round = False
        self.window: tuple = ()
        self.optimizer = self.progress = None  # (given when the run starts)

    def wrap(self, model):
        return self.group.wrap(model)  # torchft's DDP: gradients averaged over the groups in each quorum

    def start(self, state, model, optimizer, scheduler, progress) -> None:
        """What a healing peer takes from this group."""
        self.optimizer, self.progress = optimizer, progress
        if state.replicas:
            self.ledger.load(state.replicas)
        group = self.group
        group.share("model", model.state_dict, model.load_state_dict)
        group.share("optimizer", optimizer.state_dict, optimizer.load_state_dict)
        group.share("scheduler", scheduler.state_dict, scheduler.load_state_dict)
        group.share("loop", lambda: _loop_fields(state), lambda fields: _set_loop_fields(state, fields))
        group.share("ledger", self.ledger.state, self.ledger.load)
        group.share("carried", lambda: asdict(self.carried), self._carry)

    def _carry(self, due: dict) -> None:
        self.carried = StepDue(**due)

    def more_steps(self, state, total_steps: int) -> bool:
        # A group that finished while a report is still carried (its last steps were short) waits for
        # the replaced group in "sync rounds" (a step whose update is thrown away) until the newcomer
        # has healed and both can make the last report together.
        return (state.step < total_steps and not state.stopped_early) or self.carried.any

    def begin_step(self, step: int) -> None:
        self.group.start_step(step)
        self.window = self.progress.snapshot()

    def commit_step(self, state, batch: dict, step_fn: Callable[[], None]) -> Outcome:
        progress = self.progress
        committed, self.replicas, samples_used = self.group.finish_step(next(iter(batch.values())).shape[0])
        if not committed:  # a peer failed mid-step: the step is taken again in a new quorum
            self.optimizer.zero_grad(set_to_none=True)
            progress.rewind(self.window)
            return Outcome.RETRY
        self.sync_round = self.group.step > self.context.total_steps or state.stopped_early
        if self.sync_round:  # nothing is learned: the quorum only brings a replaced group in
            self.optimizer.zero_grad(set_to_none=True)
            progress.rewind(self.window)
            self.ledger.observe(state.step, self.replicas, self.clock())
            return Outcome.SYNC
        step_fn()
        state.step = self.group.step  # after healing from a peer: the peer's step
        self.ledger.record(state.step, self.replicas, samples_used, self.clock())
        return Outcome.TAKEN

    def plan_report(self, due, state, have_val_metrics: bool) -> Optional[Report]:
        # Reports only at steps every group took, every one that is due (no min interval: each
        # group's own clock would make the groups report different numbers of times).
        decision = self.gate.decide(due, self.carried, self.replicas)
        self.carried, due = carried_after(decision), decision.due
        if not decision.report:
            if self.sync_round:
                self.sleep(SYNC_ROUND_PAUSE_S)
            return None
        totals = self.progress.reduce(False)  # (this group's own window: no collective)
        # (Ray Train does not watch for preemptions with replica groups.)
        step_decision = self.context.policy.decide(due, final_save=False, notice_fresh=False,
                                                   have_val_metrics=have_val_metrics)
        return Report(step_decision, totals, None)  # (no data digest: groups skip samples by design)

    def report_metrics(self, state) -> dict:
        metrics = self.ledger.report_metrics()
        state.replicas = self.ledger.state()  # (after the drain: a checkpoint holds the counts only)
        return metrics

    def upload_deadline_s(self, decision) -> Optional[float]:
        return None

    def after_report(self, decision, step: int, cost: dict) -> None:
        pass

    def close(self) -> None:
        # Without it a group that finished can leave a healing peer stuck in its backward.
        self.group.shutdown()


def _loop_fields(state) -> dict:
    return {"step": state.step, "best_metric": state.best_metric,
            "evals_without_improvement": state.evals_without_improvement, "stopped_early": state.stopped_early}


def _set_loop_fields(state, fields: dict) -> None:
    for name, value in fields.items():
        setattr(state, name, value)


MODE = Continue()
