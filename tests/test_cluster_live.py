"""Live AWS preflight and spot-price refresh against moto_server on loopback (boto3 honours
AWS_ENDPOINT_URL). Quota logic is tested with an injected quota value: moto's Service Quotas
answers "not available in the current Region", which validate must turn into a warning."""

import copy
import os
import subprocess
import sys

import boto3
import pytest
import yaml
from aws import s3_env
from conftest import REPO

from cluster.aws_checks import quota_decision, required_vcpus
from cluster.checks import Status
from cluster.config import load_and_prepare, load_cluster_yaml
from cluster.cost import node_costs, refresh_spot_prices
from cluster.prices import load_price_table
from cluster.validate import validate_cluster

REGION = "us-west-2"


@pytest.fixture(scope="module")
def aws(moto_endpoint):
    """moto_server with what cluster.yaml names: an AMI, both instance profiles, the bucket, and
    the security group pre-created with SSH from one CIDR only."""
    endpoint = moto_endpoint
    env = {**s3_env(endpoint), "AWS_DEFAULT_REGION": REGION, "AWS_REGION": REGION}
    session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION)
    clients = {name: session.client(name, endpoint_url=endpoint) for name in ("ec2", "iam", "s3")}
    ec2 = clients["ec2"]
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    for name in ("raytrain-head", "raytrain-worker"):
        clients["iam"].create_instance_profile(InstanceProfileName=name)
    clients["s3"].create_bucket(Bucket="my-raytrain-runs", CreateBucketConfiguration={"LocationConstraint": REGION})
    group = ec2.create_security_group(GroupName="raytrain-sg", Description="raytrain")["GroupId"]
    ec2.authorize_security_group_ingress(GroupId=group, IpPermissions=[
        {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "IpRanges": [{"CidrIp": "198.18.7.0/24"}]},
        {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group}]}])
    open_group = ec2.create_security_group(GroupName="raytrain-open-sg", Description="open")["GroupId"]
    ec2.authorize_security_group_ingress(GroupId=open_group, IpPermissions=[
        {"IpProtocol": "tcp", "FromPort": 8265, "ToPort": 8265, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}])
    yield {"env": env, "image": image, "endpoint": endpoint}


def variant(tmp_path, aws, mutate=lambda c: None):
    """cluster.yaml as shipped, with moto's AMI and a real (non-documentation) SSH CIDR."""
    config = copy.deepcopy(load_cluster_yaml(REPO / "cluster.yaml"))
    for spec in config["available_node_types"].values():
        spec["node_config"]["ImageId"] = aws["image"]
    config["provider"]["security_group"]["IpPermissions"][0]["IpRanges"] = [{"CidrIp": "198.18.7.0/24"}]
    mutate(config)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def validate_live(path, aws, quota=64.0):
    with pytest.MonkeyPatch.context() as patch:
        for key, value in aws["env"].items():
            patch.setenv(key, value)
        return validate_cluster(path, env=aws["env"], quota_lookup=lambda code: quota)


def by_name(results):
    return {result.name: result for result in results}


def run_cli(*args, env, tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **env, "HOME": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "cluster", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_good_config_passes_every_live_check(tmp_path, aws):
    results = by_name(validate_live(variant(tmp_path, aws), aws))
    assert not [r.line() for r in results.values() if r.status is Status.FAIL]
    for name in (f"ami:{aws['image']}", "offered:g5.xlarge", "offered:g5.2xlarge", "offered:m5.xlarge",
                 "spot_price:g5.xlarge", "vcpu_quota:G spot", "vcpu_quota:G on-demand",
                 "instance_profile:raytrain-head", "instance_profile:raytrain-worker",
                 "security_group:raytrain-sg", "bucket:my-raytrain-runs", "ssh_cidr"):
        assert results[name].status is Status.PASS, results[name].line()


def test_cli_against_moto_copes_with_service_quotas_being_unavailable(tmp_path, aws):
    done = run_cli("validate", str(variant(tmp_path, aws)), env=aws["env"], tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARN  vcpu_quota:G spot" in done.stdout and "could not be read" in done.stdout


@pytest.mark.parametrize("mutate, check", [
    (lambda c: c["available_node_types"]["gpu_spot"]["node_config"].update(ImageId="ami-0123456789abcdef0"),
     "ami:ami-0123456789abcdef0"),
    (lambda c: c["provider"].update(availability_zone="us-west-2d"), "offered:g5.xlarge"),
    (lambda c: c["available_node_types"]["gpu_spot"]["node_config"].update(InstanceType="g9.huge"), "offered:g9.huge"),
], ids=["ami_missing", "type_not_offered_in_zone", "unknown_type"])
def test_cli_fails_what_aws_does_not_have(tmp_path, aws, mutate, check):
    done = run_cli("validate", str(variant(tmp_path, aws, mutate)), env=aws["env"], tmp_path=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"FAIL  {check}" in done.stdout


@pytest.mark.parametrize("mutate, check", [
    (lambda c: c["available_node_types"]["gpu_spot"]["node_config"].update(IamInstanceProfile={"Name": "nope"}),
     "instance_profile:nope"),
    (lambda c: c["metadata"].update(storage_path="s3://no-such-bucket/runs"), "bucket:no-such-bucket"),
    (lambda c: c["provider"]["security_group"].update(GroupName="raytrain-open-sg"), "security_group:raytrain-open-sg"),
    (lambda c: [s["node_config"].update(KeyName="missing-key") for s in c["available_node_types"].values()],
     "key_pair:missing-key"),
], ids=["instance_profile_missing", "bucket_missing", "existing_group_opens_dashboard", "key_pair_missing"])
def test_live_checks_fail_missing_or_open_resources(tmp_path, aws, mutate, check):
    results = by_name(validate_live(variant(tmp_path, aws, mutate), aws))
    assert results[check].status is Status.FAIL, results[check].line()


def test_quota_too_small_fails_with_an_injected_quota(tmp_path, aws):
    # gpu_spot: 8 x g5.xlarge (4 vCPU) = 32 vCPU of G spot quota; 16 is not enough.
    results = by_name(validate_live(variant(tmp_path, aws), aws, quota=16.0))
    assert results["vcpu_quota:G spot"].status is Status.FAIL
    assert "16 vCPUs < 32" in results["vcpu_quota:G spot"].message
    assert results["vcpu_quota:G on-demand"].status is Status.FAIL  # 4 x g5.2xlarge = 32 vCPU


def test_quota_policy_arithmetic():
    _, config = load_and_prepare(REPO / "cluster.yaml")
    needed = required_vcpus(config, {"g5.xlarge": 4, "g5.2xlarge": 8, "m5.xlarge": 4})
    assert needed == {"L-3819A6DF": 32, "L-DB2E81BA": 32}  # head (m5) is not in a G/P quota
    assert quota_decision("L-3819A6DF", 32, 32.0).status is Status.PASS
    assert quota_decision("L-3819A6DF", 32, 31.0).status is Status.FAIL
    assert quota_decision("L-3819A6DF", 32, None, "NoSuchResourceException").status is Status.WARN


def test_spot_prices_refresh_from_spot_price_history(tmp_path, aws):
    _, config = load_and_prepare(REPO / "cluster.yaml")
    session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_ENDPOINT_URL", aws["endpoint"])
        spot = refresh_spot_prices(config, session)
    assert set(spot) == {"g5.xlarge"} and spot["g5.xlarge"] > 0  # moto's placeholder price
    costs, _ = node_costs(config, load_price_table(), spot)
    assert {c.node_type: c.usd_per_hour for c in costs}["gpu_spot"] == spot["g5.xlarge"]

    done = run_cli("cost", str(REPO / "cluster.yaml"), env=aws["env"], tmp_path=tmp_path)
    assert done.returncode == 0 and "spot from AWS spot price history" in done.stdout, done.stdout + done.stderr
