"""`SendPolicy.decide`, the tracking sender's next step, without threads and without MLflow: one
table row per branch (stop, reload, persist while MLflow is away, send, back off), then the backoff's
growth through `decide` and `training.backoff` itself."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import REPO

from training.backoff import exponential_backoff_s
from training.tracking.policy import SenderAction, SenderDecision, SenderState, SendPolicy

POLICY = SendPolicy(first_backoff_s=0.5, max_backoff_s=5.0, persist_every_s=10.0, batch_size=1000)
NOW = 1000.0  # monotonic seconds
IDLE = SenderState(now_s=NOW, can_persist=True)
UP = replace(IDLE, pending=5, changed=True)                                     # MLflow answers
AWAY = replace(UP, failures=2, failed_at_s=NOW - 5.0, persisted_at_s=NOW - 3.0)  # backoff (1 s) over

A = SenderAction
ROWS = [
    # stopping comes first, and writes what is left (the final status too) where there is a run directory
    ("stop, nothing left", replace(IDLE, stopping=True, reload_requested=True), SenderDecision(A.STOP)),
    ("stop with metrics left", replace(AWAY, stopping=True), SenderDecision(A.PERSIST_AND_STOP, 5)),
    ("stop with the status left", replace(IDLE, stopping=True, status_set=True),
     SenderDecision(A.PERSIST_AND_STOP, 0, with_status=True)),
    ("stop with both left", replace(UP, stopping=True, status_set=True, reload_requested=True),
     SenderDecision(A.PERSIST_AND_STOP, 5, with_status=True)),
    ("stop without a run directory", replace(AWAY, stopping=True, can_persist=False), SenderDecision(A.STOP)),
    # a requested reload before anything else
    ("reload", replace(UP, reload_requested=True), SenderDecision(A.RELOAD)),
    ("reload while away", replace(AWAY, reload_requested=True, checkpointed=True), SenderDecision(A.RELOAD)),
    # MLflow answers: send, metrics first, in batches, then the status
    ("nothing to do", IDLE, SenderDecision(A.WAIT, wait_s=None)),
    ("send metrics", UP, SenderDecision(A.SEND_METRICS, 5)),
    ("one batch at a time", replace(UP, pending=2500), SenderDecision(A.SEND_METRICS, 1000)),
    ("metrics before the status", replace(UP, status_set=True), SenderDecision(A.SEND_METRICS, 5)),
    ("then the status", replace(IDLE, status_set=True), SenderDecision(A.SEND_STATUS, 0, with_status=True)),
    ("a checkpoint while MLflow answers: no file", replace(UP, checkpointed=True, persisted_at_s=NOW - 60),
     SenderDecision(A.SEND_METRICS, 5)),
    # MLflow away: the file at most every persist_every_s, and only if the queue changed ...
    ("persist: changed, interval passed", replace(AWAY, persisted_at_s=NOW - 10.0), SenderDecision(A.PERSIST, 5)),
    ("persist: never written yet", replace(AWAY, persisted_at_s=0.0), SenderDecision(A.PERSIST, 5)),
    ("no persist: within the interval", AWAY, SenderDecision(A.SEND_METRICS, 5)),
    ("no persist: unchanged", replace(AWAY, changed=False, persisted_at_s=NOW - 60), SenderDecision(A.SEND_METRICS, 5)),
    ("no persist: only the status left", replace(AWAY, pending=0, status_set=True, persisted_at_s=NOW - 60),
     SenderDecision(A.SEND_STATUS, 0, with_status=True)),
    ("no persist: no run directory", replace(AWAY, can_persist=False, persisted_at_s=NOW - 60),
     SenderDecision(A.SEND_METRICS, 5)),
    # ... and at once when a checkpoint was reported, even unchanged and just written
    ("persist at once on a checkpoint", replace(AWAY, checkpointed=True, changed=False, persisted_at_s=NOW),
     SenderDecision(A.PERSIST, 5)),
    ("persist on a checkpoint during the backoff", replace(AWAY, checkpointed=True, failed_at_s=NOW),
     SenderDecision(A.PERSIST, 5)),
    # MLflow away: wait out the backoff (1 s after 2 failures), at least 10 ms
    ("back off", replace(AWAY, failed_at_s=NOW - 0.25), SenderDecision(A.WAIT, wait_s=0.75)),
    ("back off, status only", replace(AWAY, pending=0, status_set=True, failed_at_s=NOW),
     SenderDecision(A.WAIT, wait_s=1.0)),
    ("back off at least 10 ms", replace(AWAY, failed_at_s=NOW - 0.999), SenderDecision(A.WAIT, wait_s=0.01)),
    ("backoff over: try again", replace(AWAY, failed_at_s=NOW - 1.0), SenderDecision(A.SEND_METRICS, 5)),
]


@pytest.mark.parametrize("state, expected", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_decide(state, expected):
    decision = POLICY.decide(state)
    assert replace(decision, wait_s=None) == replace(expected, wait_s=None)
    assert decision.wait_s == (None if expected.wait_s is None else pytest.approx(expected.wait_s))


@pytest.mark.parametrize("failures, wait_s", [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 5.0), (12, 5.0)])
def test_backoff_doubles_after_each_failure_up_to_the_maximum(failures, wait_s):
    just_failed = replace(UP, failures=failures, failed_at_s=NOW, persisted_at_s=NOW)  # the file is fresh
    assert POLICY.decide(just_failed) == SenderDecision(A.WAIT, wait_s=wait_s)
    assert POLICY.decide(replace(just_failed, now_s=NOW + wait_s)).action is A.SEND_METRICS


def test_exponential_backoff():
    assert [exponential_backoff_s(n, 1.0, 30.0) for n in (1, 2, 3, 5, 6, 20)] == [1.0, 2.0, 4.0, 16.0, 30.0, 30.0]
    assert exponential_backoff_s(0, 0.5, 5.0) == 0.5  # no failure yet: the first delay
    assert SendPolicy(first_backoff_s=0.2, max_backoff_s=1.0).backoff_s(3) == 0.8


def test_the_policy_imports_neither_mlflow_nor_threads():
    code = ("import sys, training.tracking.policy; "
            "print(sorted(m for m in ('mlflow', 'ray', 'threading', 'training.tracking.sender') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_backoff_stays_at_its_cap_after_any_number_of_failures():
    from training.backoff import exponential_backoff_s

    # (the sender thread of a run whose MLflow stayed away counted past 1024 failures: 2 ** 1024 overflowed)
    assert exponential_backoff_s(10**6, 0.5, 30.0) == 30.0
    assert [exponential_backoff_s(n, 0.5, 30.0) for n in (0, 1, 2, 3)] == [0.5, 0.5, 1.0, 2.0]
