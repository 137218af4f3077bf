"""Passwords in URIs are masked wherever the service prints or stores them (training/redaction.py);
the end-to-end proof against a real MLflow server is in test_tracking_outage.py."""

import json

import pytest
from conftest import CONFIGS

from training import config as config_lib
from training.errors import ConfigError
from training.redaction import redact, redact_values
from training.run.record import Record

SECRET = "S3cretPassw0rd"


@pytest.mark.parametrize("text, shown", [
    (f"http://alice:{SECRET}@mlflow.example:5000", "http://alice:***@mlflow.example:5000"),
    (f"postgresql://ml:{SECRET}@db/mlflow", "postgresql://ml:***@db/mlflow"),
    (f"s3://AKIAEXAMPLE:{SECRET}@bucket/runs", "s3://AKIAEXAMPLE:***@bucket/runs"),
    (f"https://:{SECRET}@host/", "https://:***@host/"),
    (f"cannot reach MLflow at http://a:{SECRET}@h:5000/api/2.0/x: API request to "
     f"http://a:{SECRET}@h:5000/api/2.0/x failed",
     "cannot reach MLflow at http://a:***@h:5000/api/2.0/x: API request to http://a:***@h:5000/api/2.0/x failed"),
    ("http://alice@host/path", "http://alice@host/path"),  # a user alone is no secret
    ("sqlite:////tmp/mlflow.db", "sqlite:////tmp/mlflow.db"),
    ("user@example.com wrote s3://bucket/a@b", "user@example.com wrote s3://bucket/a@b"),
])
def test_redact_masks_the_password_of_every_uri_in_a_text(text, shown):
    assert redact(text) == shown


def test_redact_values_walks_a_config_tree():
    tree = {"a": [f"http://u:{SECRET}@h", 1, None], "b": {"c": (f"s3://k:{SECRET}@b/p",)}, "d": 2.5}
    assert redact_values(tree) == {"a": ["http://u:***@h", 1, None], "b": {"c": ("s3://k:***@b/p",)}, "d": 2.5}


def test_a_job_config_is_shown_and_flattened_without_the_password():
    job = config_lib.load(CONFIGS / "digits.yaml", [f"tracking.tracking_uri=http://alice:{SECRET}@mlflow:5000"])
    assert job.tracking.tracking_uri.endswith(f"{SECRET}@mlflow:5000")  # the run itself connects with it
    assert SECRET not in config_lib.to_yaml(job) and "alice:***@mlflow:5000" in config_lib.to_yaml(job)
    flat = config_lib.flatten(job)
    assert flat["tracking.tracking_uri"] == "http://alice:***@mlflow:5000"
    assert SECRET not in json.dumps(config_lib.identity_of(job))


def test_the_run_record_keeps_no_password_and_a_changed_password_is_the_same_store(tmp_path):
    uri = str(tmp_path / "run.json")
    Record("r", {}, "abc", f"http://alice:{SECRET}@mlflow:5000").write(uri)
    text = (tmp_path / "run.json").read_text()
    assert SECRET not in text and "http://alice:***@mlflow:5000" in text
    record = Record.read(uri, "r", "storage")
    record.check_tracking(f"http://alice:{SECRET}@mlflow:5000")
    record.check_tracking("http://alice:rotated@mlflow:5000")
    with pytest.raises(ConfigError, match=r"tracked at http://alice:\*\*\*@mlflow:5000, "
                                          r"not http://alice:\*\*\*@other:5000") as caught:
        record.check_tracking(f"http://alice:{SECRET}@other:5000")
    assert SECRET not in str(caught.value)


def test_unreachable_mlflow_with_a_password_is_named_without_it(workdir):
    import socket

    from training.errors import UserError
    from training.run.driver import run_training

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    job = config_lib.load(CONFIGS / "digits.yaml", [f"tracking.tracking_uri=http://alice:{SECRET}@127.0.0.1:{port}"],
                          name="no-mlflow")
    lines = []
    with pytest.raises(UserError, match=rf"cannot reach MLflow at http://alice:\*\*\*@127.0.0.1:{port}") as caught:
        run_training(job, log=lines.append)
    assert SECRET not in str(caught.value) and not any(SECRET in line for line in lines)
    assert not (workdir / "runs" / "no-mlflow").exists()
