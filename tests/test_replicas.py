"""failure.mode continue without Ray: the config rules (exit code 2, nothing started), the replica
ledger and the report gate (pure), and one torchft replica group stepping against a real in-process
lighthouse."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import CONFIGS, REPO

from training import config as config_lib
from training.errors import ConfigError
from training.failure.replicas import (
    LOST,
    NOTHING_DUE,
    REJOINED,
    ReplicaLedger,
    ReportGate,
    carried_after,
    waits_for_all,
)
from training.worker.policy import StepDue


def load(*overrides):
    return config_lib.load(CONFIGS / "digits.yaml", list(overrides))


# --- config -------------------------------------------------------------------------------------

def test_restart_is_the_default_and_continue_is_accepted_for_ddp():
    assert load().failure.mode == "restart"
    assert load("failure.mode=continue").failure.mode == "continue"


@pytest.mark.parametrize("overrides, words", [
    (["parallel.strategy=fsdp"], "needs parallel.strategy ddp, not fsdp"),
    (["scaling.num_workers=1"], "needs scaling.num_workers of 2 or more, not 1"),
    (["scaling.num_workers=[2, 4]"], "needs a fixed scaling.num_workers, not the elastic range [2, 4]"),
    (["failure.max_failures=0"], "needs failure.max_failures of 1 or more, or -1"),
])
def test_continue_refuses_what_it_cannot_serve(overrides, words):
    with pytest.raises(ConfigError) as caught:
        load("failure.mode=continue", *overrides)
    message = str(caught.value)
    assert "failure.mode: continue " + words in message
    assert "use failure.mode: restart otherwise" in message  # what is supported, and what to do


def test_restart_mode_keeps_accepting_those_jobs():
    assert load("parallel.strategy=fsdp", "scaling.num_workers=1", "failure.max_failures=0").failure.mode == "restart"


def test_cli_exits_2_on_continue_with_fsdp_and_starts_nothing(tmp_path):
    env = {**os.environ, "TRAINING_BASE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "training", str(CONFIGS / "digits.yaml"), "--set",
                          "failure.mode=continue", "--set", "parallel.strategy=fsdp"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "failure.mode: continue needs parallel.strategy ddp" in out.stderr
    assert list(tmp_path.iterdir()) == []  # no data prepared, no run directory, no MLflow store


# --- ledger ---------------------------------------------------------------------------------------

def test_ledger_counts_short_steps_and_skipped_samples():
    ledger = ReplicaLedger(world_size=2, global_batch_size=64)
    ledger.record(1, 2, 64, now_s=10.0)
    ledger.record(2, 1, 32, now_s=11.0)  # a group died: its half of step 2 was not read
    ledger.record(3, 1, 32, now_s=12.0)
    ledger.record(4, 2, 64, now_s=13.0)  # back to two
    metrics = ledger.report_metrics()
    assert metrics["samples_skipped"] == 64 and metrics["short_steps"] == 2 and metrics["replicas"] == 2
    assert metrics["replica_steps"] == [{"step": 2, "replicas": 1, "samples_used": 32},
                                        {"step": 3, "replicas": 1, "samples_used": 32}]
    assert [(e["kind"], e["step"], e["time_s"]) for e in metrics["replica_events"]] == [(LOST, 2, 11.0),
                                                                                        (REJOINED, 4, 13.0)]
    again = ledger.report_metrics()  # drained: each short step and event is reported once
    assert again["replica_steps"] == [] and again["replica_events"] == [] and again["samples_skipped"] == 64


def test_ledger_state_travels_to_a_healing_peer():
    ledger = ReplicaLedger(world_size=3, global_batch_size=60)
    ledger.record(5, 2, 40, now_s=1.0)
    peer = ReplicaLedger(world_size=3, global_batch_size=60)
    peer.load(ledger.state())
    assert peer.report_metrics() == ledger.report_metrics()


def test_a_healing_group_that_used_no_samples_counts_its_whole_part():
    ledger = ReplicaLedger(world_size=2, global_batch_size=64)
    ledger.record(7, 1, 32, now_s=0.0)
    assert ledger.samples_skipped == 32


# --- report gate and start ------------------------------------------------------------------------

LOG = StepDue(log=True, evaluate=False, checkpoint=False)
CHECKPOINT = StepDue(log=False, evaluate=True, checkpoint=True)


def test_gate_reports_only_at_full_steps_and_carries_what_was_due():
    gate = ReportGate(world_size=2)
    assert not gate.decide(NOTHING_DUE, NOTHING_DUE, replicas=2).report
    short = gate.decide(CHECKPOINT, NOTHING_DUE, replicas=1)
    assert not short.report
    carried = carried_after(short)
    assert carried.checkpoint  # the checkpoint due at the short step is not lost
    full = gate.decide(NOTHING_DUE, carried, replicas=2)
    assert full.report and full.due.checkpoint and full.due.evaluate
    assert carried_after(full) == NOTHING_DUE
    merged = gate.decide(LOG, carried, replicas=2)
    assert merged.due == StepDue(log=True, evaluate=True, checkpoint=True)


def test_a_starting_group_waits_for_all_but_a_healing_one_does_not():
    assert waits_for_all(started=False, replicas=1, world_size=2, participating=True)
    assert not waits_for_all(started=False, replicas=1, world_size=2, participating=False)  # heals in it
    assert not waits_for_all(started=True, replicas=1, world_size=2, participating=True)  # a survivor goes on
    assert not waits_for_all(started=False, replicas=2, world_size=2, participating=True)


# --- one real replica group -----------------------------------------------------------------------

def test_one_replica_group_steps_against_a_real_lighthouse(monkeypatch):
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    from training.failure.replica_group import ReplicaGroup

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # what Ray's torch backend starts
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse.address())
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    group = ReplicaGroup(0, 1, 8, torch.device("cpu"))
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        group.share("model", model.state_dict, model.load_state_dict)
        wrapped = group.wrap(model)
        group.start_step(5)  # a resumed run: torchft counts from the checkpoint's step
        wrapped(torch.ones(8, 4)).sum().backward()
        expected_grad = torch.full((1, 4), 8.0)  # one group: the average is its own gradient
        assert torch.equal(model.weight.grad, expected_grad)
        assert group.finish_step(8) == (True, 1, 8)
        assert group.step == 6
    finally:
        group.shutdown()
        lighthouse.shutdown()
