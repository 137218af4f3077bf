"""Tracking in MLflow: written from the driver and the Ray Train controller, never the workers."""
