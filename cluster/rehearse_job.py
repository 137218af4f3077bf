"""The rehearsal's job: a driver that asks for GPU workers the way Ray Train does (a placement
group of {CPU: 1, GPU: 1} bundles), runs one task per bundle on CPU, then watches the idle nodes
go. Prints one JSON line per event; run by cluster/rehearse.py as `python -m cluster.rehearse_job N`."""

import json
import socket
import sys
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

T0 = time.monotonic()


def emit(event: str, **fields) -> None:
    print(json.dumps({"t_s": round(time.monotonic() - T0, 1), "event": event, **fields}), flush=True)


def node_name(node: dict) -> str:
    """The end of the node id: fake node ids differ only in their last digits."""
    return f"node-{node['NodeID'][-6:]}"


def gpu_nodes() -> list[str]:
    return sorted(node_name(node) for node in ray.nodes() if node["Alive"] and node["Resources"].get("GPU", 0) > 0)


@ray.remote(num_cpus=1, num_gpus=1)
def work(rank: int) -> dict:
    total = sum(i * i for i in range(200_000))  # CPU work: the GPUs are logical only
    node_id = ray.get_runtime_context().get_node_id()
    node = next(node for node in ray.nodes() if node["NodeID"] == node_id)
    return {"rank": rank, "node": node_name(node), "host": socket.gethostname(), "checksum": total}


def main(workers: int, timeout_s: float) -> int:
    ray.init(address="auto", log_to_driver=False)
    emit("submitted", gpu_workers_needed=workers, gpu_nodes=gpu_nodes())
    group = placement_group([{"CPU": 1, "GPU": 1}] * workers, strategy="PACK")
    seen, deadline = -1, time.monotonic() + timeout_s
    while True:
        if time.monotonic() > deadline:
            emit("not_scaled_up", gpu_nodes=gpu_nodes())
            return 1
        ready, _ = ray.wait([group.ready()], timeout=1.0)
        nodes = gpu_nodes()
        if len(nodes) != seen:
            seen = len(nodes)
            emit("nodes", gpu_nodes=nodes)
        if ready:
            break
    results = ray.get([work.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote(i)
                       for i in range(workers)])
    emit("finished", ranks=len(results), nodes=sorted({r["node"] for r in results}))
    remove_placement_group(group)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nodes = gpu_nodes()
        if len(nodes) != seen:
            seen = len(nodes)
            emit("nodes", gpu_nodes=nodes)
        if not nodes:
            emit("scaled_down")
            return 0
        time.sleep(1.0)
    emit("not_scaled_down", gpu_nodes=gpu_nodes())
    return 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), float(sys.argv[2])))
