"""EC2 instance metadata (IMDSv2) for interruption notices: a session token from
`PUT /latest/api/token`, sent with every GET and refreshed before it expires; the spot
`instance-action` and the rebalance recommendation parsed into `Notice`s. Standard library only."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

DEFAULT_IMDS_URL = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
SPOT_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
MAX_TOKEN_TTL_S = 21600  # IMDS refuses longer sessions
SPOT_ACTIONS = ("terminate", "stop", "hibernate")
REBALANCE = "rebalance"


class ImdsUnavailable(Exception):
    """IMDS did not answer (connection refused, timeout, 5xx): most likely not on EC2."""


class ImdsError(Exception):
    """IMDS answered something this client cannot use (unexpected status, malformed notice)."""


@dataclass(frozen=True)
class Notice:
    """An interruption signal: a spot action with the time it happens, or a rebalance
    recommendation with the time it was issued (or Azure's Preempt event: cluster/azure_events.py)."""

    kind: str          # one of SPOT_ACTIONS, or REBALANCE (or azure_events.PREEMPT)
    time: datetime     # timezone-aware, UTC
    event_id: str = ""  # Azure Scheduled Events only: what the acknowledgement names


def parse_time(text: str) -> datetime:
    """IMDS times look like 2026-12-01T13:20:00Z (fromisoformat only accepts 'Z' from 3.11)."""
    parsed = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def parse_spot_action(body: str) -> Notice:
    try:
        data = json.loads(body)
        action, when = str(data["action"]), parse_time(data["time"])
    except (ValueError, KeyError, TypeError) as error:
        raise ImdsError(f"malformed spot instance-action {body!r}: {error}") from error
    return Notice(kind=action, time=when)


def parse_rebalance(body: str) -> Notice:
    try:
        return Notice(kind=REBALANCE, time=parse_time(json.loads(body)["noticeTime"]))
    except (ValueError, KeyError, TypeError) as error:
        raise ImdsError(f"malformed rebalance recommendation {body!r}: {error}") from error


class ImdsClient:
    """IMDSv2 over plain HTTP. Proxies from the environment are ignored on purpose: the metadata
    address is link-local and must never be sent through an HTTP proxy."""

    def __init__(self, base_url: str = DEFAULT_IMDS_URL, token_ttl_s: int = MAX_TOKEN_TTL_S,
                 timeout_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        if not 1 <= token_ttl_s <= MAX_TOKEN_TTL_S:
            raise ValueError(f"token_ttl_s must be in 1..{MAX_TOKEN_TTL_S}, got {token_ttl_s}")
        self.base_url = base_url.rstrip("/")
        self.token_ttl_s = token_ttl_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._token: str | None = None
        self._token_expires_at = 0.0
        # Refresh ahead of expiry: a minute for the usual long sessions, a fifth of short ones.
        self._refresh_margin_s = min(60.0, token_ttl_s / 5)

    def _request(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str]:
        request = urllib.request.Request(self.base_url + path, method=method, headers=headers)
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            if error.code >= 500:
                raise ImdsUnavailable(f"{method} {path}: HTTP {error.code}") from error
            return error.code, ""
        except (urllib.error.URLError, OSError, http.client.HTTPException) as error:  # refused, timed out, cut off
            reason = getattr(error, "reason", error)
            raise ImdsUnavailable(f"{self.base_url}: {reason}") from error

    def token(self) -> str:
        if self._token is None or self._clock() >= self._token_expires_at - self._refresh_margin_s:
            started = self._clock()
            status, body = self._request("PUT", TOKEN_PATH, {TTL_HEADER: str(self.token_ttl_s)})
            if status != 200 or not body:
                raise ImdsError(f"PUT {TOKEN_PATH} answered HTTP {status}: IMDSv2 disabled?")
            self._token, self._token_expires_at = body, started + self.token_ttl_s
        return self._token

    def get(self, path: str) -> str | None:
        """The body at `path`, or None for 404 (IMDS's "nothing here"). A 401 means the token was
        rejected (expired, or IMDS restarted): fetch a new one and try once more."""
        for attempt in range(2):
            status, body = self._request("GET", path, {TOKEN_HEADER: self.token()})
            if status == 200:
                return body
            if status == 404:
                return None
            if status == 401 and attempt == 0:
                self._token = None
                continue
            raise ImdsError(f"GET {path} answered HTTP {status}")
        raise AssertionError("unreachable")

    def spot_notice(self) -> Notice | None:
        body = self.get(SPOT_ACTION_PATH)
        return parse_spot_action(body) if body is not None else None

    def rebalance_notice(self) -> Notice | None:
        body = self.get(REBALANCE_PATH)
        return parse_rebalance(body) if body is not None else None

    def notices(self) -> list[Notice]:
        """Every notice present now, the spot action first."""
        return [notice for notice in (self.spot_notice(), self.rebalance_notice()) if notice is not None]
