"""System metrics, the worker's side: real samples of this machine under the names of MLflow's
monitors, a monitor that fails, and the rows the controller logs. (The run on two nodes, with the samples in
MLflow from both: tests/test_fault_nodes.py.)"""

import inspect
import re
import threading
import time

import pytest

from training.observe.system import (
    SYSTEM_KEY,
    SystemSampler,
    gpu_monitor,
    mlflow_rows,
    node_label,
    node_monitors,
    process_monitor,
)


def test_a_node_sample_has_mlflows_series_the_throughput_and_the_workers_memory():
    sampler = SystemSampler(10, node_label("ab12cd34ef56"), node_monitors() + [process_monitor(0)])
    sampler.sample_now()
    with open(__file__, "rb") as f:  # (some disk and CPU between two samples)
        sum(f.read())
    sampler.sample_now()
    first, second = sampler.take()
    assert sampler.take() == []  # handed over once
    assert first["node"] == "node-ab12cd34" and first["time_s"] <= second["time_s"] <= time.time()
    values = second["node_values"]
    for name in ("cpu_utilization_percentage", "system_memory_usage_megabytes", "system_memory_usage_percentage",
                 "disk_usage_percentage", "disk_available_megabytes", "network_receive_megabytes",
                 "network_transmit_megabytes", "disk_read_megabytes_per_s", "disk_write_megabytes_per_s",
                 "network_receive_megabytes_per_s", "network_transmit_megabytes_per_s"):
        assert isinstance(values[name], float) and values[name] >= 0, name
    assert 0 < values["system_memory_usage_percentage"] <= 100
    # (megabytes, not bytes: this process holds numpy and pyarrow; sampling imports no MLflow)
    assert second["worker_values"]["worker_0_rss_megabytes"] > 20
    assert not any(name.startswith("gpu_") for name in values)  # no GPU here: those series are missing


def test_the_node_series_are_named_as_mlflows_own_monitors_name_theirs():
    """The series are sampled with psutil as MLflow's monitors sample them (importing those imports
    MLflow, which a training worker does without), under their names: MLflow's System metrics tab
    shows them as its own."""
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    ours = dict(node_monitors())
    for name, cls in (("cpu", CPUMonitor), ("disk", DiskMonitor), ("network", NetworkMonitor)):
        monitor = cls()
        monitor.collect_metrics()
        values = monitor.aggregate_metrics()
        monitor.clear_metrics()
        assert values and all(isinstance(v, (int, float)) for v in values.values()), name
        assert set(ours[name]()) == set(values), name
    # (no GPU here: the GPU's names are compared in the two monitors' source)
    pattern = re.compile(r'f"(gpu_\{i\}_\w+)"')
    theirs = set(pattern.findall(inspect.getsource(GPUMonitor)))
    assert len(theirs) == 5 and set(pattern.findall(inspect.getsource(gpu_monitor))) == theirs


def test_a_failing_monitor_is_dropped_with_one_warning_and_the_others_go_on():
    calls = []

    def broken():
        calls.append(1)
        raise OSError("no such device")

    warned = []
    sampler = SystemSampler(10, "node-1", [("gpu", broken), process_monitor(1)], warn=warned.append)
    for _ in range(3):
        sampler.sample_now()
    samples = sampler.take()
    assert len(samples) == 3 and all(s["node_values"] == {} and set(s["worker_values"]) == {"worker_1_rss_megabytes"}
                                     for s in samples)
    assert len(calls) == 1 and len(warned) == 1
    assert "gpu monitor failed" in warned[0] and "no such device" in warned[0] and "training goes on" in warned[0]


def test_nothing_to_sample_holds_nothing_and_the_held_samples_are_bounded(monkeypatch):
    from training.observe import system

    assert SystemSampler(10, "n", []).take() == []
    monkeypatch.setattr(system, "MAX_HELD", 4)
    sampler = SystemSampler(10, "n", [("count", lambda: {"x": 1.0})])
    for _ in range(10):
        sampler.sample_now()
    assert len(sampler.take()) == 4


def test_the_sampler_thread_samples_at_its_interval_and_stops():
    sampler = SystemSampler(0.05, "n", [process_monitor(0)])
    sampler.start()
    time.sleep(0.5)
    sampler.stop()
    time.sleep(0.1)
    taken = sampler.take()
    assert 3 <= len(taken) <= 11
    time.sleep(0.2)
    assert sampler.take() == []  # stopped


def test_a_worker_samples_as_it_starts_and_once_more_with_its_last_report():
    """A run shorter than the interval still has a series of two points: the sampler's first
    sample comes as soon as it starts (not one interval in), and the last report takes one more.
    The monitors are built in the sampling thread, not on the worker's way to its first step."""
    from conftest import wait_for

    built = []

    def build():
        built.append(threading.current_thread().name)
        return [("count", lambda: {"x": 1.0})]

    sampler = SystemSampler(3600, "n", build, first_sample_s=0.05)  # an interval no test waits out
    sampler.start()
    first = wait_for(sampler.take, 60, "the first sample, before one interval has passed")
    assert len(first) == 1 and built == ["system-metrics"]
    sampler.sample_now()  # the run's last report
    sampler.stop()
    (last,) = sampler.take()
    assert last["time_s"] >= first[0]["time_s"] and last["node_values"] == {"x": 1.0}

    # a last report before the thread's first sample: the monitors are built for it, once
    early = SystemSampler(3600, "n", build, first_sample_s=3600)
    early.start()
    early.sample_now()
    early.stop()
    assert len(early.take()) == 1 and len(built) == 2

    warned = []

    def broken():
        raise ImportError("no module named pynvml")

    failing = SystemSampler(3600, "n", broken, warn=warned.append, first_sample_s=0)
    failing.start()
    wait_for(lambda: warned, 60, "the warning of a sampler that cannot be built")
    failing.sample_now()
    failing.stop()
    assert failing.take() == [] and len(warned) == 1 and "system metrics are off" in warned[0]


def test_sampling_off_builds_no_sampler():
    assert SystemSampler.for_worker(0, "ab12cd34ef56", 0) is None


def test_every_workers_own_series_and_each_nodes_from_its_first_worker_become_mlflow_rows():
    def sample(time_s, node, cpu, rank, rss):
        return {"time_s": time_s, "node": node, "node_values": {"cpu_utilization_percentage": cpu} if cpu else {},
                "worker_values": {f"worker_{rank}_rss_megabytes": rss}}

    reports = [{"step": 10, SYSTEM_KEY: [sample(1.5, "node-a", 12.0, 0, 700.0)]},       # rank 0: node a
               {"step": 10, SYSTEM_KEY: [sample(1.6, "node-a", 13.0, 1, 800.0)]},       # rank 1: also node a
               {"step": 10, SYSTEM_KEY: [sample(1.7, "node-b", 50.0, 2, 900.0),         # rank 2: node b
                                         sample(2.7, "node-b", 51.0, 2, 901.0)]},
               {"step": 10}]                                                            # rank 3: nothing yet
    assert mlflow_rows(reports) == [
        ({"system/node-a/worker_0_rss_megabytes": 700.0, "system/node-a/cpu_utilization_percentage": 12.0}, 1.5),
        ({"system/node-a/worker_1_rss_megabytes": 800.0}, 1.6),  # node a's series: rank 0's only
        ({"system/node-b/worker_2_rss_megabytes": 900.0, "system/node-b/cpu_utilization_percentage": 50.0}, 1.7),
        ({"system/node-b/worker_2_rss_megabytes": 901.0, "system/node-b/cpu_utilization_percentage": 51.0}, 2.7)]
    # a round where node a's first worker has no sample: its series come from the next one on it
    assert mlflow_rows([{"step": 20}, {"step": 20, SYSTEM_KEY: [sample(3.0, "node-a", 14.0, 1, 810.0)]}]) == [
        ({"system/node-a/worker_1_rss_megabytes": 810.0, "system/node-a/cpu_utilization_percentage": 14.0}, 3.0)]


@pytest.mark.parametrize("value", ["-1", "often"])
def test_a_bad_sampling_interval_is_refused_naming_the_field(value):
    from conftest import CONFIGS

    from training import config as config_lib
    from training.errors import UserError

    with pytest.raises(UserError, match="tracking.system_metrics_interval_s"):
        config_lib.load(CONFIGS / "digits.yaml", [f"tracking.system_metrics_interval_s={value}"])
