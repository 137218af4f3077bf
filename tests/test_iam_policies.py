"""The instance-profile policies (cluster/iam/*.json) under the request contexts that matter, with
IAM's documented condition semantics (moto does not evaluate conditions): an explicit Deny wins;
a condition key absent from the request makes a positive operator false and a negated one true;
`...IfExists` is true when the key is absent; `ForAllValues` is true for an empty set; `Null`
tests presence. Check the same on a real account with `aws iam simulate-principal-policy` (see
README, "Security model")."""

import fnmatch
import json
from pathlib import Path

import pytest

IAM = Path(__file__).resolve().parent.parent / "cluster" / "iam"
BUCKET = "arn:aws:s3:::my-raytrain-runs"
INSTANCE = "arn:aws:ec2:us-west-2:123456789012:instance/i-0abc"


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
    match = fnmatch.fnmatchcase if operator.startswith("StringLike") or operator.startswith("StringNotLike") else str.__eq__
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
    return json.loads((IAM / name).read_text())


@pytest.mark.parametrize("name, key", [("head-policy.json", "mlflow/1/a/model.pt"), ("worker-policy.json", "runs/r/checkpoint-00000010/state.pt")])
def test_writes_without_an_encryption_header_are_allowed(name, key):
    # pyarrow and Ray Train send no SSE header: the bucket's default encryption applies.
    assert decide(policy(name), "s3:PutObject", f"{BUCKET}/{key}") == "allowed"
    assert decide(policy(name), "s3:PutObject", f"{BUCKET}/{key}",
                  {"s3:x-amz-server-side-encryption": "aws:kms"}) == "allowed"


@pytest.mark.parametrize("name, key", [("head-policy.json", "runs/x"), ("worker-policy.json", "runs/x")])
def test_a_write_asking_for_another_encryption_is_denied(name, key):
    assert decide(policy(name), "s3:PutObject", f"{BUCKET}/{key}",
                  {"s3:x-amz-server-side-encryption": "none"}) == "denied"


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
