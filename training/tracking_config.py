"""The job config's `tracking` section (MLflow: where, what is registered, how the final model is
logged, webhooks, system metrics), composed into training/config.py's JobConfig. No MLflow import."""

from __future__ import annotations

import posixpath
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from training.observe.notify import RUN_EVENTS, check_written
from training.schema import Section, printable


class NotifyConfig(Section):
    # A webhook: https://... or ${VARIABLE} naming one (resolved when the run starts, never stored).
    url: str
    # The events to post: finished, failed, preempted, restarted (sweeps: finished, failed).
    on: list[Literal[RUN_EVENTS]] = Field(
        default_factory=lambda: ["finished", "failed"], min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _yaml_on(cls, value):
        # YAML 1.1 (PyYAML) reads the key `on` as the boolean true: take it as the key it was written as.
        if isinstance(value, dict) and True in value and "on" not in value:
            value = {("on" if key is True else key): child for key, child in value.items()}
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value):
        return check_written(value)


class TrackingConfig(Section):
    enabled: bool = True
    # Default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the base directory.
    tracking_uri: Optional[str] = None
    experiment: str = Field("training", min_length=1)
    register_model: bool = True
    # Registry name; default "<data.source>-<model.name>". Each version is tagged run_id, data_digest,
    # score_metric and score (the run's last checkpoint.score_metric); the alias @best moves to a
    # version only when its score beats @best's (checkpoint.score_mode), @latest is the newest.
    registered_model_name: Optional[str] = None
    # Which runs add a version: "always" (every run), or "improved" (only a run that beats @best).
    register_when: Literal["always", "improved"] = "always"
    # A cluster config (cluster.yaml) to price the run by; default $TRAINING_CLUSTER_CONFIG.
    cluster_config: Optional[str] = None
    # Export the final model to ONNX (checked against PyTorch with onnxruntime) and log it as an
    # artifact. Default: on for built-in models, off for plug-ins. A failed export only warns.
    export_onnx: Optional[bool] = None
    # How the final model is logged to MLflow: "pt2" (torch.export: loading runs no code of the
    # model's) or "pickle" (any model, but loading it unpickles, which can run arbitrary code).
    model_format: Literal["pt2", "pickle"] = "pt2"
    # Webhooks posted when the run (or sweep) ends or its workers restart; a failed post only warns.
    notify: list[NotifyConfig] = Field(default_factory=list)
    # Seconds between system-metric samples on every node (CPU, memory, disk, network, GPU; each
    # worker's RSS), logged to the run's "System metrics" in MLflow; 0 turns them off.
    system_metrics_interval_s: float = Field(10.0, ge=0)

    @field_validator("tracking_uri", "cluster_config")
    @classmethod
    def _location(cls, value):
        return printable(value)

    @field_validator("registered_model_name")
    @classmethod
    def _registry_name(cls, value):
        # MLflow's own rules (mlflow.utils.validation._validate_model_name), asked here so that a name
        # the registry refuses fails now, not when the finished model is registered; MLflow itself
        # is not imported for it (seconds, on every command).
        if value is None:
            return value
        if not value.strip():
            raise ValueError("must not be empty; leave it out for the default <data.source>-<model.name>")
        if "/" in value or ":" in value:
            raise ValueError(f"{value!r} contains '/' or ':', which MLflow's model registry refuses")
        if posixpath.normpath(value) != value or value == "." or value.startswith(".."):  # ".", "..x"
            raise ValueError(f"{value!r} reads as a path that MLflow's model registry refuses; use letters, "
                             "digits, '_', '-' and '.'")
        return value
