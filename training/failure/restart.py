"""`failure.mode: restart` (the default; driver and workers): a dead worker or a lost node restarts the whole worker
group from the latest checkpoint (Ray Train's own restart), at any world size, exactly: the data
order and every random stream are functions of (seed, step), and the data digest proves it. A
preemption notice (a node drained for preemption) checkpoints at once and again just before the
deadline, so no finished step is lost. Driver side: nothing to refuse, Ray Train's default backend.
Worker side: `RestartWorker`, every worker in lockstep (its collectives span the group).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from training.adaptors.ray_private import default_preemption_deadline_s
from training.data.order import DIGEST_MODULUS
from training.failure.mode import FailureMode, Outcome, Report, WorkerContext


class Restart(FailureMode):
    name = "restart"
    lockstep = True

    def worker(self, context: WorkerContext) -> "RestartWorker":
        return RestartWorker(context)


class RestartWorker:
    def __init__(self, context: WorkerContext, clock: Callable[[], float] = time.time):
        self.context, self.clock = context, clock
        self.preemption: Optional[Preemption] = None
        self.fresh: Optional[Preemption] = None  # the notice first seen at the last report
        self.progress = None  # (given when the run starts)
        # Log-only steps before this one do not ask whether a report is due (StepPolicy.quiet_steps).
        self.quiet_until = 0

    def wrap(self, model):
        return self.context.wrap(model)

    def start(self, state, model, optimizer, scheduler, progress) -> None:
        """(A restart restores every worker from the checkpoint: nothing to share.)"""
        self.progress = progress

    def more_steps(self, state, total_steps: int) -> bool:
        return state.step < total_steps and not state.stopped_early

    def begin_step(self, step: int) -> None:
        pass

    def commit_step(self, state, batch: dict, step_fn: Callable[[], None]) -> Outcome:
        step_fn()
        state.step += 1
        return Outcome.TAKEN

    def plan_report(self, due, state, have_val_metrics: bool) -> Optional[Report]:
        if not due.any:
            return None  # no report at this step, and so no collective
        if not due.evaluate and state.step < self.quiet_until:
            return None  # a log-only step in a window too young to report (a final save is asked after it)
        context = self.context
        # Rank 0's clock decides for all (Progress.reduce), so every rank makes the same choice.
        final_save_wanted = (context.rank == 0 and self.preemption is not None
                             and self.preemption.final_save_due(self.clock()))
        totals = self.progress.reduce(final_save_wanted)
        state.data_digest = (state.data_digest + totals.data_digest) % DIGEST_MODULUS
        if not context.policy.reports(due, totals.elapsed_s, totals.final_save):
            self.quiet_until = state.step + context.policy.quiet_steps(totals.elapsed_s, self.progress.steps)
            return None  # too soon after the last report: the window goes on
        # A node holding a worker is being drained for preemption: checkpoint now rather than at the
        # next interval, and once more just before the deadline. Every worker asks at every report:
        # it is a collective.
        self.fresh = Preemption.fresh(context.preemption_info(), self.preemption)
        self.preemption = self.fresh or self.preemption
        decision = context.policy.decide(due, final_save=totals.final_save, notice_fresh=self.fresh is not None,
                                         have_val_metrics=have_val_metrics)
        return Report(decision, totals, state.data_digest)

    def report_metrics(self, state) -> dict:
        return {}

    def upload_deadline_s(self, decision) -> Optional[float]:
        return self.preemption.deadline_s if decision.preemption_save and self.preemption else None

    def after_report(self, decision, step: int, cost: dict) -> None:
        if self.fresh is not None and self.context.rank == 0:  # rank 0's clock decides when the final save is due
            self.preemption.plan_final_save(cost["checkpoint_blocking_s"])
            print(self.preemption.notice_line(step), flush=True)
        if decision.hold:
            if self.context.rank == 0:
                print(f"preemption deadline near: checkpoint saved at step {step}; waiting for the restart", flush=True)
            self.preemption.hold()

    def close(self) -> None:
        pass


@dataclass
class Preemption:
    """A node of this run is being drained for preemption. The run checkpoints at once (in case
    the node goes early), keeps training, checkpoints again `margin_s` before the deadline and then
    waits for Ray Train to restart the group without the node: no finished step is lost."""

    key: tuple
    deadline_s: float
    ranks: tuple = ()
    margin_s: float = 10.0
    final_saved: bool = False
    clock: Callable[[], float] = field(default=time.time, repr=False, compare=False)
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False, compare=False)

    @staticmethod
    def key_of(notice) -> tuple:
        return notice.deadline_ms, tuple(notice.preempted_node_ids)

    @classmethod
    def fresh(cls, notice, current: Optional["Preemption"], clock: Callable[[], float] = time.time,
              sleep: Callable[[float], None] = time.sleep) -> Optional["Preemption"]:
        """A Preemption for `notice` (from `ray.train.get_preemption_info()`) if it is new; None if
        there is no notice or it is the one `current` follows."""
        if notice is None or (current is not None and current.key == cls.key_of(notice)):
            return None
        # Without a deadline Ray Train waits its default before restarting.
        deadline_s = notice.deadline_ms / 1000 if notice.deadline_ms else clock() + default_preemption_deadline_s()
        return cls(cls.key_of(notice), deadline_s, tuple(notice.preempted_ranks), clock=clock, sleep=sleep)

    def plan_final_save(self, save_s: float) -> None:
        """Leave room for the final save: three times what the notice's checkpoint took."""
        self.margin_s = max(10.0, 3 * save_s)

    def final_save_due(self, now_s: float) -> bool:
        return not self.final_saved and now_s >= self.deadline_s - self.margin_s

    def hold(self, poll_s: float = 0.5, after_deadline_s: float = 60.0) -> None:
        """Wait for the restart, which comes at the deadline: steps taken now would be lost. Past
        `after_deadline_s` without one, training goes on (with no further final save)."""
        self.final_saved = True
        while self.clock() < self.deadline_s + after_deadline_s:
            self.sleep(poll_s)

    def notice_line(self, step: int) -> str:
        return (f"preemption notice for node(s) {', '.join(n[:12] for n in self.key[1])} "
                f"(ranks {list(self.ranks)}, {self.deadline_s - self.clock():.0f} s left): "
                f"checkpoint saved at step {step}; the final one {self.margin_s:.0f} s before the deadline")


MODE = Restart()
