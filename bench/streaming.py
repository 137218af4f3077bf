"""The streaming row: the `parquet` source's loader on generated data, against a raw sequential
read of the same files (`pyarrow.parquet.ParquetFile.iter_batches`), interleaved. No Ray: one
worker's part (rank 0 of 2) in this process, which is what a worker does per step."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

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


def _raw_rate(files: list[Path]) -> float:
    start, rows = time.perf_counter(), 0
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=ROW_GROUP):
            rows += batch.num_rows
    return rows / (time.perf_counter() - start)


def _loader_pass(manifest, partitions: int) -> dict:
    import psutil

    from training.data.external import train_stream
    from training.data.loader import BatchPlan

    process = psutil.Process()
    base = process.memory_info().rss
    start = time.perf_counter()
    shard = train_stream(manifest, BatchPlan(BATCH, 2, 0), seed=0)
    produced, peak, held = 0, base, 0
    for step in range(shard.steps_per_epoch):
        produced += len(shard.batch(step)["y"])
        held = max(held, len(shard.cache._cache))
        if step % 20 == 0:
            peak = max(peak, process.memory_info().rss)
    elapsed = time.perf_counter() - start
    shard.cache.close()
    group_rows = [shard.row_groups[g].rows for g in range(len(shard.row_groups))]
    return {"rows_per_s": produced / elapsed, "rss_growth": peak - base, "held": held,
            "capacity": shard.cache.capacity, "reads": shard.cache.reads, "groups": len(group_rows)}


def streaming(quick: bool) -> dict:
    from training.data.parquet import ParquetOptions, build_index
    from training.data.prepare import Manifest

    rows = 200_000 if quick else 2_000_000
    partitions, repeats = 16, (1 if quick else 3)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _write(root / "train", rows, 8, 0)
        _write(root / "validation", 4096, 1, 1)
        options = ParquetOptions(path=str(root / "train"), validation_path=str(root / "validation"), features="x",
                                 label="y", partitions=partitions)
        index = build_index(options)
        manifest = Manifest(root=str(root), source="parquet", options=options.model_dump(), task=index["task"],
                            spec=index["spec"], splits=index["splits"], schema=index["schema"], digest=index["digest"])
        files = sorted((root / "train").glob("*.parquet"))
        raw, loader = [], []
        for _ in range(repeats):  # interleaved: the page cache is warm for both after the first write
            raw.append(_raw_rate(files))
            loader.append(_loader_pass(manifest, partitions))
    row_group_bytes = ROW_GROUP * (FEATURES * 4 + 8)
    last = loader[-1]
    rates = [p["rows_per_s"] for p in loader]
    return {"rows": rows, "dataset_mb": round(rows * (FEATURES * 4 + 8) / 2**20, 1),
            "raw_iter_batches_rows_per_s": float(np.median(raw)), "loader_rows_per_s": float(np.median(rates)),
            "loader_vs_raw_read": float(np.median(rates) / np.median(raw)),
            "loader_spread": [round(min(rates) / np.median(raw), 3), round(max(rates) / np.median(raw), 3)],
            "read_fraction_per_worker": last["reads"] / last["groups"],
            "row_groups_held_max": last["held"], "budget_mb": round(last["capacity"] * row_group_bytes / 2**20, 1),
            "rss_growth_mb": round(last["rss_growth"] / 2**20, 1),
            "rss_growth_vs_budget": last["rss_growth"] / (last["capacity"] * row_group_bytes),
            "dataset_vs_budget": rows * (FEATURES * 4 + 8) / (last["capacity"] * row_group_bytes)}
