"""Benchmarks: the service measured against raw PyTorch and against itself, as ratios in one run."""
