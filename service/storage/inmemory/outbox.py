"""The extraction outbox in this process's memory (``memory://``, tests)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Self

from reducing_saver.service.storage.outbox import (
    SEALED_KEY,
    EntryKey,
    OutboxEntry,
    as_utc,
    check_fail_args,
    claim_order,
    error_text,
    json_text,
    sorted_unique,
)


def _sealed(message: Any) -> bool:
    return isinstance(message, dict) and len(message) == 1 and SEALED_KEY in message


@dataclass
class _MemoryRow:
    entry: OutboxEntry
    available_at: float
    status: str = "pending"
    attempts: int = 0
    claimed_by: str | None = None
    lease_until: float | None = None
    last_error: str | None = None
    failed_at: float | None = None
    delivered_at: float | None = None

    def snapshot(self) -> OutboxEntry:
        return replace(self.entry, attempts=self.attempts, last_error=self.last_error)

    def held_by(self, worker_id: str) -> bool:
        return self.status == "pending" and self.claimed_by == worker_id


class MemoryOutbox:
    """The outbox in this process's memory (``memory://``, tests). Thread-safe; not durable."""

    #: A put's entries are recorded before its checkpoint, on their own.
    records_with_checkpoint = False
    #: See ``storage.outbox.Outbox`` (one process: it sealed its rows itself, or none).
    claims_sealed = False

    def __init__(self) -> None:
        self._rows: dict[EntryKey, _MemoryRow] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def setup(self) -> None:
        """Nothing to create."""

    def close(self) -> None:
        """Nothing to close."""

    def record(self, entries: Iterable[OutboxEntry]) -> int:
        """See :meth:`PostgresOutbox.record`."""
        rows = sorted_unique(entries)
        now = time.time()
        inserted = 0
        with self._lock:
            for e in rows:
                row = self._rows.get(e.ident)
                newer = (
                    row is not None
                    and None not in (row.entry.fingerprint, e.fingerprint)
                    and row.entry.fingerprint != e.fingerprint
                )
                if row is None or newer:  # a new key, or a newer version of the message
                    self._rows[e.ident] = _MemoryRow(replace(e, attempts=0, last_error=None), now)
                    inserted += row is None
        return inserted

    def forget(self, entries: Iterable[OutboxEntry]) -> int:
        """See :meth:`PostgresOutbox.forget`."""
        rows = sorted_unique(entries)
        now = time.time()
        with self._lock:
            for e in rows:
                self._rows[e.ident] = _MemoryRow(
                    replace(e, message=None, message_class=None, attempts=0, last_error=None), now
                )
        return len(rows)

    def claim(self, worker_id: str, limit: int, lease_seconds: float) -> list[OutboxEntry]:
        """See :meth:`PostgresOutbox.claim`."""
        now = time.time()
        with self._lock:
            ready = [
                row
                for row in self._rows.values()
                if row.status == "pending"
                and row.available_at <= now
                and (row.lease_until is None or row.lease_until <= now)
                and (self.claims_sealed or not _sealed(row.entry.message))
            ]
            ready.sort(key=lambda row: row.available_at)
            claimed = []
            for row in ready[:limit]:
                row.claimed_by, row.lease_until = worker_id, now + lease_seconds
                row.attempts += 1
                claimed.append(row.snapshot())
        return sorted(claimed, key=claim_order)

    def _held(self, worker_id: str, keys: Iterable[EntryKey] | None) -> list[_MemoryRow]:
        if keys is None:
            return [row for row in self._rows.values() if row.held_by(worker_id)]
        rows = (self._rows.get((tuple(ns), k)) for ns, k in set(keys))
        return [row for row in rows if row is not None and row.held_by(worker_id)]

    def renew(self, worker_id: str, keys: Iterable[EntryKey] | None, lease_seconds: float) -> int:
        """See :meth:`PostgresOutbox.renew`."""
        with self._lock:
            rows = [row for row in self._held(worker_id, keys) if row.lease_until is not None]
            for row in rows:
                row.lease_until = time.time() + lease_seconds
            return len(rows)

    def complete(self, worker_id: str, keys: Iterable[EntryKey]) -> int:
        """See :meth:`PostgresOutbox.complete`."""
        with self._lock:
            rows = self._held(worker_id, list(keys))
            for row in rows:
                row.status, row.delivered_at, row.lease_until = "done", time.time(), None
                row.entry = replace(row.entry, message=None, message_class=None, checkpoint_id=None)
                row.claimed_by = row.last_error = None
            return len(rows)

    def fail(
        self,
        worker_id: str,
        key: EntryKey,
        error: str,
        *,
        retry_at: datetime | None = None,
        dead: bool = False,
    ) -> bool:
        """See :meth:`PostgresOutbox.fail`."""
        check_fail_args(retry_at, dead)
        with self._lock:
            rows = self._held(worker_id, [key])
            for row in rows:
                row.last_error, row.failed_at = error_text(error), time.time()
                row.claimed_by = row.lease_until = None
                if retry_at is None:  # dead (check_fail_args: one of the two)
                    row.status = "dead"
                else:
                    row.available_at = as_utc(retry_at).timestamp()
            return bool(rows)

    def release(self, worker_id: str, keys: Iterable[EntryKey] | None = None) -> int:
        """See :meth:`PostgresOutbox.release`."""
        with self._lock:
            rows = [row for row in self._held(worker_id, keys) if row.lease_until is not None]
            for row in rows:
                row.claimed_by = row.lease_until = None
                row.attempts = max(row.attempts - 1, 0)
            return len(rows)

    def sizes(self) -> list[tuple[tuple[str, ...], str, int]]:
        """``(namespace, thread id, bytes of the message's JSON)`` of every row (storage figures)."""
        with self._lock:
            return [
                (ident[0], row.entry.thread_id, len(json_text(row.entry.message)))
                for ident, row in self._rows.items()
            ]

    def status(self, *, namespace_prefix: Sequence[str] | None = None) -> dict[str, Any]:
        """See :meth:`PostgresOutbox.status`."""
        now = time.time()
        counts = {"pending": 0, "in_flight": 0, "delivered": 0, "dead": 0}
        oldest: datetime | None = None
        with self._lock:
            for row in self._rows.values():
                if not _under(row.entry.namespace, namespace_prefix):
                    continue
                if row.status == "done":
                    counts["delivered"] += 1
                elif row.status == "dead":
                    counts["dead"] += 1
                else:
                    live = row.lease_until is not None and row.lease_until > now
                    counts["in_flight" if live else "pending"] += 1
                    if oldest is None or row.entry.pruned_at < oldest:
                        oldest = row.entry.pruned_at
        age = None if oldest is None else max(0.0, now - oldest.timestamp())
        return {**counts, "oldest_pending_age_seconds": age}

    def dead_letters(
        self, limit: int = 100, *, namespace_prefix: Sequence[str] | None = None
    ) -> list[OutboxEntry]:
        """See :meth:`PostgresOutbox.dead_letters`."""
        with self._lock:
            dead = [
                row
                for row in self._rows.values()
                if row.status == "dead" and _under(row.entry.namespace, namespace_prefix)
            ]
            dead.sort(key=lambda row: (row.failed_at or 0.0, row.entry.namespace, row.entry.key))
            return [row.snapshot() for row in dead[:limit]]

    def retry_dead(
        self, keys: Iterable[EntryKey] | None = None, *, namespace_prefix: Sequence[str] | None = None
    ) -> int:
        """See :meth:`PostgresOutbox.retry_dead`."""
        with self._lock:
            if keys is None:
                rows = [row for row in self._rows.values() if row.status == "dead"]
            else:
                found = (self._rows.get((tuple(ns), k)) for ns, k in set(keys))
                rows = [row for row in found if row is not None and row.status == "dead"]
            rows = [row for row in rows if _under(row.entry.namespace, namespace_prefix)]
            for row in rows:
                row.status, row.attempts, row.available_at = "pending", 0, time.time()
                row.claimed_by = row.lease_until = None
            return len(rows)

    def purge_delivered(self, older_than_seconds: float) -> int:
        """See :meth:`PostgresOutbox.purge_delivered`."""
        cutoff = time.time() - older_than_seconds
        with self._lock:
            gone = [
                ident
                for ident, row in self._rows.items()
                if row.status == "done" and (row.delivered_at or 0.0) < cutoff
            ]
            for ident in gone:
                del self._rows[ident]
            return len(gone)


def _under(namespace: Sequence[str], prefix: Sequence[str] | None) -> bool:
    return prefix is None or tuple(namespace[: len(prefix)]) == tuple(prefix)
