"""The KubeRay files: valid YAML, the token only as a read-only file from its Secret in the Ray
containers that need it, no root, no privilege escalation, no capabilities, and a NetworkPolicy
that covers every pod the RayJob makes. Read as text: no Kubernetes, no Ray."""

import yaml
from conftest import REPO

RAYJOB = REPO / "cluster" / "kuberay" / "rayjob.yaml"


def documents():
    return {doc["kind"]: doc for doc in yaml.safe_load_all(RAYJOB.read_text()) if doc}


def pod_templates(job):
    cluster = job["spec"]["rayClusterSpec"]
    return {"head": cluster["headGroupSpec"]["template"],
            **{f"worker:{g['groupName']}": g["template"] for g in cluster["workerGroupSpecs"]},
            "submitter": job["spec"]["submitterPodTemplate"]}


def containers(job):
    found = {f"{pod}/{c['name']}": c for pod, template in pod_templates(job).items()
             for c in template["spec"]["containers"]}
    found["head/autoscaler"] = job["spec"]["rayClusterSpec"]["autoscalerOptions"]
    return found


def test_the_file_is_a_rayjob_and_a_network_policy():
    docs = documents()
    assert set(docs) == {"RayJob", "NetworkPolicy"}
    assert docs["RayJob"]["apiVersion"] == "ray.io/v1" and docs["NetworkPolicy"]["apiVersion"] == "networking.k8s.io/v1"


def test_the_token_is_a_read_only_file_never_an_environment_value():
    job = documents()["RayJob"]
    for name, container in containers(job).items():
        env = {item["name"]: item for item in container.get("env", [])}
        assert "RAY_AUTH_TOKEN" not in env, name
        assert env["RAY_AUTH_MODE"]["value"] == "token", name
        path = env["RAY_AUTH_TOKEN_PATH"]["value"]
        mounts = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        assert mounts and all(m["readOnly"] for m in mounts), name
    for pod, template in pod_templates(job).items():
        secrets = [v["secret"] for v in template["spec"]["volumes"] if "secret" in v]
        assert secrets == [{"secretName": "raytrain-ray-token", "defaultMode": 0o440}], pod


def test_every_pod_runs_restricted():
    job = documents()["RayJob"]
    for pod, template in pod_templates(job).items():
        context = template["spec"]["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] != 0, pod
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, pod
    for name, container in containers(job).items():
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"], name
    for pod in ("submitter", "worker:gpu"):  # the head keeps its account: the autoscaler scales with it
        assert pod_templates(job)[pod]["spec"]["automountServiceAccountToken"] is False


def test_the_network_policy_covers_every_pod_and_admits_only_the_cluster_and_the_operator():
    docs = documents()
    policy, job = docs["NetworkPolicy"]["spec"], docs["RayJob"]
    selected = policy["podSelector"]["matchLabels"]
    for pod, template in pod_templates(job).items():
        assert selected.items() <= template["metadata"]["labels"].items(), pod
    assert policy["policyTypes"] == ["Ingress"]
    peers = [peer for rule in policy["ingress"] for peer in rule["from"]]
    assert {"podSelector": {"matchLabels": selected}} in peers
    operator = [rule for rule in policy["ingress"] if any("namespaceSelector" in p for p in rule["from"])]
    assert operator and operator[0]["ports"] == [{"protocol": "TCP", "port": 8265}]
    assert job["spec"]["rayClusterSpec"]["headGroupSpec"]["serviceType"] == "ClusterIP"
