"""The model registry (driver): a finished run's logged model becomes a version of its registered
model, tagged with the run, its data and its score, and the alias `best` moves to it only when it
beats the version that holds it, on the run's `checkpoint.score_metric` in `checkpoint.score_mode`.

`@latest` is MLflow's own: it reserves the alias name and resolves `models:/<name>@latest` to the
newest version, which is the last run registered. So a user loads `models:/<name>@best` or
`@latest` and never a version number.

`decide` only decides (no MLflow), `register` carries the decision out with MLflow's client; the
client is called directly rather than through `mlflow.register_model`, which prints its progress
("Registered model ... already exists") to the console of a run that reports it anyway.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal, Optional

from training.tracking.tracker import fluent_mlflow

BEST_ALIAS = "best"
# Tags on every version this project registers (the names are part of its interface).
RUN_ID_TAG, DATA_DIGEST_TAG, SCORE_METRIC_TAG, SCORE_TAG = "run_id", "data_digest", "score_metric", "score"
# MLflow's tag on a logged model listing the versions registered from it (what mlflow.register_model sets):
# the logged model's page links to its versions by it.
_MODEL_VERSIONS_TAG = "mlflow.modelVersions"

RegisterWhen = Literal["always", "improved"]


@dataclass(frozen=True)
class Best:
    """The version that holds `@best`, with the score it was registered with (None: not comparable)."""

    version: str
    score_metric: Optional[str]
    score: Optional[float]


@dataclass(frozen=True)
class RegistrationDecision:
    register: bool
    move_best: bool
    reason: str  # one line: why the run is (or is not) the new best


def _beats(score: float, other: float, mode: str) -> bool:
    return score < other if mode == "min" else score > other


def decide(score: Optional[float], score_metric: str, score_mode: str, register_when: RegisterWhen,
           best: Optional[Best]) -> RegistrationDecision:
    """Whether a run with `score` (its last `score_metric`; None when it reported none) adds a version,
    and whether `@best` moves to it. A tie keeps `@best` where it is. A best registered on another
    metric (the config's score metric changed) or without a score cannot be compared: the run, which
    has a score on the metric now configured, takes `@best`."""
    if score is not None and not math.isfinite(score):
        score = None
    if best is None:
        move, reason = True, "the first version"
    elif score is None:
        move, reason = False, f"no {score_metric} reported: version {best.version} stays @best"
    elif best.score is None or best.score_metric != score_metric:
        move, reason = True, f"version {best.version}, @best until now, has no {score_metric} to compare"
    elif _beats(score, best.score, score_mode):
        move, reason = True, f"{score_metric} {score:.4g} beats version {best.version}'s {best.score:.4g}"
    else:
        move, reason = False, (f"{score_metric} {score:.4g} does not beat version {best.version}'s "
                               f"{best.score:.4g}, which stays @best")
    return RegistrationDecision(register=register_when == "always" or move, move_best=move, reason=reason)


def current_best(client, name: str) -> Optional[Best]:
    """The version holding `@best` of the registered model `name`; None if there is none (or no model)."""
    from mlflow.exceptions import MlflowException  # (lazy: mlflow)

    try:
        version = client.get_registered_model(name).aliases.get(BEST_ALIAS)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    if version is None:
        return None
    tags = client.get_model_version(name, str(version)).tags
    try:
        score = float(tags[SCORE_TAG])
    except (KeyError, ValueError):
        score = None
    return Best(str(version), tags.get(SCORE_METRIC_TAG), score)


def version_tags(run_id: str, data_digest: Optional[str], score_metric: str, score: Optional[float]) -> dict:
    return {RUN_ID_TAG: run_id, DATA_DIGEST_TAG: data_digest or "", SCORE_METRIC_TAG: score_metric,
            SCORE_TAG: "" if score is None else repr(float(score))}


def register(client, name: str, model_id: str, run_id: str, tags: dict, description: str,
             decision: RegistrationDecision) -> Optional[str]:
    """Carry out `decision` for the logged model `model_id`: a new version of `name` (the registered
    model made if new), its tags and description, `@best` moved if decided. Returns the version, or
    None when the decision registers nothing."""
    from mlflow.exceptions import MlflowException  # (lazy: mlflow)

    if not decision.register:
        return None
    try:
        client.create_registered_model(name, description="Registered by the training service: @best is the "
                                                         "best version on its score metric, @latest the newest.")
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise
    # A sqlite store looks the logged model of a models:/ source up through MLflow's global tracking
    # URI, not the client's: pointed at the client's store for the call.
    with fluent_mlflow(client.tracking_uri):
        version = str(client.create_model_version(name, f"models:/{model_id}", run_id=run_id, tags=tags,
                                                  description=description, model_id=model_id).version)
    if decision.move_best:
        client.set_registered_model_alias(name, BEST_ALIAS, version)
    logged = client.get_logged_model(model_id)
    listed = json.loads(logged.tags.get(_MODEL_VERSIONS_TAG) or "[]")
    client.set_logged_model_tags(model_id, {_MODEL_VERSIONS_TAG: json.dumps(
        listed + [{"name": name, "version": version}])})
    return version


def link_final_metrics(client, run_id: str, model_id: str, keys) -> dict:
    """Link the run's last value of each of `keys` to its logged model (shown on the model's page),
    re-sent exactly as first logged (same step, timestamp and value): the run's own history, which
    keeps one row per (key, step, timestamp, value), gains nothing. Returns what was linked."""
    from mlflow.entities import Metric  # (lazy: mlflow)

    reported = client.get_run(run_id).data.metrics
    last = []
    for key in dict.fromkeys(k for k in keys if k in reported):
        history = client.get_metric_history(run_id, key)
        if history:
            m = max(history, key=lambda m: (m.step, m.timestamp))
            last.append(Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id, run_id=run_id))
    if last:
        client.log_batch(run_id, metrics=last)
    return {m.key: m.value for m in last}
