"""What the outbox deliverer and the summary worker share: a worker thread that claims leased work, renews
the lease while it works, retries with backoff, and hands back what it holds when it stops."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

from reducing_saver.service.storage.background import FailureLog

#: The longest wait after failed rounds (the database unreachable): back-off must not outlast an outage by
#: minutes once the database is back.
ERROR_WAIT_MAX = 30.0


def default_worker_id() -> str:
    """``host:pid:random``: unique per worker, readable in the ``claimed_by`` of what it holds."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class LeaseRenewer(threading.Thread):
    """A daemon thread calling ``renew()`` every third of the lease (at least 0.05 s apart) until stopped.

    Args:
        name: The thread's name.
        lease_seconds: The lease being renewed.
        renew: Renews the lease; answers whether to go on renewing.
        failed: Called with what ``renew`` raised; the next renewal tries again.
    """

    def __init__(
        self,
        name: str,
        lease_seconds: float,
        renew: Callable[[], bool],
        failed: Callable[[Exception], None],
    ) -> None:
        super().__init__(name=name, daemon=True)
        self._lease = lease_seconds
        self._renew = renew
        self._failed = failed
        self._stopped = threading.Event()

    def stop(self) -> None:
        """Stop renewing; returns once a renewal in flight has finished."""
        self._stopped.set()
        self.join()

    def run(self) -> None:
        interval = max(self._lease / 3, 0.05)
        while not self._stopped.wait(interval):
            try:
                if not self._renew():
                    return
            except Exception as exc:
                self._failed(exc)


class LeasedWorker:
    """The loop of a worker claiming leased work: rounds until stopped, idle sleeps a :meth:`wake` cuts
    short, failed rounds logged (``background.FailureLog``) and retried after a doubling wait, what it holds
    handed back when it ends. A subclass does one round (:meth:`run_round`) and hands back
    (:meth:`hand_back`).

    Args:
        worker_id: Its identity in ``claimed_by``; unique per instance (default ``host:pid:random``).
        lease_seconds: How long a claim lasts without renewal.
        max_attempts: Claims of one piece of work before it becomes a dead letter.
        base_backoff: Seconds before the first retry of failed work; doubled each attempt, with jitter.
        max_backoff: The longest wait between attempts.
        idle_sleep: How long to sleep after a round that left nothing to do at once.
        linger: After a :meth:`wake`, how long to let more work gather before the next round.
        rng: Source of the jitter (seed it for reproducible tests).
    """

    #: The background task's name (``FailureLog``, the metric's ``task`` label).
    task: str = "worker"
    #: What a failed round's log line calls the round (``"<worker_id>: <round> round failed; retrying"``).
    round_name: str = "worker"
    #: The worker thread's name before ``-<worker_id>``.
    thread_prefix: str = "worker"
    #: How many times the wait after failed rounds doubles from ``idle_sleep`` (capped at ERROR_WAIT_MAX).
    error_doublings: int = 8
    #: What ``release`` cannot hand back when the database refuses (its log line).
    holds: str = "what it holds; its leases"
    logger: logging.Logger = logging.getLogger(__name__)

    def __init__(
        self,
        *,
        worker_id: str | None,
        lease_seconds: float,
        max_attempts: int,
        base_backoff: float,
        max_backoff: float,
        idle_sleep: float,
        linger: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        self.worker_id = worker_id or default_worker_id()
        self.lease_seconds = lease_seconds
        self.max_attempts = max_attempts
        self.base_backoff = base_backoff
        self.max_backoff = max_backoff
        self.idle_sleep = idle_sleep
        self.linger = linger
        self.rng = rng or random.Random()
        self._stop_event: threading.Event | None = None
        self._wakeup = threading.Event()
        self._failures = FailureLog(self.task, self.logger)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- what a subclass does ----------------------------------------------------------------------

    def run_round(self, *, after_failure: bool) -> bool:
        """One round of work (``after_failure``: the round before it failed); whether more is waiting, so
        the next round starts at once."""
        raise NotImplementedError

    def hand_back(self) -> Any:
        """Hand back everything this worker holds (lease cleared, claim not counted)."""
        raise NotImplementedError

    # -- shared --------------------------------------------------------------------------------------

    def backoff(self, attempts: int) -> float:
        """Seconds to wait after the ``attempts``-th failed attempt: exponential, capped, 50–100 % jitter."""
        delay = min(self.max_backoff, self.base_backoff * 2 ** max(attempts - 1, 0))
        return delay / 2 + self.rng.uniform(0, delay / 2)

    def error_wait(self, errors: int) -> float:
        """Seconds to wait after ``errors`` failed rounds in a row."""
        return min(ERROR_WAIT_MAX, self.idle_sleep * 2 ** min(errors, self.error_doublings))

    def run_async(self, awaitable: Any) -> Any:
        """Run ``awaitable`` on the worker's event loop: one loop for its life, so async clients bound to a
        loop keep working across calls."""
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(awaitable)

    def stopping(self) -> bool:
        """Whether the worker was told to stop."""
        return self._stop_event is not None and self._stop_event.is_set()

    def run_forever(self, stop_event: threading.Event) -> None:
        """Work until ``stop_event`` is set, then hand back what this worker still holds.

        Sleeps ``idle_sleep`` after a round that left nothing waiting; failed rounds (the database
        unreachable) are logged and retried after :meth:`error_wait`, never raised. A :meth:`wake` cuts
        either wait short: new work shows the database is back.
        """
        self._stop_event = stop_event
        errors = 0
        try:
            while not stop_event.is_set():
                try:
                    busy = self.run_round(after_failure=errors > 0)
                    errors = 0
                    self._failures.succeeded()
                except Exception as exc:
                    errors += 1
                    self._failures.failed(exc, f"{self.worker_id}: {self.round_name} round failed; retrying")
                    self._wakeup.wait(self.error_wait(errors))
                    self._wakeup.clear()
                    continue
                if not busy and not stop_event.is_set():
                    woken = self._wakeup.wait(self.idle_sleep)
                    self._wakeup.clear()
                    if woken and self.linger:
                        stop_event.wait(self.linger)
        finally:
            self.release()

    def wake(self) -> None:
        """Cut the current idle sleep short: work was just recorded (same process) or it should stop."""
        self._wakeup.set()

    def start(self) -> threading.Thread:
        """Run :meth:`run_forever` in a daemon thread; :meth:`stop` ends it."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"{self!r} is already running")
        stop_event = threading.Event()
        self._stop_event = stop_event
        self._thread = threading.Thread(
            target=self.run_forever,
            args=(stop_event,),
            name=f"{self.thread_prefix}-{self.worker_id}",
            daemon=True,
        )
        self._thread.start()
        return self._thread

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the thread :meth:`start` began, waiting at most ``timeout`` seconds for the work in hand
        (``0``: tell it and return; a later ``stop`` waits)."""
        if self._stop_event is not None:
            self._stop_event.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None
            elif timeout:
                self.logger.warning(
                    "%s: still working after %.0f s; its leases will expire", self.worker_id, timeout
                )

    def release(self) -> Any:
        """Hand back what this worker holds (:meth:`hand_back`; a database refusing is logged, the leases
        then expire), and close the event loop of async calls."""
        try:
            return self.hand_back()
        except Exception:
            self.logger.exception("%s: could not hand back %s will expire", self.worker_id, self.holds)
            return 0
        finally:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.close()


__all__ = ["ERROR_WAIT_MAX", "LeaseRenewer", "LeasedWorker", "default_worker_id"]
