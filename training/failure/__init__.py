"""Failure modes: how a run survives a lost worker (training/failure/registry.py)."""
