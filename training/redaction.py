"""Passwords in URIs (`scheme://user:password@host/...`: an MLflow server with basic auth, a
database store, S3 keys in a pyarrow URI) never leave the process that uses them: everything this
service prints, writes or sends to MLflow passes through `redact` first, which keeps the user and
replaces the password with `***`. The real value stays only in memory, where a connection needs it.

(Credentials are better kept out of URIs altogether: MLflow reads MLFLOW_TRACKING_USERNAME and
MLFLOW_TRACKING_PASSWORD, pyarrow and boto3 the AWS credential chain.)
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"

# scheme://[user][:password]@ : the user-info part of a URI, anywhere in a text (an error message
# quotes the URI it failed on). A user alone (`http://alice@host`) is not a secret and is kept.
_USER_INFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^\s/@:?#]*):(?P<password>[^\s/@?#]*)@")


def redact(text: str) -> str:
    """`text` with the password of every URI in it replaced by ***."""
    return _USER_INFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text) if "@" in text else text


def redact_values(value: Any) -> Any:
    """A copy of a config tree (dicts, lists, scalars) with every string redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redact_values(child) for key, child in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_values(child) for child in value)
    return value
