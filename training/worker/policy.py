"""What a worker does after a training step (on every worker), decided from values every worker
shares (step counts, and rank 0's clock as summed across workers), so that every rank makes the
same choice and calls the collectives and `ray.train.report` the same number of times.

The decision comes in three pure steps, one on each side of the collectives that feed it:

    due(step)                        step counts alone: may a report happen now? (if not: no
                                     collective at all)
    reports(due, elapsed_s, ...)     after the all-reduce of the losses and rank 0's clock: report
                                     now, or hold back for `min_report_interval_s`?
    decide(due, notice_fresh, ...)   after `ray.train.get_preemption_info()` (a collective asked at
                                     every report, and only then): evaluate? checkpoint? hold?

How a failure mode gates these (a min report interval and preemptions in restart mode, reports only
at steps every replica group took in continue mode) is the mode's: training/failure/.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the job config's sections, for the types alone: config imports no worker module)
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
    def of(cls, train: "TrainConfig", checkpoint: "CheckpointConfig", total_steps: int) -> "StepPolicy":
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

    def quiet_steps(self, elapsed_s: float, window_steps: float) -> int:
        """After a log-only step found the window too young to report: how many steps may pass before
        the next one asks again. Those that, at the window's pace so far, end well before
        `min_report_interval_s`: they skip the collective that asking takes, and every rank skips the
        same ones (`elapsed_s`, rank 0's clock, and the window's steps are the same on every rank)."""
        remaining_s = self.min_report_interval_s - elapsed_s
        if elapsed_s <= 0 or window_steps <= 0 or remaining_s <= 0:
            return 0
        return int(0.8 * remaining_s * window_steps / elapsed_s)

    def decide(self, due: StepDue, *, final_save: bool, notice_fresh: bool, have_val_metrics: bool) -> StepDecision:
        """A fresh preemption notice checkpoints at once (the node may go before its deadline), and
        the final save just before the deadline checkpoints again; neither waits for the interval."""
        preemption_save = notice_fresh or final_save
        return StepDecision(evaluate=due.evaluate or (preemption_save and not have_val_metrics),
                            checkpoint=due.checkpoint or preemption_save,
                            preemption_save=preemption_save, hold=final_save)


NOTHING_DUE = StepDue(log=False, evaluate=False, checkpoint=False)
