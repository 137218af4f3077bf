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


def test_the_spot_check_asks_for_current_linux_prices_in_the_configs_zones_only():
    """validate's spot_price check and `cost`'s refresh make the same query: Linux/UNIX, from now,
    in the cluster's zones, every page (checked by botocore's Stubber: moto ignores the filters)."""
    import boto3
    from botocore.stub import ANY, Stubber

    from cluster.aws_facts import gather_facts

    ec2 = boto3.client("ec2", region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x")

    class Session:  # gather_facts asks its session for clients; only EC2 is called for this config
        def client(self, name, region_name=None):
            return ec2 if name == "ec2" else boto3.client(name, region_name=region_name, aws_access_key_id="x",
                                                          aws_secret_access_key="x")

    config = {"provider": {"type": "aws", "region": "us-west-2", "availability_zone": "us-west-2a,us-west-2b"},
              "available_node_types": {"gpu_spot": {"node_config": {
                  "InstanceType": "g5.xlarge", "InstanceMarketOptions": {"MarketType": "spot"}}}}}
    point = {"AvailabilityZone": "us-west-2a", "SpotPrice": "0.4", "ProductDescription": "Linux/UNIX",
             "InstanceType": "g5.xlarge", "Timestamp": "2026-12-01T12:00:00Z"}
    with Stubber(ec2) as stub:
        stub.add_response("describe_instance_types", {"InstanceTypes": [
            {"InstanceType": "g5.xlarge", "VCpuInfo": {"DefaultVCpus": 4}}]}, {"InstanceTypes": ["g5.xlarge"]})
        stub.add_response("describe_instance_type_offerings", {"InstanceTypeOfferings": [
            {"InstanceType": "g5.xlarge", "Location": "us-west-2a", "LocationType": "availability-zone"}]},
            {"LocationType": "availability-zone", "Filters": [{"Name": "instance-type", "Values": ["g5.xlarge"]}]})
        stub.add_response("describe_spot_price_history", {"SpotPriceHistory": [point]}, {
            "InstanceTypes": ["g5.xlarge"], "ProductDescriptions": ["Linux/UNIX", "Linux/UNIX (Amazon VPC)"],
            "StartTime": ANY, "Filters": [{"Name": "availability-zone", "Values": ["us-west-2a", "us-west-2b"]}]})
        facts = gather_facts(config, Session(), quota_lookup=lambda code: 64.0)
        stub.assert_no_pending_responses()
    assert facts.spot_history == {"g5.xlarge": 1}
