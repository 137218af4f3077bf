"""Hyperparameter sweeps with Ray Tune, every trial a fault-tolerant training run of `training`."""
