"""Every private MLflow API this project uses, in one place (driver, Train controller, workers).

MLflow's client retries a failed request with backoff for minutes; a tracking outage must never
stall training, so the tracker sends each request once, with a short timeout, through MLflow's own
REST helpers. `tests/test_adaptors.py` checks each name here, so an MLflow upgrade that moves one
fails there, by name.
"""

from __future__ import annotations

import json

# MLflow writes all its event output in a process (its loggers' records, and the lines it prints,
# such as "Registered model 'x' already exists. Creating a new version of this model...") through one
# stream, MLFLOW_LOGGING_STREAM of this module, which forwards each write to sys.stderr as it is at
# that moment. A write coming from it is one of MLflow's events, whole: a record may span many lines
# (a failed input-example validation carries the example's JSON and the error).
MLFLOW_STREAM_MODULE = "mlflow.utils.logging_utils"


def written_by_mlflow_stream(caller) -> bool:
    """Whether the frame `caller`, the one that called a stream's write, is MLflow's event stream."""
    return caller.f_globals.get("__name__") == MLFLOW_STREAM_MODULE


def host_creds(client):
    """The REST store's credentials of an `MlflowClient`, or None for a local store (sqlite)."""
    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    get = getattr(store, "get_host_creds", None)
    return get() if get is not None else None


def rest_once(creds, method: str, endpoint: str, timeout_s: float, message=None, params=None):
    """One REST request, no retries; raises MlflowException (with an HTTP status) on an error answer."""
    from mlflow.utils.proto_json_utils import message_to_json  # (lazy: mlflow)
    from mlflow.utils.rest_utils import http_request, verify_rest_response  # (lazy: mlflow)

    kwargs = {"json": json.loads(message_to_json(message))} if message is not None else {"params": params}
    response = http_request(creds, endpoint, method, max_retries=0, backoff_factor=0, timeout=timeout_s, **kwargs)
    return verify_rest_response(response, endpoint)


def log_batch_message(run_id: str, metrics: list):
    from mlflow.protos.service_pb2 import LogBatch  # (lazy: mlflow)

    return LogBatch(run_id=run_id, metrics=[m.to_proto() for m in metrics])


def update_run_message(run_id: str, status: str, end_time_ms: int):
    from mlflow.entities import RunStatus  # (lazy: mlflow)
    from mlflow.protos.service_pb2 import UpdateRun  # (lazy: mlflow)

    return UpdateRun(run_id=run_id, run_uuid=run_id, status=RunStatus.from_string(status), end_time=end_time_ms)
