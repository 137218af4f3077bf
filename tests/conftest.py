import os
import sys
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

    if ray.is_initialized():
        ray.shutdown()
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
