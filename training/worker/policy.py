"""What a worker does after a training step, decided on every worker from values every worker
shares (step counts, and rank 0's clock as summed across workers), so that every rank makes the
same choice and calls the collectives and `ray.train.report` the same number of times.

The decision comes in three pure steps, one on each side of the collectives that feed it:

    due(step)                        step counts alone: may a report happen now? (if not: no
                                     collective at all)
    reports(due, elapsed_s, ...)     after the all-reduce of the losses and rank 0's clock: report
                                     now, or hold back for `min_report_interval_s`?
    decide(due, notice_fresh, ...)   after `ray.train.get_preemption_info()` (a collective asked at
                                     every report, and only then): evaluate? checkpoint? hold?

`Preemption` follows one drain notice: when its final checkpoint is due, and the wait after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from training.adaptors.ray_private import default_preemption_deadline_s
from training.config import CheckpointConfig, TrainConfig


@dataclass(frozen=True)
class StepDue:
    """What the step counts make due after a step (a checkpoint step is an evaluation step)."""

    log: bool
    evaluate: bool
    checkpoint: bool

    @property
    def any(self) -> bool:
        return self.log or self.evaluate


@dataclass(frozen=True)
class StepDecision:
    """What a report consists of."""

    evaluate: bool
    checkpoint: bool
    preemption_save: bool = False  # a just-in-time checkpoint: uploaded before the report returns
    hold: bool = False  # the final save before a preemption deadline: then wait for the restart

    def after_evaluation(self, stopped_early: bool) -> "StepDecision":
        # The evaluation that stops the run early is the last: checkpoint the state it scored.
        return replace(self, checkpoint=self.checkpoint or stopped_early)

    @property
    def reports_val_metrics(self) -> bool:
        # A scored checkpoint carries the latest validation metrics, even from an earlier step.
        return self.checkpoint or self.evaluate


@dataclass(frozen=True)
class StepPolicy:
    total_steps: int
    log_every_n_steps: int
    eval_every_n_steps: int
    checkpoint_every_n_steps: int
    min_report_interval_s: float

    @classmethod
    def of(cls, train: TrainConfig, checkpoint: CheckpointConfig, total_steps: int) -> "StepPolicy":
        return cls(total_steps, train.log_every_n_steps, train.eval_every_n_steps, checkpoint.every_n_steps,
                   train.min_report_interval_s)

    def due(self, step: int) -> StepDue:
        """`step`: steps finished, the one just taken included."""
        checkpoint = step % self.checkpoint_every_n_steps == 0 or step == self.total_steps
        return StepDue(log=step % self.log_every_n_steps == 0,
                       evaluate=step % self.eval_every_n_steps == 0 or checkpoint, checkpoint=checkpoint)

    def reports(self, due: StepDue, elapsed_s: float, final_save: bool) -> bool:
        """A log-only step reports once `min_report_interval_s` has passed since the last report;
        until then its losses stay in the window."""
        return due.evaluate or final_save or elapsed_s >= self.min_report_interval_s

    def decide(self, due: StepDue, *, final_save: bool, notice_fresh: bool, have_val_metrics: bool) -> StepDecision:
        """A fresh preemption notice checkpoints at once (the node may go before its deadline), and
        the final save just before the deadline checkpoints again; neither waits for the interval."""
        preemption_save = notice_fresh or final_save
        return StepDecision(evaluate=due.evaluate or (preemption_save and not have_val_metrics),
                            checkpoint=due.checkpoint or preemption_save,
                            preemption_save=preemption_save, hold=final_save)


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
