"""How the service's background work (delivery, lease renewals, summaries, TTL sweeps, storage figures)
reports what fails.

A database that cannot serve now (an outage, a failover, a connection a load balancer cut, a statement
cancelled by ``statement_timeout``: ``storage.transient``) is passing trouble. A task's first such failure
is logged once, as one WARNING line without a traceback; further ones while the trouble lasts are not
logged again (DEBUG); the task's next success logs that it recovered (INFO). Any other error is a fault,
logged with its traceback every time. Every failure counts in :data:`FAILURES`, which ``/metrics`` shows as
``reducing_saver_background_errors_total{task, kind}`` (kind ``transient`` or ``fault``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from reducing_saver.service.storage import transient

#: ``(task, kind)`` -> failures of this process since it started (kind: ``transient`` or ``fault``).
FAILURES: Counter[tuple[str, str]] = Counter()
_FAILURES_LOCK = threading.Lock()


def failures() -> dict[tuple[str, str], int]:
    """A copy of :data:`FAILURES` (for the metrics)."""
    with _FAILURES_LOCK:
        return dict(FAILURES)


class FailureLog:
    """What one background task logs and counts when a round of it fails.

    Args:
        task: The task's name in the metric's ``task`` label (``delivery``, ``sweep``...).
        logger: Where its lines go (the task's module logger).
    """

    def __init__(self, task: str, logger: logging.Logger) -> None:
        self.task = task
        self.logger = logger
        self._troubled = 0  # transient failures since the last success

    def failed(self, exc: BaseException, what: str) -> None:
        """Count and log a failure of ``what`` (a sentence naming the work and what happens next)."""
        reason = transient(exc)
        with _FAILURES_LOCK:
            FAILURES[(self.task, "fault" if reason is None else "transient")] += 1
        if reason is None:
            self.logger.error("%s", what, exc_info=exc)
            return
        self._troubled += 1
        level = logging.WARNING if self._troubled == 1 else logging.DEBUG
        self.logger.log(level, "%s: %s (logged once until it recovers)", what, reason)

    def succeeded(self) -> None:
        """Note a round that went through: after passing trouble, log that the task recovered."""
        if self._troubled:
            self.logger.info(
                "%s: the database answers again after %d failed round(s)", self.task, self._troubled
            )
            self._troubled = 0
