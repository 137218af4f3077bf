"""Spot watcher: the pure policy without Ray or network; the IMDSv2 client against a fake IMDS (a
real HTTP server on loopback, enforcing session tokens as EC2's does); and the real command as a
subprocess watching the worker node of a local two-node Ray cluster: a notice is switched on, and
Ray's GCS must show the node draining with the notice's deadline and, once it is gone, dead with
reason preemption and the watcher's message."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone

import pytest
from aws import FakeImds, closed_port_url
from conftest import REPO, private_cluster

from cluster.cli import main as cluster_main
from cluster.imds import SPOT_ACTION_PATH, ImdsClient, ImdsError, ImdsUnavailable, Notice
from cluster.spot_watcher import SpotPolicy, SpotWatcher

NOW = datetime(2026, 12, 1, 13, 0, 0, tzinfo=timezone.utc)


def iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------- the policy, pure

def test_termination_notice_drains_with_the_notice_time_as_deadline():
    decision = SpotPolicy().decide(Notice("terminate", NOW + timedelta(seconds=120)), NOW)
    assert decision.drain and decision.deadline == NOW + timedelta(seconds=120)
    assert decision.deadline_remaining_s == 120
    assert decision.deadline_timestamp_ms == int((NOW + timedelta(seconds=120)).timestamp() * 1000)
    assert decision.reason_message == "EC2 spot interruption notice: terminate at 2026-12-01T13:02:00Z"


@pytest.mark.parametrize("action", ["stop", "hibernate", "reboot-someday"])
def test_every_spot_action_drains(action):
    decision = SpotPolicy().decide(Notice(action, NOW + timedelta(seconds=30)), NOW)
    assert decision.drain and decision.deadline_remaining_s == 30 and action in decision.reason_message


def test_a_notice_already_past_is_clamped_to_now():
    decision = SpotPolicy().decide(Notice("terminate", NOW - timedelta(seconds=45)), NOW)
    assert decision.drain and decision.deadline == NOW and decision.deadline_remaining_s == 0
    assert decision.deadline_timestamp_ms > 0  # 0 would mean "no deadline" to Ray


def test_the_same_notice_drains_once_and_only_an_earlier_deadline_drains_again():
    policy, notice = SpotPolicy(), Notice("terminate", NOW + timedelta(seconds=120))
    first = policy.decide(notice, NOW)
    again = policy.decide(notice, NOW + timedelta(seconds=5), draining_until=first.deadline)
    assert first.drain and not again.drain and "already draining" in again.summary
    sooner = policy.decide(Notice("terminate", NOW + timedelta(seconds=60)), NOW + timedelta(seconds=6),
                           draining_until=first.deadline)
    assert sooner.drain and sooner.deadline == NOW + timedelta(seconds=60)


@pytest.mark.parametrize("on_rebalance", ["ignore", "log"])
def test_rebalance_recommendation_is_not_drained_by_default(on_rebalance):
    decision = SpotPolicy(on_rebalance=on_rebalance).decide(Notice("rebalance", NOW), NOW)
    assert not decision.drain and f"on_rebalance={on_rebalance}" in decision.summary
    assert SpotPolicy().on_rebalance == "log"


def test_rebalance_drain_uses_its_own_longer_deadline_and_never_extends_a_spot_deadline():
    policy = SpotPolicy(on_rebalance="drain", rebalance_deadline_s=900)
    early = policy.decide(Notice("rebalance", NOW), NOW + timedelta(seconds=3))
    assert early.drain and early.deadline == NOW + timedelta(seconds=903) and "rebalance" in early.reason_message
    later_poll = policy.decide(Notice("rebalance", NOW), NOW + timedelta(seconds=8), draining_until=early.deadline)
    assert not later_poll.drain
    spot = policy.decide(Notice("terminate", NOW + timedelta(seconds=200)), NOW + timedelta(seconds=80),
                         draining_until=early.deadline)
    assert spot.drain and spot.deadline == NOW + timedelta(seconds=200)
    after_spot = policy.decide(Notice("rebalance", NOW), NOW + timedelta(seconds=85), draining_until=spot.deadline)
    assert not after_spot.drain


def test_policy_rejects_bad_settings():
    with pytest.raises(ValueError, match="on_rebalance"):
        SpotPolicy(on_rebalance="panic")
    with pytest.raises(ValueError, match="rebalance_deadline_s"):
        SpotPolicy(rebalance_deadline_s=-1)


@pytest.fixture
def imds():
    server = FakeImds()
    yield server
    server.close()


def test_fake_imds_refuses_gets_without_a_token(imds):
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(imds.url + SPOT_ACTION_PATH, timeout=5)
    assert refused.value.code == 401 and imds.unauthorized == 1


def test_client_sends_its_token_and_404_means_no_notice(imds):
    client = ImdsClient(imds.url)
    assert client.notices() == [] and imds.puts == 1 and imds.gets == 2 and imds.unauthorized == 0


def test_client_parses_spot_and_rebalance_notices(imds):
    imds.spot = {"action": "terminate", "time": "2026-12-01T13:02:00Z"}
    imds.rebalance = {"noticeTime": "2026-12-01T12:58:00Z"}
    assert ImdsClient(imds.url).notices() == [
        Notice("terminate", datetime(2026, 12, 1, 13, 2, tzinfo=timezone.utc)),
        Notice("rebalance", datetime(2026, 12, 1, 12, 58, tzinfo=timezone.utc))]
    imds.spot = {"action": "terminate"}
    with pytest.raises(ImdsError, match="malformed spot instance-action"):
        ImdsClient(imds.url).spot_notice()


def test_client_refreshes_its_token_before_expiry(imds):
    client = ImdsClient(imds.url, token_ttl_s=2)  # refreshed 0.4 s before it expires
    client.notices()
    time.sleep(1.0)
    client.notices()
    assert imds.puts == 1  # still valid, reused
    time.sleep(0.8)       # 1.8 s: inside the refresh margin, not yet expired
    client.notices()
    assert imds.puts == 2 and imds.unauthorized == 0


def test_client_recovers_when_imds_forgets_its_token(imds):
    client = ImdsClient(imds.url)
    client.notices()
    imds.forget_tokens()
    imds.spot = {"action": "stop", "time": "2026-12-01T13:02:00Z"}
    assert client.spot_notice().kind == "stop"
    assert imds.unauthorized == 1 and imds.puts == 2


def test_client_reports_imds_unreachable():
    with pytest.raises(ImdsUnavailable):
        ImdsClient(closed_port_url(), timeout_s=1).notices()


def test_watcher_backs_off_while_imds_is_unreachable_and_logs_once(caplog):
    waits: list[float] = []
    watcher = SpotWatcher(ImdsClient(closed_port_url(), timeout_s=1), SpotPolicy(), drain=lambda d: None,
                          interval_s=2, max_backoff_s=10, sleep=waits.append)
    with caplog.at_level("INFO", logger="cluster.spot_watcher"):
        watcher.run(stop=lambda: len(waits) >= 5)
    assert waits == [4, 8, 10, 10, 10]
    assert sum("IMDS unreachable" in r.message for r in caplog.records) == 1


def test_watcher_drains_once_per_notice_through_the_injected_drain(imds):
    drained = []
    clock = iter(NOW + timedelta(seconds=s) for s in range(100))
    watcher = SpotWatcher(ImdsClient(imds.url), SpotPolicy(), drain=drained.append, clock=lambda: next(clock))
    assert watcher.poll_once() == []
    imds.spot = {"action": "terminate", "time": iso(NOW + timedelta(seconds=120))}
    for _ in range(3):
        watcher.poll_once()
    assert len(drained) == 1 and drained[0].deadline == NOW + timedelta(seconds=120)
    assert drained[0].deadline_remaining_s == 120


def test_watcher_retries_a_failed_drain_on_the_next_poll(imds):
    attempts = []

    def flaky_drain(decision):
        attempts.append(decision)
        if len(attempts) == 1:
            raise RuntimeError("GCS unreachable")

    imds.spot = {"action": "terminate", "time": iso(datetime.now(timezone.utc) + timedelta(seconds=120))}
    polls = []
    watcher = SpotWatcher(ImdsClient(imds.url), SpotPolicy(), drain=flaky_drain, sleep=polls.append)
    watcher.run(stop=lambda: len(polls) >= 3)
    assert len(attempts) == 2 and len(watcher.drains) == 1


# ---------------------------------------------------------------- the command on a real two-node Ray cluster

@pytest.fixture(scope="module")
def two_nodes():
    """Head + one worker node."""
    with private_cluster(worker_nodes=1) as (cluster, (worker,)):
        yield cluster, worker


def watcher_command(address, *args):
    return [sys.executable, "-m", "cluster", "spot-watcher", "--address", address, *args]


@pytest.mark.ray
def test_once_exits_1_with_a_clear_message_off_ec2(two_nodes, capsys):
    cluster, worker = two_nodes
    code = cluster_main(["spot-watcher", "--once", "--address", cluster.address, "--node-id", worker.node_id,
                         "--imds-url", closed_port_url()])
    assert code == 1 and "IMDS unreachable" in capsys.readouterr().err


@pytest.mark.ray
def test_own_node_is_found_automatically_only_when_unambiguous(two_nodes, capsys):
    cluster, worker = two_nodes
    # Head and worker raylets both run on this host: the watcher must refuse to guess.
    assert cluster_main(["spot-watcher", "--once", "--address", cluster.address]) == 2
    assert "2 nodes of this cluster run on this host" in capsys.readouterr().err
    assert cluster_main(["spot-watcher", "--once", "--address", cluster.address, "--node-id", "ab" * 28]) == 2
    assert "no such node" in capsys.readouterr().err


@pytest.mark.ray
@pytest.mark.chaos
def test_watcher_drains_its_node_with_the_notice_deadline(two_nodes, imds):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cluster import ray_nodes

    cluster, worker = two_nodes
    gcs = ray_nodes.gcs_client(cluster.address)

    @ray.remote(num_cpus=0)
    class Busy:  # keeps the drained node alive: an idle drained raylet exits at once
        def node(self):
            return ray.get_runtime_context().get_node_id()

    busy = Busy.options(scheduling_strategy=NodeAffinitySchedulingStrategy(worker.node_id, soft=False)).remote()
    assert ray.get(busy.node.remote()) == worker.node_id

    watcher = subprocess.Popen(
        watcher_command(cluster.address, "--node-id", worker.node_id, "--imds-url", imds.url,
                        "--interval-s", "0.2", "--token-ttl-s", "2"),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while imds.gets < 6 and time.monotonic() < deadline and watcher.poll() is None:
            time.sleep(0.1)
        assert imds.gets >= 6, "the watcher never polled IMDS"
        assert worker.node_id not in ray_nodes.draining_deadlines_ms(gcs)  # no notice, no drain

        notice_time = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=90)
        imds.spot = {"action": "terminate", "time": iso(notice_time)}
        drained = {}
        while time.monotonic() < deadline + 15 and worker.node_id not in drained:
            drained = ray_nodes.draining_deadlines_ms(gcs)
            time.sleep(0.1)
        # Ray Train's preemption watcher reads exactly this: the node and its deadline.
        assert drained.get(worker.node_id) == int(notice_time.timestamp() * 1000)
        assert list(drained) == [worker.node_id]  # the head is untouched

        gets_at_drain = imds.gets
        while (imds.gets < gets_at_drain + 8 or imds.puts < 2) and time.monotonic() < deadline + 30:
            time.sleep(0.1)  # more polls of the same notice, past the first token's lifetime...
        assert imds.puts >= 2 and imds.unauthorized == 0  # the 2 s token was refreshed in time
    finally:
        watcher.terminate()
        output = watcher.communicate(timeout=15)[0]
    assert watcher.returncode == 0, output
    assert output.count("drain accepted") == 1, output  # ...and still one drain

    # The node takes no new work: a task that prefers it runs on the head instead.
    @ray.remote(num_cpus=0)
    def where():
        return ray.get_runtime_context().get_node_id()

    prefers_worker = NodeAffinitySchedulingStrategy(worker.node_id, soft=True)
    assert ray.get(where.options(scheduling_strategy=prefers_worker).remote()) == cluster.head_node.node_id

    # Once its last work is gone the drained raylet exits, and Ray records why.
    ray.kill(busy)
    node = None
    until = time.monotonic() + 30
    while time.monotonic() < until:
        node = next(n for n in ray_nodes.list_nodes(gcs) if n.node_id == worker.node_id)
        if not node.alive:
            break
        time.sleep(0.2)
    assert node is not None and not node.alive
    assert node.death_reason == "AUTOSCALER_DRAIN_PREEMPTED"
    assert node.death_message == f"EC2 spot interruption notice: terminate at {iso(notice_time)}"
