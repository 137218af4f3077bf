"""Azure preflight and cost: Ray's schema and this project's rules on cluster/azure.yaml and on
broken or insecure copies of it (each rule fails its own copy), the live checks' verdicts on
gathered facts, the `SKIP azure_live` path, and `cost` through the real CLI. No Azure, no Ray."""

import copy
import os
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

from cluster.azure_live import AzureFacts, VmSku, azure_live_results, live_checks, parse_skus
from cluster.azure_rules import as_ip_permissions
from cluster.checks import Status
from cluster.config import load_cluster_yaml, ray_prepare_and_validate
from cluster.prices import load_price_table
from cluster.validate import validate_cluster

AZURE_YAML = REPO / "cluster" / "azure.yaml"


def offline_env(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AWS_", "AZURE_"))}
    env["HOME"] = str(tmp_path)
    return env


def write_variant(tmp_path, mutate):
    config = copy.deepcopy(load_cluster_yaml(AZURE_YAML))
    mutate(config)
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def by_name(results):
    return {result.name: result for result in results}


def run_cli(*args, env):
    return subprocess.run([sys.executable, "-m", "cluster", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_shipped_azure_config_passes_rays_schema_and_every_rule(tmp_path):
    prepared = ray_prepare_and_validate(load_cluster_yaml(AZURE_YAML))
    assert prepared["provider"]["type"] == "azure"
    results = by_name(validate_cluster(AZURE_YAML, env=offline_env(tmp_path)))
    assert not [r.line() for r in results.values() if r.status is Status.FAIL]
    for rule in ("azure_provider", "vm_sizes", "gpu_worker_type", "head_without_gpu", "spot_fallback", "zones",
                 "cache_stopped_nodes", "auth_token", "open_ports", "bind_address", "managed_identity",
                 "storage_tracking", "azure_secrets", "pinned_image"):
        assert results[rule].status is Status.PASS, results[rule].line()


def _gpu(c, name):
    return c["available_node_types"][name]["node_config"]["azure_arm_parameters"]


def _replace_in_commands(key, old, new):
    def mutate(c):
        c[key] = [command.replace(old, new) for command in c[key]]
    return mutate


def _append_rule(rule):
    return lambda c: c["metadata"]["network_security_group"]["security_rules"].append(rule)


BROKEN = {
    # name: (mutation, rule, words its message must hold)
    "no_resource_group": (lambda c: c["provider"].pop("resource_group"), "azure_provider", "provider.resource_group"),
    "no_location": (lambda c: c["provider"].pop("location"), "azure_provider", "provider.location"),
    "worker_without_vm_size": (lambda c: _gpu(c, "gpu_spot").pop("vmSize"), "vm_sizes", "gpu_spot"),
    "spot_without_max_price": (lambda c: _gpu(c, "gpu_spot").pop("billingProfile"), "spot_fallback",
                               "billingProfile.maxPrice"),
    "spot_deallocated": (lambda c: _gpu(c, "gpu_spot").update(evictionPolicy="Deallocate"), "spot_fallback",
                         "evictionPolicy: Delete"),
    "cache_stopped_nodes_unstated": (lambda c: c["provider"].pop("cache_stopped_nodes"), "cache_stopped_nodes",
                                     "state provider.cache_stopped_nodes"),
    "no_gpu_type": (lambda c: [c["available_node_types"].pop(n) for n in ("gpu_spot", "gpu_ondemand")],
                    "gpu_worker_type", "no worker type offers a GPU"),
    "head_with_gpu": (lambda c: c["available_node_types"]["head_cpu"]["resources"].update(GPU=1),
                      "head_without_gpu", "the head offers 1 GPU"),
    "max_workers_absurd": (lambda c: c.update(max_workers=10**9), "worker_counts", "max_workers is 1000000000"),
    "auth_off_on_workers": (_replace_in_commands("worker_start_ray_commands", "export RAY_AUTH_MODE=token;", ""),
                            "auth_token", "worker_start_ray_commands[1]"),
    "mlflow_port_open": (_append_rule({"name": "mlflow", "priority": 900, "direction": "Inbound", "access": "Allow",
                                       "protocol": "Tcp", "source_address_prefix": "Internet",
                                       "destination_port_range": "5000"}), "open_ports", "5000 (MLflow)"),
    "ray_ports_open_any": (_append_rule({"name": "all", "priority": 901, "direction": "Inbound", "access": "Allow",
                                         "protocol": "*", "source_address_prefix": "*",
                                         "destination_port_range": "*"}), "open_ports", "6379 (GCS)"),
    "ssh_from_anywhere": (lambda c: c["metadata"]["network_security_group"]["security_rules"][0].update(
        source_address_prefix="*"), "ssh_cidr", "SSH open to 0.0.0.0/0"),
    "dashboard_open_to_the_internet": (lambda c: [
        _replace_in_commands("head_start_ray_commands", "--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0")(c),
        _append_rule({"name": "dash", "priority": 902, "direction": "Inbound", "access": "Allow", "protocol": "Tcp",
                      "source_address_prefix": "0.0.0.0/0", "destination_port_range": "8000-9000"})(c)],
        "bind_address", "remote code execution"),
    "no_managed_identity": (lambda c: c["provider"].pop("msi_name"), "managed_identity", "provider.msi_name"),
    "storage_on_s3": (lambda c: c["metadata"].update(storage_path="s3://bucket/runs"), "storage_tracking",
                      "is not Azure Blob storage"),
    "storage_az_scheme": (lambda c: c["metadata"].update(storage_path="az://runs/runs"), "storage_tracking",
                          "does not read az://"),
    "storage_key_in_uri": (lambda c: c["metadata"].update(
        storage_path="abfs://runs@acct.dfs.core.windows.net/runs?account_key=c2VjcmV0c2VjcmV0"), "storage_tracking",
        "carries a credential"),
    "mlflow_artifacts_not_blob": (_replace_in_commands(
        "head_start_ray_commands", "wasbs://mlflow@raytrainruns.blob.core.windows.net/mlflow", "/tmp/artifacts"),
        "storage_tracking", "--artifacts-destination"),
    "storage_key_inlined": (lambda c: c["setup_commands"].append("export AZURE_STORAGE_KEY=c2VjcmV0c2VjcmV0"),
                            "azure_secrets", "AZURE_STORAGE_KEY=<literal>"),
    "sas_token_inlined": (lambda c: c["setup_commands"].append(
        "azcopy copy 'https://acct.blob.core.windows.net/runs?sv=2022-11-02&sig=abcdefghijklmnopqrstuv%3D' ."),
        "azure_secrets", "a SAS token"),
    "connection_string_inlined": (lambda c: c["metadata"].update(
        conn="DefaultEndpointsProtocol=https;AccountName=a;AccountKey=c2VjcmV0;"), "azure_secrets",
        "a storage account key"),
    "mlflow_without_auth": (_replace_in_commands("head_start_ray_commands", "--app-name basic-auth ", ""),
                            "mlflow_auth", "without authentication"),
}


@pytest.mark.parametrize("variant", sorted(BROKEN))
def test_each_broken_copy_fails_its_rule_with_its_message(variant, tmp_path):
    mutate, rule, words = BROKEN[variant]
    results = by_name(validate_cluster(write_variant(tmp_path, mutate), env=offline_env(tmp_path)))
    expected = Status.WARN if rule == "mlflow_auth" else Status.FAIL
    assert results[rule].status is expected and words in results[rule].message, results[rule].line()


def test_a_secret_is_named_but_never_repeated(tmp_path):
    mutate = BROKEN["storage_key_inlined"][0]
    lines = [r.line() for r in validate_cluster(write_variant(tmp_path, mutate), env=offline_env(tmp_path))]
    assert not [line for line in lines if "c2VjcmV0c2VjcmV0" in line]


def test_nsg_rules_become_the_shared_exposure_shape():
    permissions = as_ip_permissions([
        {"direction": "Inbound", "access": "Allow", "protocol": "Tcp", "source_address_prefix": "VirtualNetwork",
         "destination_port_range": "6379"},
        {"direction": "Inbound", "access": "Deny", "protocol": "*", "source_address_prefix": "*",
         "destination_port_range": "*"},
        {"direction": "Inbound", "access": "Allow", "protocol": "Tcp", "source_address_prefixes": ["Internet"],
         "destination_port_ranges": ["8000-9000"]}])
    assert permissions == [
        {"IpProtocol": "tcp", "FromPort": 6379, "ToPort": 6379, "IpRanges": [{"CidrIp": "10.0.0.0/8"}]},
        {"IpProtocol": "tcp", "FromPort": 8000, "ToPort": 9000, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}]


def test_cli_exit_codes_and_the_live_skip(tmp_path):
    env = offline_env(tmp_path)
    ok = run_cli("validate", str(AZURE_YAML), env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "SKIP  azure_live" in ok.stdout and "0 failed" in ok.stdout
    broken = run_cli("validate", str(write_variant(tmp_path, BROKEN["spot_without_max_price"][0])), env=env)
    assert broken.returncode == 1 and "FAIL  spot_fallback" in broken.stdout
    rejected = run_cli("validate", str(write_variant(tmp_path, lambda c: c["provider"].update(type=7))), env=env)
    assert rejected.returncode == 2 and "Ray rejects the config" in rejected.stderr


class NoLogin:
    def get_token(self, scope):
        raise RuntimeError("DefaultAzureCredential failed to retrieve a token")


def test_live_checks_skip_without_credentials_or_when_turned_off():
    prepared = ray_prepare_and_validate(load_cluster_yaml(AZURE_YAML))
    gpus = load_price_table().gpus_by_instance()
    (no_login,) = azure_live_results(prepared, gpus, env={}, credential=NoLogin())
    assert no_login.status is Status.SKIP and "no Azure credentials" in no_login.message
    (off,) = azure_live_results(prepared, gpus, env={}, live=False)
    assert off.status is Status.SKIP and "--offline" in off.message


SKUS = [  # the shape of Microsoft.Compute/skus answers
    {"resourceType": "virtualMachines", "name": "Standard_D4s_v5", "family": "standardDSv5Family",
     "locationInfo": [{"location": "eastus", "zones": ["1", "2", "3"]}],
     "capabilities": [{"name": "vCPUs", "value": "4"}]},
    {"resourceType": "virtualMachines", "name": "Standard_NC4as_T4_v3", "family": "standardNCASv3_T4Family",
     "locationInfo": [{"location": "eastus", "zones": ["1", "2", "3"]}],
     "capabilities": [{"name": "vCPUs", "value": "4"}, {"name": "GPUs", "value": "1"}],
     "restrictions": [{"type": "Zone", "restrictionInfo": {"zones": ["3"]}}]},
    {"resourceType": "virtualMachines", "name": "Standard_NC8as_T4_v3", "family": "standardNCASv3_T4Family",
     "locationInfo": [{"location": "eastus", "zones": ["1", "2"]}],
     "capabilities": [{"name": "vCPUs", "value": "8"}]},
    {"resourceType": "disks", "name": "Premium_LRS"},
]


def test_live_verdicts_on_sizes_zones_and_quota():
    prepared = ray_prepare_and_validate(load_cluster_yaml(AZURE_YAML))
    gpus = load_price_table().gpus_by_instance()
    skus = parse_skus(SKUS, "eastus")
    assert skus["Standard_NC4as_T4_v3"] == VmSku("Standard_NC4as_T4_v3", "standardNCASv3_T4Family", 4,
                                                 frozenset({"1", "2", "3"}), frozenset({"3"}))
    # gpu_spot: 8 x 4 vCPUs of spot quota; gpu_ondemand: 4 x 8 of the T4 family's.
    enough = {"lowPriorityCores": (0, 32), "standardNCASv3_T4Family": (8, 40)}
    results = by_name(live_checks(prepared, AzureFacts("eastus", skus, enough), gpus))
    assert results["azure_vm_sizes"].status is Status.WARN and "zone(s) 3" in results["azure_vm_sizes"].message
    assert results["azure_gpu_quota"].status is Status.PASS
    short = {"lowPriorityCores": (4, 32), "standardNCASv3_T4Family": (8, 40)}
    quota = by_name(live_checks(prepared, AzureFacts("eastus", skus, short), gpus))["azure_gpu_quota"]
    assert quota.status is Status.FAIL and "lowPriorityCores: max_workers need 32 vCPUs, 28 free" in quota.message
    missing = {name: sku for name, sku in skus.items() if name != "Standard_NC8as_T4_v3"}
    sizes = by_name(live_checks(prepared, AzureFacts("eastus", missing, enough), gpus))["azure_vm_sizes"]
    assert sizes.status is Status.FAIL and "Standard_NC8as_T4_v3 is not offered" in sizes.message


def test_cost_prices_azure_sizes_from_the_dated_table(tmp_path):
    table = load_price_table()
    for size in ("Standard_D4s_v5", "Standard_NC4as_T4_v3", "Standard_NC8as_T4_v3"):
        price = table.get(size)
        assert price is not None and 0 < price.spot_usd_per_hour < price.on_demand_usd_per_hour
    done = run_cli("cost", str(AZURE_YAML), "--hours", "2", "--workers", "10", env=offline_env(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "Standard_NC4as_T4_v3 spot" in done.stdout and "8 x gpu_spot, 2 x gpu_ondemand" in done.stdout
    # head 2 h x 0.192 + 8 x 2 h x 0.160 spot + 2 x 2 h x 0.752 regular
    assert "total    $5.95" in done.stdout and "energy   1.40 kWh" in done.stdout


def test_every_node_installs_what_pyproject_lists():
    import shlex

    import tomllib
    from packaging.requirements import Requirement

    wanted = {Requirement(r).name: Requirement(r)
              for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    installed = {}
    for command in yaml.safe_load(AZURE_YAML.read_text())["setup_commands"]:
        words = shlex.split(command)
        if len(words) > 2 and words[0].endswith("pip") and words[1] == "install":
            installed.update({Requirement(w).name: Requirement(w) for w in words[2:] if not w.startswith("-")})
    assert set(wanted) <= set(installed), sorted(set(wanted) - set(installed))
    for name, requirement in wanted.items():
        assert installed[name].specifier == requirement.specifier or str(installed[name].specifier).startswith("==")
