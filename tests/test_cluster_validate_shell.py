"""Unit tests of how validate reads a cluster config: one launcher command as the shell runs it,
the ports Ray and MLflow listen on, and ingress ranges as addresses. Pure functions, no Ray."""

import pytest

from cluster.network import (
    exposure,
    is_too_wide,
    listeners,
    mlflow_listener,
    public_span,
    ray_start_listeners,
    reaches_internet,
)
from cluster.rules import literal_secrets
from cluster.shell import (
    auth_mode_at_ray_start,
    container_env,
    env_at,
    exports_auth_token,
    is_mlflow_server,
    simple_commands,
)

TOKEN = "9f8e7d6c5b4a39281706f5e4d3c2b1a0"


@pytest.mark.parametrize("command, modes", [
    ("export RAY_AUTH_MODE=token; ray start --head", ["token"]),
    ("export RAY_AUTH_MODE=token && ray start --head", ["token"]),
    ("RAY_AUTH_MODE=token ray start --head", ["token"]),
    ("RAY_AUTH_MODE=token ~/venv/bin/ray start --head", ["token"]),
    ("env RAY_AUTH_MODE=token nohup ray start --address=$RAY_HEAD_IP:6379", ["token"]),
    ("export RAY_AUTH_MODE\nRAY_AUTH_MODE=token\nray start", ["token"]),  # marked for export, then set
    ("RAY_AUTH_MODE=token; export RAY_AUTH_MODE; ray start", ["token"]),
    ("RAY_AUTH_MODE=token; ray start", [None]),  # a shell variable, not exported
    ("export RAY_AUTH_MODE=token", []),
    ("ray start --head; export RAY_AUTH_MODE=token", [None]),
    ("export RAY_AUTH_MODE=token; unset RAY_AUTH_MODE; ray start", [None]),
    ("export RAY_AUTH_MODE=token; env -u RAY_AUTH_MODE ray start", [None]),
    ("export RAY_AUTH_MODE=token; RAY_AUTH_MODE=disabled ray start", ["disabled"]),
    ("(export RAY_AUTH_MODE=token); ray start", [None]),  # a subshell's export ends with it
    ("(export RAY_AUTH_MODE=token; ray start) || true", ["token"]),
    ("echo 'export RAY_AUTH_MODE=token; ray start'", []),  # quoted: one word, nothing runs
    ("X=$(echo a | tr a b; true); export RAY_AUTH_MODE=token; ray start", ["token"]),
    ("export RAY_AUTH_MODE=token; ray start --head; ray start", ["token", "token"]),
    ("export RAY_AUTH_MODE=token; bash -c 'ray start --head'", ["token"]),  # a child shell inherits
    ("bash -c 'export RAY_AUTH_MODE=token'; ray start", [None]),
])
def test_auth_mode_is_read_per_command_as_the_shell_sets_it(command, modes):
    assert auth_mode_at_ray_start(command) == modes


def test_auth_mode_may_come_from_the_container_environment():
    assert auth_mode_at_ray_start("ray start", {"RAY_AUTH_MODE": "token"}) == ["token"]
    assert auth_mode_at_ray_start("unset RAY_AUTH_MODE; ray start", {"RAY_AUTH_MODE": "token"}) == [None]
    config = {"docker": {"image": "rayproject/ray:2.60.0", "run_options": ["--env RAY_AUTH_MODE=token", "-e", "A=b"]}}
    assert container_env(config, "head") == {"RAY_AUTH_MODE": "token", "A": "b"}
    assert container_env({"docker": {"run_options": ["-e RAY_AUTH_MODE=token"]}}, "head") == {}  # no container


def test_exports_auth_token_needs_a_ray_start_in_the_same_command():
    assert exports_auth_token("export RAY_AUTH_MODE=token; ray start --head")
    assert not exports_auth_token("export RAY_AUTH_MODE=token")
    assert not exports_auth_token("export RAY_AUTH_MODE=token; ray start; RAY_AUTH_MODE=disabled ray start")


def test_simple_commands_split_at_every_operator_but_not_inside_quotes_or_substitutions():
    split = simple_commands("a=1 b && c || d | e; f & g\nh 'i;j' \"$(k | l)\" > out 2>&1")
    assert [s.argv for s in split] == [("b",), ("c",), ("d",), ("e",), ("f",), ("g",), ("h", "i;j", "$__substituted__")]
    assert [s.joined_by for s in split] == ["", "&&", "||", "|", ";", "&", "\n"]
    assert split[0].assignments == (("a", "1"),) and split[-1].redirects[0] == "out"


def test_environment_of_the_mlflow_server():
    (argv, env), = env_at("export K=$(python -c 'print(1)'); A=1 nohup mlflow server --port 5001 &", is_mlflow_server)
    assert argv[:2] == ("mlflow", "server") and env["A"] == "1" and env["K"] == "$__substituted__"


@pytest.mark.parametrize("text, found", [
    (f"echo {TOKEN} > ~/.ray/auth_token", "a literal token written to auth_token"),
    (f"printf %s {TOKEN} | tee ~/.ray/auth_token", "a literal token written to auth_token"),
    (f"--env RAY_AUTH_TOKEN {TOKEN}", "RAY_AUTH_TOKEN <literal>"),
    (f"--env=RAY_AUTH_TOKEN={TOKEN}", "RAY_AUTH_TOKEN=<literal>"),
    (f"export RAY_AUTH_TOKEN='{TOKEN}'; ray start", "RAY_AUTH_TOKEN=<literal>"),
    ("MLFLOW_TRACKING_PASSWORD=hunter2 python -m training", "MLFLOW_TRACKING_PASSWORD=<literal>"),
])
def test_literal_secrets_are_found(text, found):
    assert [what for _, what in literal_secrets({"setup_commands": [text]})] == [found]


@pytest.mark.parametrize("text", [
    "export RAY_AUTH_TOKEN=$(cat ~/.ray/auth_token)", "export RAY_AUTH_TOKEN_PATH=/etc/ray/token",
    "RAY_AUTH_TOKEN=\"$TOKEN\" ray start", "--env RAY_AUTH_TOKEN", "ray get-auth-token --generate > ~/.ray/auth_token",
    "echo $TOKEN > ~/.ray/auth_token", "echo done > ~/log",
])
def test_references_to_secrets_are_not_secrets(text):
    assert literal_secrets({"setup_commands": [text], "docker": {"run_options": [text]}}) == []


def test_ray_start_ports_follow_flags_and_defaults():
    head = {item.label(): item.host for item in ray_start_listeners(("ray", "start", "--head"))}
    assert head == {"6379 (GCS)": None, "8265 (dashboard)": "127.0.0.1", "10001 (Ray client)": None,
                    "52365 (dashboard agent)": None, "10002-19999 (worker ports)": None,
                    "32768-60999 (random: object manager, node manager, metrics, dashboard agent gRPC, "
                    "runtime env agent)": None}
    flagged = ray_start_listeners(("ray", "start", "--head", "--port=7000", "--dashboard-port", "9000",
                                   "--dashboard-host=0.0.0.0", "--min-worker-port=20000", "--max-worker-port=20100",
                                   "--object-manager-port=8076", "--include-dashboard=false"))
    labels = [item.label() for item in flagged]
    assert "7000 (GCS)" in labels and "20000-20100 (worker ports)" in labels and "8076 (object manager)" in labels
    assert not any("dashboard)" in label for label in labels)
    worker = [item.label() for item in ray_start_listeners(("ray", "start", "--worker-port-list=11000,11001"))]
    assert "11000 (worker)" in worker and "GCS" not in " ".join(worker)


def test_mlflow_port_and_host_with_long_and_short_flags():
    assert mlflow_listener(("mlflow", "server")).label() == "5000 (MLflow)"
    assert mlflow_listener(("mlflow", "server")).host == "127.0.0.1"
    short = mlflow_listener(("mlflow", "server", "-h", "0.0.0.0", "-p", "5001"))
    assert (short.label(), short.host) == ("5001 (MLflow)", "0.0.0.0")
    config = {"head_start_ray_commands": ["python -m mlflow server --port=5002 --host $HEAD_IP &"]}
    assert [item.label() for item in listeners(config)] == ["5002 (MLflow)"]


@pytest.mark.parametrize("cidr, public", [
    ("0.0.0.0/0", True), ("0.0.0.0/1", True), ("128.0.0.0/1", True), ("203.0.113.0/24", True),
    ("172.15.0.0/16", True), ("10.0.0.0/8", False), ("10.1.2.0/24", False), ("172.16.0.0/12", False),
    ("192.168.1.1/32", False), ("127.0.0.1/32", False), ("169.254.169.254/32", False), ("::/0", True),
    ("2000::/3", True), ("fd00::/8", False), ("fe80::/64", False), ("not a cidr", True), ("10.0.0.0/7", True),
])
def test_internet_reach_is_address_containment(cidr, public):
    assert reaches_internet(cidr) is public


def test_trusted_ranges_and_merged_halves():
    assert not reaches_internet("100.64.0.0/16", trusted=["100.64.0.0/10"])
    assert public_span(["0.0.0.0/1", "128.0.0.0/1", "10.0.0.0/8"]) == ["0.0.0.0/0"]
    assert is_too_wide("0.0.0.0/0") and is_too_wide("0.0.0.0/7") and not is_too_wide("203.0.113.0/24")
    assert is_too_wide("2000::/3") and not is_too_wide("2001:db8::/48")


def test_exposure_reads_protocols_port_ranges_and_listeners():
    listening = ray_start_listeners(("ray", "start", "--head", "--dashboard-port=9000"))
    world = [{"CidrIp": "0.0.0.0/1"}, {"CidrIp": "128.0.0.0/1"}]
    assert exposure([{"IpProtocol": "udp", "FromPort": 0, "ToPort": 65535, "IpRanges": world}],
                    listening=listening)[0] == []
    assert exposure([{"IpProtocol": "icmp", "FromPort": 8, "ToPort": -1, "IpRanges": world}],
                    listening=listening)[0] == []
    opened, ssh_world, _ = exposure([{"IpProtocol": "tcp", "FromPort": 8000, "ToPort": 10001, "IpRanges": world}],
                                    listening=listening)
    assert opened == ["9000 (dashboard)", "10001 (Ray client)"] and ssh_world == []
    private = [{"IpProtocol": "-1", "IpRanges": [{"CidrIp": "10.0.0.0/16"}], "Ipv6Ranges": [{"CidrIpv6": "fd00::/8"}]}]
    assert exposure(private, listening=listening)[0] == []
    ssh = [{"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "IpRanges": world}]
    assert exposure(ssh, listening=listening)[1] == ["0.0.0.0/0"]
