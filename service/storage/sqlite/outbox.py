"""The extraction outbox as a table in the service's SQLite file (``BEGIN IMMEDIATE`` transactions)."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Self

import orjson

from reducing_saver.service.storage.outbox import (
    COLUMNS,
    DELIVERED_DROPS,
    SEALED_START,
    TABLE,
    EntryKey,
    OutboxEntry,
    as_utc,
    check_fail_args,
    claim_order,
    error_text,
    json_text,
    sorted_unique,
)
from reducing_saver.service.storage.sqlite import migrations
from reducing_saver.service.storage.sqlite.connections import connect


class SqliteOutbox:
    """The outbox as a table in a SQLite file (the service's own file, next to the checkpoints).

    SQLite has no ``SKIP LOCKED``: claims and every other change run in ``BEGIN IMMEDIATE`` transactions,
    which take the write lock up front, so several threads or processes never claim the same row. The
    namespace is stored as JSON text, which tells ``("a", "b:c")`` and ``("a:b", "c")`` apart.

    Args:
        path: The SQLite file.
    """

    #: A put's entries are recorded before its checkpoint, on their own.
    records_with_checkpoint = False
    #: See ``storage.outbox.Outbox``.
    claims_sealed = False

    def __init__(self, path: str) -> None:
        self.path = str(path)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = connect(self.path)
            conn.row_factory = sqlite3.Row
            self._local.conn = conn
            with self._connections_lock:
                self._connections.append(conn)
        return conn

    def _write(self):
        return _SqliteImmediate(self._conn())

    def close(self) -> None:
        """Close every connection this outbox opened (one per thread that used it)."""
        with self._connections_lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()
        self._local = threading.local()

    def setup(self) -> None:
        """Bring the service's tables up to date (``migrations.apply``, under the file's write lock)."""
        with self._write() as cur:
            migrations.apply(cur)

    def record(self, entries: Iterable[OutboxEntry]) -> int:
        """See :meth:`PostgresOutbox.record`."""
        rows = sorted_unique(entries)
        if not rows:
            return 0
        with self._write() as cur:
            now = time.time()
            cur.executemany(
                f"INSERT INTO {TABLE} (namespace, key, thread_id, checkpoint_id, message, message_class, "
                "pruned_at, available_at, fingerprint) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (namespace, key) DO NOTHING",
                [
                    (
                        _ns_text(e.namespace),
                        e.key,
                        e.thread_id,
                        e.checkpoint_id,
                        json_text(e.message),
                        e.message_class,
                        as_utc(e.pruned_at).timestamp(),
                        now,
                        e.fingerprint,
                    )
                    for e in rows
                ],
            )
            inserted = cur.rowcount
            # A newer version of a message (another fingerprint) replaces its row, delivered again.
            cur.executemany(
                f"UPDATE {TABLE} SET message = ?, message_class = ?, thread_id = ?, checkpoint_id = ?, "
                "pruned_at = ?, fingerprint = ?, status = 'pending', attempts = 0, available_at = ?, "
                "claimed_by = NULL, lease_until = NULL, last_error = NULL, failed_at = NULL, delivered_at = NULL "
                "WHERE namespace = ? AND key = ? AND fingerprint <> ?",
                [
                    (
                        json_text(e.message),
                        e.message_class,
                        e.thread_id,
                        e.checkpoint_id,
                        as_utc(e.pruned_at).timestamp(),
                        e.fingerprint,
                        now,
                        _ns_text(e.namespace),
                        e.key,
                        e.fingerprint,
                    )
                    for e in rows
                    if e.fingerprint is not None
                ],
            )
            return inserted

    def forget(self, entries: Iterable[OutboxEntry]) -> int:
        """See :meth:`PostgresOutbox.forget`."""
        rows = sorted_unique(entries)
        if not rows:
            return 0
        now = time.time()
        with self._write() as cur:
            cur.executemany(
                f"INSERT INTO {TABLE} (namespace, key, thread_id, checkpoint_id, message, message_class, "
                "pruned_at, available_at) VALUES (?, ?, ?, ?, 'null', NULL, ?, ?) ON CONFLICT (namespace, key) "
                "DO UPDATE SET status = 'pending', message = 'null', message_class = NULL, claimed_by = NULL, "
                "lease_until = NULL, available_at = excluded.available_at, attempts = 0, last_error = NULL, "
                "failed_at = NULL, delivered_at = NULL",
                [
                    (
                        _ns_text(e.namespace),
                        e.key,
                        e.thread_id,
                        e.checkpoint_id,
                        as_utc(e.pruned_at).timestamp(),
                        now,
                    )
                    for e in rows
                ],
            )
        return len(rows)

    def claim(self, worker_id: str, limit: int, lease_seconds: float) -> list[OutboxEntry]:
        """See :meth:`PostgresOutbox.claim`."""
        now = time.time()
        with self._write() as cur:
            # Sealed rows only under --encryption (claims_sealed): others wait for a process with the key ring.
            sealed = "" if self.claims_sealed else " AND substr(message, 1, ?) <> ?"
            picked = cur.execute(
                f"SELECT namespace, key FROM {TABLE} WHERE status = 'pending' AND available_at <= ? "
                f"AND (lease_until IS NULL OR lease_until <= ?){sealed} ORDER BY available_at LIMIT ?",
                (now, now, *(() if self.claims_sealed else (len(SEALED_START), SEALED_START)), limit),
            ).fetchall()
            if not picked:
                return []
            cur.executemany(
                f"UPDATE {TABLE} SET claimed_by = ?, lease_until = ?, attempts = attempts + 1 "
                "WHERE namespace = ? AND key = ?",
                [(worker_id, now + lease_seconds, r["namespace"], r["key"]) for r in picked],
            )
            rows = []
            for r in picked:
                rows.extend(
                    cur.execute(
                        f"SELECT {COLUMNS} FROM {TABLE} WHERE namespace = ? AND key = ?",
                        (r["namespace"], r["key"]),
                    ).fetchall()
                )
        return sorted((_sqlite_entry(r) for r in rows), key=claim_order)

    def renew(self, worker_id: str, keys: Iterable[EntryKey] | None, lease_seconds: float) -> int:
        """See :meth:`PostgresOutbox.renew`."""
        until = time.time() + lease_seconds
        return self._update_held(
            "lease_until = ?", (until,), worker_id, keys, extra="AND lease_until IS NOT NULL"
        )

    def complete(self, worker_id: str, keys: Iterable[EntryKey]) -> int:
        """See :meth:`PostgresOutbox.complete`."""
        keys = list(keys)
        if not keys:
            return 0
        return self._update_held(
            f"status = 'done', delivered_at = ?, lease_until = NULL, {DELIVERED_DROPS}",
            (time.time(),),
            worker_id,
            keys,
        )

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
        now = time.time()
        params: tuple[Any, ...]
        if retry_at is None:  # dead (check_fail_args: one of the two)
            sets, params = (
                "status = 'dead', last_error = ?, failed_at = ?, claimed_by = NULL, lease_until = NULL",
                (
                    error_text(error),
                    now,
                ),
            )
        else:
            sets, params = (
                "available_at = ?, last_error = ?, failed_at = ?, claimed_by = NULL, lease_until = NULL",
                (as_utc(retry_at).timestamp(), error_text(error), now),
            )
        return self._update_held(sets, params, worker_id, [key]) == 1

    def release(self, worker_id: str, keys: Iterable[EntryKey] | None = None) -> int:
        """See :meth:`PostgresOutbox.release`."""
        return self._update_held(
            "claimed_by = NULL, lease_until = NULL, attempts = MAX(attempts - 1, 0)",
            (),
            worker_id,
            keys,
            extra="AND lease_until IS NOT NULL",
        )

    def _update_held(
        self,
        sets: str,
        params: tuple[Any, ...],
        worker_id: str,
        keys: Iterable[EntryKey] | None,
        extra: str = "",
    ) -> int:
        base = f"UPDATE {TABLE} SET {sets} WHERE claimed_by = ? AND status = 'pending' {extra}"
        with self._write() as cur:
            if keys is None:
                cur.execute(base, (*params, worker_id))
                return cur.rowcount
            pairs = sorted({(tuple(ns), k) for ns, k in keys})
            cur.executemany(
                base + " AND namespace = ? AND key = ?",
                [(*params, worker_id, _ns_text(ns), k) for ns, k in pairs],
            )
            return cur.rowcount if pairs else 0

    def status(self, *, namespace_prefix: Sequence[str] | None = None) -> dict[str, Any]:
        """See :meth:`PostgresOutbox.status`."""
        now = time.time()
        where, extra = _sqlite_prefix_where(namespace_prefix, "WHERE")
        row = (
            self._conn()
            .execute(
                f"""SELECT
                  COALESCE(SUM(status = 'pending' AND (lease_until IS NULL OR lease_until <= ?)), 0)
                    AS pending,
                  COALESCE(SUM(status = 'pending' AND lease_until > ?), 0) AS in_flight,
                  COALESCE(SUM(status = 'done'), 0) AS delivered,
                  COALESCE(SUM(status = 'dead'), 0) AS dead,
                  MIN(CASE WHEN status = 'pending' THEN pruned_at END) AS oldest
                FROM {TABLE}{where}""",
                (now, now, *extra),
            )
            .fetchone()
        )
        oldest = row["oldest"]
        return {
            "pending": row["pending"],
            "in_flight": row["in_flight"],
            "delivered": row["delivered"],
            "dead": row["dead"],
            "oldest_pending_age_seconds": None if oldest is None else max(0.0, now - oldest),
        }

    def dead_letters(
        self, limit: int = 100, *, namespace_prefix: Sequence[str] | None = None
    ) -> list[OutboxEntry]:
        """See :meth:`PostgresOutbox.dead_letters`."""
        where, extra = _sqlite_prefix_where(namespace_prefix, "AND")
        rows = (
            self._conn()
            .execute(
                f"SELECT {COLUMNS} FROM {TABLE} WHERE status = 'dead'{where} "
                "ORDER BY failed_at, namespace, key LIMIT ?",
                (*extra, limit),
            )
            .fetchall()
        )
        return [_sqlite_entry(r) for r in rows]

    def retry_dead(
        self, keys: Iterable[EntryKey] | None = None, *, namespace_prefix: Sequence[str] | None = None
    ) -> int:
        """See :meth:`PostgresOutbox.retry_dead`."""
        where, extra = _sqlite_prefix_where(namespace_prefix, "AND")
        base = (
            f"UPDATE {TABLE} SET status = 'pending', attempts = 0, available_at = ?, claimed_by = NULL, "
            f"lease_until = NULL WHERE status = 'dead'{where}"
        )
        now = time.time()
        with self._write() as cur:
            if keys is None:
                cur.execute(base, (now, *extra))
                return cur.rowcount
            pairs = sorted({(tuple(ns), k) for ns, k in keys})
            if not pairs:
                return 0
            cur.executemany(
                base + " AND namespace = ? AND key = ?", [(now, *extra, _ns_text(ns), k) for ns, k in pairs]
            )
            return cur.rowcount

    def purge_delivered(self, older_than_seconds: float) -> int:
        """See :meth:`PostgresOutbox.purge_delivered`."""
        with self._write() as cur:
            cur.execute(
                f"DELETE FROM {TABLE} WHERE status = 'done' AND delivered_at < ?",
                (time.time() - older_than_seconds,),
            )
            return cur.rowcount


class _SqliteImmediate:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on error) around a cursor."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def __enter__(self) -> sqlite3.Cursor:
        self._conn.execute("BEGIN IMMEDIATE")
        self._cur = self._conn.cursor()
        return self._cur

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._cur.close()
        self._conn.execute("ROLLBACK" if exc_type is not None else "COMMIT")


def _sqlite_prefix_where(prefix: Sequence[str] | None, keyword: str) -> tuple[str, tuple[Any, ...]]:
    """Rows whose namespace (a JSON array) starts with the labels of ``prefix``."""
    if prefix is None:
        return "", ()
    tests = " AND ".join(f"json_extract(namespace, '$[{i}]') IS ?" for i in range(len(prefix)))
    return f" {keyword} ({tests})", tuple(prefix)


def _ns_text(namespace: Sequence[str]) -> str:
    return orjson.dumps(list(namespace)).decode()


def _sqlite_entry(row: sqlite3.Row) -> OutboxEntry:
    return OutboxEntry(
        namespace=tuple(orjson.loads(row["namespace"])),
        key=row["key"],
        thread_id=row["thread_id"],
        checkpoint_id=row["checkpoint_id"],
        message=orjson.loads(row["message"]),
        pruned_at=datetime.fromtimestamp(row["pruned_at"], UTC),
        attempts=row["attempts"],
        message_class=row["message_class"],
        last_error=row["last_error"],
    )
