"""Data transforms as a user would write them, outside the training package (the parquet source's
`transform`), for the Spark-written digits table (tests/data/spark_digits: `pixels`, `digit`, and
the `day` its Hive folders give)."""

import numpy as np
import pyarrow as pa


def scale_pixels(table: pa.Table, scale: float = 16.0, fail_on_day: str = "") -> pa.Table:
    """Per batch: pixels scaled into [0, 1] as a fixed-size list of float32, the digit as the label,
    and the day (a Hive partition value, not in the files) as an int."""
    days = table.column("day").to_pylist()
    if fail_on_day and fail_on_day in days:
        raise RuntimeError(f"cannot handle day {fail_on_day}")
    pixels = table.column("pixels").combine_chunks()
    values = (pixels.flatten().to_numpy(zero_copy_only=False) / scale).astype(np.float32)
    width = len(values) // max(len(pixels), 1)
    return pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(values), width),
                     "label": table.column("digit"),
                     "day": pa.array([int(d.rsplit("-", 1)[-1]) for d in days], pa.int64())})


def odd_digits_as_dicts(row: dict, keep: str = "odd"):
    """Per row: only odd (or even) digits, as a dict; None leaves a row out."""
    if (row["digit"] % 2 == 1) != (keep == "odd"):
        return None
    return {"x": [p / 16.0 for p in row["pixels"]], "label": row["digit"] // 2}


def as_pandas(table: pa.Table):
    frame = table.select(["digit"]).to_pandas()
    frame["x"] = [[float(p) for p in row] for row in table.column("pixels").to_pylist()]
    return frame.rename(columns={"digit": "label"})


def no_label(table: pa.Table) -> pa.Table:
    return table.select(["pixels"])


def not_a_table(table: pa.Table):
    return [1, 2, 3]
