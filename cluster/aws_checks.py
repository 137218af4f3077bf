"""Live AWS checks as pure decisions over AwsFacts (gathered by cluster/aws_facts.py)."""

from __future__ import annotations

from cluster.aws_facts import AwsFacts, quota_bucket
from cluster.checks import CheckResult, failed, instance_type, passed, warned, zones
from cluster.network import exposure, listeners, mlflow_port

QUOTA_NAMES = {"L-DB2E81BA": "G on-demand", "L-3819A6DF": "G spot",
               "L-417A185B": "P on-demand", "L-7212CCBC": "P spot"}


def live_checks(config: dict, facts: AwsFacts) -> list[CheckResult]:
    return [*image_checks(facts), *offering_checks(config, facts), *spot_history_checks(facts),
            *quota_checks(config, facts), *profile_and_key_checks(facts),
            security_group_check(config, facts), *bucket_checks(facts)]


def image_checks(facts: AwsFacts) -> list[CheckResult]:
    return [passed(f"ami:{image}", f"exists in {facts.region}") if exists else
            failed(f"ami:{image}", f"not found in {facts.region}: use an AMI of this region "
                   "(AMI ids differ per region)")
            for image, exists in sorted(facts.images.items())]


def offering_checks(config: dict, facts: AwsFacts) -> list[CheckResult]:
    listed = zones(config)
    results = []
    for name, offered in sorted(facts.offerings.items()):
        check = f"offered:{name}"
        if facts.vcpus.get(name) is None:
            results.append(failed(check, f"{name} is not an instance type in {facts.region}"))
            continue
        missing = [zone for zone in listed if zone not in offered]
        if listed and len(missing) == len(listed):
            results.append(failed(check, f"not offered in {', '.join(listed)}; offered in "
                                  f"{', '.join(sorted(offered)) or 'no zone of ' + facts.region}"))
        elif missing:
            results.append(warned(check, f"not offered in {', '.join(missing)}: launches there fail; drop the zone"))
        else:
            results.append(passed(check, f"offered in {', '.join(listed) or 'the region'}"))
    return results


def spot_history_checks(facts: AwsFacts) -> list[CheckResult]:
    return [passed(f"spot_price:{name}", f"a current spot price in {points} zone(s)") if points else
            warned(f"spot_price:{name}", "no spot price history: spot capacity may be unavailable here")
            for name, points in sorted(facts.spot_history.items())]


def required_vcpus(config: dict, vcpus: dict) -> dict[str, int]:
    """vCPUs each G/P quota must allow when every node type runs at max_workers (head: 1)."""
    head = config.get("head_node_type")
    needed: dict[str, int] = {}
    for name, spec in config.get("available_node_types", {}).items():
        code = quota_bucket(spec)
        count = 1 if name == head else int(spec.get("max_workers", 0))
        if code and vcpus.get(instance_type(spec)):
            needed[code] = needed.get(code, 0) + count * int(vcpus[instance_type(spec)])
    return needed


def quota_decision(code: str, required: int, quota: float | None, note: str = "") -> CheckResult:
    """The vCPU quota policy: the quota must cover every node of its family at max_workers."""
    check = f"vcpu_quota:{QUOTA_NAMES.get(code, code)}"
    if quota is None:
        return warned(check, f"quota {code} could not be read ({note or 'unknown'}): check it in the Service "
                      f"Quotas console; {required} vCPUs needed at max_workers")
    if quota < required:
        return failed(check, f"quota {quota:g} vCPUs < {required} needed at max_workers: request an increase "
                      f"({code}) or lower max_workers")
    return passed(check, f"quota {quota:g} vCPUs >= {required} needed at max_workers")


def quota_checks(config: dict, facts: AwsFacts) -> list[CheckResult]:
    needed = required_vcpus(config, dict(facts.vcpus))
    return [quota_decision(code, needed.get(code, 0), quota, facts.quota_notes.get(code, ""))
            for code, quota in sorted(facts.quotas.items())]


def profile_and_key_checks(facts: AwsFacts) -> list[CheckResult]:
    profiles = [passed(f"instance_profile:{name}", "exists") if exists else
                failed(f"instance_profile:{name}", "not found: create it with cluster/iam/ (docs/clusters.md)")
                for name, exists in sorted(facts.instance_profiles.items())]
    keys = [passed(f"key_pair:{name}", "exists") if exists else
            failed(f"key_pair:{name}", f"not found in {facts.region}: import it or fix KeyName")
            for name, exists in sorted(facts.key_pairs.items())]
    return profiles + keys


def security_group_check(config: dict, facts: AwsFacts) -> CheckResult:
    name = (config["provider"].get("security_group") or {}).get("GroupName", "ray-autoscaler-<cluster>")
    check = f"security_group:{name}"
    if facts.security_group is None:
        return warned(check, "does not exist yet: Ray will create it and add SSH from 0.0.0.0/0; pre-create "
                      "it with only your SSH rule (docs/clusters.md)")
    open_ray, ssh_world, _ = exposure(list(facts.security_group), mlflow_port(config), listeners(config))
    if open_ray or ssh_world:
        return failed(check, f"open to the internet: {', '.join(open_ray + ['22 (SSH)'] * bool(ssh_world))}")
    if not any(rule.get("UserIdGroupPairs") for rule in facts.security_group):
        return warned(check, "no rule for traffic between cluster nodes: Ray reuses the group as it is; "
                      "add all traffic from the group itself")
    return passed(check, "exists; nothing open to the internet")


def bucket_checks(facts: AwsFacts) -> list[CheckResult]:
    return [passed(f"bucket:{bucket}", "reachable") if error is None else
            failed(f"bucket:{bucket}", f"not reachable ({error}): create it or fix the name")
            for bucket, error in sorted(facts.buckets.items())]
