"""Checkpoints: written and uploaded by the workers, read by workers, the driver and sweeps."""
