"""Delivery of pruned messages from the outbox to long-term memory (a LangGraph ``BaseStore``).

A :class:`Deliverer` claims batches of outbox rows under a lease it renews, groups them by memory
namespace, hands each group to an extractor (:class:`StoreExtractor` by default, or a user's
``module:callable`` through :func:`load_extractor`) and marks the rows done; failures are retried with
backoff and end as dead letters. docs/memory.md ("How nothing is lost", "A custom extractor") describes
delivery, retries and the extractor's contract.
"""

from __future__ import annotations

import inspect
import logging
import random
import threading
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from itertools import groupby

from reducing_saver.service.extraction.extractors import Extractor, PermanentExtractionError
from reducing_saver.service.leased_worker import LeasedWorker, LeaseRenewer
from reducing_saver.service.storage.background import FailureLog
from reducing_saver.service.storage.outbox import EntryKey, Outbox, OutboxEntry

# -- delivery --------------------------------------------------------------------------------------

logger = logging.getLogger(__name__)

#: How a dead letter's ``last_error`` starts when no retry can fix it.
PERMANENT_PREFIX = "permanent failure, retrying cannot help: "


class Deliverer(LeasedWorker):
    """Moves outbox rows to an extractor: claim, renew while extracting, complete or retry, park
    (the loop, backoff and hand-back: ``leased_worker.LeasedWorker``).

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

    task = "delivery"
    round_name = "delivery"
    thread_prefix = "deliverer"
    holds = "its rows; their leases"
    logger = logger

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
        super().__init__(
            worker_id=worker_id,
            lease_seconds=lease_seconds,
            max_attempts=max_attempts,
            base_backoff=base_backoff,
            max_backoff=max_backoff,
            idle_sleep=idle_sleep,
            linger=linger,
            rng=rng,
        )
        self.outbox = outbox
        self.extractor = extractor
        self.batch_size = batch_size
        #: Rows the last ``run_once`` claimed.
        self.last_claimed = 0

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
        claim = _Claim(self.outbox, self.worker_id, self.lease_seconds, [e.ident for e in entries])
        renewer = LeaseRenewer(
            f"lease-renewer-{self.worker_id}", self.lease_seconds, claim.renew, claim.failed
        )
        renewer.start()
        delivered = 0
        stopped = False
        try:
            groups = [
                (namespace, list(group)) for namespace, group in groupby(entries, key=lambda e: e.namespace)
            ]
            delivered, groups = self._deliver_together(groups, claim)
            for namespace, group in groups:
                if self.stopping():
                    stopped = True
                    break
                delivered += self._deliver_group(namespace, group, claim)
        finally:
            renewer.stop()
        if stopped:
            # Shutting down: hand the untouched rows back at once instead of waiting out their lease.
            self.outbox.release(self.worker_id, claim.outstanding())
        return delivered

    def run_round(self, *, after_failure: bool) -> bool:
        """One :meth:`run_once`; whether it claimed a full batch (more may be waiting)."""
        self.run_once()
        return self.last_claimed >= self.batch_size

    def _deliver_together(
        self, groups: list[tuple[tuple[str, ...], list[OutboxEntry]]], claim: _Claim
    ) -> tuple[int, list[tuple[tuple[str, ...], list[OutboxEntry]]]]:
        """Hand several namespace groups to the extractor at once when it can take them
        (``extract_groups``, the store extractor's: one store write for them all), and complete them in one
        statement. Groups holding deletions or rows claimed too often, and every group when that call
        fails, are left for :meth:`_deliver_group` (one group at a time, as for any extractor).

        Returns:
            How many rows were delivered, and the groups left.
        """
        extract_groups = getattr(self.extractor, "extract_groups", None)
        plain = [
            (namespace, group)
            for namespace, group in groups
            if all(e.message is not None and e.attempts <= self.max_attempts for e in group)
        ]
        if extract_groups is None or len(plain) < 2 or self.stopping():
            return 0, groups
        try:
            extract_groups(plain)
        except Exception as exc:  # each group again on its own: a failure is then that group's alone
            logger.debug("extractor %r failed on %d groups at once: %s", self.extractor, len(plain), exc)
            return 0, groups
        delivered = self._complete([e for _, group in plain for e in group], claim)
        together = {namespace for namespace, _ in plain}
        return delivered, [(namespace, group) for namespace, group in groups if namespace not in together]

    def _deliver_group(self, namespace: tuple[str, ...], group: list[OutboxEntry], claim: _Claim) -> int:
        crashed = [e for e in group if e.attempts > self.max_attempts]
        for entry in crashed:
            message = (
                f"claimed {entry.attempts} times without an outcome (a worker crashed or lost its lease "
                "each time)"
            )
            self._fail(entry, message, permanent=True, claim=claim)
        group = [e for e in group if e.attempts <= self.max_attempts]
        deletions = [e for e in group if e.message is None]
        if deletions:  # messages the agent deleted on purpose: they leave the store
            group = [e for e in group if e.message is not None]
            error = self._forget(deletions, namespace)
            if error is None:
                delivered = self._complete(deletions, claim)
            else:
                delivered = 0
                for entry in deletions:
                    self._fail(entry, _describe(error), permanent=False, claim=claim)
            return delivered + (self._deliver_group(namespace, group, claim) if group else 0)
        if not group:
            return 0
        error = self._extract(group, namespace)
        if error is None:
            return self._complete(group, claim)
        if len(group) == 1:
            permanent = isinstance(error, PermanentExtractionError)
            self._fail(group[0], _describe(error), permanent=permanent, claim=claim)
            return 0
        # One bad message must not hold back the others: retry the group one message at a time.
        delivered = 0
        for entry in group:
            single_error = self._extract([entry], namespace)
            if single_error is None:
                delivered += self._complete([entry], claim)
            else:
                self._fail(
                    entry,
                    _describe(single_error),
                    permanent=isinstance(single_error, PermanentExtractionError),
                    claim=claim,
                )
        return delivered

    def _extract(self, entries: list[OutboxEntry], namespace: tuple[str, ...]) -> Exception | None:
        try:
            result = self.extractor(entries, namespace)
            if inspect.isawaitable(result):
                self.run_async(result)
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
            logger.warning(
                "forgetting %d message(s) of namespace %r failed: %s", len(entries), namespace, _describe(exc)
            )
            return exc
        return None

    def _complete(self, entries: list[OutboxEntry], claim: _Claim) -> int:
        keys = [e.ident for e in entries]
        # Stop renewing first: a renewal racing the completion would report a lost lease.
        claim.finished(keys)
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

    def _fail(self, entry: OutboxEntry, error: str, *, permanent: bool, claim: _Claim) -> None:
        claim.finished([entry.ident])
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

    def error_wait(self, errors: int) -> float:
        """The shared wait after failed rounds, never longer than ``max_backoff``."""
        return min(self.max_backoff, super().error_wait(errors))

    def hand_back(self) -> int:
        """Hand back every row this worker holds (lease cleared, claim not counted).

        Returns:
            How many rows were handed back.
        """
        return self.outbox.release(self.worker_id)


class _Claim:
    """The rows of one claimed batch still in hand, and the renewal of their lease (by a ``LeaseRenewer``)."""

    def __init__(
        self, outbox: Outbox, worker_id: str, lease_seconds: float, keys: Iterable[EntryKey]
    ) -> None:
        self._outbox = outbox
        self._worker_id = worker_id
        self._lease = lease_seconds
        self._keys = set(keys)
        self._lock = threading.Lock()
        self._failures = FailureLog("lease_renewal", logger)

    def finished(self, keys: Iterable[EntryKey]) -> None:
        with self._lock:
            self._keys.difference_update(keys)

    def outstanding(self) -> list[EntryKey]:
        with self._lock:
            return sorted(self._keys)

    def renew(self) -> bool:
        """Renew the lease of the rows still in hand (always goes on renewing)."""
        keys = self.outstanding()
        if not keys:
            return True
        renewed = self._outbox.renew(self._worker_id, keys, self._lease)
        self._failures.succeeded()
        # Rows finished meanwhile are not renewed either; only count those still in hand.
        still = len(set(keys).intersection(self.outstanding()))
        if renewed < still:
            logger.warning(
                "%s: lost the lease of %d row(s) to another worker", self._worker_id, still - renewed
            )
        return True

    def failed(self, exc: Exception) -> None:
        self._failures.failed(exc, f"{self._worker_id}: lease renewal failed; retrying")


def _describe(exc: BaseException | str) -> str:
    if isinstance(exc, str):
        return exc
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
