"""Chaos on a multi-node local cluster (`ray.cluster_utils.Cluster`): a lost node shrinks an
elastic run and a returning node grows it again, with the global batch unchanged; a node drained
for preemption gets a just-in-time checkpoint that the run resumes from, with no failure counted; in
failure.mode continue, a lost node stops nobody: the other worker steps on alone until a replacement
rejoins."""

import json
import os
import threading
import time

import pytest
from conftest import CONFIGS, private_cluster, tracked_history, wait_for

from training import config as config_lib
from training.checkpoint import format as ckpt
from training.metrics import mlflow_name
from training.run.driver import run_training

pytestmark = [pytest.mark.ray, pytest.mark.chaos, pytest.mark.slow]

# (no ONNX export at the end: seconds per run, and nothing here is about the exported model)
COMMON = ["train.global_batch_size=32", "train.log_every_n_steps=10", "train.min_report_interval_s=0",
          "scaling.cpus_per_worker=1", "train.torch_threads=1", "tracking.register_model=false",
          "tracking.export_onnx=false"]


# For this module's cluster: the default report poll (0.5 s; the reports every 10 steps hold a run
# to ~20 steps/s, so each phase of a run outlasts a node's loss or arrival), and a worker group
# whose placement group is not ready given up on after 5 s, not 60: after a node is lost, Ray
# Train sizes the next group from a reservation that still counts that node, waits for it, then
# retries smaller. (The timeout covers the placement group's reservation only, not the workers'
# start: on free 1-CPU nodes it is ready in well under a second; one given up on early is retried.)
CLUSTER_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "5"}


@pytest.fixture(scope="module")
def cluster():
    saved = {key: os.environ.get(key) for key in CLUSTER_ENV}
    os.environ.update(CLUSTER_ENV)  # inherited by every process of the cluster
    try:
        with private_cluster(worker_nodes=1, dashboard=True, log_to_driver=True) as (cluster, _):
            yield cluster
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def ensure_nodes(cluster, workers: int):
    """The head and exactly `workers` live worker nodes of 1 CPU, all CPUs free. A node that died
    without `remove_node` (a drained node past its deadline) is taken out of the Cluster's list
    first: its `wait_for_nodes` counts every node it added as one that must be alive."""
    import ray

    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    for node in [n for n in cluster.worker_nodes if n.node_id not in alive]:
        cluster.remove_node(node, allow_graceful=False)
    while len(cluster.worker_nodes) > workers:
        cluster.remove_node(cluster.worker_nodes[-1])
    while len(cluster.worker_nodes) < workers:
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes(timeout=120)  # (30 s by default: a node's start on a loaded machine can take longer)
    # and every CPU free: what the last test's run held is given back a little after it ends (seen on a
    # loaded machine: an elastic run started here with 1 worker, and never had one on the drained node)
    wait_for(lambda: ray.available_resources().get("CPU", 0) == workers + 1, 120, "every node's CPU free")


def checkpoints(run_dir):
    """step -> meta of every complete checkpoint in the run directory."""
    import pyarrow.fs as pafs

    found = {}
    for path in sorted(run_dir.glob("checkpoint-*")):
        if ckpt.is_complete(pafs.LocalFileSystem(), str(path)):
            found[ckpt.step_of(path.name)] = json.loads((path / ckpt.META_FILE).read_text())
    return found


def run_in_thread(job):
    outcome = {}

    def target():
        try:
            outcome["summary"] = run_training(job, log=print)
        except BaseException as exc:  # surfaced by the test
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def digest_history(workdir, name):
    from mlflow.tracking import MlflowClient

    _, run = loss_history(workdir, name)
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, mlflow_name("data_digest"))}


def loss_history(workdir, name):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id],
                                filter_string=f"tags.`training.run_name` = '{name}'")
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train_loss")}, run



def expected_digests(workdir, steps: int, seed: int = 0) -> dict[int, int]:
    """step -> the data digest a run of these global batches of 32 has after that step, computed here
    from the prepared data alone (at world size 1: the digest is the same at any size)."""
    from training.data.manifest import Manifest
    from training.data.order import DIGEST_MODULUS, BatchPlan, batch_digest
    from training.data.registry import source_of

    (root,) = (workdir / "runs" / "datasets").glob("digits-*")
    manifest = Manifest.load(str(root))
    shard = source_of(manifest.source).open(manifest, BatchPlan(32, 1, 0), seed)
    total, digests = 0, {}
    for step in range(steps):
        shard.batch(step)
        total = (total + batch_digest(step, shard.sample_ids(step))) % DIGEST_MODULUS
        digests[step + 1] = total
    return digests


def assert_system_metrics_from_every_node(workdir, run):
    """Each node's series under its own prefix, as MLflow's System metrics tab groups them: the
    node's, and the memory of the workers it ran; every node alive now among them."""
    import ray
    from mlflow.tracking import MlflowClient

    from training.observe.system import node_label

    nodes = {key.split("/")[1] for key in run.data.metrics if key.startswith("system/node-")}
    assert nodes >= {node_label(n["NodeID"]) for n in ray.nodes() if n["Alive"]}, run.data.metrics.keys()
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    for node in nodes:
        for name in ("cpu_utilization_percentage", "system_memory_usage_megabytes", "disk_usage_percentage",
                     "network_receive_megabytes_per_s"):
            history = client.get_metric_history(run.info.run_id, f"system/{node}/{name}")
            assert len(history) >= 3 and all(m.value >= 0 for m in history), (node, name)
        rss = [key for key in run.data.metrics if key.startswith(f"system/{node}/worker_")]
        assert rss and all(key.endswith("_rss_megabytes") for key in rss)  # (a rank per group it ran in)
        assert all(100 < m.value < 20_000 for key in rss for m in client.get_metric_history(run.info.run_id, key))  # MB


ELASTIC_STEPS = 1200


def test_a_lost_node_shrinks_the_run_and_a_new_one_grows_it(cluster, workdir):
    ensure_nodes(cluster, 1)
    # A checkpoint every 100 steps (5 s at 20 steps/s): each phase is seen as soon as it has one. The
    # group regrows at about step 500-800 (the node added at the first checkpoint at 1 worker, about
    # step 200, then 10-30 s to join and restart), with hundreds of steps left to train at 2 workers
    # again; 1200 leaves a regrowth up to 45 s late room. System metrics every second, from each node.
    job = config_lib.load(CONFIGS / "digits.yaml", COMMON + [
        f"train.max_steps={ELASTIC_STEPS}", "checkpoint.every_n_steps=100", "train.eval_every_n_steps=100",
        "scaling.num_workers=[1,2]", "scaling.resize_check_interval_s=2", "failure.max_failures=3",
        "tracking.system_metrics_interval_s=1"], name="elastic")
    run_dir = workdir / "runs" / "elastic"
    thread, outcome = run_in_thread(job)

    wait_for(lambda: any(m["world_size"] == 2 for m in checkpoints(run_dir).values()), 180, "a checkpoint at 2 workers")
    (worker_node,) = [node for node in cluster.worker_nodes]
    cluster.remove_node(worker_node)
    shrunk = wait_for(lambda: [s for s, m in checkpoints(run_dir).items() if m["world_size"] == 1],
                      180, "a checkpoint at 1 worker")
    cluster.add_node(num_cpus=1)
    wait_for(lambda: [s for s, m in checkpoints(run_dir).items() if m["world_size"] == 2 and s > min(shrunk)],
             180, "a checkpoint at 2 workers again")
    thread.join(timeout=300)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["summary"].steps == ELASTIC_STEPS

    _, run = loss_history(workdir, "elastic")
    sizes = {int(m.value) for m in __import__("mlflow").tracking.MlflowClient(
        f"sqlite:///{workdir}/mlflow.db").get_metric_history(run.info.run_id, mlflow_name("world_size"))}
    assert sizes == {1, 2}
    assert outcome["summary"].metrics["val_accuracy"] >= 0.9
    # One global batch of 32 at every world size: exactly the global batches of the data order, step
    # for step, through the shrink and the regrowth (each logged digest against the one computed
    # here from the data alone; a fixed-size run logs the same: tests/test_parquet_run.py)
    expected = expected_digests(workdir, ELASTIC_STEPS)
    logged = digest_history(workdir, "elastic")
    assert len(logged) >= 100 and all(logged[s] == expected[s] for s in logged)
    assert outcome["summary"].metrics["data_digest"] == expected[ELASTIC_STEPS]
    assert_system_metrics_from_every_node(workdir, run)  # (the lost node's, the new one's, the head's)


def test_a_node_drained_for_preemption_costs_no_steps(cluster, workdir, capfd):
    import ray
    from ray.core.generated import autoscaler_pb2

    ensure_nodes(cluster, 1)
    # max_failures=0: a preemption must not count as a failure. No regular checkpoint before the end:
    # every other one is the notice's. Drained early (about step 50-200), the final save comes at
    # most ~10 s (200 steps) after the notice: 900 steps leave hundreds to train on the remaining node.
    job = config_lib.load(CONFIGS / "digits.yaml", COMMON + [
        "train.max_steps=900", "checkpoint.every_n_steps=1000", "train.eval_every_n_steps=1000",
        "scaling.num_workers=[1,2]", "scaling.resize_check_interval_s=600", "failure.max_failures=0",
        "checkpoint.keep=10"], name="spot")
    run_dir = workdir / "runs" / "spot"
    thread, outcome = run_in_thread(job)
    # Drained once the run trains at 2 workers (its reports in MLflow): 3 s after the workers were
    # placed, as this once did, the group could still be starting, and a worker created on a
    # draining node never started.
    client = __import__("mlflow").tracking.MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    world_size = mlflow_name("world_size")
    wait_for(lambda: 2 in {int(m.value) for m in tracked_history(client, "digits", world_size, "spot")}, 180,
             "training at 2 workers, tracked")
    (worker_node,) = [node for node in cluster.worker_nodes]
    accepted, message = ray._raylet.GcsClient(address=cluster.address).drain_node(
        worker_node.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "spot interruption", int(time.time() * 1000) + 20_000)  # a 20 s notice
    try:
        assert accepted, message
        thread.join(timeout=300)
    finally:  # the instance ends, as the cloud ends a preempted one (a draining node takes no new work)
        cluster.remove_node(worker_node, allow_graceful=False)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["summary"].steps == 900
    output = capfd.readouterr()
    text = output.out + output.err
    (workdir / "output.txt").write_text(text)  # for a look when something below fails
    assert "preemption notice" in text and "preemption deadline near" in text

    # The notice's checkpoint, then the final one before the deadline; the run resumed from the
    # final one on the remaining node, and no step was taken after it by the old group.
    saved = sorted(s for s, m in checkpoints(run_dir).items() if "preemption_checkpoint_step" in m["metrics"])
    assert len(saved) == 2 and saved[-1] < 900, saved
    assert f"resumed from step {saved[-1]} with 1 worker (" in text
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    _, run = loss_history(workdir, "spot")
    sizes = {m.step: int(m.value) for m in client.get_metric_history(run.info.run_id, mlflow_name("world_size"))}
    # (the final save's own report can miss tracking: the controller registers a report after the
    # worker made it, and the drained node may go first; its checkpoint is what the run resumed from)
    assert max(step for step, size in sizes.items() if size == 2) <= saved[-1]
    assert min(step for step, size in sizes.items() if size == 1) > saved[-1]



def test_a_node_lost_in_continue_mode_stops_nobody(cluster, workdir):
    """failure.mode continue on three nodes of 1 CPU: the node of one training worker is lost; the
    other worker keeps its process and steps alone, Ray Train starts a replacement on the CPU that is
    left, and it rejoins; one MLflow run marks the short steps."""
    from ray.util.state import list_actors

    def train_workers(**state):
        filters = [("class_name", "=", "RayTrainWorker")] + [(k, "=", v) for k, v in state.items()]
        return {a.actor_id: a for a in list_actors(filters=filters, limit=1000)}

    ensure_nodes(cluster, 2)
    earlier = set(train_workers())  # (this module's other runs')
    job = config_lib.load(CONFIGS / "digits.yaml", COMMON + [
        "failure.mode=continue", "scaling.num_workers=2", "train.max_steps=800", "train.global_batch_size=64",
        "checkpoint.every_n_steps=400", "train.eval_every_n_steps=400", "failure.max_failures=3"], name="lostnode")
    thread, outcome = run_in_thread(job)
    client = __import__("mlflow").tracking.MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    wait_for(lambda: any(m.step >= 60 for m in tracked_history(client, "digits", "train_loss", "lostnode")), 240,
             "the run's reports past step 60")
    workers = list(train_workers(state="ALIVE").values())
    assert len(workers) == 2, workers
    head = cluster.head_node.node_id
    lost, survivor = sorted(workers, key=lambda actor: actor.node_id == head)  # a worker node's goes
    assert lost.node_id != head, "both training workers on the head"
    (node,) = [n for n in cluster.worker_nodes if n.node_id == lost.node_id]
    lost_at = time.time()
    cluster.remove_node(node)
    # The replacement comes while the survivor's actor (the same process) is alive: a full restart
    # would have replaced it too.
    replacement = wait_for(lambda: set(train_workers(state="ALIVE")) - {lost.actor_id, survivor.actor_id} - earlier,
                           180, "a replacement worker")
    assert survivor.actor_id in train_workers(state="ALIVE"), "the surviving worker went away"
    thread.join(timeout=300)
    assert "error" not in outcome, outcome.get("error")
    summary = outcome["summary"]
    assert summary.steps == 800 and summary.metrics["short_steps"] >= 1
    assert summary.metrics["samples_skipped"] >= 32 * summary.metrics["short_steps"]
    assert set(train_workers()) - earlier == {lost.actor_id, survivor.actor_id, *replacement}  # nobody else started

    (run,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id],
                                filter_string="tags.`training.run_name` = 'lostnode'")
    lost_events = client.get_metric_history(run.info.run_id, mlflow_name("replica_lost"))
    rejoined = client.get_metric_history(run.info.run_id, mlflow_name("replica_rejoined"))
    assert lost_events and rejoined and lost_at <= lost_events[0].timestamp / 1000 <= rejoined[0].timestamp / 1000
    replicas = client.get_metric_history(run.info.run_id, mlflow_name("replicas"))
    assert any(m.value == 1 for m in replicas) and max(m.step for m in replicas) == 800
