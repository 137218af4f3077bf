"""The command line's bad-input paths: exit 2, one clear message naming the field, no Ray started."""

import json
import subprocess
import sys

import pytest
from cli_probe import run_cases
from conftest import REPO

from training import config as config_lib

BAD = REPO / "tests" / "bad_configs"

BAD_INPUT = [
    (["--set", "optim.lr=-1"], "optim.lr: Input should be greater than 0"),
    (["--set", "train.precsion=bf16"], "train.precsion: unknown key"),
    (["missing.yaml"], "config file missing.yaml does not exist"),
    (["--set", "model.name=nomodule:fn"], "model.name: cannot import module 'nomodule'"),
    (["--set", "data.source=nomodule:fn"], "data.source: cannot import module 'nomodule'"),
    (["--set", "model.name=gpt", "--set", "model.options={}"], "model.name: gpt is for language_model data"),
    (["--set", "checkpoint.score_metric=val_perplexity"],
     "checkpoint.score_metric: 'val_perplexity' is not a validation metric"),
    (["--set", "train.global_batch_size=5000"], "train.global_batch_size 5000 is larger than the"),
    (["--set", "checkpoint.storage_path=/proc/nope"], "checkpoint.storage_path /proc/nope is not writable"),
    (["--name", "bad name!"], "name: String should match pattern"),
    ([str(BAD / "binary.yaml")], "binary.yaml is not UTF-8 text"),
    ([str(BAD / "self_alias.yaml")], "a YAML alias refers to a value that contains it (line 4)"),
    ([str(BAD / "duplicate_keys.yaml")], "duplicate key 'seed' (first at line 1)"),
    ([str(BAD / "empty.yaml")], "empty.yaml is empty"),
    ([str(BAD / "control_character.yaml")], "control_character.yaml is not valid YAML: unacceptable character #x0000"),
    (["--set", "name=\x00"], "the value is not valid YAML: unacceptable character #x0000"),
    (["--set", "model.name=gpt", "--set", "model.options={preset: [tiny]}"], "model.options.preset: must be 'tiny'"),
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
    (["--set", 'checkpoint.storage_path="runs\\x00x"'],
     "checkpoint.storage_path: 'runs\\x00x' contains a control character"),
    (["--set", "data.cache_dir=file://"], "data.cache_dir: 'file://' names no path"),
    # Plug-ins that fail on import or when called: the field, the error's first line, no traceback.
    (["--set", "data.source=plugins.raises_at_import:blobs"],
     "data.source: importing module 'plugins.raises_at_import' failed: RuntimeError: cannot reach the license server;"),
    (["--set", "data.source=plugins.broken_syntax:blobs"],
     "data.source: importing module 'plugins.broken_syntax' failed: SyntaxError: invalid syntax"),
    (["--set", "model.name=plugins.exits_at_import:build", "--set", "model.options={}"],
     "model.name: importing module 'plugins.exits_at_import' failed: SystemExit: 0"),
    (["--set", "data.source=plugins.examples:source_fails"],
     "data.source plugins.examples:source_fails failed: ValueError: bucket 'corpus' not found\n"),
    (["--set", "data.source=plugins.examples:source_exits"],
     "data.source plugins.examples:source_exits failed: SystemExit: 3"),
    (["--set", "data.source=plugins.examples:blobs"], "data.source plugins.examples:blobs rejected data.options"),
    (["--set", "model.name=plugins.examples:model_fails", "--set", "model.options={}"],
     "model.name plugins.examples:model_fails failed: ValueError: hidden sizes must be positive"),
    (["--set", "data.options.split_seed=-1"], "data.options.split_seed: Input should be greater than or equal to 0"),
    # Data a model cannot train on, found before it is prepared.
    (["--set", "data.source=plugins.examples:nan_features"],
     "split 'train': x must hold finite features; row 7 has NaN"),
    (["--set", "data.source=plugins.examples:inf_features"],
     "split 'train': x must hold finite features; row 3 has NaN"),
    (["--set", "data.source=plugins.examples:nan_labels"],
     "split 'train': y must hold integer class labels; row 5 has nan"),
    (["--set", "data.source=plugins.examples:negative_labels"], "y must hold class labels from 0; row 2 has -1"),
    (["--set", "data.source=plugins.examples:fractional_labels"], "y must hold integer class labels; row 4 has 1.5"),
    (["--set", "data.source=plugins.examples:narrow_validation"],
     "the validation split has 5 features per row, the train split 6"),
    (["--set", "data.source=plugins.examples:tokens", "--set", "data.options={validation_high: 200}",
      "--set", "model.name=gpt", "--set", "model.options={}"],
     "the validation split has token id 199, but the train split's vocabulary ends at 99"),
    (["--set", "data.source=plugins.examples:tokens", "--set", "data.options={validation_width: 9}",
      "--set", "model.name=gpt", "--set", "model.options={}"],
     "the validation split has 9 tokens per sequence, the train split 17"),
    # Models whose shapes do not fit the data: one forward pass on the meta device finds them.
    (["--set", "data.source=plugins.examples:blobs", "--set", "data.options={}",
      "--set", "model.name=plugins.examples:wide_output", "--set", "model.options={}"],
     "returns logits of shape [2, 4]; the data needs [2, 3] (num_classes 3)"),
    (["--set", "data.source=plugins.examples:blobs", "--set", "data.options={}",
      "--set", "model.name=plugins.examples:fixed_input", "--set", "model.options={}"],
     "a forward pass on 2 rows shaped like the data ([2, 6]) fails"),
    # Webhooks: the field named, a literal URL never quoted whole, a variable by its name.
    (["--set", "tracking.notify=[{url: 'https://h.example/x', on: [finish]}]"],
     "tracking.notify.0.on.0: must be 'finished', 'failed', 'preempted' or 'restarted'"),
    (["--set", "tracking.notify=[{url: 'htps://h.example/S3cretPassw0rd'}]"],
     "tracking.notify.0.url: the URL htps://h.example/*** must start with https://"),
    (["--set", "tracking.notify=[{url: '${NOTIFY_HOOK_NOT_SET}', on: [failed]}]"],
     "tracking.notify.0.url: the environment variable NOTIFY_HOOK_NOT_SET is not set"),
    (["--set", "train.profile={steps: [390, 401]}"],
     "train.profile.steps [390, 401] ends after the run's last step (train.max_steps: 400)"),
    # What the end of a run needs, asked at its start.
    (["--set", "tracking.registered_model_name=team/digits"],
     "tracking.registered_model_name: 'team/digits' contains '/' or ':'"),
    (["--set", "tracking.registered_model_name=..digits"],
     "tracking.registered_model_name: '..digits' reads as a path"),
    (["--set", "tracking.cluster_config=missing-cluster.yaml"],
     "tracking.cluster_config: missing-cluster.yaml: no such file"),
    (["--set", f"tracking.cluster_config={REPO / 'training' / 'configs' / 'digits.yaml'}"],
     "digits.yaml is not a cluster config"),
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
RESUME_STRATEGY_ARGS = ("--name", "r2", "--set", "parallel.strategy=fsdp")
HELP_ARGS = ("--help",)


@pytest.fixture(scope="module")
def bad_input(tmp_path_factory):
    """Every case of this module through `training.run.cli.main` (the bad inputs, a resume of a
    different run, --help), in one process: {args: (result, its working directory)}."""
    cases = {}
    for args in [tuple(a) for a, _ in BAD_INPUT] + [RESUME_ARGS, RESUME_STRATEGY_ARGS, HELP_ARGS]:
        cases[args] = tmp_path_factory.mktemp("cli")
    run_dir = cases[RESUME_ARGS] / "runs" / "r1"  # a run of that name exists, with another identity
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text('{"identity": {"seed": 5}, "mlflow_run_id": null}')
    run_dir = cases[RESUME_STRATEGY_ARGS] / "runs" / "r2"  # the default job, run with ddp
    run_dir.mkdir(parents=True)
    identity = config_lib.identity_of(config_lib.load(REPO / "training" / "configs" / "digits.yaml"))
    (run_dir / "run.json").write_text(json.dumps({"identity": identity, "mlflow_run_id": None}))
    results = run_cases("training.run.cli", [{"args": list(args), "cwd": str(cwd)} for args, cwd in cases.items()])
    return {args: (result, cwd) for (args, cwd), result in zip(cases.items(), results)}


def test_resuming_with_a_different_model_is_refused(bad_input):
    result, _ = bad_input[RESUME_ARGS]
    assert result["returncode"] == 2
    assert "run 'r1' already exists with a different seed" in result["stderr"]
    assert not result["ray_imported"]


def test_resuming_with_another_parallel_strategy_is_refused(bad_input):
    result, cwd = bad_input[RESUME_STRATEGY_ARGS]
    assert result["returncode"] == 2, result["stderr"]
    assert "run 'r2' already exists with a different parallel.strategy;" in result["stderr"]
    assert not result["ray_imported"]
    assert [p.name for p in (cwd / "runs").iterdir()] == ["r2"]


def test_help_documents_the_command(bad_input):
    result, _ = bad_input[HELP_ARGS]
    assert result["returncode"] == 0
    for text in ("--set KEY=VALUE", "--name", "RAY_ADDRESS", "exit codes", "MLFLOW_TRACKING_URI"):
        assert text in result["stdout"]


def test_print_config_shows_the_resolved_config():  # and `python -m training` is the command
    result = subprocess.run([sys.executable, "-m", "training", "training/configs/tinylm.yaml", "--print-config",
                             "--set", "optim.lr=0.01"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0 and "lr: 0.01" in result.stdout and "source: tinylm" in result.stdout
