"""Model sizes nobody means: refused at the config (the built-in families' options, with the dotted
option) or where the model is built from the data's spec (any family), before anything starts;
sizes of real use still build."""

import pytest
from cli_probe import run_cases
from conftest import CONFIGS

from training import config as config_lib
from training.errors import ConfigError, UserError
from training.models.family import MAX_SPEC
from training.models.registry import model_section
from training.run.preflight import check_model_builds

DIGITS = {"input_dim": 64, "num_classes": 10}
TEXT = {"vocab_size": 256, "seq_len": 16}

TOO_BIG = [  # (config, override, the message's start)
    ("tinylm.yaml", "model.options.n_layer=1000000", "model.options.n_layer: Input should be less than or equal to"),
    ("tinylm.yaml", "model.options.n_head=4096", "model.options.n_head: Input should be less than or equal to"),
    ("tinylm.yaml", "model.options.d_model=1048576", "model.options.d_model: Input should be less than or equal to"),
    ("digits.yaml", "model.options.hidden=[-1]", "model.options.hidden.0: Input should be greater than or equal to 1"),
    ("digits.yaml", "model.options.hidden=[64, 0]", "model.options.hidden.1: Input should be greater than or equal"),
    ("digits.yaml", "model.options.hidden=[10000000]", "model.options.hidden.0: Input should be less than or equal"),
    ("digits.yaml", f"model.options.hidden={[8] * 2000}", "model.options.hidden: List should have at most"),
]


@pytest.mark.parametrize("config, override, message", TOO_BIG, ids=lambda v: v.split("=")[0][:40])
def test_a_size_nobody_means_is_refused_naming_the_option(config, override, message):
    with pytest.raises(ConfigError) as error:
        config_lib.load(CONFIGS / config, [override])
    assert message in str(error.value)


def test_a_cnn_with_no_channels_in_a_layer_is_refused():
    with pytest.raises(ConfigError, match=r"model.options.channels.0: Input should be greater than or equal to 1"):
        config_lib.load(CONFIGS / "digits.yaml", ["model.name=digits_cnn", "model.options={channels: [0]}"])


def test_the_largest_sizes_allowed_still_validate_and_build():
    job = config_lib.load(CONFIGS / "tinylm.yaml", ["model.options.n_layer=1024", "model.options.n_head=1024",
                                                   "model.options.d_model=65536"])
    assert (job.model.options.n_layer, job.model.options.n_head, job.model.options.d_model) == (1024, 1024, 65536)
    check_model_builds(model_section({"name": "digits_mlp", "options": {"hidden": [65536]}}), "classification",
                       {"input_dim": 64, "num_classes": MAX_SPEC["num_classes"]})


def test_the_command_refuses_them_with_exit_2_before_ray(tmp_path):
    cases = [[str(CONFIGS / config), "--set", override] for config, override, _ in TOO_BIG[::3]]
    for args, result, (_, _, message) in zip(cases, run_cases("training.run.cli", [
            {"args": args, "cwd": str(tmp_path)} for args in cases]), TOO_BIG[::3]):
        assert result["returncode"] == 2 and message in result["stderr"], result["stderr"]
        assert "Traceback" not in result["stderr"] and not result["ray_imported"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name, task, spec, key", [
    ("digits_mlp", "classification", {**DIGITS, "num_classes": 2 ** 40}, "num_classes"),
    ("digits_cnn", "classification", {**DIGITS, "num_classes": MAX_SPEC["num_classes"] + 1}, "num_classes"),
    ("plugins.examples:linear", "classification", {**DIGITS, "num_classes": 2 ** 40}, "num_classes"),
    ("gpt", "language_model", {**TEXT, "vocab_size": 2 ** 40}, "vocab_size"),
    ("gpt", "language_model", {**TEXT, "seq_len": 2 ** 30}, "seq_len"),
])
def test_a_head_the_data_makes_absurd_is_refused_at_the_build(name, task, spec, key):
    """The meta-device check allocates nothing: without a bound, a head of 2^40 classes passes it."""
    with pytest.raises(UserError) as error:
        check_model_builds(model_section({"name": name}), task, spec)
    message = str(error.value)
    assert f"the data needs a model with {key} {spec[key]:,}" in message and f"at most {MAX_SPEC[key]:,}" in message
