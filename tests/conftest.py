import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "training" / "configs"

# Keep Ray's per-run chatter small and its controller responsive on a 2-core machine.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")
sys.path.insert(0, str(REPO / "tests"))  # plug-in examples under tests/plugins


@pytest.fixture(autouse=True)
def _tracking_uri_unchanged():
    """mlflow.set_tracking_uri (in a test, to load a model) exports MLFLOW_TRACKING_URI; put it back,
    or every later run in this process, and every process started from it, would track there."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster per test module (starting one costs 5-20 s)."""
    import ray

    from training.run.session import live_local_cluster

    if ray.is_initialized():
        ray.shutdown()
    live_local_cluster()  # forgets a dead cluster's address, which Ray's state API would wait on
    ray.init(address="local", num_cpus=2, log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh base directory: runs/, the data cache and mlflow.db live under it."""
    monkeypatch.setenv("TRAINING_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def wait_for(condition, timeout_s: float, what: str):
    """Poll condition() until it returns something true (returned), or fail naming what was awaited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")


@contextmanager
def private_cluster(ray_tmpdir, worker_nodes: int, dashboard: bool = False, log_to_driver: bool = False):
    """A head and `worker_nodes` nodes of 1 CPU (ray.cluster_utils.Cluster), connected, with Ray's
    temp dir (and its "current cluster" file) kept private so that nothing else joins it, or waits
    on it once it is gone. `dashboard`: serve the state API (Ray Train's placement-group cleaner)."""
    import ray
    from ray.cluster_utils import Cluster

    old_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(ray_tmpdir)
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": dashboard})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(worker_nodes)]
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=log_to_driver)
    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
        if old_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old_tmpdir
