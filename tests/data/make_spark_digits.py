"""Writes tests/data/spark_digits: scikit-learn's digits as a Spark table, by Spark itself.

    pip install pyspark numpy scikit-learn   # and a Java 17+ runtime (apt-get install openjdk-17-jre-headless)
    python tests/data/make_spark_digits.py

The table is what a Spark job leaves in a warehouse: Hive-partitioned by a string column
(`day=.../`), `part-*.snappy.parquet` files written by parquet-mr, with Hadoop's `.crc` files and
`_SUCCESS` beside them, a Parquet LIST column of floats (Spark's `array<float>`), an integer label,
and columns the training does not read (a long id, an INT96 timestamp: Spark's default). Small row
groups (a 16 KiB block size), so each file holds several. The tests read the committed output, so
they need neither Java nor Spark; rerun this to check a newer Spark writes what they expect.
"""

import datetime
import shutil
import sys
from pathlib import Path

import numpy as np
from pyspark.sql import SparkSession
from pyspark.sql import types as T
from sklearn.datasets import load_digits

OUT = Path(__file__).resolve().parent / "spark_digits"


def write(out: Path) -> None:
    """The digits table at `out`, replaced if it exists."""
    digits = load_digits()
    x, y = (digits.data / 16).astype(np.float32), digits.target.astype(np.int32)
    day = np.random.default_rng(0).integers(0, 2, len(y))
    start = datetime.datetime(2026, 1, 1, 8, 0, 0)
    rows = [(int(i), [float(v) for v in x[i]], int(y[i]), f"2026-01-0{day[i] + 1}",
             start + datetime.timedelta(seconds=int(i))) for i in range(len(y))]
    schema = T.StructType([T.StructField("id", T.LongType(), False),
                           T.StructField("pixels", T.ArrayType(T.FloatType(), False), False),
                           T.StructField("digit", T.IntegerType(), False),
                           T.StructField("day", T.StringType(), False),
                           T.StructField("captured_at", T.TimestampType(), False)])
    spark = (SparkSession.builder.master("local[2]").appName("spark-digits")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.session.timeZone", "UTC")
             .config("spark.hadoop.parquet.block.size", str(16 * 1024))
             .getOrCreate())
    try:
        frame = spark.createDataFrame(rows, schema).repartition(4, "id")
        shutil.rmtree(out, ignore_errors=True)
        frame.write.partitionBy("day").parquet(str(out))
        print(f"spark {spark.version} wrote {frame.count()} rows to {out}")
    finally:
        spark.stop()


def main() -> int:
    write(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
