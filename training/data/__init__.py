"""Data: each source (training/data/registry.py) is planned and prepared by the driver into data
with a manifest; each worker reads its share of every global batch from it."""
