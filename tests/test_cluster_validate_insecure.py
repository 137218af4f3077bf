"""Static preflight against insecure variants of the shipped cluster.yaml: each one must fail the
rule named beside it (offline, no AWS, no Ray cluster). The variants are what Ray's launcher
would really run: every command in a new shell, every ingress range as addresses."""

import copy
import os
import stat
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from cluster.checks import Laptop, Status
from cluster.config import load_and_prepare, load_cluster_yaml
from cluster.rules import auth_token, local_token, mlflow_auth
from cluster.validate import validate_cluster

CLUSTER_YAML = REPO / "cluster.yaml"
TOKEN = "9f8e7d6c5b4a39281706f5e4d3c2b1a0"  # what `ray get-auth-token --generate` writes: hex


def laptop(tmp_path):
    """An environment whose HOME holds the token and MLflow's login file, and no AWS credentials."""
    home = tmp_path / "home"
    for name in (".ray/auth_token", ".raytrain/mlflow-auth.ini"):
        (home / name).parent.mkdir(parents=True, exist_ok=True)
        (home / name).write_text("x\n")
        (home / name).chmod(stat.S_IRUSR | stat.S_IWUSR)
    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    env["HOME"] = str(home)
    return env


def validate_variant(tmp_path, mutate):
    config = copy.deepcopy(load_cluster_yaml(CLUSTER_YAML))
    mutate(config)
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(config))
    return {result.name: result for result in validate_cluster(path, env=laptop(tmp_path), live=False)}


def _node(c, name):
    return c["available_node_types"][name]["node_config"]


def _replace(c, key, index, old, new):
    assert old in c[key][index], (key, index, old)
    c[key][index] = c[key][index].replace(old, new)


def _open(c, low, high, *cidrs, protocol="tcp"):
    c["provider"]["security_group"]["IpPermissions"].append(
        {"IpProtocol": protocol, "FromPort": low, "ToPort": high,
         "IpRanges": [{"CidrIp": cidr} for cidr in cidrs if ":" not in cidr],
         "Ipv6Ranges": [{"CidrIpv6": cidr} for cidr in cidrs if ":" in cidr]})


def _imds_optional(c):
    _node(c, "head_cpu")["MetadataOptions"]["HttpTokens"] = "optional"


def _imds_absent(c):
    del _node(c, "gpu_ondemand")["MetadataOptions"]


def _auth_export_in_its_own_command(c):
    _replace(c, "head_start_ray_commands", 1, "export RAY_AUTH_MODE=token;", "")
    c["head_start_ray_commands"].insert(1, "export RAY_AUTH_MODE=token")


def _auth_unset_before_start(c):
    _replace(c, "worker_start_ray_commands", 1, "ray start", "unset RAY_AUTH_MODE; ray start")


def _auth_disabled_inline(c):
    _replace(c, "head_start_ray_commands", 1, "ray start", "RAY_AUTH_MODE=disabled ray start")


def _token_echoed_to_file(c):
    c["setup_commands"].append(f"mkdir -p ~/.ray && echo {TOKEN} > ~/.ray/auth_token")


def _token_in_docker_env(c):
    c["docker"]["run_options"].append(f"--env RAY_AUTH_TOKEN {TOKEN}")


def _token_assigned_in_command(c):
    _replace(c, "worker_start_ray_commands", 1, "ray start", f"RAY_AUTH_TOKEN='tok_{TOKEN}' ray start")


def _world_as_two_halves_on_ssh(c):
    c["provider"]["security_group"]["IpPermissions"][0]["IpRanges"] = [{"CidrIp": "0.0.0.0/1"},
                                                                      {"CidrIp": "128.0.0.0/1"}]


def _world_as_two_halves_on_all_ports(c):
    _open(c, -1, -1, "0.0.0.0/1", "128.0.0.0/1", protocol="-1")


def _worker_ports_open(c):
    _open(c, 10002, 19999, "0.0.0.0/0")


def _public_ipv6_block_open(c):
    _open(c, 0, 65535, "2000::/3")


def _mlflow_on_another_port_open(c):
    _replace(c, "head_start_ray_commands", 2, "--host $HEAD_IP --port 5000", "--host 0.0.0.0 --port 5001")
    _open(c, 5001, 5001, "0.0.0.0/0")


def _ebs_unencrypted(c):
    _node(c, "gpu_spot")["BlockDeviceMappings"][0]["Ebs"]["Encrypted"] = False


def _ebs_encryption_unsaid(c):
    del _node(c, "gpu_ondemand")["BlockDeviceMappings"][0]["Ebs"]["Encrypted"]


def _ebs_absent(c):
    del _node(c, "head_cpu")["BlockDeviceMappings"]


def _dashboard_on_all_interfaces_and_open(c):
    _replace(c, "head_start_ray_commands", 1, "--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0")
    _open(c, 8000, 9000, "0.0.0.0/0")


def _max_workers_absurd(c):
    c["max_workers"] = 1e9  # `max_workers: 1.0e+9` in YAML: a float Ray's schema lets through


INSECURE = {
    "imds_v1_optional": (_imds_optional, "imdsv2"),
    "imds_options_absent": (_imds_absent, "imdsv2"),
    "auth_export_in_its_own_command": (_auth_export_in_its_own_command, "auth_token"),
    "auth_unset_before_ray_start": (_auth_unset_before_start, "auth_token"),
    "auth_disabled_inline": (_auth_disabled_inline, "auth_token"),
    "token_echoed_to_auth_token": (_token_echoed_to_file, "auth_token"),
    "token_in_docker_env_option": (_token_in_docker_env, "auth_token"),
    "token_assigned_in_command": (_token_assigned_in_command, "auth_token"),
    "ssh_world_as_two_halves": (_world_as_two_halves_on_ssh, "ssh_cidr"),
    "all_ports_world_as_two_halves": (_world_as_two_halves_on_all_ports, "open_ports"),
    "worker_ports_open": (_worker_ports_open, "open_ports"),
    "public_ipv6_block_open": (_public_ipv6_block_open, "open_ports"),
    "mlflow_other_port_open": (_mlflow_on_another_port_open, "open_ports"),
    "ebs_unencrypted": (_ebs_unencrypted, "ebs_encryption"),
    "ebs_encryption_unsaid": (_ebs_encryption_unsaid, "ebs_encryption"),
    "ebs_mappings_absent": (_ebs_absent, "ebs_encryption"),
    "dashboard_all_interfaces_and_open": (_dashboard_on_all_interfaces_and_open, "bind_address"),
    "max_workers_absurd": (_max_workers_absurd, "worker_counts"),
}


@pytest.mark.parametrize("variant", sorted(INSECURE))
def test_each_insecure_variant_fails_its_rule(variant, tmp_path):
    mutate, rule = INSECURE[variant]
    results = validate_variant(tmp_path, mutate)
    assert rule in results and results[rule].status is Status.FAIL, [r.line() for r in results.values()]


def test_the_shipped_file_passes_with_the_laptop_files_present(tmp_path):
    results = validate_variant(tmp_path, lambda c: None)
    assert not [r.line() for r in results.values() if r.status is Status.FAIL]
    for name in ("auth_token", "local_token", "open_ports", "imdsv2", "ebs_encryption", "imds_hop_limit",
                 "mlflow_auth", "bind_address"):
        assert results[name].status is Status.PASS, results[name].line()


def test_messages_say_where_and_why(tmp_path):
    export_apart = validate_variant(tmp_path, _auth_export_in_its_own_command)["auth_token"].message
    assert "head_start_ray_commands[2]" in export_apart and "new shell" in export_apart
    mlflow = validate_variant(tmp_path, _mlflow_on_another_port_open)["open_ports"].message
    assert "5001 (MLflow)" in mlflow
    workers = validate_variant(tmp_path, _worker_ports_open)["open_ports"].message
    assert "10002-19999 (worker ports)" in workers
    absurd = validate_variant(tmp_path, _max_workers_absurd)["worker_counts"].message
    assert "max_workers is 1000000000.0" in absurd
    secret = validate_variant(tmp_path, _token_in_docker_env)["auth_token"].message
    assert TOKEN not in secret and "docker.run_options" in secret


@pytest.mark.parametrize("mutate, rule, words", [
    (lambda c: _replace(c, "head_start_ray_commands", 1, "--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0"),
     "bind_address", "0.0.0.0"),
    (lambda c: _replace(c, "head_start_ray_commands", 2, "--app-name basic-auth ", ""),
     "mlflow_auth", "without authentication"),
    (lambda c: _node(c, "head_cpu")["MetadataOptions"].update(HttpPutResponseHopLimit=1),
     "imds_hop_limit", "containers"),
    (lambda c: c.pop("docker"), "imds_hop_limit", "runs no containers"),
], ids=["dashboard_all_interfaces_closed_port", "mlflow_without_auth", "hop_limit_1_with_containers",
        "hop_limit_2_without_containers"])
def test_softer_findings_are_warnings(mutate, rule, words, tmp_path):
    result = validate_variant(tmp_path, mutate)[rule]
    assert result.status is Status.WARN and words in result.message, result.line()


def test_a_missing_laptop_token_says_what_to_run(tmp_path):
    env = laptop(tmp_path)
    (tmp_path / "home" / ".ray" / "auth_token").unlink()
    results = {r.name: r for r in validate_cluster(CLUSTER_YAML, env=env, live=False)}
    assert results["local_token"].status is Status.WARN
    assert "ray get-auth-token --generate" in results["local_token"].message


def test_laptop_files_are_facts_a_test_can_fake():
    _, prepared = load_and_prepare(CLUSTER_YAML)
    shared = Laptop(Path("/home/me"), file_mode=lambda path: 0o644)
    assert local_token(prepared, shared).status is Status.WARN and "chmod 600" in local_token(prepared, shared).message
    private = Laptop(Path("/home/me"), file_mode=lambda path: 0o600)
    assert local_token(prepared, private).status is Status.PASS
    assert mlflow_auth(prepared, private).status is Status.PASS
    inside = Laptop(Path("/home/me"), repo_root=Path("/home/me"), file_mode=lambda path: 0o600)
    assert auth_token(prepared, inside).status is Status.FAIL and mlflow_auth(prepared, inside).status is Status.FAIL


@pytest.mark.parametrize("source", ["./secrets/auth_token", "secrets/auth_token"])
def test_a_token_mounted_from_inside_the_repository_fails_before_the_file_exists(tmp_path, monkeypatch, source):
    """`ray up` runs from the repository's root: a relative token source is a file of the repository
    (shipped with it, or committed), wherever validate runs and whether or not the file is there yet."""
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    config = copy.deepcopy(load_cluster_yaml(CLUSTER_YAML))
    config["file_mounts"]["~/.ray/auth_token"] = source
    path = repo / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    env = laptop(tmp_path)
    for cwd in (repo, tmp_path / "elsewhere"):
        cwd.mkdir(exist_ok=True)
        monkeypatch.chdir(cwd)
        results = {result.name: result for result in validate_cluster(path, env=env, live=False)}
        assert not (repo / "secrets").exists()
        assert results["auth_token"].status is Status.FAIL, (cwd, results["auth_token"].line())
        assert "inside the repository" in results["auth_token"].message
    monkeypatch.chdir(tmp_path)
    config["file_mounts"]["~/.ray/auth_token"] = "~/.ray/auth_token"  # the shipped way: outside it
    path.write_text(yaml.safe_dump(config))
    assert {r.name: r for r in validate_cluster(path, env=env, live=False)}["auth_token"].status is Status.PASS
