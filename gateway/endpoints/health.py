"""Rotation bookkeeping for endpoints out of process (engine workers, OpenAI-
compatible servers): one passing health check puts an endpoint in rotation,
two failing ones in a row (or a request that found it dead) take it out."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

FAILURES_TO_LEAVE = 2  # one lost probe on a busy server is not an outage


class HealthState:
    def __init__(self, what: str):
        self.what = what  # e.g. "engine w1 at host:port", for the log lines
        self.healthy = False
        self._failures = 0

    def passed(self, detail: str = "") -> None:
        if not self.healthy:
            log.info("%s is healthy%s", self.what, detail)
        self.healthy, self._failures = True, 0

    def failed(self, reason: str) -> None:
        self._failures += 1
        if self.healthy and self._failures >= FAILURES_TO_LEAVE:
            log.warning("%s failed health checks (%s): out of rotation", self.what, reason)
            self.healthy = False

    def mark_failed(self) -> None:
        """A request found it dead: out of rotation until the next passing check."""
        self.healthy = False
