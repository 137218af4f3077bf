"""Distributed, fault-tolerant PyTorch training on Ray Train, tracked in MLflow.

Entry points: `python -m training` (training/run/cli.py) and `training.run.driver.run_training`.
Which process runs what: `run/` the driver, `worker/` the Ray Train workers, `tracking/` the driver
and the Ray Train controller, `checkpoint/` written by the workers and read by all. The three seams
along which the service grows, each a registry of one module per member: `data/` (data sources),
`models/` (model families) and `failure/` (failure modes); `tasks.py` is what a model learns from
the data, defined once.
"""
