"""`train.profile`: the range checked against the run, and the real torch.profiler trace of rank 0
written to a run directory, without Ray."""

import json

import pytest
import torch
from conftest import CONFIGS

from training import config as config_lib
from training.config import ProfileConfig
from training.errors import ConfigError
from training.run.preflight import check_profile_fits
from training.worker.profile import StepProfiler


@pytest.mark.parametrize("steps, message", [
    ("[5, 500]", "train.profile.steps [5, 500] ends after the run's last step (train.max_steps: 400)"),
    ("[9, 3]", "train.profile.steps: [9, 3]: the first step comes after the last"),
    ("[0, 3]", "train.profile.steps.0: Input should be greater than or equal to 1"),
    ("[1, 2000]", "at most 1000 steps are traced"),
])
def test_a_profile_range_outside_the_run_is_refused_naming_the_field(steps, message):
    with pytest.raises(ConfigError) as refused:
        config_lib.load(CONFIGS / "digits.yaml", [f"train.profile={{steps: {steps}}}"])
    assert message in str(refused.value)


def test_a_run_in_epochs_is_checked_once_its_rows_are_known():
    job = config_lib.load(CONFIGS / "digits.yaml", ["train.max_steps=null", "train.epochs=2",
                                                     "train.profile={steps: [40, 46]}"])
    check_profile_fits(job.train, train_rows=64 * 23)  # 23 steps an epoch: 46 steps
    with pytest.raises(ConfigError, match=r"train.profile.steps \[40, 46\] ends after the run's last step"):
        check_profile_fits(job.train, train_rows=64 * 22)


def test_rank_0_writes_a_chrome_trace_of_the_steps_asked_for(tmp_path, capsys):
    model = torch.nn.Linear(8, 2)
    others = StepProfiler(ProfileConfig(steps=(2, 3)), rank=1, device=torch.device("cpu"), run_dir=str(tmp_path))
    profiler = StepProfiler(ProfileConfig(steps=(2, 3)), rank=0, device=torch.device("cpu"), run_dir=str(tmp_path))
    for step in range(1, 6):
        for p in (profiler, others):
            p.before_step(step)
        model(torch.randn(4, 8)).sum().backward()
        for p in (profiler, others):
            p.after_step(step)
    (trace,) = (tmp_path / "profile").iterdir()
    assert trace.name == "trace-steps-2-3.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("addmm" in str(e.get("name", "")) for e in events)  # the Linear layer's matmul, traced
    assert "profile: steps 2-3 traced on rank 0" in capsys.readouterr().out
