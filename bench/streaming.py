"""The streaming row: the `parquet` source's loader on generated data, against a raw sequential
read of the same files (`pyarrow.parquet.ParquetFile.iter_batches`), interleaved. No Ray: one
worker's part (rank 0 of 2) in this process, which is what a worker does per step.

Each pass's CPU time (this process, every thread) is measured beside its wall time: the loader
decodes the row groups it reads as the raw read does (on read-ahead threads beside the consumer),
copies each into a slot of its cache, and copies every row of a batch once into its shuffled place.
Its CPU per row delivered against the raw read's (each pass's against the raw passes' median: the
spread), and the cores it keeps busy, say how far the rows/s ratio can go on this machine."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from bench.common import REPO
from training.data.files import list_splits
from training.data.manifest import Manifest
from training.data.order import BatchPlan
from training.data.parquet import ParquetOptions, open_stream
from training.data.parquet_index import build_index

FEATURES = 64
ROW_GROUP = 8192
BATCH = 256


def _write(folder: Path, rows: int, files: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for index, count in enumerate(np.array_split(np.arange(rows), files)):
        x = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(len(count) * FEATURES, dtype=np.float32)), FEATURES)
        pq.write_table(pa.table({"x": x, "y": pa.array(rng.integers(0, 10, len(count)))}),
                       folder / f"part-{index:05d}.parquet", row_group_size=ROW_GROUP)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _raw_pass(files: list[Path]) -> dict:
    start, cpu, rows = time.perf_counter(), _cpu_s(), 0
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=ROW_GROUP):
            rows += batch.num_rows
    elapsed = time.perf_counter() - start
    return {"rows_per_s": rows / elapsed, "cpu_s_per_row": (_cpu_s() - cpu) / rows,
            "cores_busy": (_cpu_s() - cpu) / elapsed}


def _loader_pass(manifest, partitions: int) -> dict:
    process = psutil.Process()
    base = process.memory_info().rss
    start, cpu = time.perf_counter(), _cpu_s()
    shard = open_stream(manifest, BatchPlan(BATCH, 2, 0), seed=0)
    produced, peak, held, watching_s = 0, base, 0, 0.0
    for step in range(shard.steps_per_epoch):
        produced += len(shard.batch(step)["y"])
        if step % 20 == 0:  # (the cache's size changes only where a chunk starts: 64 steps or more here)
            # this pass's own watching, no part of the loader's CPU (the raw pass has none): taken out
            watch = time.thread_time()
            held = max(held, len(shard.cache._cache))
            peak = max(peak, process.memory_info().rss)
            watching_s += time.thread_time() - watch
    elapsed, cpu = time.perf_counter() - start, _cpu_s() - cpu - watching_s
    shard.close()
    group_rows = [shard.row_groups[g].rows for g in range(len(shard.row_groups))]
    return {"rows_per_s": produced / elapsed, "cpu_s_per_row": cpu / produced, "cores_busy": cpu / elapsed,
            "rss_growth": peak - base, "held": held,
            "capacity": shard.cache.capacity, "reads": shard.cache.reads, "groups": len(group_rows)}


def streaming(quick: bool) -> dict:
    rows = 200_000 if quick else 3_300_000  # full: the dataset over 8x the loader's memory budget
    partitions, repeats = 16, (1 if quick else 5)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _write(root / "train", rows, 8, 0)
        _write(root / "validation", 4096, 1, 1)
        options = ParquetOptions(path=str(root / "train"), validation_path=str(root / "validation"), features="x",
                                 label="y", partitions=partitions)
        index = build_index(list_splits(options.path, options.validation_path, None), options.columns())
        manifest = Manifest(root=str(root), source="parquet", options=options.model_dump(), task=index["task"],
                            spec=index["spec"], splits=index["splits"], schema=index["schema"], digest=index["digest"])
        files = sorted((root / "train").glob("*.parquet"))
        raw, loader = [], []
        for _ in range(repeats):  # interleaved: the page cache is warm for both after the first write
            raw.append(_raw_pass(files))
            loader.append(_loader_pass(manifest, partitions))
    row_group_bytes = ROW_GROUP * (FEATURES * 4 + 8)
    last = loader[-1]
    rates, raw_rates = [p["rows_per_s"] for p in loader], [p["rows_per_s"] for p in raw]
    raw_cpu = float(np.median([p["cpu_s_per_row"] for p in raw]))
    cpu_ratios = [p["cpu_s_per_row"] / raw_cpu for p in loader]
    return {"rows": rows, "dataset_mb": round(rows * (FEATURES * 4 + 8) / 2**20, 1),
            "raw_iter_batches_rows_per_s": float(np.median(raw_rates)), "loader_rows_per_s": float(np.median(rates)),
            "loader_vs_raw_read": float(np.median(rates) / np.median(raw_rates)),
            "loader_spread": [round(min(rates) / np.median(raw_rates), 3), round(max(rates) / np.median(raw_rates), 3)],
            # CPU per row delivered over the raw read's, and the cores each keeps busy (medians)
            "loader_cpu_per_row_vs_raw": float(np.median(cpu_ratios)),
            "loader_cpu_per_row_spread": [round(min(cpu_ratios), 3), round(max(cpu_ratios), 3)],
            "loader_cores_busy": float(np.median([p["cores_busy"] for p in loader])),
            "raw_cores_busy": float(np.median([p["cores_busy"] for p in raw])),
            "read_fraction_per_worker": last["reads"] / last["groups"],
            "row_groups_held_max": last["held"], "budget_mb": round(last["capacity"] * row_group_bytes / 2**20, 1),
            "rss_growth_mb": round(last["rss_growth"] / 2**20, 1),
            "rss_growth_vs_budget": last["rss_growth"] / (last["capacity"] * row_group_bytes),
            "dataset_vs_budget": rows * (FEATURES * 4 + 8) / (last["capacity"] * row_group_bytes)}


# The driver while it prepares data: its peak RSS for a dataset 10x larger than another, each in a
# fresh process (the parquet source: an index of footers; the text source tokenized in the driver,
# file by file, with a tokenizer trained on a bounded sample).
_PREPARE = """
import sys
import json
from training.data.registry import data_section, prepare
prepare(data_section(json.loads(sys.argv[1])), sys.argv[2], log=lambda *a, **k: None)
# this process's own high-water mark (VmHWM: its memory since exec, unlike ru_maxrss, which keeps the
# forked parent's)
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def _peak_rss_of_prepare(data: dict, cache: Path) -> int:
    result = subprocess.run([sys.executable, "-c", _PREPARE, json.dumps(data), str(cache)], cwd=REPO,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"prepare exited {result.returncode} for {data['source']}: {result.stderr[-2000:]}")
    return int(result.stdout.split()[-1]) * 1024  # kB


def _write_text(folder: Path, files: int, seed: int, lines_per_file: int) -> None:
    """Text files of Python-like lines (about 40 bytes each)."""
    rng = np.random.default_rng(seed)
    words = np.array(["def", "return", "self", "value", "import", "for", "in", "if", "else", "None", "class",
                      "yield", "lambda", "print", "range", "len", "data", "index", "result", "with"])
    folder.mkdir(parents=True)
    for index in range(files):
        lines = [" ".join(rng.choice(words, 8)) for _ in range(lines_per_file)]
        (folder / f"doc-{index:04d}.txt").write_text("\n".join(lines) + "\n")


def driver_memory(quick: bool) -> dict:
    """Peak driver RSS preparing a dataset 10x larger than another, per source."""
    small_files, rows_per_file, lines_per_file = (2, 10_000, 1000) if quick else (4, 100_000, 10_000)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for scale in (1, 10):
            _write(root / f"parquet-{scale}", small_files * scale * rows_per_file, small_files * scale, scale)
            _write_text(root / f"text-{scale}", small_files * scale, scale, lines_per_file)
        for source in ("parquet", "text"):
            peaks, sizes = {}, {}
            for scale in (1, 10):
                folder = root / f"{source}-{scale}"
                if source == "parquet":
                    options = {"path": str(folder), "features": "x", "label": "y", "validation_fraction": 0.2}
                else:
                    options = {"path": str(folder), "validation_fraction": 0.2, "seq_len": 64, "tokenize_on": "driver",
                               "tokenizer": {"train": {"vocab_size": 512, "sample_bytes": 1_000_000}}}
                peaks[scale] = _peak_rss_of_prepare({"source": source, "options": options},
                                                    root / f"cache-{source}-{scale}")
                sizes[scale] = sum(p.stat().st_size for p in folder.iterdir())
            results[source] = {"small_mb": round(sizes[1] / 2**20, 1), "large_mb": round(sizes[10] / 2**20, 1),
                               "small_peak_rss_mb": round(peaks[1] / 2**20, 1),
                               "large_peak_rss_mb": round(peaks[10] / 2**20, 1),
                               "large_vs_small_peak_rss": peaks[10] / peaks[1]}
    return results
