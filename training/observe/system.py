"""System metrics per node, for the run's MLflow "System metrics" tab.

Workers sample; only the controller writes to MLflow. Every worker samples its node (CPU and memory,
disk use, network since the start, and with `nvidia-ml-py` and a GPU its utilisation, memory and
power) under the names MLflow's own monitors give them, plus the disk and network throughput since
the last sample, and its own process's RSS. The samples are psutil's (and NVML's), read here as
MLflow's monitors read them, not through those monitors: importing them imports MLflow, ~1.6 s of
CPU that held a training worker's GIL one interval into the run (digits on 1 worker: 10% of its
steady throughput in the benchmark's overhead row); tests/test_system_metrics.py checks the names
against MLflow's monitors. The samples travel with the worker's next report (`SYSTEM_KEY`), and
the controller logs them as `system/<node>/<name>`, at the time they were taken: MLflow's names and
node prefixes, so its UI groups them per node. Of the workers on one node, the controller logs the
node's series from the first (in rank order) that has samples: a worker cannot tell which Ray node
its neighbours are on (Ray Train's local rank counts by IP address, which nodes may share), and a
sample costs well under a millisecond.

A monitor that fails is dropped with one warning; sampling never fails a step.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Callable, Optional

import psutil

SYSTEM_KEY = "system"  # the reported metrics' key for the samples since the last report
MAX_HELD = 360  # samples a worker holds for its next report (an hour at 10 s); the oldest go first


def node_label(node_id: str) -> str:
    """A node's prefix in the metric names: short, and one per Ray node."""
    return f"node-{node_id[:8]}"


class Throughput:
    """Disk and network megabytes per second since the previous sample (MLflow's monitors give use
    and totals, not rates)."""

    def __init__(self):
        self._psutil = psutil
        self._last = self._read()

    def _read(self) -> tuple[float, float, float, float, float]:
        disk, net = self._psutil.disk_io_counters(), self._psutil.net_io_counters()
        return (time.monotonic(), disk.read_bytes if disk else 0, disk.write_bytes if disk else 0,
                net.bytes_recv, net.bytes_sent)

    def sample(self) -> dict:
        now = self._read()
        seconds = max(now[0] - self._last[0], 1e-6)
        rates = [max(b - a, 0) / seconds / 1e6 for a, b in zip(self._last[1:], now[1:])]
        self._last = now
        return dict(zip(("disk_read_megabytes_per_s", "disk_write_megabytes_per_s",
                         "network_receive_megabytes_per_s", "network_transmit_megabytes_per_s"),
                        (round(r, 3) for r in rates)))


def cpu_sample() -> dict:
    memory = psutil.virtual_memory()
    return {"cpu_utilization_percentage": round(psutil.cpu_percent(), 1),
            "system_memory_usage_megabytes": round(memory.used / 1e6, 1),
            "system_memory_usage_percentage": round(memory.used / memory.total * 100, 1)}


def disk_sample() -> dict:
    usage = psutil.disk_usage(os.sep)
    return {"disk_usage_percentage": round(float(usage.percent), 1), "disk_usage_megabytes": round(usage.used / 1e6, 1),
            "disk_available_megabytes": round(usage.free / 1e6, 1)}


def network_monitor() -> Callable[[], dict]:
    """Megabytes received and sent since the monitor was made (the counters count since boot)."""
    start = psutil.net_io_counters()

    def sample() -> dict:
        now = psutil.net_io_counters()
        return {"network_receive_megabytes": (now.bytes_recv - start.bytes_recv) / 1e6,
                "network_transmit_megabytes": (now.bytes_sent - start.bytes_sent) / 1e6}
    return sample


def gpu_monitor() -> Callable[[], dict]:
    """Each GPU's memory, utilisation and power through NVML (`nvidia-ml-py`); ImportError or an
    NVML error where there is none."""
    import pynvml  # (an optional dependency: the `gpu` extra, on GPU nodes)

    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

    def sample() -> dict:
        values = {}
        for i, handle in enumerate(handles):
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            power_mw, limit_mw = pynvml.nvmlDeviceGetPowerUsage(handle), pynvml.nvmlDeviceGetEnforcedPowerLimit(handle)
            values.update({f"gpu_{i}_memory_usage_percentage": round(memory.used / memory.total * 100, 1),
                           f"gpu_{i}_memory_usage_megabytes": round(memory.used / 1e6, 1),
                           f"gpu_{i}_utilization_percentage": float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                           f"gpu_{i}_power_usage_watts": round(power_mw / 1000, 1),
                           f"gpu_{i}_power_usage_percentage": round(power_mw / limit_mw * 100, 1)})
        return values
    return sample


def node_monitors() -> list[tuple[str, Callable[[], dict]]]:
    """A node's monitors (the GPU's only where NVML is installed and finds a GPU), and the
    throughput one."""
    psutil.cpu_percent()  # the first call starts the count that the CPU sample reads
    monitors = [("cpu", cpu_sample), ("disk", disk_sample), ("network", network_monitor()),
                ("throughput", Throughput().sample)]
    try:
        monitors.append(("gpu", gpu_monitor()))
    except Exception:  # no nvidia-ml-py, or no GPU: those series are simply missing
        pass
    return monitors


WORKER_MONITOR = "worker"  # the monitor whose values are this worker's own, not its node's


def process_monitor(rank: int) -> tuple[str, Callable[[], dict]]:
    process = psutil.Process(os.getpid())
    return WORKER_MONITOR, lambda: {f"worker_{rank}_rss_megabytes": round(process.memory_info().rss / 1e6, 1)}


class SystemSampler:
    """Samples in a daemon thread: once as soon as it starts (`first_sample_s` in, so that the CPU
    figure covers a real span), then every `interval_s`; the worker takes one more with its run's
    last report (`sample_now`), so that a run shorter than the interval still has a series and no
    sample is taken after the last report, which would never be sent. `take()` hands over the
    samples since the last call, each {"time_s", "node", "node_values", "worker_values"}. A monitor
    that raises is dropped with a warning."""

    def __init__(self, interval_s: float, node: str,
                 monitors: list[tuple[str, Callable[[], dict]]] | Callable[[], list[tuple[str, Callable[[], dict]]]],
                 warn: Callable[[str], None] = lambda line: warnings.warn(line, stacklevel=2),
                 first_sample_s: float = 1.0):
        """`monitors`, or a function that builds them: then the first sample builds them, in the
        sampling thread (NVML's start on a GPU node is not on the worker's way to its first step)."""
        self.interval_s, self.node, self.warn = interval_s, node, warn
        self.first_sample_s = min(first_sample_s, interval_s)
        self._build = monitors if callable(monitors) else None
        self._monitors = [] if callable(monitors) else list(monitors)
        self._held: list[dict] = []
        self._lock = threading.Lock()  # the held samples
        self._sampling = threading.Lock()  # one sample at a time: the thread's, or the last report's
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def for_worker(cls, interval_s: float, node_id: str, rank: int) -> Optional["SystemSampler"]:
        """The sampler of a training worker, started; None when sampling is off (interval 0). A
        sampler that cannot even be built is a warning, and the run trains without one."""
        if not interval_s:
            return None
        sampler = cls(interval_s, node_label(node_id), lambda: node_monitors() + [process_monitor(rank)],
                      warn=lambda line: print(f"warning: {line}", flush=True))
        sampler.start()
        return sampler

    def build_monitors(self) -> None:
        """Build the monitors from the function given; one that fails turns sampling off with a
        warning (never a training failure)."""
        build, self._build = self._build, None
        try:
            self._monitors = build()
        except Exception as exc:  # noqa: BLE001
            self.warn(f"system metrics are off on this worker: {type(exc).__name__}: {exc}")

    def sample_now(self) -> None:
        with self._sampling:
            if self._build is not None:
                self.build_monitors()
            self._sample()

    def _sample(self) -> None:
        values: dict = {"node_values": {}, "worker_values": {}}
        for entry in list(self._monitors):
            name, monitor = entry
            try:
                values["worker_values" if name == WORKER_MONITOR else "node_values"].update(monitor())
            except Exception as exc:  # noqa: BLE001 (a sampler that fails is a warning)
                self._monitors.remove(entry)
                self.warn(f"system metrics: the {name} monitor failed ({type(exc).__name__}: {exc}); "
                          "its series stop here, training goes on")
        if values["node_values"] or values["worker_values"]:
            with self._lock:
                self._held.append({"time_s": time.time(), "node": self.node, **values})
                del self._held[:-MAX_HELD]

    def take(self) -> list[dict]:
        with self._lock:
            held, self._held = self._held, []
        return held

    def start(self) -> None:
        def loop():
            with self._sampling:  # (a last sample asked for meanwhile waits for the monitors)
                if self._build is not None:
                    self.build_monitors()
            if self._stop.wait(self.first_sample_s):
                return
            self.sample_now()
            while not self._stop.wait(self.interval_s):
                self.sample_now()

        self._thread = threading.Thread(target=loop, name="system-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


def mlflow_rows(reports: list[dict]) -> list[tuple[dict, float]]:
    """Every worker's samples in one report round (the reports in rank order), as
    ({"system/<node>/<name>": value}, time_s): each worker's own series, and each node's from the
    first worker on it that sampled the node."""
    rows, claimed = [], {}
    for index, metrics in enumerate(reports):
        for sample in metrics.get(SYSTEM_KEY) or ():
            node = sample["node"]
            values = dict(sample.get("worker_values") or {})
            if sample.get("node_values") and claimed.setdefault(node, index) == index:
                values.update(sample["node_values"])
            if values:
                prefix = f"system/{node}/"
                rows.append(({prefix + name: value for name, value in values.items()}, sample["time_s"]))
    return rows
