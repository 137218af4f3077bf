"""Gathering what AWS knows about a cluster config, through boto3 (imported lazily).

This module only asks; cluster/aws_checks.py decides. boto3 honours AWS_ENDPOINT_URL, so the same
code runs against moto_server on loopback in tests."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from cluster.checks import instance_type, is_spot, zones
from cluster.shell import commands, flag_value

QuotaLookup = Callable[[str], "float | None"]


@dataclass(frozen=True)
class AwsFacts:
    region: str
    images: Mapping[str, bool] = field(default_factory=dict)           # AMI id -> exists
    vcpus: Mapping[str, int | None] = field(default_factory=dict)      # type -> vCPUs (None: unknown type)
    offerings: Mapping[str, frozenset] = field(default_factory=dict)   # type -> zones offering it
    spot_history: Mapping[str, int] = field(default_factory=dict)      # spot type -> price points seen
    quotas: Mapping[str, float | None] = field(default_factory=dict)   # quota code -> vCPUs (None: unreadable)
    quota_notes: Mapping[str, str] = field(default_factory=dict)
    instance_profiles: Mapping[str, bool] = field(default_factory=dict)
    key_pairs: Mapping[str, bool] = field(default_factory=dict)
    security_group: tuple | None = None                                # its IpPermissions; None: absent
    buckets: Mapping[str, str | None] = field(default_factory=dict)    # bucket -> error (None: reachable)


# Service Quotas codes (vCPUs) for the accelerated families: (family, market) -> code.
QUOTA_CODES = {("G", "on-demand"): "L-DB2E81BA", ("G", "spot"): "L-3819A6DF",
               ("P", "on-demand"): "L-417A185B", ("P", "spot"): "L-7212CCBC"}


# What botocore's own credential chain finds (environment, shared files, SSO, container, the EC2
# instance profile through IMDS), run in a child process: the chain reads the process environment,
# and `env` is the environment asked about. The metadata timeouts are set for the probe only, so a
# laptop without IMDS answers in about two seconds at most (one try of 1 s for the IMDSv2 token,
# one for the IMDSv1 fallback), whatever the user's own AWS_METADATA_SERVICE_* say.
_CREDENTIALS_PROBE = "import boto3; c = boto3.Session().get_credentials(); print(c.method if c else '')"
PROBE_METADATA_ENV = {"AWS_METADATA_SERVICE_TIMEOUT": "1", "AWS_METADATA_SERVICE_NUM_ATTEMPTS": "1"}
PROBE_TIMEOUT_S = 20.0  # the child's import of boto3 on a loaded machine included


def aws_credentials_source(env: Mapping[str, str] = os.environ) -> str | None:
    """Where boto3 would take credentials from under `env` (botocore's name for it: "env",
    "shared-credentials-file", "iam-role" for an instance profile, ...), or None: no credentials,
    a broken configuration, or a probe that did not answer in time."""

    try:
        done = subprocess.run([sys.executable, "-c", _CREDENTIALS_PROBE], env={**env, **PROBE_METADATA_ENV},
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def has_aws_credentials(env: Mapping[str, str] = os.environ) -> bool:
    """Credentials in the environment or a shared credentials file (answered without a probe), or
    anywhere else boto3's chain looks: on the head node that is the instance profile."""
    if env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_PROFILE"):
        return True
    shared = env.get("AWS_SHARED_CREDENTIALS_FILE") or str(Path(env.get("HOME", "~")).expanduser() / ".aws/credentials")
    return Path(shared).is_file() or aws_credentials_source(env) is not None


def quota_bucket(node_type: dict) -> str | None:
    """The Service Quotas code that caps this node type's vCPUs, for G and P families only."""
    name = (instance_type(node_type) or "").lower()
    family = "G" if name.startswith(("g", "vt")) else "P" if name.startswith("p") else None
    return QUOTA_CODES.get((family, "spot" if is_spot(node_type) else "on-demand")) if family else None


def storage_buckets(config: dict) -> list[str]:
    paths = [str((config.get("metadata") or {}).get("storage_path", "")),
             flag_value(commands(config, "head_start_ray_commands"), "--artifacts-destination") or ""]
    buckets = [path[len("s3://"):].split("/")[0] for path in paths if path.startswith("s3://")]
    return list(dict.fromkeys(bucket for bucket in buckets if bucket))


def _code(error: Exception) -> str:
    return str(getattr(error, "response", {}).get("Error", {}).get("Code", type(error).__name__))


def service_quota_lookup(session: Any, region: str) -> QuotaLookup:
    client = session.client("service-quotas", region_name=region)

    def lookup(code: str) -> float | None:
        return float(client.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
    return lookup


def current_spot_prices(ec2: Any, instance_type_name: str, zones=()) -> dict[str, float]:
    """zone -> the Linux/UNIX spot price in effect now for one instance type, in `zones` (default:
    every zone of the region). One history query from now on (StartTime=now: each zone's current
    price), for Linux/UNIX only, read to its last page: unfiltered, other operating systems and
    older points fill the first page and zones go missing."""

    query = {"InstanceTypes": [instance_type_name], "ProductDescriptions": ["Linux/UNIX", "Linux/UNIX (Amazon VPC)"],
             "StartTime": datetime.datetime.now(datetime.timezone.utc)}
    if zones:
        query["Filters"] = [{"Name": "availability-zone", "Values": sorted(zones)}]
    latest: dict[str, tuple] = {}
    for page in ec2.get_paginator("describe_spot_price_history").paginate(**query):
        for point in page["SpotPriceHistory"]:
            zone = point["AvailabilityZone"]
            if not point["ProductDescription"].startswith("Linux/UNIX") or (zones and zone not in zones):
                continue
            if zone not in latest or point["Timestamp"] > latest[zone][0]:
                latest[zone] = (point["Timestamp"], float(point["SpotPrice"]))
    return {zone: price for zone, (_, price) in latest.items()}


def gather_facts(config: dict, session: Any = None, quota_lookup: QuotaLookup | None = None) -> AwsFacts:
    """Ask AWS about every resource the config names. Errors that mean "not there" become facts;
    any other error (no network, access denied) propagates to the caller."""
    import boto3  # (lazy: boto3)
    from botocore.exceptions import ClientError  # (lazy: botocore)

    region = config["provider"]["region"]
    session = session or boto3.Session()
    ec2 = session.client("ec2", region_name=region)
    node_types = config.get("available_node_types", {}).values()
    types = sorted({instance_type(spec) for spec in node_types if instance_type(spec)})

    images = {}
    for image in sorted({spec["node_config"]["ImageId"] for spec in node_types if spec["node_config"].get("ImageId")}):
        try:
            images[image] = bool(ec2.describe_images(ImageIds=[image])["Images"])
        except ClientError as error:
            if not _code(error).startswith("InvalidAMIID"):
                raise
            images[image] = False

    vcpus, offerings = {}, {}
    for name in types:
        try:
            info = ec2.describe_instance_types(InstanceTypes=[name])["InstanceTypes"]
            vcpus[name] = int(info[0]["VCpuInfo"]["DefaultVCpus"]) if info else None
        except ClientError as error:
            if _code(error) != "InvalidInstanceType":
                raise
            vcpus[name] = None
        found = ec2.describe_instance_type_offerings(
            LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [name]}])
        offerings[name] = frozenset(offer["Location"] for offer in found["InstanceTypeOfferings"])

    spot_history = {}  # in the zones the cluster launches in (default: the region's), as refresh_spot_prices
    for name in sorted({instance_type(spec) for spec in node_types if is_spot(spec)}):
        spot_history[name] = len(current_spot_prices(ec2, name, set(zones(config))))

    quotas, notes = {}, {}
    lookup = quota_lookup or service_quota_lookup(session, region)
    for code in sorted({quota_bucket(spec) for spec in node_types} - {None}):
        try:
            quotas[code] = lookup(code)
        except Exception as error:  # moto and some regions answer "not available in the current Region"
            quotas[code], notes[code] = None, f"{_code(error)}: {str(error)[:120]}"

    iam = session.client("iam", region_name=region)
    profiles = {}
    for spec in node_types:
        profile = spec["node_config"].get("IamInstanceProfile") or {}
        name = profile.get("Name") or str(profile.get("Arn", "")).split("/")[-1]
        if name and name not in profiles:
            try:
                iam.get_instance_profile(InstanceProfileName=name)
                profiles[name] = True
            except ClientError as error:
                if _code(error) != "NoSuchEntity":
                    raise
                profiles[name] = False

    key_pairs = {}
    for name in sorted({spec["node_config"]["KeyName"] for spec in node_types if spec["node_config"].get("KeyName")}):
        try:
            key_pairs[name] = bool(ec2.describe_key_pairs(KeyNames=[name])["KeyPairs"])
        except ClientError as error:
            if not _code(error).startswith("InvalidKeyPair"):
                raise
            key_pairs[name] = False

    group_name = (config["provider"].get("security_group") or {}).get("GroupName")
    group = None
    if group_name:
        found = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": [group_name]}])["SecurityGroups"]
        group = tuple(found[0].get("IpPermissions", [])) if found else None

    s3 = session.client("s3", region_name=region)
    buckets = {}
    for bucket in storage_buckets(config):
        try:
            s3.head_bucket(Bucket=bucket)
            buckets[bucket] = None
        except ClientError as error:
            buckets[bucket] = _code(error)

    return AwsFacts(region=region, images=images, vcpus=vcpus, offerings=offerings, spot_history=spot_history,
                    quotas=quotas, quota_notes=notes, instance_profiles=profiles, key_pairs=key_pairs,
                    security_group=group, buckets=buckets)
