"""Azure's instance metadata for the spot watcher on a worker VM: Scheduled Events (a `Preempt`
event for this VM is Azure's spot eviction notice, at least 30 s ahead, with `NotBefore` as the
time it happens), their acknowledgement (`StartRequests`, which lets Azure go ahead at once), and
which cloud's metadata service answers here (`--cloud auto`). Standard library only; it raises
cluster/imds.py's exceptions so the watcher treats both clouds alike."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime

from cluster.imds import TOKEN_PATH, TTL_HEADER, ImdsError, ImdsUnavailable, Notice

DEFAULT_AZURE_METADATA_URL = "http://169.254.169.254"
SCHEDULED_EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
VM_NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
PREEMPT = "Preempt"
CLOUDS = ("aws", "azure", "auto")


def parse_not_before(text: str, now: datetime) -> datetime:
    """NotBefore is an RFC 1123 date ("Mon, 19 Sep 2016 18:29:47 GMT"), empty once the event has
    started: then it is happening now."""
    if not str(text).strip():
        return now
    try:
        moment = parsedate_to_datetime(str(text))
    except (TypeError, ValueError) as error:
        raise ImdsError(f"malformed NotBefore {text!r}") from error
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def preempt_notices(document: dict, vm_name: str, now: datetime) -> list[Notice]:
    """The Preempt events naming this VM in a Scheduled Events document (other event types, such as
    Reboot or Freeze, and events for other VMs are not evictions of this node)."""
    try:
        events = list(document.get("Events") or [])
        return [Notice(PREEMPT, parse_not_before(event.get("NotBefore", ""), now), str(event["EventId"]))
                for event in events if event.get("EventType") == PREEMPT
                and vm_name.lower() in (str(r).lower() for r in event.get("Resources") or [])]
    except (AttributeError, KeyError, TypeError) as error:
        raise ImdsError(f"malformed Scheduled Events document: {error}") from error


class ScheduledEventsClient:
    """Azure's Scheduled Events over plain HTTP with the `Metadata: true` header Azure requires;
    proxies from the environment are ignored (the link-local address must never go through one).
    `notices()` has the shape of ImdsClient's, `acknowledge(notice)` approves one event."""

    def __init__(self, base_url: str = DEFAULT_AZURE_METADATA_URL, timeout_s: float = 5.0,
                 vm_name: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._vm_name = vm_name
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self.acknowledged: set[str] = set()

    def _request(self, method: str, path: str, body: bytes | None = None) -> str:
        headers = {"Metadata": "true", **({"Content-Type": "application/json"} if body else {})}
        request = urllib.request.Request(self.base_url + path, data=body, method=method, headers=headers)
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                return response.read().decode()
        except urllib.error.HTTPError as error:
            if error.code >= 500:
                raise ImdsUnavailable(f"{method} {path}: HTTP {error.code}") from error
            raise ImdsError(f"{method} {path} answered HTTP {error.code}") from error
        except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
            raise ImdsUnavailable(f"{self.base_url}: {getattr(error, 'reason', error)}") from error

    def vm_name(self) -> str:
        """This VM's name, as Scheduled Events lists it in an event's Resources."""
        if self._vm_name is None:
            name = self._request("GET", VM_NAME_PATH).strip()
            if not name:
                raise ImdsError("the instance metadata service gave an empty VM name")
            self._vm_name = name
        return self._vm_name

    def notices(self, now: datetime | None = None) -> list[Notice]:
        body = self._request("GET", SCHEDULED_EVENTS_PATH)
        try:
            document = json.loads(body)
        except ValueError as error:
            raise ImdsError(f"Scheduled Events answered something other than JSON: {body[:100]!r}") from error
        return preempt_notices(document, self.vm_name(), now or datetime.now(timezone.utc))

    def acknowledge(self, notice: Notice) -> None:
        """Approve the event (POST StartRequests): Azure may then evict at once. Once per event."""
        if notice.event_id in self.acknowledged:
            return
        body = json.dumps({"StartRequests": [{"EventId": notice.event_id}]}).encode()
        self._request("POST", SCHEDULED_EVENTS_PATH, body)
        self.acknowledged.add(notice.event_id)


def _answers(url: str, method: str, headers: dict[str, str], timeout_s: float) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, method=method, headers=headers), timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return False


def detect_cloud(aws_url: str, azure_url: str, timeout_s: float = 2.0) -> str:
    """"azure" or "aws": the cloud whose metadata service answers here. Azure's is asked first: its
    request (a GET with `Metadata: true`) is harmless to EC2's IMDS, which answers it 404."""
    if _answers(azure_url.rstrip("/") + VM_NAME_PATH, "GET", {"Metadata": "true"}, timeout_s):
        return "azure"
    if _answers(aws_url.rstrip("/") + TOKEN_PATH, "PUT", {TTL_HEADER: "60"}, timeout_s):
        return "aws"
    raise ImdsUnavailable(f"neither Azure's instance metadata ({azure_url}) nor EC2's IMDSv2 ({aws_url}) answered")
