"""A bad `--set` is reported as that --set's, naming its key, in both CLIs (real processes, no Ray:
the config is refused before anything starts); a problem in the file itself is still the file's."""

import subprocess
import sys
from pathlib import Path

import pytest

from training import config as config_lib
from training.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "training" / "configs" / "digits.yaml"
SWEEP = ROOT / "tuning" / "sweeps" / "digits_asha.yaml"


def refused(*argv: str) -> str:
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    return done.stderr.strip()


@pytest.mark.parametrize("module, config", [("training", DIGITS), ("tuning", SWEEP)])
def test_a_bad_set_value_names_the_set_and_its_key(module, config):
    message = refused("-m", module, str(config), "--set", "train.max_steps=abc")
    assert message == ("error: --set train.max_steps: "
                       "Input should be a valid integer, unable to parse string as an integer")


@pytest.mark.parametrize("module, config", [("training", DIGITS), ("tuning", SWEEP)])
def test_an_unknown_set_key_names_the_set(module, config):
    message = refused("-m", module, str(config), "--set", "train.lr=0.1")
    assert message.startswith("error: --set train.lr: unknown key; allowed: "), message
    assert "is invalid" not in message


def test_a_sweep_field_set_wrong_names_the_set():
    message = refused("-m", "tuning", str(SWEEP), "--set", "num_samples=many")
    assert message.startswith("error: --set num_samples: Input should be a valid integer"), message


def test_a_set_that_replaces_a_section_is_blamed_for_what_is_wrong_inside_it():
    with pytest.raises(ConfigError) as raised:
        config_lib.load(DIGITS, ["data.options={label: 3}"])
    assert str(raised.value).startswith("--set data.options: data.options.label: unknown key")


def test_the_file_is_blamed_for_its_own_mistakes_and_the_set_for_its_own(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(DIGITS.read_text().replace("seed: 0", "seed: soon"))
    with pytest.raises(ConfigError) as raised:
        config_lib.load(bad, ["optim.lr=fast"])
    lines = str(raised.value).splitlines()
    assert lines[0] == f"{bad} is invalid:"
    assert lines[1].startswith("  seed: Input should be a valid integer")
    assert lines[2].startswith("--set optim.lr: Input should be a valid number")


def test_a_set_value_is_not_repeated_where_it_may_hold_a_secret():
    with pytest.raises(ConfigError) as raised:
        config_lib.load(DIGITS, ["tracking.notify=[{url: 'htps://hooks.example/T0ken'}]"])
    assert "T0ken" not in str(raised.value)
    assert str(raised.value).startswith("--set tracking.notify: tracking.notify.0.url: "), str(raised.value)
