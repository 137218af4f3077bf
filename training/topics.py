"""The topics of this project's own warnings (any process): each line starts with its topic
("tracking: MLflow at ... is unreachable"), which says what it is about, and by which the console
tells the Train controller's own lines from Ray's on its stderr (training/run/console.py)."""

from __future__ import annotations

import logging

TRACKING = "tracking"  # MLflow: a run's metrics, params, datasets and artifacts
NOTIFY = "notify"  # webhooks
STATUS = "status"  # a run's status files in its storage
TOPICS = (TRACKING, NOTIFY, STATUS)


def line(topic: str, text: str) -> str:
    return f"{topic}: {text}"


class _TopicLogger(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return line(self.extra["topic"], msg), kwargs


def logger(topic: str, name: str) -> logging.LoggerAdapter:
    """A module's logger whose lines start with `topic`."""
    return _TopicLogger(logging.getLogger(name), {"topic": topic})
