"""Distributed, fault-tolerant PyTorch training on Ray Train, tracked in MLflow.

Entry points: `python -m training` (training/cli.py) and `training.run.run_training`.
"""
