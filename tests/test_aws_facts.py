"""Whether a machine has AWS credentials, asked as boto3 asks: on the head node the only ones are
the instance profile's, served by the EC2 metadata service (here a fake IMDSv2 on loopback); off
EC2 the answer must come quickly, never a hang on a metadata address that does not answer."""

import socket
import time

import pytest

from aws import FakeImds, closed_port_url
from cluster.aws_facts import aws_credentials_source, has_aws_credentials


def bare_env(tmp_path, **extra) -> dict:
    """No keys, no profile, no ~/.aws: only what the test adds."""
    return {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", **extra}


@pytest.fixture
def imds_with_profile():
    server = FakeImds(role="raytrain-head")
    yield server
    server.close()


def test_the_instance_profile_is_found_through_imdsv2(tmp_path, imds_with_profile):
    env = bare_env(tmp_path, AWS_EC2_METADATA_SERVICE_ENDPOINT=imds_with_profile.url)
    assert aws_credentials_source(env) == "iam-role"
    assert has_aws_credentials(env)
    # Every GET carried a session token (HttpTokens: required): IMDSv1 would have been refused.
    assert imds_with_profile.puts >= 1 and imds_with_profile.unauthorized == 0


def test_an_instance_without_a_profile_has_no_credentials(tmp_path):
    server = FakeImds(role=None)
    try:
        assert not has_aws_credentials(bare_env(tmp_path, AWS_EC2_METADATA_SERVICE_ENDPOINT=server.url))
    finally:
        server.close()


def test_without_imds_the_answer_is_no_and_quick(tmp_path):
    started = time.monotonic()
    assert not has_aws_credentials(bare_env(tmp_path, AWS_EC2_METADATA_SERVICE_ENDPOINT=closed_port_url()))
    assert time.monotonic() - started < 10  # a child Python and boto3's import, nothing waited for


def test_a_metadata_address_that_never_answers_is_given_up_on_in_seconds(tmp_path):
    """A laptop off EC2 whose network drops packets to the metadata address: the probe's own
    timeouts (1 s, one try) win over the user's, here a minute."""
    with socket.socket() as silent:  # accepts connections, never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        env = bare_env(tmp_path, AWS_EC2_METADATA_SERVICE_ENDPOINT=f"http://127.0.0.1:{silent.getsockname()[1]}",
                       AWS_METADATA_SERVICE_TIMEOUT="60", AWS_METADATA_SERVICE_NUM_ATTEMPTS="3")
        started = time.monotonic()
        assert not has_aws_credentials(env)
        assert time.monotonic() - started < 12


def test_keys_profiles_and_shared_files_answer_without_a_probe(tmp_path):
    assert has_aws_credentials({"AWS_ACCESS_KEY_ID": "x", "HOME": str(tmp_path)})
    assert has_aws_credentials({"AWS_PROFILE": "dev", "HOME": str(tmp_path)})
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text("[default]\n")
    assert has_aws_credentials({"HOME": str(tmp_path)})


def test_metadata_turned_off_means_no_instance_profile(tmp_path, imds_with_profile):
    env = bare_env(tmp_path, AWS_EC2_METADATA_SERVICE_ENDPOINT=imds_with_profile.url, AWS_EC2_METADATA_DISABLED="true")
    assert not has_aws_credentials(env) and imds_with_profile.puts == 0
