"""Webhook targets and messages (any process; pure: no network, no clock of its own).

A target's URL is written in the config (`tracking.notify: [{url, on}]`) and may reference
environment variables (`${SLACK_WEBHOOK}`). The written form is what configs, MLflow params and run
files show (a literal URL is shown as `scheme://host/***`: a webhook's path is its secret); the
resolved URL exists only in the memory of the processes that post (the driver, the Train controller).
"""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass
from typing import Mapping, Optional

from training.errors import ConfigError
from training.metrics import KEY_METRICS

RUN_EVENTS = ("finished", "failed", "preempted", "restarted")
SWEEP_EVENTS = ("finished", "failed")  # a sweep's trials are runs that do not notify on their own

_REFERENCE = re.compile(r"\$\{([^}]*)\}")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def references(url: str) -> list[str]:
    """The environment variables a written URL names; ValueError for a malformed reference."""
    names = _REFERENCE.findall(url)
    bad = [name for name in names if not _NAME.match(name)]
    if bad or "${" in _REFERENCE.sub("", url):
        raise ValueError("has a malformed variable reference; write ${NAME} with NAME made of letters, "
                         "digits and '_' (such as ${SLACK_WEBHOOK})")  # (the URL is not quoted: it may be a secret)
    return names


def url_problem(url: str) -> Optional[str]:
    """What is wrong with a (resolved, or literal) webhook URL, or None. Never quotes the URL."""
    if any(ord(char) < 33 or ord(char) == 127 for char in url):
        return "contains a space or a control character"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
    except ValueError as exc:
        return f"is not a URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return "must start with https:// (or http://)"
    if not parts.hostname:
        return "names no host"
    return None


def check_written(url: str) -> str:
    """The config's check of a written URL: references well formed, and a literal URL well formed
    (a URL with references is checked once they are resolved, before the run starts)."""
    if not url.strip():
        raise ValueError("must not be empty: an https:// URL, or ${VARIABLE} naming one")
    if not references(url):
        problem = url_problem(url)
        if problem:
            raise ValueError(f"the URL {shown_url(url)} {problem}")
    return url


def shown_url(url: str) -> str:
    """How a written URL appears anywhere it is shown or stored: as written when it references
    variables (the secret is in them), else scheme://host/*** (a webhook's path and query are its secret)."""
    if _REFERENCE.search(url):
        return url
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return "***"
    if not parts.scheme or not host:
        return "***"
    port = f":{parts.port}" if _port_or_none(parts) else ""
    return f"{parts.scheme}://{host}{port}/***"


def _port_or_none(parts) -> Optional[int]:
    try:
        return parts.port
    except ValueError:
        return None


@dataclass(frozen=True)
class Target:
    """One resolved webhook: `field` names it in messages (tracking.notify.0); the URL is never shown."""

    field: str
    url: str
    events: tuple[str, ...]

    def __repr__(self) -> str:  # (a traceback or a log of the object must not show the URL)
        return f"Target({self.field}, {self.host}, on={list(self.events)})"

    @property
    def host(self) -> str:
        return urllib.parse.urlsplit(self.url).hostname or "?"


def resolve(written: list, environ: Mapping[str, str] = os.environ, prefix: str = "tracking.notify") -> list[Target]:
    """The targets of `tracking.notify` (NotifyConfig sections) with their URLs resolved from
    `environ`. ConfigError naming the field (and the variable, never its value) for a variable that
    is not set or a resolved URL that is not one."""
    targets = []
    for index, target in enumerate(written):
        field = f"{prefix}.{index}.url"
        try:
            names = references(target.url)
        except ValueError as exc:
            raise ConfigError(f"{field}: {exc}") from None
        missing = [name for name in names if not environ.get(name)]
        if missing:
            raise ConfigError(f"{field}: the environment variable {', '.join(missing)} is not set (or empty); "
                              f"export it in the shell that starts the run, or write the URL in the config")
        url = _REFERENCE.sub(lambda m: environ[m.group(1)], target.url)
        problem = url_problem(url)
        if problem:
            where = f" (from {', '.join('$' + n for n in names)})" if names else ""
            raise ConfigError(f"{field}: the URL{where} {problem}")
        targets.append(Target(f"{prefix}.{index}", url, tuple(dict.fromkeys(target.on))))
    return targets


def scrub(text: str, targets: list[Target]) -> str:
    """`text` with every target's resolved URL (and its path) replaced by the target's field name."""
    for target in targets:
        text = text.replace(target.url, target.field)
        path = urllib.parse.urlsplit(target.url).path
        if len(path) > 1:
            text = text.replace(path, "/***")
    return text


# --- messages ---------------------------------------------------------------------------------------


def _metric_text(metrics: dict) -> str:
    return ", ".join(f"{k} {metrics[k]:.4g}" for k in KEY_METRICS if isinstance(metrics.get(k), (int, float)))


def run_message(event: str, name: str, *, step: Optional[int] = None, total_steps: Optional[int] = None,
                metrics: Optional[dict] = None, mlflow_run_id: Optional[str] = None,
                mlflow_url: Optional[str] = None, error: Optional[str] = None, restarts: Optional[int] = None,
                detail: Optional[str] = None) -> dict:
    """The JSON body posted for a run's event; `text` is what Slack (and Slack-compatible chat) shows."""
    key = {k: metrics[k] for k in KEY_METRICS if isinstance((metrics or {}).get(k), (int, float))}
    where = f" at step {step}" + (f"/{total_steps}" if total_steps else "") if step is not None else ""
    lines = [f"run {name} {event}{where}" + (f": {detail}" if detail else "")]
    if key:
        lines.append(_metric_text(key))
    lines += _closing_lines(error, mlflow_run_id, mlflow_url)
    return {"text": "\n".join(lines), "kind": "run", "name": name, "event": event, "status": event,
            "step": step, "total_steps": total_steps, "metrics": key, "restarts": restarts,
            "mlflow_run_id": mlflow_run_id, "mlflow_url": mlflow_url, "error": error}


def _closing_lines(error: Optional[str], mlflow_run_id: Optional[str], mlflow_url: Optional[str]) -> list[str]:
    return ([f"error: {error}"] if error else []) + ([f"MLflow: {mlflow_url or mlflow_run_id}"]
                                                    if mlflow_url or mlflow_run_id else [])


def sweep_message(event: str, name: str, *, counts: dict, metric: str, best: Optional[dict] = None,
                  mlflow_run_id: Optional[str] = None, mlflow_url: Optional[str] = None,
                  error: Optional[str] = None) -> dict:
    """The JSON body posted for a sweep's end: the trial counts and the best trial
    (`best`: {trial_id, run, value, steps, params})."""
    lines = [f"sweep {name} {event}: "
             + ", ".join(f"{counts.get(s, 0)} {s}" for s in ("finished", "stopped", "failed"))]
    if best:
        lines.append(f"best trial {best['trial_id']} ({best['run']}): {metric} {best['value']:.4g} "
                     f"at step {best['steps']}")
    lines += _closing_lines(error, mlflow_run_id, mlflow_url)
    return {"text": "\n".join(lines), "kind": "sweep", "name": name, "event": event, "status": event,
            "counts": counts, "metric": metric, "best": best, "mlflow_run_id": mlflow_run_id,
            "mlflow_url": mlflow_url, "error": error}


def mlflow_run_url(tracking_uri: Optional[str], experiment_id: Optional[str], run_id: Optional[str]) -> Optional[str]:
    """A link to the run in MLflow's UI when the store is a server (http[s]); the password of a URI
    is not in it (redacted), nor the user."""
    if not (tracking_uri and experiment_id and run_id) or not tracking_uri.startswith(("http://", "https://")):
        return None
    parts = urllib.parse.urlsplit(tracking_uri)
    host = parts.hostname or ""
    port = f":{parts.port}" if _port_or_none(parts) else ""
    base = f"{parts.scheme}://{host}{port}{parts.path.rstrip('/')}"
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def event_for_transition(previous: str, current: str) -> Optional[str]:
    """The run event that a Train controller's state change is, if any (state names as Ray Train's
    TrainControllerStateType): entering PREEMPTING is a preemption notice; entering RESTARTING or
    RESCHEDULING is a restart of the worker group after a failure (a preemption's included)."""
    if current == previous:
        return None
    if current == "PREEMPTING":
        return "preempted"
    if current in ("RESTARTING", "RESCHEDULING"):
        return "restarted"
    return None
