"""One-shot MLflow calls of the tracker (driver and Ray Train controller): is MLflow there, send a
batch of metrics, set a run's final status. Each is one attempt with a short timeout and no
retries (MLflow's own client retries back off for minutes); when to try again is the tracker's
`SendPolicy`. A REST store is called through `training.adaptors.mlflow_private`, a local store
(sqlite), which cannot hang, through `MlflowClient`."""

from __future__ import annotations

import os

from training.adaptors import mlflow_private
from training.errors import first_line
from training.redaction import redact


def keep_password_out_of_mlflow_output(tracking_uri: str) -> None:
    """MLflow's client prints a link to each run it ends (`View run ... at: <tracking URI>/#/...`),
    password included: in a process that uses a URI with one, it is told not to."""
    if redact(tracking_uri) != tracking_uri:
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"


class MlflowTransport:
    """The calls to one tracking URI; the send calls raise whatever MLflow or the connection raised."""

    def __init__(self, tracking_uri: str, timeout_s: float):
        self.tracking_uri, self.timeout_s = tracking_uri, timeout_s
        self._client = None
        keep_password_out_of_mlflow_output(tracking_uri)

    @property
    def client(self):
        """MLflow's own client for this URI, retries and all: for calls that may wait on MLflow."""
        if self._client is None:
            from mlflow.tracking import MlflowClient  # (lazy: mlflow)

            self._client = MlflowClient(self.tracking_uri)
        return self._client

    def check_reachable(self) -> None:
        """One short request that any MLflow tracking server answers; raises if it does not."""
        if self._creds() is not None:
            self._rest("GET", "/api/2.0/mlflow/experiments/search", params={"max_results": 1})
        else:
            self.client.search_experiments(max_results=1)

    def reachable(self) -> bool:
        try:
            self.check_reachable()
            return True
        except Exception:
            return False

    def send_metrics(self, run_id: str, metrics: list) -> None:
        """Log a batch of `mlflow.entities.Metric` (at most 1000, MLflow's limit for one request)."""
        if self._creds() is None:
            self.client.log_batch(run_id, metrics=metrics)
            return
        self._rest("POST", "/api/2.0/mlflow/runs/log-batch", mlflow_private.log_batch_message(run_id, metrics))

    def send_status(self, run_id: str, status: str, end_time_ms: int) -> None:
        if self._creds() is None:
            self.client.set_terminated(run_id, status=status, end_time=end_time_ms)
            return
        self._rest("POST", "/api/2.0/mlflow/runs/update",
                   mlflow_private.update_run_message(run_id, status, end_time_ms))

    def _creds(self):
        """The REST store's credentials, or None for a local store."""
        return mlflow_private.host_creds(self.client)

    def _rest(self, method: str, endpoint: str, message=None, params=None):
        return mlflow_private.rest_once(self._creds(), method, endpoint, self.timeout_s, message=message,
                                        params=params)


def is_rejected(exc: Exception) -> bool:
    """MLflow answered and refused (a client error: a bad value, a deleted run), so sending the same
    again cannot help; not a timeout, a refused connection, a 5xx or a 429."""
    from mlflow.exceptions import MlflowException  # (lazy: mlflow)

    if not isinstance(exc, MlflowException):
        return False
    code = exc.get_http_status_code()
    return 400 <= code < 500 and code != 429


def short_reason(exc: Exception, timeout_s: float) -> str:
    """Why an attempt failed, in a few words for a warning."""
    text = str(exc)
    if "Connection refused" in text or "NewConnectionError" in text:
        return "connection refused"
    if "timeout" in text.lower() or "timed out" in text.lower():
        return f"no answer within {timeout_s:g} s"
    return first_line(exc, 200)
