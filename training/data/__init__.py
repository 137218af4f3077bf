"""Data: sources -> Parquet shards with a manifest -> each worker's share of every global batch."""
