"""`python -m cluster chaos`: the target choice without Ray (seeded, never the head or a draining
node unless allowed, refusals that say why); then the real command, as a subprocess, against a
local three-node Ray cluster whose "training workers" are real actors of class RayTrainWorker
(process title ray::RayTrainWorker, as Ray Train's own), checked by process and by Ray's node state.
The tests of the live cluster build on each other (one worker killed, one node drained, the other
node killed) and run in file order."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import psutil  # noqa: E402
import pytest
import ray  # noqa: F401  (Ray puts its vendored psutil on the path)
from conftest import REPO, private_cluster

from cluster.chaos import ChaosPolicy, NothingToDo
from cluster.ray_nodes import ActorProcess, NodeInfo

HEAD = NodeInfo("h" * 56, "10.0.0.1", is_head=True, alive=True, draining=False)
A = NodeInfo("a" * 56, "10.0.0.2", is_head=False, alive=True, draining=False)
B = NodeInfo("b" * 56, "10.0.0.3", is_head=False, alive=True, draining=False)


def actor(n: int, node: NodeInfo) -> ActorProcess:
    return ActorProcess(f"{n:032x}", "RayTrainWorker", 1000 + n, node.node_id)


# ---------------------------------------------------------------- the policy, pure

def test_refuses_when_no_training_worker_runs():
    with pytest.raises(NothingToDo, match="no Ray Train workers are running"):
        ChaosPolicy().decide("kill-worker", [], [HEAD, A], random.Random(0))
    dead = NodeInfo(A.node_id, A.ip, is_head=False, alive=False, draining=False)
    with pytest.raises(NothingToDo, match="no Ray Train workers are running"):
        ChaosPolicy().decide("kill-node", [actor(1, A)], [HEAD, dead], random.Random(0))


def test_never_targets_the_head_unless_allowed():
    workers = [actor(1, HEAD), actor(2, HEAD)]
    with pytest.raises(NothingToDo, match=r"2 on the head \(--allow-head to include it\)"):
        ChaosPolicy().decide("kill-node", workers, [HEAD, A], random.Random(0))
    decision = ChaosPolicy(allow_head=True).decide("kill-node", workers, [HEAD, A], random.Random(0))
    assert decision.node == HEAD and "head" in decision.describe()
    for seed in range(20):
        picked = ChaosPolicy().decide("kill-worker", workers + [actor(3, A)], [HEAD, A], random.Random(seed))
        assert picked.worker == actor(3, A) and picked.node == A


def test_skips_draining_nodes_and_honours_node_id():
    draining = NodeInfo(A.node_id, A.ip, is_head=False, alive=True, draining=True)
    workers = [actor(1, A), actor(2, B)]
    assert ChaosPolicy().decide("drain-node", workers, [HEAD, draining, B], random.Random(0)).node == B
    with pytest.raises(NothingToDo, match="1 on draining nodes"):
        ChaosPolicy(node_id=A.node_id).decide("kill-worker", workers, [HEAD, draining, B], random.Random(0))
    assert ChaosPolicy(node_id=A.node_id).decide("kill-node", workers, [HEAD, A, B], random.Random(0)).node == A


def test_choice_is_random_but_seeded():
    workers = [actor(n, node) for n, node in enumerate([A, A, B, B, B])]
    picks = {seed: ChaosPolicy().decide("kill-worker", workers, [HEAD, A, B], random.Random(seed)).worker
             for seed in range(12)}
    assert len(set(picks.values())) > 2  # not always the same worker
    assert all(ChaosPolicy().decide("kill-worker", workers, [HEAD, A, B], random.Random(seed)).worker == pick
               for seed, pick in picks.items())


# ---------------------------------------------------------------- the command on a real local cluster

@pytest.fixture(scope="module")
def cluster():
    """Head + two worker nodes."""
    with private_cluster(worker_nodes=2) as (local, nodes):
        yield local, nodes


@pytest.fixture(scope="module")
def train_workers(cluster):
    """{pid: node id}: one RayTrainWorker on the head, two on each worker node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    class RayTrainWorker:
        def where(self):
            return os.getpid(), ray.get_runtime_context().get_node_id()

    # Named as Ray Train names its worker class (module level there; shipped by value here).
    RayTrainWorker.__qualname__ = "RayTrainWorker"
    RayTrainWorker = ray.remote(num_cpus=0)(RayTrainWorker)
    local, nodes = cluster
    placement = [local.head_node.node_id] + [node.node_id for node in nodes for _ in range(2)]
    actors = [RayTrainWorker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
              for node_id in placement]
    located = dict(ray.get([a.where.remote() for a in actors]))
    assert sorted(located.values()) == sorted(placement)
    yield located


def chaos(address, *args):
    done = subprocess.run([sys.executable, "-m", "cluster", "chaos", *args, "--address", address],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr


def pid_gone(pid: int, timeout_s: float = 10) -> bool:
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.ray
@pytest.mark.chaos
def test_cli_refuses_with_exit_2_when_no_training_worker_runs(cluster):
    local, _ = cluster
    code, out, err = chaos(local.address, "kill-worker")
    assert code == 2, out + err
    assert "no Ray Train workers are running" in err


@pytest.mark.ray
@pytest.mark.chaos
def test_kill_worker_dry_run_names_a_target_and_touches_nothing(cluster, train_workers):
    local, _ = cluster
    code, out, err = chaos(local.address, "kill-worker", "--dry-run", "--seed", "7")
    assert code == 0, out + err
    named = [pid for pid in train_workers if f"pid {pid} " in out]
    assert len(named) == 1 and train_workers[named[0]] != local.head_node.node_id, out
    assert all(psutil.pid_exists(pid) for pid in train_workers)


@pytest.mark.ray
@pytest.mark.chaos
def test_kill_worker_sigkills_one_training_worker_off_the_head(cluster, train_workers):
    local, _ = cluster
    code, out, err = chaos(local.address, "kill-worker", "--seed", "7")
    assert code == 0, out + err
    killed = [pid for pid in train_workers if f"pid {pid} " in out]
    assert len(killed) == 1, out
    assert pid_gone(killed[0]), f"pid {killed[0]} still alive"
    survivors = [pid for pid in train_workers if pid != killed[0]]
    assert all(psutil.pid_exists(pid) for pid in survivors)
    head_worker = next(pid for pid, node in train_workers.items() if node == local.head_node.node_id)
    assert head_worker in survivors


@pytest.mark.ray
@pytest.mark.chaos
def test_drain_node_drains_a_node_running_a_worker_as_if_preempted(cluster, train_workers):
    from cluster import ray_nodes

    local, nodes = cluster
    gcs = ray_nodes.gcs_client(local.address)
    before_ms = time.time() * 1000
    code, out, err = chaos(local.address, "drain-node", "--deadline-s", "45", "--seed", "1")
    assert code == 0, out + err
    draining = ray_nodes.draining_deadlines_ms(gcs)
    assert len(draining) == 1, draining
    (node_id, deadline_ms), = draining.items()
    assert node_id in {node.node_id for node in nodes} and node_id in train_workers.values()
    assert before_ms + 45_000 <= deadline_ms <= time.time() * 1000 + 45_000
    node = next(n for n in ray_nodes.list_nodes(gcs) if n.node_id == node_id)
    assert node.alive  # busy with its workers until the deadline, but taking nothing new
    until = time.monotonic() + 10
    while not node.draining and time.monotonic() < until:  # the node's own report lags a little
        time.sleep(0.2)
        node = next(n for n in ray_nodes.list_nodes(gcs) if n.node_id == node_id)
    assert node.draining


@pytest.mark.ray
@pytest.mark.chaos
def test_kill_node_kills_the_raylet_of_the_other_worker_node(cluster, train_workers):
    from cluster import ray_nodes

    local, nodes = cluster
    gcs = ray_nodes.gcs_client(local.address)
    draining = set(ray_nodes.draining_deadlines_ms(gcs))
    target = next(node for node in nodes if node.node_id not in draining)  # the only candidate left
    raylet = next(p for p in psutil.process_iter(["cmdline"])
                  if f"--node_id={target.node_id}" in " ".join(p.info["cmdline"] or []))
    code, out, err = chaos(local.address, "kill-node", "--seed", "1")
    assert code == 0, out + err
    assert target.node_id in out and "Ray marks it dead" in out, out
    assert pid_gone(raylet.pid)
    on_target = [pid for pid, node in train_workers.items() if node == target.node_id]
    assert on_target and all(pid_gone(pid) for pid in on_target)
    states = {n.node_id: n.alive for n in ray_nodes.list_nodes(gcs)}
    assert states[target.node_id] is False
    assert states[local.head_node.node_id] and all(states[n] for n in draining)
    head_worker = next(pid for pid, node in train_workers.items() if node == local.head_node.node_id)
    assert psutil.pid_exists(head_worker)
