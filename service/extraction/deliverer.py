"""Delivery of pruned messages from the outbox to long-term memory (a LangGraph ``BaseStore``).

A :class:`Deliverer` claims batches of outbox rows under a lease it renews, groups them by memory
namespace, hands each group to an extractor (:class:`StoreExtractor` by default, or a user's
``module:callable`` through :func:`load_extractor`) and marks the rows done; failures are retried with
backoff and end as dead letters. docs/memory.md ("How nothing is lost", "A custom extractor") describes
delivery, retries and the extractor's contract.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import random
import socket
import threading
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from itertools import groupby

from reducing_saver.service.storage.background import FailureLog
from reducing_saver.service.extraction.extractors import Extractor, PermanentExtractionError
from reducing_saver.service.storage.outbox import EntryKey, Outbox, OutboxEntry

# -- delivery --------------------------------------------------------------------------------------

logger = logging.getLogger(__name__)

#: The longest wait after failed delivery rounds (the database unreachable): back-off must not outlast an
#: outage by minutes once the database is back.
ERROR_WAIT_MAX = 30.0

#: How a dead letter's ``last_error`` starts when no retry can fix it.
PERMANENT_PREFIX = "permanent failure, retrying cannot help: "


def default_worker_id() -> str:
    """``host:pid:random``: unique per Deliverer, readable in the outbox's ``claimed_by``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Deliverer:
    """Moves outbox rows to an extractor: claim, renew while extracting, complete or retry, park.

    Args:
        outbox: Where the pruned messages wait.
        extractor: ``extractor(entries, namespace)``, called once per namespace group (its result is
            awaited when awaitable); raising means the group failed.
        worker_id: This deliverer's identity in ``claimed_by``; unique per instance (default
            ``host:pid:random``).
        batch_size: Rows claimed at a time.
        lease_seconds: How long a claim lasts without renewal; renewed every third of it while the
            extractor runs. Rows of a crashed worker come back after at most this long.
        max_attempts: Claims a row may take; a failure on the last one makes it a dead letter. A row
            claimed more often than this without any outcome (a worker crashing on it) is parked too.
        base_backoff: Seconds before the first retry; doubled each attempt, with jitter (50–100 %).
        max_backoff: The longest wait between attempts.
        idle_sleep: How long ``run_forever`` sleeps when there was less than a batch to do.
        linger: After a :meth:`wake`, how long to let more rows gather before claiming: one claim, one
            store batch and one completion then cover the pruned messages of many puts instead of one.
        rng: Source of the jitter (seed it for reproducible tests).
    """

    def __init__(
        self,
        outbox: Outbox,
        extractor: Extractor,
        *,
        worker_id: str | None = None,
        batch_size: int = 100,
        lease_seconds: float = 30.0,
        max_attempts: int = 8,
        base_backoff: float = 1.0,
        max_backoff: float = 300.0,
        idle_sleep: float = 1.0,
        linger: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be positive, got {lease_seconds}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        if base_backoff < 0 or max_backoff < base_backoff:
            raise ValueError(
                f"need 0 <= base_backoff <= max_backoff, got base_backoff={base_backoff}, "
                f"max_backoff={max_backoff}"
            )
        self.outbox = outbox
        self.extractor = extractor
        self.worker_id = worker_id or default_worker_id()
        self.batch_size = batch_size
        self.lease_seconds = lease_seconds
        self.max_attempts = max_attempts
        self.base_backoff = base_backoff
        self.max_backoff = max_backoff
        self.idle_sleep = idle_sleep
        self.linger = linger
        self.rng = rng or random.Random()
        #: Rows the last ``run_once`` claimed.
        self.last_claimed = 0
        self._stop_event: threading.Event | None = None
        self._wakeup = threading.Event()
        self._failures = FailureLog("delivery", logger)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"Deliverer({self.worker_id!r}, {self.extractor!r})"

    # -- one batch ---------------------------------------------------------------------------------

    def run_once(self) -> int:
        """Claim one batch and deliver it.

        Returns:
            How many rows were delivered (marked done).
        """
        entries = self.outbox.claim(self.worker_id, self.batch_size, self.lease_seconds)
        self.last_claimed = len(entries)
        if not entries:
            return 0
        renewer = _LeaseRenewer(self.outbox, self.worker_id, self.lease_seconds, [e.ident for e in entries])
        renewer.start()
        delivered = 0
        stopped = False
        try:
            for namespace, group in groupby(entries, key=lambda e: e.namespace):
                if self._stop_event is not None and self._stop_event.is_set():
                    stopped = True
                    break
                delivered += self._deliver_group(namespace, list(group), renewer)
        finally:
            renewer.stop()
        if stopped:
            # Shutting down: hand the untouched rows back at once instead of waiting out their lease.
            self.outbox.release(self.worker_id, renewer.outstanding())
        return delivered

    def _deliver_group(
        self, namespace: tuple[str, ...], group: list[OutboxEntry], renewer: _LeaseRenewer
    ) -> int:
        crashed = [e for e in group if e.attempts > self.max_attempts]
        for entry in crashed:
            message = (
                f"claimed {entry.attempts} times without an outcome (a worker crashed or lost its lease "
                "each time)"
            )
            self._fail(entry, message, permanent=True, renewer=renewer)
        group = [e for e in group if e.attempts <= self.max_attempts]
        deletions = [e for e in group if e.message is None]
        if deletions:  # messages the agent deleted on purpose: they leave the store
            group = [e for e in group if e.message is not None]
            error = self._forget(deletions, namespace)
            if error is None:
                delivered = self._complete(deletions, renewer)
            else:
                delivered = 0
                for entry in deletions:
                    self._fail(entry, _describe(error), permanent=False, renewer=renewer)
            return delivered + (self._deliver_group(namespace, group, renewer) if group else 0)
        if not group:
            return 0
        error = self._extract(group, namespace)
        if error is None:
            return self._complete(group, renewer)
        if len(group) == 1:
            permanent = isinstance(error, PermanentExtractionError)
            self._fail(group[0], _describe(error), permanent=permanent, renewer=renewer)
            return 0
        # One bad message must not hold back the others: retry the group one message at a time.
        delivered = 0
        for entry in group:
            single_error = self._extract([entry], namespace)
            if single_error is None:
                delivered += self._complete([entry], renewer)
            else:
                self._fail(
                    entry,
                    _describe(single_error),
                    permanent=isinstance(single_error, PermanentExtractionError),
                    renewer=renewer,
                )
        return delivered

    def _extract(self, entries: list[OutboxEntry], namespace: tuple[str, ...]) -> Exception | None:
        try:
            result = self.extractor(entries, namespace)
            if inspect.isawaitable(result):
                self._event_loop().run_until_complete(result)
        except Exception as exc:
            logger.warning(
                "extractor %r failed on %d message(s) of namespace %r: %s",
                self.extractor,
                len(entries),
                namespace,
                _describe(exc),
            )
            return exc
        return None

    def _forget(self, entries: list[OutboxEntry], namespace: tuple[str, ...]) -> Exception | None:
        """The extractor's ``forget(entries, namespace)`` when it has one (an extractor without one wrote
        nothing this service can find again: there is nothing to remove)."""
        forget = getattr(self.extractor, "forget", None)
        if forget is None:
            return None
        try:
            forget(entries, namespace)
        except Exception as exc:
            logger.warning("forgetting %d message(s) of namespace %r failed: %s", len(entries), namespace, _describe(exc))
            return exc
        return None

    def _complete(self, entries: list[OutboxEntry], renewer: _LeaseRenewer) -> int:
        keys = [e.ident for e in entries]
        # Stop renewing first: a renewal racing the completion would report a lost lease.
        renewer.finished(keys)
        done = self.outbox.complete(self.worker_id, keys)
        if done < len(keys):
            logger.warning(
                "%s: %d of %d delivered rows had been claimed by another worker (lease lost); they may be "
                "delivered again",
                self.worker_id,
                len(keys) - done,
                len(keys),
            )
        return done

    def _fail(self, entry: OutboxEntry, error: str, *, permanent: bool, renewer: _LeaseRenewer) -> None:
        renewer.finished([entry.ident])
        if permanent or entry.attempts >= self.max_attempts:
            # A dead letter says which kind it is: re-driving a permanent failure fails the same way
            # (fix the extractor or the data first); a retryable one may go through later.
            if permanent:
                error = f"{PERMANENT_PREFIX}{error}"
            else:
                error = f"retryable failure, gave up after {entry.attempts} attempt(s): {error}"
            held = self.outbox.fail(self.worker_id, entry.ident, error, dead=True)
            if held:
                logger.error(
                    "message %r of namespace %r is a dead letter after %d attempt(s): %s",
                    entry.key,
                    entry.namespace,
                    entry.attempts,
                    error,
                )
        else:
            retry_at = datetime.now(UTC) + timedelta(seconds=self.backoff(entry.attempts))
            self.outbox.fail(self.worker_id, entry.ident, error, retry_at=retry_at)

    def backoff(self, attempts: int) -> float:
        """Seconds to wait after the ``attempts``-th failed attempt: exponential, capped, 50–100 % jitter."""
        delay = min(self.max_backoff, self.base_backoff * 2 ** max(attempts - 1, 0))
        return delay / 2 + self.rng.uniform(0, delay / 2)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        # One loop for the deliverer's life: async clients bound to a loop keep working across calls.
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop

    # -- running -----------------------------------------------------------------------------------

    def run_forever(self, stop_event: threading.Event) -> None:
        """Deliver until ``stop_event`` is set, then hand back what this worker still holds.

        Sleeps ``idle_sleep`` whenever a claim found less than a full batch; database errors are logged
        and retried with backoff (at most :data:`ERROR_WAIT_MAX` seconds apart), never raised (an outage is
        logged once, without a traceback: ``background.FailureLog``). A
        :meth:`wake` cuts that wait short too: a put that just recorded rows shows the database is back.
        """
        self._stop_event = stop_event
        errors = 0
        try:
            while not stop_event.is_set():
                try:
                    self.run_once()
                    errors = 0
                    self._failures.succeeded()
                except Exception as exc:
                    errors += 1
                    self._failures.failed(exc, f"{self.worker_id}: delivery round failed; retrying")
                    backoff = self.idle_sleep * 2 ** min(errors, 8)
                    self._wakeup.wait(min(self.max_backoff, ERROR_WAIT_MAX, backoff))
                    self._wakeup.clear()
                    continue
                if self.last_claimed < self.batch_size and not stop_event.is_set():
                    woken = self._wakeup.wait(self.idle_sleep)
                    self._wakeup.clear()
                    if woken and self.linger:
                        stop_event.wait(self.linger)
        finally:
            self.release()

    def wake(self) -> None:
        """Cut the current idle sleep short: rows were just recorded (same process) or it should stop."""
        self._wakeup.set()

    def start(self) -> threading.Thread:
        """Run :meth:`run_forever` in a daemon thread; :meth:`stop` ends it."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"{self!r} is already running")
        stop_event = threading.Event()
        self._stop_event = stop_event
        self._thread = threading.Thread(
            target=self.run_forever, args=(stop_event,), name=f"deliverer-{self.worker_id}", daemon=True
        )
        self._thread.start()
        return self._thread

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the thread :meth:`start` began: it finishes the namespace group in hand, hands back the
        rest of its batch, and ends."""
        if self._stop_event is not None:
            self._stop_event.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning(
                    "%s: still extracting after %.0f s; its leases will expire", self.worker_id, timeout or 0
                )
            self._thread = None

    def release(self) -> int:
        """Hand back every row this worker holds (lease cleared, claim not counted), and close the event
        loop of async extractors.

        Returns:
            How many rows were handed back.
        """
        try:
            return self.outbox.release(self.worker_id)
        except Exception:
            logger.exception("%s: could not hand back its rows; their leases will expire", self.worker_id)
            return 0
        finally:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.close()


class _LeaseRenewer(threading.Thread):
    """Renews the lease of the rows in hand every third of the lease, until stopped."""

    def __init__(
        self, outbox: Outbox, worker_id: str, lease_seconds: float, keys: Iterable[EntryKey]
    ) -> None:
        super().__init__(name=f"lease-renewer-{worker_id}", daemon=True)
        self._outbox = outbox
        self._worker_id = worker_id
        self._lease = lease_seconds
        self._keys = set(keys)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._failures = FailureLog("lease_renewal", logger)

    def finished(self, keys: Iterable[EntryKey]) -> None:
        with self._lock:
            self._keys.difference_update(keys)

    def outstanding(self) -> list[EntryKey]:
        with self._lock:
            return sorted(self._keys)

    def stop(self) -> None:
        self._stopped.set()
        self.join()

    def run(self) -> None:
        interval = max(self._lease / 3, 0.05)
        while not self._stopped.wait(interval):
            keys = self.outstanding()
            if not keys:
                continue
            try:
                renewed = self._outbox.renew(self._worker_id, keys, self._lease)
            except Exception as exc:
                self._failures.failed(exc, f"{self._worker_id}: lease renewal failed; retrying")
                continue
            self._failures.succeeded()
            # Rows finished meanwhile are not renewed either; only count those still in hand.
            still = len(set(keys).intersection(self.outstanding()))
            if renewed < still:
                logger.warning(
                    "%s: lost the lease of %d row(s) to another worker", self._worker_id, still - renewed
                )


def _describe(exc: BaseException | str) -> str:
    if isinstance(exc, str):
        return exc
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
