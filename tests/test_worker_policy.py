"""The per-worker step policy and the preemption timing, without Ray."""

from dataclasses import dataclass, field

import pytest

from training.config import CheckpointConfig, TrainConfig
from training.failure.restart import Preemption
from training.worker.policy import StepDecision, StepDue, StepPolicy

# log every 10 steps, evaluate every 30, checkpoint every 50, 120 steps, a report at most every 5 s
POLICY = StepPolicy(total_steps=120, log_every_n_steps=10, eval_every_n_steps=30, checkpoint_every_n_steps=50,
                    min_report_interval_s=5.0)


def test_the_policy_is_built_from_the_train_and_checkpoint_sections():
    train = TrainConfig(max_steps=120, log_every_n_steps=10, eval_every_n_steps=30, min_report_interval_s=5.0)
    assert StepPolicy.of(train, CheckpointConfig(every_n_steps=50), total_steps=120) == POLICY


@pytest.mark.parametrize("step, log, evaluate, checkpoint", [
    (7, False, False, False),  # most steps: nothing due, no collective
    (10, True, False, False),  # log only
    (30, True, True, False),  # evaluation
    (50, True, True, True),  # a checkpoint step is an evaluation step
    (55, False, False, False),
    (100, True, True, True),
    (120, True, True, True),  # the last step checkpoints, whatever the interval
])
def test_what_the_step_counts_make_due(step, log, evaluate, checkpoint):
    assert POLICY.due(step) == StepDue(log, evaluate, checkpoint)
    assert POLICY.due(step).any is (log or evaluate)


def test_a_step_that_is_due_only_for_evaluation_may_still_report():
    policy = StepPolicy(total_steps=100, log_every_n_steps=7, eval_every_n_steps=5, checkpoint_every_n_steps=100,
                        min_report_interval_s=0.0)
    assert policy.due(5).any and not policy.due(5).log


@pytest.mark.parametrize("step, elapsed_s, final_save, reports", [
    (10, 1.0, False, False),  # a log-only step within min_report_interval_s is held back
    (10, 5.0, False, True),
    (10, 1.0, True, True),  # the final preemption save does not wait
    (30, 1.0, False, True),  # nor an evaluation
    (50, 0.0, False, True),  # nor a checkpoint
])
def test_min_report_interval_holds_back_log_only_reports(step, elapsed_s, final_save, reports):
    assert POLICY.reports(POLICY.due(step), elapsed_s, final_save) is reports


CASES = {  # name: (step, final_save, notice_fresh, have_val_metrics, stopped_early) -> decision
    "log only": ((10, False, False, True, False), StepDecision(evaluate=False, checkpoint=False)),
    "evaluation": ((30, False, False, True, False), StepDecision(evaluate=True, checkpoint=False)),
    "checkpoint": ((50, False, False, True, False), StepDecision(evaluate=True, checkpoint=True)),
    "last step": ((120, False, False, False, False), StepDecision(evaluate=True, checkpoint=True)),
    "fresh notice, no val metrics yet": (
        (10, False, True, False, False), StepDecision(evaluate=True, checkpoint=True, preemption_save=True)),
    "fresh notice with val metrics": (
        (10, False, True, True, False), StepDecision(evaluate=False, checkpoint=True, preemption_save=True)),
    "fresh notice at an evaluation": (
        (30, False, True, True, False), StepDecision(evaluate=True, checkpoint=True, preemption_save=True)),
    "final save": ((10, True, False, True, False),
                   StepDecision(evaluate=False, checkpoint=True, preemption_save=True, hold=True)),
    "final save, no val metrics yet": (
        (10, True, False, False, False), StepDecision(evaluate=True, checkpoint=True, preemption_save=True, hold=True)),
    "early stop at an evaluation": ((30, False, False, True, True), StepDecision(evaluate=True, checkpoint=True)),
}


@pytest.mark.parametrize("name", CASES)
def test_the_decision_of_a_report(name):
    (step, final_save, notice_fresh, have_val_metrics, stopped_early), expected = CASES[name]
    due = POLICY.due(step)
    decision = POLICY.decide(due, final_save=final_save, notice_fresh=notice_fresh, have_val_metrics=have_val_metrics)
    if decision.evaluate:
        decision = decision.after_evaluation(stopped_early)
    assert decision == expected
    # A checkpoint carries validation metrics, the latest ones when it does not evaluate itself.
    assert decision.reports_val_metrics is (decision.evaluate or decision.checkpoint)


def test_no_early_stop_leaves_the_decision_as_it_was():
    decision = POLICY.decide(POLICY.due(30), final_save=False, notice_fresh=False, have_val_metrics=True)
    assert decision.after_evaluation(stopped_early=False) == decision


@dataclass
class FakeClock:
    now_s: float = 1000.0
    sleeps: list = field(default_factory=list)

    def __call__(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now_s += seconds


@dataclass
class Notice:  # the shape of ray.train.PreemptionInfo
    deadline_ms: int | None
    preempted_node_ids: list = field(default_factory=lambda: ["a" * 40])
    preempted_ranks: list = field(default_factory=lambda: [1])


def test_a_notice_is_fresh_once():
    clock = FakeClock()
    assert Preemption.fresh(None, None, clock) is None
    first = Preemption.fresh(Notice(1_030_000), None, clock, clock.sleep)
    assert first.deadline_s == 1030.0 and first.ranks == (1,)
    assert Preemption.fresh(Notice(1_030_000), first, clock) is None  # the same notice, asked again
    later = Preemption.fresh(Notice(1_090_000), first, clock)  # a new deadline is a new notice
    assert later is not None and later.deadline_s == 1090.0


def test_a_notice_without_a_deadline_gets_ray_trains_default():
    from training.adaptors.ray_private import default_preemption_deadline_s

    clock = FakeClock()
    assert Preemption.fresh(Notice(None), None, clock).deadline_s == 1000.0 + default_preemption_deadline_s()


def test_the_final_save_comes_its_margin_before_the_deadline_and_once():
    clock = FakeClock()
    preemption = Preemption.fresh(Notice(1_060_000), None, clock, clock.sleep)
    assert not preemption.final_save_due(1049.0) and preemption.final_save_due(1050.0)  # 10 s margin
    preemption.plan_final_save(save_s=5.0)  # a slow save: three times its time
    assert preemption.margin_s == 15.0
    assert not preemption.final_save_due(1044.0) and preemption.final_save_due(1045.0)
    preemption.plan_final_save(save_s=1.0)
    assert preemption.margin_s == 10.0  # never under 10 s
    assert "preemption notice for node(s) aaaaaaaaaaaa (ranks [1], 60 s left)" in preemption.notice_line(7)
    assert clock.sleeps == []  # deciding never waits

    clock.now_s = 1050.0
    preemption.hold(poll_s=0.5, after_deadline_s=60.0)
    assert clock.now_s == 1120.0 and set(clock.sleeps) == {0.5}  # until 60 s past the deadline
    assert not preemption.final_save_due(1119.0)  # the final save happened: not again
