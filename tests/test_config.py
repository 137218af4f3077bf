"""Job config: typed sections, strict keys, dotted-path errors, --set overrides."""

import pytest
import yaml
from conftest import CONFIGS

from training import config as config_lib
from training.errors import ConfigError


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    job = config_lib.load(path)
    assert job.failure.max_failures > 0  # shipped configs survive a failure


def test_defaults_and_overrides_by_dotted_path():
    job = config_lib.load(CONFIGS / "digits.yaml",
                          ["optim.lr=3e-4", "scaling.num_workers=[1, 3]", "train.early_stopping.patience_evals=2"],
                          name="my-run")
    assert job.optim.lr == pytest.approx(3e-4)
    assert job.scaling.min_workers == 1 and job.scaling.max_workers == 3
    assert job.train.early_stopping.patience_evals == 2 and job.train.early_stopping.metric == "val_loss"
    assert job.name == "my-run"


@pytest.mark.parametrize("overrides, expected", [
    (["optim.lrr=1"], "optim.lrr: unknown key; allowed: betas, grad_clip_norm, lr"),
    (["bogus=1"], "bogus: unknown key"),
    (["train.precision=fp16"], "train.precision: must be 'auto', 'fp32' or 'bf16'"),
    (["optim.lr=-1"], "optim.lr: Input should be greater than 0"),
    (["scaling.num_workers=[3, 1]"], "scaling.num_workers: must be a positive int, or [min, max]"),
    (["train.epochs=2"], "set exactly one of train.max_steps and train.epochs"),
    (["model.options.hiddn=[3]"], "model.options.hiddn: unknown key; allowed: dropout, hidden"),
    (["data.options.seq_len=4"], "data.options.seq_len: unknown key; allowed: split_seed, val_fraction"),
    (["model.name=resnet"], "model.name: unknown model 'resnet'"),
    (["data.source=imagenet"], "data.source: unknown source 'imagenet'"),
    (["train.global_batch_size=1"], "train.global_batch_size (1) must be at least scaling.num_workers (2)"),
    (["name=has space"], "name: String should match pattern"),
    (["optim=3"], "optim: Input should be a valid dictionary"),
])
def test_bad_values_name_the_dotted_path(overrides, expected):
    with pytest.raises(ConfigError) as error:
        config_lib.load(CONFIGS / "digits.yaml", overrides)
    assert expected in str(error.value)


def test_set_needs_key_value_and_sections_stay_sections():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        config_lib.load(None, ["optim.lr"])
    with pytest.raises(ConfigError, match="optim.lr is a value, not a section"):
        config_lib.load(CONFIGS / "digits.yaml", ["optim.lr.x=1"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config_lib.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config_lib.load(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        config_lib.load(bad)


def test_resolved_config_round_trips_through_yaml():
    job = config_lib.load(CONFIGS / "tinylm.yaml", ["train.max_steps=7"])
    again = config_lib.validate(yaml.safe_load(config_lib.to_yaml(job)))
    assert again == job


def test_flatten_and_identity():
    job = config_lib.load(CONFIGS / "digits.yaml")
    flat = config_lib.flatten(job)
    assert flat["optim.lr"] == "0.003" and flat["scaling.num_workers"] == "2" and flat["name"] == "null"
    changed = config_lib.load(CONFIGS / "digits.yaml", ["train.max_steps=9", "scaling.num_workers=1"])
    assert config_lib.identity_of(changed) == config_lib.identity_of(job)  # length and scale may change
    assert config_lib.identity_of(config_lib.load(CONFIGS / "digits.yaml", ["seed=1"])) != config_lib.identity_of(job)


@pytest.mark.parametrize("override", ["optim.lr=.inf", "optim.weight_decay=.nan", "optim.grad_clip_norm=.inf",
                                      "train.epochs=.inf", "scaling.cpus_per_worker=.nan",
                                      "train.min_report_interval_s=.inf"])
def test_non_finite_floats_are_refused_by_name(override):
    field = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{field}: Input should be a finite number"):
        config_lib.load(None, [override])


def test_a_config_file_name_makes_a_valid_default_run_name():
    import datetime

    from training.run.paths import default_run_name

    now = datetime.datetime(2025, 1, 2, 3, 4, 5)
    assert default_run_name("configs/my job (1)!.yaml", now) == "my-job-1-20250102-030405"
    assert default_run_name("!!!.yaml", now) == "job-20250102-030405"
    assert default_run_name(None, now) == "job-20250102-030405"
    for path in ["my job (1)!.yaml", ".hidden.yaml", "é$`rm -rf`.yml", "x" * 300 + ".yaml"]:
        config_lib.JobConfig(name=default_run_name(path))  # a valid name: no ConfigError


def test_the_parallel_strategy_is_part_of_a_runs_identity():
    from training.run.record import Record

    job = config_lib.load(CONFIGS / "digits.yaml")
    fsdp = config_lib.load(CONFIGS / "digits.yaml", ["parallel.strategy=fsdp"])
    assert config_lib.identity_of(job)["parallel.strategy"] == "ddp"
    record = Record("r", config_lib.identity_of(job), None, None)
    with pytest.raises(ConfigError, match="already exists with a different parallel.strategy;"):
        record.check_resumable(config_lib.identity_of(fsdp), "run", "the original values")
    # A record written before the strategy joined the identity does not hold it: not compared.
    older = {k: v for k, v in config_lib.identity_of(job).items() if k != "parallel.strategy"}
    Record("r", older, None, None).check_resumable(config_lib.identity_of(fsdp), "run", "the original values")
    Record("s", {"base": older, "num_samples": 4}, None, None).check_resumable(  # a sweep's base job
        {"base": config_lib.identity_of(fsdp), "num_samples": 4}, "sweep", "the original sweep file")
    # Any other field the record lacks is a difference: the record is not one to continue.
    with pytest.raises(ConfigError, match="different model"):
        Record("r", {k: v for k, v in older.items() if k != "model"}, None, None).check_resumable(
            config_lib.identity_of(job), "run", "the original values")


@pytest.mark.parametrize("name, message", [
    ("team/digits", "contains '/' or ':'"), ("a:b", "contains '/' or ':'"), (" ", "must not be empty"),
    (".", "reads as a path"), ("..x", "reads as a path"),
])
def test_a_registered_model_name_the_registry_refuses_is_refused_now(name, message):
    with pytest.raises(ConfigError, match=f"tracking.registered_model_name: .*{message}"):
        config_lib.load(None, [f"tracking.registered_model_name={name!r}"])
    assert config_lib.load(None, ["tracking.registered_model_name=digits-mlp_v2.1"])
