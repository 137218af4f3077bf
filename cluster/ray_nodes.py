"""The few Ray Core calls about nodes that the spot watcher and the chaos commands need, in one
place because they go through Ray's GCS client (`ray._raylet.GcsClient`, what `ray drain-node`
itself uses; not covered by Ray's API stability promise). Ray is imported lazily."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config import ConfigError

GCS_TIMEOUT_S = 15


class RayUnavailable(Exception):
    """The Ray cluster could not be reached or refused a request."""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str              # hex
    ip: str
    is_head: bool
    alive: bool
    draining: bool            # Ray schedules nothing new there
    death_reason: str = ""    # e.g. AUTOSCALER_DRAIN_PREEMPTED, once dead
    death_message: str = ""


def resolve_address(address: str | None) -> str:
    """host:port of the GCS: the given address, else $RAY_ADDRESS, else the cluster the last
    `ray start` on this machine joined (as the `ray` CLI does)."""
    from ray._private import services  # (lazy: ray)

    try:
        return services.canonicalize_bootstrap_address_or_die(address)
    except (ConnectionError, ValueError) as error:
        raise ConfigError(f"--address: {error}") from error


def gcs_client(address: str | None):
    from ray._raylet import GcsClient  # (lazy: ray)

    resolved = resolve_address(address)
    try:
        return GcsClient(address=resolved)
    except Exception as error:  # RpcError after Ray's own connect timeout
        raise RayUnavailable(f"cannot reach the Ray cluster at {resolved}: {error}") from error


def list_nodes(gcs) -> list[NodeInfo]:
    from ray.core.generated import gcs_pb2  # (lazy: ray)

    try:
        infos = gcs.get_all_node_info(timeout=GCS_TIMEOUT_S)
    except Exception as error:  # RpcError, timeout: one message for all of them
        raise RayUnavailable(f"cannot read the cluster's nodes from the GCS: {error}") from error
    alive_state = gcs_pb2.GcsNodeInfo.GcsNodeState.ALIVE
    draining_state = gcs_pb2.NodeSnapshot.State.DRAINING
    nodes = []
    for node_id, info in infos.items():
        reason_enum = info.death_info.DESCRIPTOR.fields_by_name["reason"].enum_type
        reason = reason_enum.values_by_number[info.death_info.reason].name if info.death_info.reason else ""
        nodes.append(NodeInfo(node_id=node_id.hex(), ip=info.node_manager_address, is_head=info.is_head_node,
                              alive=info.state == alive_state,
                              draining=info.state_snapshot.state == draining_state,
                              death_reason=reason, death_message=info.death_info.reason_message))
    return nodes


def draining_deadlines_ms(gcs) -> dict[str, int]:
    """{node id hex: drain deadline in Unix ms (0: none)}: what Ray Train's preemption watcher reads."""
    return dict(gcs.get_draining_nodes(timeout=GCS_TIMEOUT_S))


def check_node(nodes: list[NodeInfo], node_id: str) -> NodeInfo:
    for node in nodes:
        if node.node_id == node_id:
            if not node.alive:
                raise ConfigError(f"--node-id {node_id}: that node is dead")
            return node
    raise ConfigError(f"--node-id {node_id}: no such node in this cluster "
                      f"(alive: {', '.join(n.node_id for n in nodes if n.alive) or 'none'})")


def local_node_id(nodes: list[NodeInfo]) -> str:
    """This host's node: the raylets running here (found by their --node_id flag, as `ray.init`
    does) that are alive in this cluster. Exactly one is expected on a cloud instance."""
    from ray._private.services import find_node_ids  # (lazy: ray)

    local = set(find_node_ids())
    mine = sorted(node.node_id for node in nodes if node.alive and node.node_id in local)
    if not mine:
        raise ConfigError("no raylet of this cluster runs on this host: start Ray here first "
                          "(`ray start --address=...`) or pass --node-id")
    if len(mine) > 1:
        raise ConfigError(f"{len(mine)} nodes of this cluster run on this host ({', '.join(mine)}): "
                          "pass --node-id to say which one to watch")
    return mine[0]


def drain_node(gcs, node_id: str, reason_message: str, deadline_timestamp_ms: int) -> None:
    """`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`: the node takes no new work, Ray Train
    sees the preemption and its deadline, and the raylet exits once idle. A deadline of 0 would mean
    "none" to Ray, so callers always pass a real timestamp."""
    from ray.core.generated import autoscaler_pb2  # (lazy: ray)

    assert deadline_timestamp_ms > 0, "a drain deadline of 0 means 'no deadline' to Ray"
    try:
        accepted, rejection = gcs.drain_node(node_id, autoscaler_pb2.DRAIN_NODE_REASON_PREEMPTION,
                                             reason_message, deadline_timestamp_ms, timeout=GCS_TIMEOUT_S)
    except Exception as error:
        raise RayUnavailable(f"drain request for node {node_id} failed: {error}") from error
    if not accepted:
        raise RayUnavailable(f"drain request for node {node_id} rejected: {rejection}")


@dataclass(frozen=True)
class ActorProcess:
    actor_id: str
    class_name: str
    pid: int
    node_id: str


def alive_actors(class_name: str) -> list[ActorProcess]:
    """Alive actors of a class, from the GCS actor table (needs `ray.init`; no dashboard needed,
    unlike `ray.util.state.list_actors`)."""
    import ray._private.state  # (lazy: ray)

    table = ray._private.state.actors(actor_state_name="ALIVE")
    return [ActorProcess(actor_id=actor_id, class_name=info["ActorClassName"], pid=int(info["Pid"]),
                         node_id=info["Address"]["NodeID"])
            for actor_id, info in sorted(table.items())
            if info["ActorClassName"] == class_name and info.get("Pid")]
