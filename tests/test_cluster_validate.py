"""Static preflight: Ray's own validator and this project's rules on the shipped cluster files and
on deliberately broken variants; exit codes through the real CLI. No AWS, no Ray cluster."""

import copy
import os
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

from cluster.checks import Status
from cluster.config import ConfigError, load_cluster_yaml, ray_prepare_and_validate
from cluster.network import exposure
from cluster.shell import exports_auth_token
from cluster.validate import validate_cluster

CLUSTER_YAML = REPO / "cluster.yaml"
ONPREM_YAML = REPO / "cluster" / "onprem.yaml"


def offline_env(tmp_path):
    """No AWS credentials anywhere (env, ~/.aws, an instance profile): live checks must be skipped."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    env["HOME"] = str(tmp_path)
    env["AWS_EC2_METADATA_DISABLED"] = "true"  # (on a machine with an instance profile)
    return env


def run_cli(*args, env):
    return subprocess.run([sys.executable, "-m", "cluster", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def write_variant(tmp_path, mutate, source=CLUSTER_YAML):
    config = copy.deepcopy(load_cluster_yaml(source))
    mutate(config)
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def statuses(results):
    return {result.name: result.status for result in results}


@pytest.mark.parametrize("path", [CLUSTER_YAML, ONPREM_YAML], ids=["aws", "onprem"])
def test_rays_own_validator_accepts_the_shipped_configs(path):
    prepared = ray_prepare_and_validate(load_cluster_yaml(path))
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("path", [CLUSTER_YAML, ONPREM_YAML], ids=["aws", "onprem"])
def test_shipped_configs_pass_every_static_rule(path, tmp_path):
    results = validate_cluster(path, env=offline_env(tmp_path))
    assert not [r for r in results if r.status is Status.FAIL], [r.line() for r in results]
    assert statuses(results)["aws_live"] is Status.SKIP


def _open_dashboard(c):
    c["provider"]["security_group"]["IpPermissions"].append(
        {"IpProtocol": "tcp", "FromPort": 8265, "ToPort": 8265, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]})


def _open_all_ipv6(c):
    c["provider"]["security_group"]["IpPermissions"].append({"IpProtocol": "-1", "Ipv6Ranges": [{"CidrIpv6": "::/0"}]})


def _auth_off(c):
    c["head_start_ray_commands"] = [cmd.replace("export RAY_AUTH_MODE=token;", "export RAY_AUTH_MODE=disabled;")
                                    for cmd in c["head_start_ray_commands"]]


def _auth_missing_on_workers(c):
    c["worker_start_ray_commands"] = [cmd.replace("export RAY_AUTH_MODE=token;", "")
                                      for cmd in c["worker_start_ray_commands"]]


def _no_gpu_type(c):
    for name in ("gpu_spot", "gpu_ondemand"):
        c["available_node_types"][name]["resources"] = {"CPU": 4}
        c["available_node_types"][name]["node_config"]["InstanceType"] = "m5.xlarge"


def _min_above_max(c):
    c["available_node_types"]["gpu_spot"].update(min_workers=3, max_workers=1)


def _head_with_gpu(c):
    c["available_node_types"]["head_cpu"]["resources"] = {"CPU": 4, "GPU": 1}


def _ssh_from_anywhere(c):
    c["provider"]["security_group"]["IpPermissions"][0]["IpRanges"] = [{"CidrIp": "0.0.0.0/0"}]


def _token_not_shipped(c):
    c["file_mounts"].pop("~/.ray/auth_token")


def _token_literal(c):
    c["worker_start_ray_commands"][1] = "export RAY_AUTH_TOKEN=abcdef0123456789; " + c["worker_start_ray_commands"][1]


def _no_storage(c):
    c["metadata"].pop("storage_path")


def _no_mlflow_uri_on_workers(c):
    c["worker_start_ray_commands"] = [cmd.replace("export MLFLOW_TRACKING_URI=http://$RAY_HEAD_IP:5000;", "")
                                      for cmd in c["worker_start_ray_commands"]]


BROKEN = {
    "open_dashboard_port": (_open_dashboard, "open_ports"),
    "all_ports_open_ipv6": (_open_all_ipv6, "open_ports"),
    "auth_disabled_on_head": (_auth_off, "auth_token"),
    "auth_missing_on_workers": (_auth_missing_on_workers, "auth_token"),
    "gpu_worker_type_missing": (_no_gpu_type, "gpu_worker_type"),
    "min_above_max": (_min_above_max, "worker_counts"),
    "head_with_gpu": (_head_with_gpu, "head_without_gpu"),
    "ssh_from_anywhere": (_ssh_from_anywhere, "ssh_cidr"),
    "token_not_shipped": (_token_not_shipped, "auth_token"),
    "token_literal_in_file": (_token_literal, "auth_token"),
    "no_run_storage": (_no_storage, "storage_tracking"),
    "no_mlflow_uri_on_workers": (_no_mlflow_uri_on_workers, "storage_tracking"),
}


@pytest.mark.parametrize("variant", sorted(BROKEN))
def test_each_broken_variant_fails_its_rule(variant, tmp_path):
    mutate, rule = BROKEN[variant]
    results = validate_cluster(write_variant(tmp_path, mutate), env=offline_env(tmp_path))
    assert statuses(results)[rule] is Status.FAIL, [r.line() for r in results]


def test_token_file_inside_the_repository_fails(tmp_path):
    (tmp_path / ".git").mkdir()  # the variant's directory is a repository
    path = write_variant(tmp_path, lambda c: c["file_mounts"].update({"~/.ray/auth_token": str(tmp_path / "token")}))
    results = validate_cluster(path, env=offline_env(tmp_path))
    assert statuses(results)["auth_token"] is Status.FAIL


def test_auth_export_must_come_before_ray_start():
    assert exports_auth_token("export RAY_AUTH_MODE=token; ray start --head")
    assert not exports_auth_token("ray start --head; export RAY_AUTH_MODE=token")
    assert not exports_auth_token("export RAY_AUTH_MODE=token; RAY_AUTH_MODE=disabled ray start --head")
    assert not exports_auth_token("ray start --head")


def test_exposure_policy_reads_port_ranges_and_sources():
    rules = [{"IpProtocol": "tcp", "FromPort": 5000, "ToPort": 9000, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]},
             {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "IpRanges": [{"CidrIp": "10.0.0.0/8"}]}]
    open_ray, ssh_world, ssh_sources = exposure(rules, mlflow_port=5000)
    # Plain `ray start` (Ray 2.60): the object manager and metrics ports are random, not in this range.
    assert open_ray == ["5000 (MLflow)", "6379 (GCS)", "8265 (dashboard)"]
    assert ssh_world == [] and ssh_sources == ["10.0.0.0/8"]


def test_cli_exit_codes(tmp_path):
    env = offline_env(tmp_path)
    ok = run_cli("validate", str(CLUSTER_YAML), env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "SKIP  aws_live" in ok.stdout and "0 failed" in ok.stdout

    broken = run_cli("validate", str(write_variant(tmp_path, _open_dashboard)), env=env)
    assert broken.returncode == 1 and "FAIL  open_ports" in broken.stdout and "8265 (dashboard)" in broken.stdout

    missing = run_cli("validate", str(tmp_path / "nope.yaml"), env=env)
    assert missing.returncode == 2 and "no such file" in missing.stderr

    (tmp_path / "bad.yaml").write_text("provider: [unclosed\n")
    not_yaml = run_cli("validate", str(tmp_path / "bad.yaml"), env=env)
    assert not_yaml.returncode == 2 and "not valid YAML" in not_yaml.stderr

    rejected = run_cli("validate", str(write_variant(tmp_path, lambda c: c.update(unknown_key=1))), env=env)
    assert rejected.returncode == 2 and "Ray rejects the config" in rejected.stderr


def test_ray_schema_errors_are_bad_input():
    with pytest.raises(ConfigError, match="Ray rejects"):
        ray_prepare_and_validate({"provider": {"type": "aws", "region": "us-west-2"},
                                  "available_node_types": {"x": {"node_config": {}}}, "head_node_type": "x"})


def test_cluster_imports_neither_training_nor_tuning():
    code = ("import sys, cluster.cli, cluster.validate, cluster.cost, cluster.rehearse, cluster.aws_facts; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('training', 'tuning')); "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("path", [CLUSTER_YAML, ONPREM_YAML], ids=["cluster.yaml", "onprem.yaml"])
def test_every_node_installs_what_pyproject_lists(path):
    """`ray job submit` runs `python -m training` on the head and the workers import the project
    there: each node needs every dependency pyproject.toml names, with the same version bounds
    (torch pinned, in the command before), and MLflow's login and NVML besides."""
    import shlex

    import tomllib
    from packaging.requirements import Requirement

    wanted = {Requirement(r).name: Requirement(r)
              for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    commands = yaml.safe_load(path.read_text())["setup_commands"]
    installed = {}
    for command in commands:
        words = shlex.split(command)
        if len(words) > 2 and words[0].endswith("pip") and words[1] == "install":
            installed.update({Requirement(w).name: Requirement(w) for w in words[2:] if not w.startswith("-")})
    assert set(wanted) <= set(installed), sorted(set(wanted) - set(installed))
    for name, requirement in wanted.items():
        assert (installed[name].specifier == requirement.specifier
                or str(installed[name].specifier).startswith("==")), name
        assert requirement.extras <= installed[name].extras, name
    assert "auth" in installed["mlflow"].extras and "nvidia-ml-py" in installed
