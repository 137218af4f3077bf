"""Rehearse failures on a live cluster: SIGKILL a Ray Train worker, drain a node as if preempted,
or kill a node's Ray processes. The target is always a node running a Ray Train worker (an alive
actor of class RayTrainWorker, the process titled "ray::RayTrainWorker"), never the head unless
allowed, never a node already draining.

`ChaosPolicy` picks the target (pure, seeded); `ChaosExecutor` does it from a connected driver.
Processes on other nodes are killed there, by a zero-CPU task pinned to the node (it runs even when
the training workers hold every CPU and GPU)."""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass

import psutil

from cluster import ray_nodes
from cluster.ray_nodes import ActorProcess, NodeInfo

ACTIONS = ("kill-worker", "drain-node", "kill-node")
TRAIN_WORKER_CLASS = "RayTrainWorker"
TRAIN_WORKER_TITLE = "ray::RayTrainWorker"


class NothingToDo(Exception):
    """No target matches: the message says why and what would change that."""


@dataclass(frozen=True)
class ChaosDecision:
    action: str
    node: NodeInfo
    worker: ActorProcess | None = None   # kill-worker only

    def describe(self) -> str:
        where = f"node {self.node.node_id} ({self.node.ip}{', head' if self.node.is_head else ''})"
        if self.action == "kill-worker":
            return f"SIGKILL {TRAIN_WORKER_CLASS} pid {self.worker.pid} (actor {self.worker.actor_id}) on {where}"
        if self.action == "drain-node":
            return f"drain {where} with reason preemption"
        return f"SIGKILL the raylet and every process under it on {where}"


@dataclass(frozen=True)
class ChaosPolicy:
    allow_head: bool = False
    node_id: str | None = None   # only this node

    def decide(self, action: str, workers: list[ActorProcess], nodes: list[NodeInfo],
               rng: random.Random) -> ChaosDecision:
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}; one of {ACTIONS}")
        alive = {node.node_id: node for node in nodes if node.alive}
        running = [w for w in workers if w.node_id in alive]
        if not running:
            raise NothingToDo(f"no Ray Train workers are running (no alive {TRAIN_WORKER_CLASS} actors): "
                              "start a training run first")
        skipped = []
        if self.node_id is not None:
            skipped += [f"{sum(w.node_id != self.node_id for w in running)} on other nodes than --node-id"]
            running = [w for w in running if w.node_id == self.node_id]
        if not self.allow_head:
            skipped += [f"{sum(alive[w.node_id].is_head for w in running)} on the head (--allow-head to include it)"]
            running = [w for w in running if not alive[w.node_id].is_head]
        skipped += [f"{sum(alive[w.node_id].draining for w in running)} on draining nodes "
                    "(Ray schedules nothing there)"]
        running = [w for w in running if not alive[w.node_id].draining]
        if not running:
            raise NothingToDo(f"no Ray Train worker matches: {'; '.join(s for s in skipped if not s.startswith('0 '))}")
        if action == "kill-worker":
            worker = rng.choice(running)
            return ChaosDecision(action, alive[worker.node_id], worker)
        node_id = rng.choice(sorted({w.node_id for w in running}))
        return ChaosDecision(action, alive[node_id])


def _remote_killers():
    """The tasks that run on the target node. Defined here, inside a function, so Ray ships them by
    value: the target node needs nothing of this project installed."""
    import ray  # (lazy: ray)

    @ray.remote(num_cpus=0, max_retries=0)
    def kill_pid(pid: int, title: str) -> str:


        # The pid must still be the worker it was (pids are reused): check its process title.
        cmdline = " ".join(psutil.Process(pid).cmdline())
        if not cmdline.startswith(title):
            raise RuntimeError(f"pid {pid} is now {cmdline[:80]!r}, not {title}: not killed")
        os.kill(pid, signal.SIGKILL)
        return ray.get_runtime_context().get_node_id()

    @ray.remote(num_cpus=0, max_retries=0)
    def kill_raylet(node_id: str) -> None:
        me = psutil.Process()
        raylet = me.parent()  # the raylet starts its workers itself
        if raylet is None or f"--node_id={node_id}" not in " ".join(raylet.cmdline()):
            raise RuntimeError(f"parent of pid {me.pid} is not the raylet of node {node_id}: nothing killed")
        for child in raylet.children(recursive=True):
            if child.pid != me.pid:
                try:
                    child.send_signal(signal.SIGKILL)
                except psutil.NoSuchProcess:
                    pass
        raylet.send_signal(signal.SIGKILL)
        os.kill(me.pid, signal.SIGKILL)

    return kill_pid, kill_raylet


class ChaosExecutor:
    """Carries out a decision from a driver connected with `ray.init`."""

    def __init__(self, gcs, timeout_s: float = 60.0):
        self.gcs, self.timeout_s = gcs, timeout_s

    @staticmethod
    def _pinned(node_id: str) -> dict:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # (lazy: ray)

        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)}

    def execute(self, decision: ChaosDecision, deadline_s: float) -> str:
        import ray  # (lazy: ray)


        kill_pid, kill_raylet = _remote_killers()
        node_id = decision.node.node_id
        if decision.action == "kill-worker":
            ran_on = ray.get(kill_pid.options(**self._pinned(node_id)).remote(decision.worker.pid, TRAIN_WORKER_TITLE),
                             timeout=self.timeout_s)
            assert ran_on == node_id, f"the kill task ran on {ran_on}, not {node_id}"
            return f"killed {TRAIN_WORKER_CLASS} pid {decision.worker.pid} on node {node_id}"
        if decision.action == "drain-node":
            deadline_ms = int(time.time() * 1000 + deadline_s * 1000)
            ray_nodes.drain_node(self.gcs, node_id,
                                 f"chaos drain-node: rehearsed preemption, deadline {deadline_s:g} s", deadline_ms)
            return f"node {node_id} draining with reason preemption, deadline in {deadline_s:g} s"
        started = time.monotonic()
        ref = kill_raylet.options(**self._pinned(node_id)).remote(node_id)
        try:
            ray.get(ref, timeout=self.timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError):
            raise  # the task refused (its error says why), or never ran
        except ray.exceptions.RayError:
            pass  # expected: the task killed its own node
        while time.monotonic() - started < self.timeout_s:
            node = next(n for n in ray_nodes.list_nodes(self.gcs) if n.node_id == node_id)
            if not node.alive:
                return f"node {node_id} killed: Ray marks it dead after {time.monotonic() - started:.1f} s"
            time.sleep(0.5)
        raise TimeoutError(f"node {node_id} still alive {self.timeout_s:g} s after its raylet was killed")
