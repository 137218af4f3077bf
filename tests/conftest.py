import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "training" / "configs"

# Keep Ray's per-run chatter small and its controller responsive on a 2-core machine. The Train
# controller takes one report per worker per poll: the tests report every few steps
# (train.min_report_interval_s=0), and at the default 0.5 s poll a digits run could not pass 20 steps/s
# (100 with this poll), whatever the run proves. Every Ray a test starts inherits this environment.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")
os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers (failure.mode continue)
sys.path.insert(0, str(REPO / "tests"))  # plug-in examples under tests/plugins

# Every Ray this test session starts (ray.init, `ray start`, ray.cluster_utils.Cluster, and the
# commands the tests run, which inherit the variable) keeps its session files and its "current
# cluster" address file in a directory of its own, under /tmp for short socket paths. A test then
# never joins a cluster it did not start, such as one that someone else on this machine started with
# `ray start` (whose address Ray records in /tmp/ray), and nobody else joins ours.
SESSION_PREFIX = "raytests-"
OWNER_FILE = "owner"


def _process_start_ticks(pid: int):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _stop_what_dead_sessions_left() -> None:
    """Kill the processes that an earlier session of this suite left behind (it was killed before
    it could stop its Ray), found by the RAY_TMPDIR they inherited, and remove its directory.
    Nothing else is touched: not Ray clusters that others on this machine run, nor live sessions."""
    for directory in Path("/tmp").glob(f"{SESSION_PREFIX}*"):
        try:
            pid, ticks = (directory / OWNER_FILE).read_text().split()
            alive = _process_start_ticks(int(pid)) == ticks
        except (OSError, ValueError):  # being made this instant, or emptied at its end and written again
            try:
                alive = time.time() - directory.stat().st_mtime < 600  # by a Ray process that was stopping
            except OSError:
                continue
        if alive:
            continue  # that session is still running
        marker = f"RAY_TMPDIR={directory}".encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                variables = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(v == marker or v.startswith(marker + b"/") for v in variables):
                try:
                    os.kill(int(proc.name), signal.SIGKILL)
                except OSError:
                    pass
        shutil.rmtree(directory, ignore_errors=True)


def _private_ray_tmpdir() -> Path:
    _stop_what_dead_sessions_left()
    directory = Path(tempfile.mkdtemp(prefix=SESSION_PREFIX, dir="/tmp"))
    (directory / OWNER_FILE).write_text(f"{os.getpid()} {_process_start_ticks(os.getpid())}")
    return directory


RAY_TMPDIR = _private_ray_tmpdir()
os.environ["RAY_TMPDIR"] = str(RAY_TMPDIR)


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


_shared = {"up": False}


def _stop_shared_cluster() -> None:
    if _shared["up"]:
        import ray

        ray.shutdown()
        _shared["up"] = False


@pytest.fixture
def ray_cluster():
    """The local Ray cluster of 2 CPUs that the tests asking for it share (starting one costs 5-20 s).
    Started by the first such test; stopped before a Ray test that starts its own Ray, and at the
    end (see pytest_collection_modifyitems and pytest_runtest_teardown below)."""
    import ray

    if _shared["up"] and ray.is_initialized() and not _all_cpus_free(ray, timeout_s=10):
        # What an earlier test left holding CPUs (seen: a PBT sweep's trial whose Train controller
        # and 0.5-CPU worker group outlived the sweep) would leave this test's workers unplaceable, and
        # Ray Train retries an unplaceable group without end: start a clean cluster instead.
        warnings.warn(f"the shared Ray cluster still had CPUs held after the last test "
                      f"({ray.available_resources().get('CPU', 0):g} of "
                      f"{ray.cluster_resources().get('CPU', 0):g} free): restarted it")
        _stop_shared_cluster()
    if not (_shared["up"] and ray.is_initialized()):
        from training.run.session import live_local_cluster

        if ray.is_initialized():
            ray.shutdown()
        live_local_cluster()  # forgets a dead cluster's address, which Ray's state API would wait on
        # The plug-in examples importable on the workers: on the PYTHONPATH of the processes this
        # starts (the raylet, and the workers it starts). Not a runtime_env's py_modules, which
        # starts every worker of every test through the runtime-env agent (2-3 s more per test
        # with a worker group, measured).
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"), before]))
        try:
            ray.init(address="local", num_cpus=2, log_to_driver=True)
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before
        _shared["up"] = True
    yield ray


def _all_cpus_free(ray, timeout_s: float) -> bool:
    """Whether every CPU of the connected cluster is free (none held by an actor or a placement
    group) within timeout_s: what a finished run holds is given back a little after it ends."""
    try:
        wait_for(lambda: ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0) > 0,
                 timeout_s, "every CPU free")
        return True
    except AssertionError:
        return False


def _uses_shared_cluster(item) -> bool:
    return "ray_cluster" in getattr(item, "fixturenames", ())


def _lane(item) -> int:
    """0: no Ray; 1: a Ray test that starts its own (a private cluster, a `ray start` head, a command
    that starts Ray); 2: the quick bench's fault and sweep rows (their own Ray, in a subprocess),
    before 3: the tests on the shared cluster. The bench's other rows are in lane 1: the two groups
    then take about as long."""
    if not item.get_closest_marker("ray"):
        return 0
    if _uses_shared_cluster(item):
        return 3
    return 2 if item.module.__name__ == "test_bench" and "single_run" not in item.name else 1


def pytest_collection_modifyitems(session, config, items):
    """The tests without Ray first, then the Ray tests that start their own Ray, then the quick bench
    and the tests on the shared cluster (so that it starts once). Tests keep their order within a
    module and a lane (module fixtures stay shared).

    Under pytest-xdist (`make test`: `-n 2 --dist loadgroup`) the Ray tests are in two groups, each
    run in this order by one worker, one test at a time: those that start their own Ray, and the
    quick bench with the tests on the shared cluster (a worker's own). Both workers first share the
    tests without Ray, then take a group each: two Ray tests at a time, never more (on 2 cores the
    wait-bound ones, waiting on a restart, a node or a sweep, leave a CPU to the other). (A third
    worker running the tests without Ray alongside the two groups was measured slower: 29:00 of
    tests against 27:38, the quick bench's rows above all.)"""
    modules = {name: index for index, name in enumerate(dict.fromkeys(item.module.__name__ for item in items))}
    items.sort(key=lambda item: (_lane(item), modules[item.module.__name__]))


def pytest_itemcollected(item):
    if _uses_shared_cluster(item) and not item.get_closest_marker("ray"):
        item.add_marker(pytest.mark.ray)  # (a test on the shared cluster is a Ray test, marked or not)
    if item.get_closest_marker("ray"):  # (marked here, before pytest-xdist reads the marks)
        item.add_marker(pytest.mark.xdist_group("ray" if _lane(item) >= 2 else "ray-own"))


def pytest_runtest_teardown(item, nextitem):
    # A Ray test that brings its own cluster (a private multi-node one, a `ray start` head, a command
    # that starts Ray) must find none running here.
    if nextitem is not None and nextitem.get_closest_marker("ray") and not _uses_shared_cluster(nextitem):
        _stop_shared_cluster()


def pytest_sessionfinish(session, exitstatus):
    _stop_shared_cluster()
    shutil.rmtree(RAY_TMPDIR, ignore_errors=True)


@pytest.fixture(scope="session")
def moto_endpoint():
    """One moto_server (AWS on loopback) for every test that needs one: starting it costs seconds.
    Each test works in buckets and resources of its own names."""
    from aws import moto_server

    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def empty_mlflow_db(tmp_path_factory):
    """An MLflow sqlite store with its tables made and nothing in them. A new store runs MLflow's
    schema migrations (3-9 s here); a copy of this one is current at once. Copied where a test's
    runs would otherwise create their store."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def workdir(tmp_path, monkeypatch, empty_mlflow_db):
    """A fresh base directory: runs/, the data cache and mlflow.db (an empty store) live under it."""
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    monkeypatch.setenv("TRAINING_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def train_worker_pids() -> list[int]:
    """Ray Train worker processes (Ray names them ray::RayTrainWorker...) of a cluster this test
    process started: never a worker of another Ray on this machine, such as the other test lane's."""
    from bench.recovery import train_worker_pids as descendants

    return descendants()


def wait_for(condition, timeout_s: float, what: str):
    """Poll condition() until it returns something true (returned), or fail naming what was awaited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def tracked_history(client, experiment: str, metric: str, run_name: str | None = None) -> list:
    """MLflow's history of `metric` for a run in `experiment` (the run named `run_name`, or the first
    one found) so far: empty before the run exists, or while the store is locked by the run's own
    writes (sqlite, written by another process)."""
    from mlflow.exceptions import MlflowException

    try:
        found = client.get_experiment_by_name(experiment)
        where = f"tags.`training.run_name` = '{run_name}'" if run_name else ""
        runs = client.search_runs([found.experiment_id], filter_string=where) if found else []
        return client.get_metric_history(runs[0].info.run_id, metric) if runs else []
    except MlflowException:
        return []


def first_exploit(runs: Path, max_steps: int) -> tuple[Path, int]:
    """A PBT sweep's first exploit before the last step (an exploit at the last step has nothing
    left to train): the new training run's directory (`<trial run>-x<step>`) and the donor's step."""
    step_of = lambda p: int(p.name.rsplit("-x", 1)[1])  # noqa: E731
    exploits = sorted((p for p in runs.iterdir() if "-x" in p.name and step_of(p) < max_steps), key=step_of)
    assert exploits, "PBT exploited no trial before the end"
    return exploits[0], step_of(exploits[0])


@contextmanager
def private_cluster(worker_nodes: int, dashboard: bool = False, log_to_driver: bool = False):
    """A head and `worker_nodes` nodes of 1 CPU (ray.cluster_utils.Cluster), connected, with Ray's
    temp dir (and its "current cluster" file) kept private so that nothing else joins it, or waits
    on it once it is gone. `dashboard`: serve the state API (Ray Train's placement-group cleaner)."""
    import ray
    from ray.cluster_utils import Cluster

    old_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="c", dir=RAY_TMPDIR)
    _stop_shared_cluster()
    if ray.is_initialized():
        ray.shutdown()
    head = {"num_cpus": 1, "include_dashboard": dashboard}
    if dashboard:  # a port of its own: 8265 may be another Ray's on this machine (Cluster does not move on)
        from aws import free_port

        head["dashboard_port"] = free_port()
    cluster = Cluster(initialize_head=True, head_node_args=head)
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
