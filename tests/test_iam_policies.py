"""The instance-profile policies (cluster/iam/*.json, ACCOUNT_ID filled in as users do) under the
request contexts that matter, with IAM's documented condition semantics (moto does not evaluate
conditions): an explicit Deny wins; a condition key absent from the request makes a positive
operator false and a negated one true; `...IfExists` is true when the key is absent;
`ForAllValues` is true for an empty set; `Null` tests presence; `Bool` compares case-insensitively.
A launch by the head's autoscaler is authorized per resource (instance, volume, image, subnet,
security group, ...), each with its own keys, as EC2 does for RunInstances. The policies are also
linted offline with cloudsplaining and parliament. Check the same on a real account with
`aws iam simulate-principal-policy` (see docs/clusters.md, "Security model")."""

import fnmatch
import json
import sys
from pathlib import Path

import pytest
import yaml

IAM = Path(__file__).resolve().parent.parent / "cluster" / "iam"
BUCKET = "arn:aws:s3:::my-raytrain-runs"
ACCOUNT, ACCOUNT_PLACEHOLDER = "123456789012", "ACCOUNT_ID"
INSTANCE = f"arn:aws:ec2:us-west-2:{ACCOUNT}:instance/i-0abc"


def _values(value) -> list:
    return value if isinstance(value, list) else [value]


def _condition_holds(operator: str, key: str, expected, context: dict) -> bool:
    present = key in context
    if operator == "Null":
        return (not present) == (str(expected).lower() == "true")
    if_exists = operator.endswith("IfExists")
    operator = operator.removesuffix("IfExists")
    if operator.startswith("ForAllValues:"):
        inner = operator.split(":", 1)[1]
        return all(_condition_holds(inner, key, expected, {key: v}) for v in _values(context.get(key, [])))
    negated = "Not" in operator
    if not present:
        return True if (if_exists or negated) else False
    if operator == "Bool":
        return any(str(v).lower() == str(e).lower() for v in _values(context[key]) for e in _values(expected))
    match = (fnmatch.fnmatchcase if operator.startswith("StringLike") or operator.startswith("StringNotLike")
             else str.__eq__)
    hit = any(match(str(v), str(e)) for v in _values(context[key]) for e in _values(expected))
    return not hit if negated else hit


def _statement_applies(statement: dict, action: str, resource: str, context: dict) -> bool:
    if not any(fnmatch.fnmatchcase(action, a) for a in _values(statement["Action"])):
        return False
    if not any(fnmatch.fnmatchcase(resource, r) for r in _values(statement["Resource"])):
        return False
    return all(_condition_holds(op, key, expected, context)
               for op, block in statement.get("Condition", {}).items() for key, expected in block.items())


def decide(policy: dict, action: str, resource: str, context: dict | None = None) -> str:
    applying = [s for s in policy["Statement"] if _statement_applies(s, action, resource, context or {})]
    if any(s["Effect"] == "Deny" for s in applying):
        return "denied"
    return "allowed" if any(s["Effect"] == "Allow" for s in applying) else "implicitly denied"


def policy(name: str) -> dict:
    """The policy as a user installs it: ACCOUNT_ID filled in (docs/clusters.md, "Before the first ray up")."""
    return json.loads((IAM / name).read_text().replace(ACCOUNT_PLACEHOLDER, ACCOUNT))


@pytest.mark.parametrize("name, key", [("head-policy.json", "mlflow/1/a/model.pt"),
                                       ("worker-policy.json", "runs/r/checkpoint-00000010/state.pt")])
def test_writes_without_an_encryption_header_are_allowed(name, key):
    # pyarrow and Ray Train send no SSE header: the bucket's default encryption applies.
    assert decide(policy(name), "s3:PutObject", f"{BUCKET}/{key}") == "allowed"
    assert decide(policy(name), "s3:PutObject", f"{BUCKET}/{key}",
                  {"s3:x-amz-server-side-encryption": "aws:kms"}) == "allowed"


@pytest.mark.parametrize("name, key", [("head-policy.json", "runs/x"), ("worker-policy.json", "runs/x")])
def test_a_write_asking_for_another_encryption_is_denied(name, key):
    assert decide(policy(name), "s3:PutObject", f"{BUCKET}/{key}",
                  {"s3:x-amz-server-side-encryption": "none"}) == "denied"


@pytest.mark.parametrize("name", ["head-policy.json", "worker-policy.json"])
def test_the_bucket_region_can_be_read(name):
    # GetBucketLocation has no s3:prefix key: under ListBucket's prefix condition it was never allowed.
    assert decide(policy(name), "s3:GetBucketLocation", BUCKET) == "allowed"
    assert decide(policy(name), "s3:ListBucket", BUCKET, {"s3:prefix": "runs/r/"}) == "allowed"
    assert decide(policy(name), "s3:ListBucket", BUCKET, {"s3:prefix": "secrets/"}) != "allowed"


def test_workers_reach_only_runs():
    assert decide(policy("worker-policy.json"), "s3:PutObject", f"{BUCKET}/mlflow/x") != "allowed"


def test_the_head_tags_instances_only_at_launch_as_this_cluster():
    head = policy("head-policy.json")
    launch = {"ec2:CreateAction": "RunInstances", "aws:RequestTag/ray-cluster-name": "raytrain",
              "aws:TagKeys": ["ray-cluster-name", "ray-node-type"]}
    assert decide(head, "ec2:CreateTags", INSTANCE, launch) == "allowed"
    # Launching an instance tagged as another cluster, or untagged, is not tagging at launch.
    assert decide(head, "ec2:CreateTags", INSTANCE, {**launch, "aws:RequestTag/ray-cluster-name": "other"}) != "allowed"
    assert decide(head, "ec2:CreateTags", INSTANCE, {"ec2:CreateAction": "RunInstances"}) != "allowed"


def test_the_head_cannot_adopt_a_foreign_instance_and_then_terminate_it():
    head = policy("head-policy.json")
    foreign = {"aws:RequestTag/ray-cluster-name": "raytrain", "aws:TagKeys": ["ray-cluster-name"]}
    assert decide(head, "ec2:CreateTags", INSTANCE, foreign) != "allowed"
    assert decide(head, "ec2:TerminateInstances", INSTANCE) != "allowed"
    assert decide(head, "ec2:TerminateInstances", INSTANCE, {"ec2:ResourceTag/ray-cluster-name": "other"}) != "allowed"


def test_the_head_updates_its_own_nodes_tags_but_never_their_cluster_name():
    head = policy("head-policy.json")
    mine = {"ec2:ResourceTag/ray-cluster-name": "raytrain"}
    # The autoscaler's node-status updates (AWSNodeProvider.set_node_tags -> create_tags).
    assert decide(head, "ec2:CreateTags", INSTANCE, {**mine, "aws:TagKeys": ["ray-node-status"]}) == "allowed"
    assert decide(head, "ec2:CreateTags", INSTANCE, {**mine, "aws:TagKeys": ["ray-cluster-name"]}) != "allowed"
    assert decide(head, "ec2:TerminateInstances", INSTANCE, mine) == "allowed"


def test_the_evaluator_reads_absent_keys_as_iam_does():
    assert _condition_holds("StringNotEqualsIfExists", "k", ["a"], {}) is True
    assert _condition_holds("StringNotEquals", "k", ["a"], {}) is True
    assert _condition_holds("StringEquals", "k", ["a"], {}) is False
    assert _condition_holds("Null", "k", "false", {}) is False and _condition_holds("Null", "k", "true", {}) is True
    assert _condition_holds("ForAllValues:StringNotEquals", "k", ["a"], {}) is True
    assert _condition_holds("ForAllValues:StringNotEquals", "k", ["a"], {"k": ["b", "a"]}) is False


# ---------------------------------------------------------------- launches by the head's autoscaler

CLUSTER_YAML = Path(__file__).resolve().parent.parent / "cluster.yaml"
CLUSTER = "raytrain"
DLAMI_OWNER = "amazon"  # ImageOwnerAlias of the Deep Learning AMIs (owner id 898082745236)
OURS = {"ec2:ResourceTag/ray-cluster-name": CLUSTER}
VOLUME_TAGS = {"ResourceType": "volume", "Tags": [{"Key": "ray-cluster-name", "Value": CLUSTER}]}


def arn(kind: str, name: str, account: str = ACCOUNT) -> str:
    return f"arn:aws:ec2:us-west-2:{account}:{kind}/{name}"


def _request_tags(tags: dict) -> dict:
    if not tags:
        return {}
    return {**{f"aws:RequestTag/{key}": value for key, value in tags.items()}, "aws:TagKeys": list(tags)}


def _tag_spec(node_config: dict, resource_type: str) -> dict:
    return {tag["Key"]: tag["Value"] for spec in node_config.get("TagSpecifications", [])
            if spec["ResourceType"] == resource_type for tag in spec["Tags"]}


def run_instances(node_config: dict, image_owner: str = DLAMI_OWNER, subnet: dict = OURS, group: dict = OURS
                  ) -> list[tuple[str, dict]]:
    """Each resource one RunInstances call of Ray's AWS node provider is authorized on, with its
    request context. The instance carries ray-cluster-name plus the config's instance tags
    (AWSNodeProvider._create_node); volumes only what the config's volume TagSpecifications say."""
    instance = {"ec2:InstanceType": node_config["InstanceType"],
                **_request_tags({**_tag_spec(node_config, "instance"), "ray-cluster-name": CLUSTER})}
    tokens = (node_config.get("MetadataOptions") or {}).get("HttpTokens")
    if tokens is not None:
        instance["ec2:MetadataHttpTokens"] = tokens
    requests = [(arn("instance", "*"), instance), (f"arn:aws:ec2:us-west-2::image/{node_config['ImageId']}",
                                                   {"ec2:Owner": image_owner}),
                (arn("subnet", "subnet-0abc"), subnet), (arn("security-group", "sg-0abc"), group),
                (arn("network-interface", "*"), {})]
    for mapping in node_config.get("BlockDeviceMappings", []):
        volume = _request_tags(_tag_spec(node_config, "volume"))
        if "Encrypted" in mapping.get("Ebs", {}):
            volume["ec2:Encrypted"] = str(mapping["Ebs"]["Encrypted"]).lower()
        requests.append((arn("volume", "*"), volume))
    if (node_config.get("InstanceMarketOptions") or {}).get("MarketType") == "spot":
        requests.append((arn("spot-instances-request", "*"), {}))
    return requests


def launch(node_config: dict, **where) -> str:
    """"allowed", or what denies the launch: the first resource the head may not use."""
    head = policy("head-policy.json")
    for resource, context in run_instances(node_config, **where):
        decision = decide(head, "ec2:RunInstances", resource, context)
        if decision != "allowed":
            return f"{decision}: {resource.split(':')[-1].split('/')[0]}"
    return "allowed"


def worker_node_configs() -> dict[str, dict]:
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    return {name: spec["node_config"] for name, spec in config["available_node_types"].items()
            if name != config["head_node_type"]}


def tagged_volumes(node_config: dict) -> dict:
    return {**node_config, "TagSpecifications": [*node_config.get("TagSpecifications", []), VOLUME_TAGS]}


GOOD = tagged_volumes({"InstanceType": "g5.xlarge", "ImageId": "ami-0a2b85e15b7c0ac34",
                       "InstanceMarketOptions": {"MarketType": "spot"},
                       "BlockDeviceMappings": [{"DeviceName": "/dev/sda1",
                                                "Ebs": {"VolumeSize": 150, "Encrypted": True}}],
                       "MetadataOptions": {"HttpTokens": "required", "HttpPutResponseHopLimit": 2}})


@pytest.mark.parametrize("node_type", sorted(worker_node_configs()))
def test_the_launches_cluster_yaml_makes_are_allowed(node_type):
    node_config = worker_node_configs()[node_type]
    assert _tag_spec(node_config, "volume"), (f"cluster.yaml's {node_type} must tag its volumes at launch: "
                                              "its node_config needs TagSpecifications [{ResourceType: volume, "
                                              "Tags: [{Key: ray-cluster-name, Value: raytrain}]}]")
    assert launch(node_config) == "allowed"


def test_the_policy_launches_exactly_cluster_yaml_worker_types():
    allowed = next(s for s in policy("head-policy.json")["Statement"] if "ec2:InstanceType" in str(s.get("Condition")))
    types = allowed["Condition"]["StringEquals"]["ec2:InstanceType"]
    assert sorted(types) == sorted({config["InstanceType"] for config in worker_node_configs().values()})


def test_a_launch_without_imdsv2_is_denied():
    assert launch({**GOOD, "MetadataOptions": {"HttpTokens": "optional"}}) == "denied: instance"
    assert launch({key: value for key, value in GOOD.items() if key != "MetadataOptions"}) == "denied: instance"


@pytest.mark.parametrize("ebs", [{"VolumeSize": 150, "Encrypted": False}, {"VolumeSize": 150}], ids=["false", "unset"])
def test_a_launch_with_an_unencrypted_volume_is_denied(ebs):
    verdict = launch({**GOOD, "BlockDeviceMappings": [{"DeviceName": "/dev/sda1", "Ebs": ebs}]})
    assert verdict.endswith(": volume") and verdict != "allowed"


def test_a_launch_from_a_foreign_ami_is_denied():
    assert launch(GOOD, image_owner="aws-marketplace") == "implicitly denied: image"
    assert launch(GOOD, image_owner="210987654321") == "implicitly denied: image"
    assert launch(GOOD, image_owner="898082745236") == "allowed"  # the DLAMI owner by its account id


def test_a_launch_outside_the_clusters_subnet_or_group_is_denied():
    assert launch(GOOD, subnet={}) == "implicitly denied: subnet"
    assert launch(GOOD, subnet={"ec2:ResourceTag/ray-cluster-name": "other"}) == "implicitly denied: subnet"
    assert launch(GOOD, group={"ec2:ResourceTag/ray-cluster-name": "other"}) == "implicitly denied: security-group"


def test_a_launch_not_tagged_as_this_cluster_is_denied():
    untagged_volume = {**GOOD, "TagSpecifications": []}
    assert launch(untagged_volume) == "implicitly denied: volume"
    other = {**GOOD, "TagSpecifications": [{"ResourceType": "volume",
                                            "Tags": [{"Key": "ray-cluster-name", "Value": "other"}]}]}
    assert launch(other) == "implicitly denied: volume"
    assert launch({**GOOD, "InstanceType": "p5.48xlarge"}) == "implicitly denied: instance"


def test_resources_in_another_account_are_not_granted():
    head = policy("head-policy.json")
    context = run_instances(GOOD)[0][1]
    assert decide(head, "ec2:RunInstances", arn("instance", "*", "210987654321"), context) != "allowed"
    assert decide(head, "ec2:TerminateInstances", arn("instance", "i-0abc", "210987654321"), OURS) != "allowed"


def test_allows_name_the_account_placeholder_never_any_account():
    """Users fill ACCOUNT_ID in (README); an Allow over every account (`arn:aws:ec2:*:*:`) is gone.
    Denies may stay account-wide: they must hold even before the placeholder is filled in."""
    for path in sorted(IAM.glob("*-policy.json")):
        for statement in json.loads(path.read_text())["Statement"]:
            for resource in _values(statement["Resource"]):
                account = resource.split(":")[4] if resource.startswith("arn:aws:") else ""
                if statement["Effect"] == "Allow" and resource != "*":
                    assert account in ("", ACCOUNT_PLACEHOLDER), (path.name, statement["Sid"], resource)


# ---------------------------------------------------------------- IAM linters (offline, test extras)

def installed_policies() -> dict[str, str]:
    """The identity policies as installed (ACCOUNT_ID filled in); the trust policy is no identity
    policy (a Principal, no Resource) and is left out."""
    return {path.name: path.read_text().replace(ACCOUNT_PLACEHOLDER, ACCOUNT)
            for path in sorted(IAM.glob("*-policy.json"))}


def test_cloudsplaining_finds_nothing_above_low():
    """cloudsplaining (Salesforce) with its default exclusions flags actions allowed without a
    resource constraint or condition. Its strict mode also flags constrained statements; accepted
    there: s3:GetObject (only the bucket's runs/ and mlflow/ prefixes) and iam:PassRole (only the
    worker role, only to EC2), which the autoscaler needs to launch workers."""
    pytest.importorskip("cloudsplaining")
    from cloudsplaining.command.scan_policy_file import scan_policy
    from cloudsplaining.shared.constants import DEFAULT_EXCLUSIONS_CONFIG

    for name, text in installed_policies().items():
        results = scan_policy(json.loads(text), DEFAULT_EXCLUSIONS_CONFIG)
        above_low = {kind: found["findings"] for kind, found in results.items()
                     if isinstance(found, dict) and found.get("findings") and found.get("severity") != "low"}
        assert above_low == {}, (name, above_low)


def _parliament(monkeypatch):
    """parliament 1.6.4 imports pkg_resources, which setuptools 81 removed: its two calls are
    resource_filename, given here from importlib.resources when pkg_resources is missing."""
    try:
        import pkg_resources  # noqa: F401
    except ImportError:
        import importlib.resources
        import types

        shim = types.ModuleType("pkg_resources")
        shim.resource_filename = lambda package, name: str(importlib.resources.files(package) / name)
        monkeypatch.setitem(sys.modules, "pkg_resources", shim)
    return pytest.importorskip("parliament")


# parliament's findings that are accepted, and why:
#  RESOURCE_MISMATCH: RunInstances is split into one statement per resource type so that each
#    carries its own conditions (AWS's documented pattern); parliament wants every statement to
#    name all of the action's resource types (duo-labs/parliament#3, open).
#  PERMISSIONS_MANAGEMENT_ACTIONS, PRIVILEGE_ESCALATION (CreateEC2WithExistingIP): the autoscaler
#    launches workers with the worker role; iam:PassRole names that role only, to EC2 only.
PARLIAMENT_ACCEPTED = {
    "head-policy.json": {"RESOURCE_MISMATCH", "PERMISSIONS_MANAGEMENT_ACTIONS", "PRIVILEGE_ESCALATION"},
    "worker-policy.json": set()}


def test_parliament_finds_only_the_accepted_findings(monkeypatch):
    """parliament (Duo Labs) checks every action, resource ARN and condition key against AWS's
    IAM definitions: a misspelt key, or one that the action does not know, is a finding."""
    parliament = _parliament(monkeypatch)
    for name, text in installed_policies().items():
        findings = parliament.analyze_policy_string(text, include_community_auditors=True).findings
        assert {finding.issue for finding in findings} <= PARLIAMENT_ACCEPTED[name], (
            name, [(f.issue, f.detail) for f in findings if f.issue not in PARLIAMENT_ACCEPTED[name]])


def test_parliament_would_catch_a_condition_key_the_action_does_not_have(monkeypatch):
    parliament = _parliament(monkeypatch)
    misspelt = installed_policies()["head-policy.json"].replace("ec2:MetadataHttpTokens", "ec2:MetadataHttpToken", 1)
    assert "UNKNOWN_CONDITION_FOR_ACTION" in {f.issue for f in parliament.analyze_policy_string(misspelt).findings}
