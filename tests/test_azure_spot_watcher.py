"""Spot evictions on Azure: the Scheduled Events client against a fake metadata service (a real HTTP
server on loopback that, like Azure's, refuses requests without `Metadata: true`), the watcher's
order of drain then acknowledgement, `--cloud auto`, and the real command on the worker node of a
local two-node Ray cluster: a Preempt event for this VM must make Ray's GCS show the node draining
with NotBefore as deadline, and the acknowledgement must come only after the drain was accepted and
Ray released the node. That the same drain call carries a training run through with a just-in-time
checkpoint is proven by tests/test_fault_nodes.py::test_a_node_drained_for_preemption_costs_no_steps."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from aws import FakeImds, closed_port_url
from conftest import REPO, private_cluster

from cluster.azure_events import PREEMPT, ScheduledEventsClient, detect_cloud
from cluster.imds import ImdsError, ImdsUnavailable, Notice
from cluster.spot_watcher import SpotPolicy, SpotWatcher

NOW = datetime(2026, 12, 1, 13, 0, 0, tzinfo=timezone.utc)
VM = "raytrain-worker-1"


def rfc1123(moment: datetime) -> str:
    return format_datetime(moment.astimezone(timezone.utc), usegmt=True)


class FakeScheduledEvents:
    """Azure's instance metadata on loopback: the VM's name, Scheduled Events (set `events`), and
    StartRequests acknowledgements, each recorded with what `on_ack()` says at that moment."""

    def __init__(self, vm_name: str = VM):
        self.vm_name, self.events, self.incarnation = vm_name, [], 1
        self.gets, self.refused, self.acks = 0, 0, []
        self.on_ack = lambda: None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status, body, kind="application/json"):
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _allowed(self):
                if self.headers.get("Metadata") != "true":  # as Azure: no header, no answer
                    fake.refused += 1
                    self._answer(400, json.dumps({"error": "Bad request. Required metadata header not specified"}))
                    return False
                return True

            def do_GET(self):
                if not self._allowed():
                    return
                if self.path.startswith("/metadata/instance/compute/name"):
                    return self._answer(200, fake.vm_name, "text/plain")
                if self.path == "/metadata/scheduledevents?api-version=2020-07-01":
                    fake.gets += 1
                    return self._answer(200, json.dumps({"DocumentIncarnation": fake.incarnation,
                                                         "Events": fake.events}))
                self._answer(404, "{}")

            def do_POST(self):
                if not self._allowed():
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                fake.acks += [(request["EventId"], fake.on_ack()) for request in body.get("StartRequests", [])]
                self._answer(200, "")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def preempt(self, event_id: str, not_before: datetime, vm: str | None = None, kind: str = PREEMPT) -> None:
        self.events.append({"EventId": event_id, "EventType": kind, "ResourceType": "VirtualMachine",
                            "Resources": [vm or self.vm_name], "EventStatus": "Scheduled",
                            "NotBefore": rfc1123(not_before), "Description": "", "EventSource": "Platform",
                            "DurationInSeconds": -1})
        self.incarnation += 1

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def azure():
    server = FakeScheduledEvents()
    yield server
    server.close()


# ---------------------------------------------------------------- client and policy, no Ray

def test_client_reads_only_preempt_events_for_this_vm(azure):
    client = ScheduledEventsClient(azure.url)
    assert client.notices() == [] and azure.gets == 1
    azure.preempt("E-other-vm", NOW + timedelta(seconds=30), vm="someone-else")
    azure.preempt("E-reboot", NOW + timedelta(seconds=300), kind="Reboot")
    azure.preempt("E-1", NOW + timedelta(seconds=30))
    assert client.notices(now=NOW) == [Notice(PREEMPT, NOW + timedelta(seconds=30), "E-1")]
    assert azure.refused == 0  # every request carried Metadata: true


def test_a_started_event_without_not_before_is_happening_now(azure):
    azure.preempt("E-1", NOW)
    azure.events[0].update(NotBefore="", EventStatus="Started")
    assert ScheduledEventsClient(azure.url).notices(now=NOW) == [Notice(PREEMPT, NOW, "E-1")]
    azure.events[0]["NotBefore"] = "tomorrow-ish"
    with pytest.raises(ImdsError, match="malformed NotBefore"):
        ScheduledEventsClient(azure.url).notices(now=NOW)


def test_client_reports_the_service_unreachable():
    with pytest.raises(ImdsUnavailable):
        ScheduledEventsClient(closed_port_url(), timeout_s=1).notices()


def test_policy_drains_on_preempt_with_not_before_as_deadline():
    decision = SpotPolicy().decide(Notice(PREEMPT, NOW + timedelta(seconds=30), "E-1"), NOW)
    assert decision.drain and decision.deadline == NOW + timedelta(seconds=30) and decision.deadline_remaining_s == 30
    assert decision.reason_message == ("Azure spot eviction (Scheduled Event Preempt E-1) not before "
                                       "2026-12-01T13:00:30Z")


def test_watcher_acknowledges_only_after_the_drain_is_accepted_and_the_node_released(azure):
    calls, released = [], [False]

    def drain(decision):
        calls.append(("drain", decision.deadline))
        if len([c for c in calls if c[0] == "drain"]) == 1:
            raise RuntimeError("GCS unreachable")  # the first drain fails: nothing may be acknowledged

    client = ScheduledEventsClient(azure.url)
    watcher = SpotWatcher(client, SpotPolicy(), drain, clock=lambda: NOW,
                          acknowledge=lambda n: (calls.append(("ack", n.event_id)), client.acknowledge(n)),
                          released=lambda: released[0])
    azure.preempt("E-1", NOW + timedelta(seconds=30))
    with pytest.raises(RuntimeError):
        watcher.poll_once()
    assert azure.acks == [] and calls == [("drain", NOW + timedelta(seconds=30))]
    watcher.poll_once()   # drain accepted, but Ray still holds the node
    watcher.poll_once()
    assert azure.acks == [] and watcher.to_acknowledge and len(watcher.drains) == 1
    released[0] = True
    watcher.poll_once()
    watcher.poll_once()   # the event is still listed until Azure acts: acknowledged once
    assert [c[0] for c in calls] == ["drain", "drain", "ack"] and [a[0] for a in azure.acks] == ["E-1"]


def test_cloud_auto_picks_whichever_metadata_service_answers(azure):
    aws = FakeImds()
    try:
        assert detect_cloud(aws_url=closed_port_url(), azure_url=azure.url) == "azure"
        assert detect_cloud(aws_url=aws.url, azure_url=closed_port_url()) == "aws"
        # EC2's IMDS answers Azure's request 404: still aws.
        assert detect_cloud(aws_url=aws.url, azure_url=aws.url) == "aws"
    finally:
        aws.close()
    with pytest.raises(ImdsUnavailable, match="neither"):
        detect_cloud(aws_url=closed_port_url(), azure_url=closed_port_url(), timeout_s=1)


# ---------------------------------------------------------------- the command on a real two-node Ray cluster

@pytest.mark.ray
@pytest.mark.chaos
def test_watcher_drains_on_preempt_and_acknowledges_after_ray_released_the_node(azure):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cluster import ray_nodes

    with private_cluster(worker_nodes=1) as (cluster, (worker,)):
        gcs = ray_nodes.gcs_client(cluster.address)

        def node_state():  # what Ray says about the worker when the acknowledgement arrives
            node = next(n for n in ray_nodes.list_nodes(gcs) if n.node_id == worker.node_id)
            return {"alive": node.alive, "death_reason": node.death_reason}

        azure.on_ack = node_state

        @ray.remote(num_cpus=0)
        class Busy:  # keeps the drained node alive: an idle drained raylet exits at once
            def node(self):
                return ray.get_runtime_context().get_node_id()

        busy = Busy.options(scheduling_strategy=NodeAffinitySchedulingStrategy(worker.node_id, soft=False)).remote()
        assert ray.get(busy.node.remote()) == worker.node_id

        watcher = subprocess.Popen(
            [sys.executable, "-m", "cluster", "spot-watcher", "--cloud", "auto", "--imds-url", closed_port_url(),
             "--azure-metadata-url", azure.url, "--address", cluster.address, "--node-id", worker.node_id,
             "--interval-s", "0.2"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 30
            while azure.gets < 3 and time.monotonic() < deadline and watcher.poll() is None:
                time.sleep(0.1)
            assert azure.gets >= 3, "the watcher never polled Scheduled Events"
            assert worker.node_id not in ray_nodes.draining_deadlines_ms(gcs)  # no event, no drain

            not_before = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=60)
            azure.preempt("A1B2C3D4-eviction", not_before)
            drained = {}
            while time.monotonic() < deadline + 15 and worker.node_id not in drained:
                drained = ray_nodes.draining_deadlines_ms(gcs)
                time.sleep(0.1)
            # Ray Train's preemption watcher reads exactly this: the node and its deadline.
            assert drained.get(worker.node_id) == int(not_before.timestamp() * 1000)
            assert list(drained) == [worker.node_id]
            gets_at_drain = azure.gets
            while azure.gets < gets_at_drain + 5 and time.monotonic() < deadline + 30:
                time.sleep(0.1)
            assert azure.acks == []  # drained, but Ray still holds the node: Azure must wait

            ray.kill(busy)  # the last work leaves: the drained raylet exits, then the watcher acknowledges
            until = time.monotonic() + 30
            while not azure.acks and time.monotonic() < until:
                time.sleep(0.1)
        finally:
            watcher.terminate()
            output = watcher.communicate(timeout=15)[0]
        assert azure.acks == [("A1B2C3D4-eviction", {"alive": False, "death_reason": "AUTOSCALER_DRAIN_PREEMPTED"})], \
            output
        assert output.count("drain accepted") == 1 and azure.refused == 0, output
        node = next(n for n in ray_nodes.list_nodes(gcs) if n.node_id == worker.node_id)
        assert node.death_message == (f"Azure spot eviction (Scheduled Event Preempt A1B2C3D4-eviction) not before "
                                      f"{not_before.strftime('%Y-%m-%dT%H:%M:%SZ')}")
