"""Chaos: Ray Train workers SIGKILLed from outside at random moments; the run recovers from its
latest complete checkpoint and ends with weights bit-identical to an uninterrupted run."""

import os
import random
import signal
import threading
import time

import pytest
import torch
from conftest import CONFIGS, train_worker_pids

from training import config as config_lib
from training.checkpoint import format as ckpt
from training.run.driver import run_training

pytestmark = [pytest.mark.ray, pytest.mark.chaos, pytest.mark.slow]

OVERRIDES = ["train.max_steps=1200", "train.global_batch_size=32", "checkpoint.every_n_steps=100",
             "train.eval_every_n_steps=100", "train.log_every_n_steps=10", "train.min_report_interval_s=0",
             "failure.max_failures=6", "tracking.enabled=false", "checkpoint.keep=1"]


def final_weights(run_dir):
    return ckpt.load(sorted(run_dir.glob("checkpoint-*"))[-1])["model"]


def test_killed_workers_resume_to_bit_identical_weights(ray_cluster, workdir):
    # (the uninterrupted run reports less often, so it trains faster; reports do not touch the weights)
    clean = run_training(config_lib.load(CONFIGS / "digits.yaml", OVERRIDES + ["train.log_every_n_steps=100"],
                                         name="clean"), log=print)

    kills, rng = [], random.Random(1234)

    def chaos():
        deadline = time.monotonic() + 240
        while len(kills) < 2 and time.monotonic() < deadline:  # two kills: the group restarts twice
            if not list((workdir / "runs" / "chaos").glob("checkpoint-*")):
                time.sleep(0.2)  # let a first checkpoint exist, then kill at random moments
                continue
            time.sleep(rng.uniform(0.2, 2.0))
            pids = train_worker_pids()
            if pids:
                pid = rng.choice(pids)
                try:
                    os.kill(pid, signal.SIGKILL)
                    kills.append(pid)
                except ProcessLookupError:
                    pass
                time.sleep(4)  # the group restarts before the next kill

    killer = threading.Thread(target=chaos, daemon=True)
    killer.start()
    chaotic = run_training(config_lib.load(CONFIGS / "digits.yaml", OVERRIDES, name="chaos"), log=print)
    killer.join(timeout=5)

    assert len(kills) >= 2, "the chaos thread did not get to kill workers"
    assert chaotic.steps == clean.steps == 1200
    expected, actual = final_weights(workdir / "runs" / "clean"), final_weights(workdir / "runs" / "chaos")
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), f"{name} differs after {len(kills)} kills"
