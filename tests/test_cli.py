"""The command line's bad-input paths: exit 2, one clear message naming the field, no Ray started."""

import subprocess
import sys

import pytest

from cli_probe import run_cases
from conftest import REPO

BAD = REPO / "tests" / "bad_configs"

BAD_INPUT = [
    (["--set", "optim.lr=-1"], "optim.lr: Input should be greater than 0"),
    (["--set", "train.precsion=bf16"], "train.precsion: unknown key"),
    (["missing.yaml"], "config file missing.yaml does not exist"),
    (["--set", "model.name=nomodule:fn"], "model.name: cannot import module 'nomodule'"),
    (["--set", "data.source=nomodule:fn"], "data.source: cannot import module 'nomodule'"),
    (["--set", "model.name=gpt", "--set", "model.options={}"], "model.name: gpt is for language_model data"),
    (["--set", "checkpoint.score_metric=val_perplexity"], "checkpoint.score_metric: 'val_perplexity' is not a validation metric"),
    (["--set", "train.global_batch_size=5000"], "train.global_batch_size 5000 is larger than the"),
    (["--set", "checkpoint.storage_path=/proc/nope"], "checkpoint.storage_path /proc/nope is not writable"),
    (["--name", "bad name!"], "name: String should match pattern"),
    ([str(BAD / "binary.yaml")], "binary.yaml is not UTF-8 text"),
    ([str(BAD / "self_alias.yaml")], "a YAML alias refers to a value that contains it (line 4)"),
    ([str(BAD / "duplicate_keys.yaml")], "duplicate key 'seed' (first at line 1)"),
    ([str(BAD / "empty.yaml")], "empty.yaml is empty"),
    ([str(BAD / "alias_bomb.yaml")], "expands to more than 100000 values through YAML aliases"),
    (["--set", "optim..lr=1"], "'optim..lr' has an empty part"),
    (["--set", "optim.betas=[2, -1]"], "optim.betas.0: Input should be less than 1"),
    (["--set", "seed=-1"], "seed: Input should be greater than or equal to 0"),
    (["--set", f"seed={2 ** 80}"], "seed: Input should be less than 4294967296"),
    (["--set", "train.max_steps=1000000000000000"], "train.max_steps: Input should be less than or equal to"),
    (["--set", "scaling.num_workers=true"], "scaling.num_workers"),
    (["--set", "scaling.resources_per_worker={GPU: -1}"], "scaling.resources_per_worker.GPU: Input should be greater"),
    (["--set", "tracking.tracking_uri=http://alice:S3cretPassw0rd@127.0.0.1:9/"], "alice:***@127.0.0.1:9"),
    (["--set", "checkpoint.storage_path=s3://"], "checkpoint.storage_path: 's3://' names no bucket or host"),
    (["--set", "checkpoint.storage_path=s3:///runs"], "checkpoint.storage_path: 's3:///runs' names no bucket"),
    (["--set", "checkpoint.storage_path=''"], "checkpoint.storage_path: must not be empty"),
    (["--set", "checkpoint.storage_path=foo://bar/runs"], "Unrecognized filesystem type in URI: foo://bar/runs"),
    (["--set", "tracking.experiment=''"], "tracking.experiment: String should have at least 1 character"),
]


@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_bad_input_exits_2_before_ray(bad_input, args, message):
    result, cwd = bad_input[tuple(args)]
    assert result["returncode"] == 2, result["stderr"] + result["stdout"]
    assert message in result["stderr"]
    assert "Traceback" not in result["stderr"]
    assert "S3cretPassw0rd" not in result["stderr"] + result["stdout"]
    assert not result["ray_imported"], "Ray was imported on a bad-input path"
    assert list(cwd.iterdir()) == []  # nothing written: no data, no runs, no mlflow.db


RESUME_ARGS = ("--name", "r1")
HELP_ARGS = ("--help",)


@pytest.fixture(scope="module")
def bad_input(tmp_path_factory):
    """Every case of this module through `training.run.cli.main` (the bad inputs, a resume of a
    different run, --help), in one process: {args: (result, its working directory)}."""
    cases = {}
    for args in [tuple(a) for a, _ in BAD_INPUT] + [RESUME_ARGS, HELP_ARGS]:
        cases[args] = tmp_path_factory.mktemp("cli")
    run_dir = cases[RESUME_ARGS] / "runs" / "r1"  # a run of that name exists, with another identity
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text('{"identity": {"seed": 5}, "mlflow_run_id": null}')
    results = run_cases("training.run.cli", [{"args": list(args), "cwd": str(cwd)} for args, cwd in cases.items()])
    return {args: (result, cwd) for (args, cwd), result in zip(cases.items(), results)}


def test_resuming_with_a_different_model_is_refused(bad_input):
    result, _ = bad_input[RESUME_ARGS]
    assert result["returncode"] == 2
    assert "run 'r1' already exists with a different seed" in result["stderr"]
    assert not result["ray_imported"]


def test_help_documents_the_command(bad_input):
    result, _ = bad_input[HELP_ARGS]
    assert result["returncode"] == 0
    for text in ("--set KEY=VALUE", "--name", "RAY_ADDRESS", "exit codes", "MLFLOW_TRACKING_URI"):
        assert text in result["stdout"]


def test_print_config_shows_the_resolved_config():  # and `python -m training` is the command
    result = subprocess.run([sys.executable, "-m", "training", "training/configs/tinylm.yaml", "--print-config",
                             "--set", "optim.lr=0.01"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0 and "lr: 0.01" in result.stdout and "source: tinylm" in result.stdout
