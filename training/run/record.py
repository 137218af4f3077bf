"""The record a run or a sweep writes into its storage when it first starts (`run.json`,
`sweep.json`), read by the driver when the same name is started again: what defines the run (its
identity), which MLflow run tracks it, and where."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from training import storage
from training.config import LATER_IDENTITY_FIELDS
from training.errors import ConfigError, UserError, first_line
from training.redaction import redact


@dataclass
class Record:
    name: str
    identity: dict
    mlflow_run_id: Optional[str]  # a sweep's: its parent run
    tracking_uri: Optional[str]
    created: float = field(default_factory=time.time)
    registered: Optional[dict] = None  # a sweep's best model, once registered: registered once only
    dataset: Optional[dict] = None  # a run's prepared data when it started: {root, digest}
    pinned: Optional[dict] = None  # {option: digest} of what it read besides its data (family.pinned)

    @classmethod
    def read(cls, uri: str, name: str, what: str) -> Optional["Record"]:
        """The record of run (or sweep) `name` at `uri`, None if there is none; UserError if the
        storage (`what`) cannot be reached or the record is not one this service wrote whole."""
        try:
            if not storage.exists(uri):
                return None
            text = storage.read_text(uri)
        except (OSError, ValueError) as exc:  # (pyarrow's ArrowInvalid, for a URI it cannot use, is a ValueError)
            raise UserError(redact(f"{what} is not reachable: {first_line(exc)}")) from None
        try:
            raw = json.loads(text)
            identity = raw["identity"]
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{uri} is not a complete run record; move it away (or use a new --name) "
                            "to start the run afresh") from None
        run_id = raw.get("mlflow_run_id", raw.get("parent_run_id"))  # sweeps wrote parent_run_id
        return cls(raw.get("name", name), identity, run_id, raw.get("tracking_uri"), raw.get("created", 0.0),
                   raw.get("registered"), raw.get("dataset"), raw.get("pinned"))

    def write(self, uri: str) -> None:
        record = asdict(self)
        record["tracking_uri"] = redact(self.tracking_uri) if self.tracking_uri else self.tracking_uri
        storage.write_text(uri, json.dumps(record, indent=2))

    def check_resumable(self, identity: dict, kind: str, remedy: str) -> None:
        """Refuse to continue a run whose identity changed: it would mix two different runs.
        `identity` is what defines the run now, in the form it was recorded (JSON values). A field that
        joined the identity after the record was written is not compared (a run's, or a sweep's base job's)."""
        identity = _as_recorded(json.loads(json.dumps(identity)), self.identity)
        if isinstance(identity.get("base"), dict) and isinstance(self.identity.get("base"), dict):
            identity["base"] = _as_recorded(identity["base"], self.identity["base"])
        changed = [key for key, value in identity.items() if self.identity.get(key) != value]
        if changed:
            raise ConfigError(f"{kind} {self.name!r} already exists with a different {', '.join(changed)}; "
                              f"resuming it would mix two different {kind}s. "
                              f"Use a new --name, or {remedy} to resume it.")

    def check_tracking(self, tracking_uri: Optional[str]) -> None:
        """(The record keeps the URI without its password: a changed password is the same store.)"""
        shown = redact(tracking_uri) if tracking_uri else tracking_uri
        if self.tracking_uri is not None and redact(self.tracking_uri) != shown:
            raise ConfigError(f"run {self.name!r} is tracked at {redact(self.tracking_uri)}, not {shown}; "
                              "set tracking.tracking_uri to the original to resume it")


def _as_recorded(identity: dict, recorded: dict) -> dict:
    """`identity` without the fields that joined the identity after `recorded` was written."""
    return {key: value for key, value in identity.items() if key in recorded or key not in LATER_IDENTITY_FIELDS}
