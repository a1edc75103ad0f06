"""The extraction outbox: messages that left the window, kept durably until long-term memory has them.

The invariant the outbox upholds, with the put path recording *before* the checkpoint is stored: every
message that ever entered a thread's stored checkpoints is in the latest stored checkpoint, or is a row
here waiting for extraction, or is a row here already extracted. So a pruned message can be lost by
neither a crash nor a failing extractor, and the constraint on ``(namespace, key)`` keeps it once although
LangGraph hands every put of a turn the same unreduced list and those puts may land on different replicas.

A row goes through three states:

* ``pending``: waiting for a worker. A worker *claims* a batch: the rows get its id (``claimed_by``) and a
  lease (``lease_until``) that it renews while its extractor runs. A pending row whose lease has expired
  (its worker crashed) is claimable again; a row that failed waits until its ``retry_at``.
* ``done``: the extractor took it. The row stays, so a late put of the same turn records nothing.
* ``dead``: it failed ``max_attempts`` times (or failed for good). Kept, listed by :meth:`dead_letters`,
  sent back to ``pending`` by :meth:`retry_dead`.

Nothing is ever dropped: there is no capacity bound and no back-pressure discard.

Three implementations share one API: :class:`PostgresOutbox` (``FOR UPDATE SKIP LOCKED`` claims, safe
across replicas), :class:`SqliteOutbox` (a table in the service's SQLite file, ``BEGIN IMMEDIATE``
transactions) and :class:`MemoryOutbox` (one process, for ``memory://``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol, Self, TypeAlias

import orjson
from langchain_core.messages import BaseMessage

from reducing_saver.service.messages_codec import EncodedMessage
from reducing_saver.service.pglock import setup_lock
from reducing_saver.service.reducer import message_key

__all__ = [
    "EntryKey",
    "MemoryOutbox",
    "Outbox",
    "OutboxEntry",
    "PostgresOutbox",
    "SqliteOutbox",
    "make_entries",
    "open_outbox",
]

logger = logging.getLogger(__name__)

#: ``(namespace, key)``: what makes an outbox row unique.
EntryKey: TypeAlias = tuple[tuple[str, ...], str]

TABLE = "reducing_saver_outbox"
#: Advisory lock key for the outbox set-up; distinct from the saver migration lock, so the two never wait
#: on each other.
_SETUP_LOCK_KEY = 0x72732D6F7574626F  # "rs-outbo"
#: Rows per INSERT statement (9 parameters each; PostgreSQL allows 65535 per statement).
_INSERT_CHUNK = 1000
_MAX_ERROR_CHARS = 4000


@dataclass(frozen=True)
class OutboxEntry:
    """One pruned message waiting for (or done with) extraction.

    Attributes:
        namespace: The run's memory namespace.
        key: The message's key in that namespace: its id, or a stable digest for id-less messages
            (``reducer.message_key``).
        thread_id: The thread the message was pruned from.
        checkpoint_id: The checkpoint whose put pruned it, when known.
        message: The message's ``model_dump()`` dict, JSON-clean.
        pruned_at: When it was recorded (UTC).
        attempts: How many times a worker has claimed it (this claim included, for claimed entries).
        message_class: ``"module:Class"`` of the message as serialized, when known; lets the extractor
            rebuild the right LangChain class without importing anything the payload names.
        last_error: The last extraction error (dead letters and retried rows).
    """

    namespace: tuple[str, ...]
    key: str
    thread_id: str
    checkpoint_id: str | None
    message: dict[str, Any]
    pruned_at: datetime
    attempts: int = 0
    message_class: str | None = None
    last_error: str | None = None

    @property
    def ident(self) -> EntryKey:
        """``(namespace, key)``."""
        return (self.namespace, self.key)


def make_entries(
    messages: Iterable[Any],
    namespace: Sequence[str],
    *,
    thread_id: str,
    checkpoint_id: str | None = None,
    pruned_at: datetime | None = None,
) -> list[OutboxEntry]:
    """Outbox entries for pruned messages, keyed as the reducer keys them (one per key).

    Args:
        messages: ``EncodedMessage`` (the service), LangChain message objects (in-process) or
            ``model_dump()`` dicts.
        namespace: The memory namespace they belong to.
        thread_id: The thread they were pruned from.
        checkpoint_id: The checkpoint whose put pruned them.
        pruned_at: Defaults to now (UTC).

    Returns:
        One entry per distinct message key, in input order.

    Raises:
        TypeError: If a message is neither a message object nor a mapping.
    """
    namespace = tuple(str(label) for label in namespace)
    when = _utc(pruned_at) if pruned_at is not None else datetime.now(UTC)
    entries: dict[str, OutboxEntry] = {}
    for message in messages:
        if isinstance(message, EncodedMessage):
            fields, cls = dict(message), f"{message.module}:{message.name}"
        elif isinstance(message, BaseMessage):
            fields, cls = message.model_dump(), f"{type(message).__module__}:{type(message).__name__}"
        elif isinstance(message, Mapping):
            fields, cls = dict(message), None
        else:
            raise TypeError(f"a pruned message must be a message or a mapping, got {type(message).__name__}")
        key = message_key(message, namespace)
        if key not in entries:
            entries[key] = OutboxEntry(
                namespace, key, str(thread_id), checkpoint_id, json_clean(fields), when, 0, cls
            )
    return list(entries.values())


def json_clean(value: Mapping[str, Any]) -> dict[str, Any]:
    """``value`` as plain JSON data (bytes become base64 text, unknown objects their ``str``)."""
    try:
        return orjson.loads(orjson.dumps(value, default=_json_default, option=orjson.OPT_NON_STR_KEYS))
    except orjson.JSONEncodeError:  # integers beyond 64 bits, say: the slower encoder copes
        return json.loads(json.dumps(value, default=_json_default))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(obj)).decode("ascii")
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    return str(obj)


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def _utc(when: datetime) -> datetime:
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def _error_text(error: str) -> str:
    return error if len(error) <= _MAX_ERROR_CHARS else error[: _MAX_ERROR_CHARS - 1] + "…"


def _sorted_unique(entries: Iterable[OutboxEntry]) -> list[OutboxEntry]:
    """One entry per ``(namespace, key)``, in key order: every writer inserts in the same order, so two
    transactions waiting on each other's uncommitted keys cannot deadlock."""
    unique: dict[EntryKey, OutboxEntry] = {}
    for entry in entries:
        unique.setdefault(entry.ident, entry)
    return [unique[ident] for ident in sorted(unique)]


def _check_fail_args(retry_at: datetime | None, dead: bool) -> None:
    if (retry_at is None) == (not dead):
        raise TypeError("fail() needs exactly one of retry_at=<datetime> or dead=True")


class Outbox(Protocol):
    """What every outbox offers; see :class:`PostgresOutbox` for the full contract."""

    def setup(self) -> None: ...
    def record(self, entries: Iterable[OutboxEntry]) -> int: ...
    def claim(self, worker_id: str, limit: int, lease_seconds: float) -> list[OutboxEntry]: ...
    def renew(self, worker_id: str, keys: Iterable[EntryKey] | None, lease_seconds: float) -> int: ...
    def complete(self, worker_id: str, keys: Iterable[EntryKey]) -> int: ...
    def fail(
        self,
        worker_id: str,
        key: EntryKey,
        error: str,
        *,
        retry_at: datetime | None = None,
        dead: bool = False,
    ) -> bool: ...
    def release(self, worker_id: str, keys: Iterable[EntryKey] | None = None) -> int: ...
    def status(self, *, namespace_prefix: Sequence[str] | None = None) -> dict[str, Any]: ...
    def dead_letters(self, limit: int = 100, *, namespace_prefix: Sequence[str] | None = None) -> list[OutboxEntry]: ...
    def retry_dead(
        self, keys: Iterable[EntryKey] | None = None, *, namespace_prefix: Sequence[str] | None = None
    ) -> int: ...
    def purge_delivered(self, older_than_seconds: float) -> int: ...
    def close(self) -> None: ...


# -- PostgreSQL ------------------------------------------------------------------------------------

_PG_SETUP = (
    f"""CREATE TABLE IF NOT EXISTS {TABLE} (
        namespace text[] NOT NULL,
        key text NOT NULL,
        thread_id text NOT NULL,
        checkpoint_id text,
        message json NOT NULL,
        message_class text,
        pruned_at timestamptz NOT NULL,
        status text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'done', 'dead')),
        attempts integer NOT NULL DEFAULT 0,
        available_at timestamptz NOT NULL DEFAULT now(),
        claimed_by text,
        lease_until timestamptz,
        last_error text,
        failed_at timestamptz,
        delivered_at timestamptz,
        PRIMARY KEY (namespace, key)
    )""",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_ready ON {TABLE} (available_at) WHERE status = 'pending'",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_age ON {TABLE} (pruned_at) WHERE status = 'pending'",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_dead ON {TABLE} (failed_at) WHERE status = 'dead'",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_claimed ON {TABLE} (claimed_by) WHERE status = 'pending'",
)

_PG_COLUMNS = (
    "namespace, key, thread_id, checkpoint_id, message, message_class, pruned_at, attempts, last_error"
)


class PostgresOutbox:
    """The outbox as a PostgreSQL table, shared by every replica and worker.

    Args:
        pool_or_conninfo: A ``psycopg_pool.ConnectionPool`` to borrow connections from (the backend's, for
            the put path), or a connection string (a small pool of this outbox's own is opened).
        pool_size: Size of the pool opened for a connection string.

    Each call borrows a connection for one explicit transaction and gives it back, so the outbox works on
    autocommit pools (the backend's) and on transactional ones alike, and never holds a connection between
    calls.
    """

    def __init__(self, pool_or_conninfo: Any, *, pool_size: int = 4) -> None:
        from psycopg_pool import ConnectionPool

        if isinstance(pool_or_conninfo, str):
            self._pool = ConnectionPool(
                pool_or_conninfo,
                min_size=1,
                max_size=pool_size,
                kwargs={"autocommit": True, "prepare_threshold": 0},
                open=False,
                name="reducing-saver-outbox",
            )
            self._pool.open(wait=True, timeout=30.0)
            self._owns_pool = True
        else:
            self._pool = pool_or_conninfo
            self._owns_pool = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the pool when this outbox opened it."""
        if self._owns_pool:
            self._pool.close()

    def _cursor(self):
        from psycopg.rows import dict_row

        return _PgCursor(self._pool, dict_row)

    def setup(self) -> None:
        """Create the table and its indexes (idempotent), one statement at a time, under an advisory lock
        so replicas starting together do not race."""
        with self._pool.connection() as conn, setup_lock(conn, _SETUP_LOCK_KEY):
            for statement in _PG_SETUP:
                with conn.transaction():
                    conn.execute(statement)

    def record(self, entries: Iterable[OutboxEntry]) -> int:
        """Record entries for extraction, once per ``(namespace, key)``; durable when it returns.

        Idempotent: keys already present (pending, done or dead) are left alone. All or nothing (one
        statement, or one transaction over several); rows go in key order.

        Returns:
            How many rows were inserted.

        Raises:
            psycopg.Error: If the rows could not be written (nothing is recorded then).
        """
        rows = _sorted_unique(entries)
        if not rows:
            return 0
        chunks = [rows[start : start + _INSERT_CHUNK] for start in range(0, len(rows), _INSERT_CHUNK)]
        with self._pool.connection() as conn:
            # One INSERT is atomic on its own autocommit connection: one round trip, where BEGIN and
            # COMMIT would add two. Several need the transaction.
            atomic = conn.transaction() if len(chunks) > 1 else contextlib.nullcontext()
            with atomic, conn.cursor() as cur:
                inserted = self._insert(cur, chunks)
        return inserted

    @staticmethod
    def _insert(cur: Any, chunks: list[list[OutboxEntry]]) -> int:
        from psycopg.types.json import Json

        inserted = 0
        for chunk in chunks:
            params: list[Any] = []
            for e in chunk:
                params += [
                    list(e.namespace),
                    e.key,
                    e.thread_id,
                    e.checkpoint_id,
                    Json(e.message, dumps=_dumps),
                    e.message_class,
                    _utc(e.pruned_at),
                ]
            values = ",".join(["(%s, %s, %s, %s, %s, %s, %s)"] * len(chunk))
            cur.execute(
                f"INSERT INTO {TABLE} (namespace, key, thread_id, checkpoint_id, message, message_class, "
                f"pruned_at) VALUES {values} ON CONFLICT (namespace, key) DO NOTHING",
                params,
            )
            inserted += cur.rowcount
        return inserted

    def claim(self, worker_id: str, limit: int, lease_seconds: float) -> list[OutboxEntry]:
        """Claim up to ``limit`` ready rows for ``worker_id`` with a lease of ``lease_seconds``.

        Ready: pending, past its ``retry_at``, and not under a live lease. Concurrent claimers skip each
        other's rows (``FOR UPDATE SKIP LOCKED``). Each claim counts one attempt.

        Returns:
            The claimed entries, ordered by namespace, then pruned_at, then key.
        """
        with self._cursor() as cur:
            cur.execute(
                f"""WITH picked AS (
                        SELECT namespace, key FROM {TABLE}
                        WHERE status = 'pending' AND available_at <= now()
                          AND (lease_until IS NULL OR lease_until <= now())
                        ORDER BY available_at
                        LIMIT %(limit)s
                        FOR UPDATE SKIP LOCKED)
                    UPDATE {TABLE} AS o
                    SET claimed_by = %(worker)s,
                        lease_until = now() + make_interval(secs => %(lease)s),
                        attempts = o.attempts + 1
                    FROM picked WHERE o.namespace = picked.namespace AND o.key = picked.key
                    RETURNING o.namespace, o.key, o.thread_id, o.checkpoint_id, o.message, o.message_class,
                              o.pruned_at, o.attempts, o.last_error""",
                {"limit": limit, "worker": worker_id, "lease": float(lease_seconds)},
            )
            rows = cur.fetchall()
        return sorted((_pg_entry(r) for r in rows), key=_claim_order)

    def renew(self, worker_id: str, keys: Iterable[EntryKey] | None, lease_seconds: float) -> int:
        """Extend the lease of rows ``worker_id`` still holds (all of them when ``keys`` is None).

        Returns:
            How many rows were renewed; fewer than asked means some are no longer this worker's.
        """
        where, params = _pg_keys_filter(keys)
        if where is None:
            return 0
        with self._cursor() as cur:
            cur.execute(
                f"UPDATE {TABLE} SET lease_until = now() + make_interval(secs => %s) "
                f"WHERE claimed_by = %s AND status = 'pending' AND lease_until IS NOT NULL{where}",
                [float(lease_seconds), worker_id, *params],
            )
            return cur.rowcount

    def complete(self, worker_id: str, keys: Iterable[EntryKey]) -> int:
        """Mark rows ``worker_id`` holds as delivered.

        A row whose lease expired is still completed when nobody else claimed it meanwhile.

        Returns:
            How many rows were marked done.
        """
        where, params = _pg_keys_filter(keys)
        if not where:
            return 0
        with self._cursor() as cur:
            cur.execute(
                f"UPDATE {TABLE} SET status = 'done', delivered_at = now(), lease_until = NULL "
                f"WHERE claimed_by = %s AND status = 'pending'{where}",
                [worker_id, *params],
            )
            return cur.rowcount

    def fail(
        self,
        worker_id: str,
        key: EntryKey,
        error: str,
        *,
        retry_at: datetime | None = None,
        dead: bool = False,
    ) -> bool:
        """Give a row back after a failed extraction: to retry at ``retry_at``, or parked (``dead=True``).

        Returns:
            False when the row is no longer ``worker_id``'s (its lease was lost to another worker).
        """
        _check_fail_args(retry_at, dead)
        namespace, message_key_ = key
        with self._cursor() as cur:
            if dead:
                cur.execute(
                    f"UPDATE {TABLE} SET status = 'dead', last_error = %s, failed_at = now(), "
                    "claimed_by = NULL, lease_until = NULL "
                    "WHERE namespace = %s AND key = %s AND claimed_by = %s AND status = 'pending'",
                    [_error_text(error), list(namespace), message_key_, worker_id],
                )
            else:
                cur.execute(
                    f"UPDATE {TABLE} SET available_at = %s, last_error = %s, failed_at = now(), "
                    "claimed_by = NULL, lease_until = NULL "
                    "WHERE namespace = %s AND key = %s AND claimed_by = %s AND status = 'pending'",
                    [_utc(retry_at), _error_text(error), list(namespace), message_key_, worker_id],
                )
            return cur.rowcount == 1

    def release(self, worker_id: str, keys: Iterable[EntryKey] | None = None) -> int:
        """Hand back rows ``worker_id`` holds without an outcome (graceful shutdown): lease cleared, the
        claim not counted as an attempt.

        Returns:
            How many rows were released.
        """
        where, params = _pg_keys_filter(keys)
        if where is None:
            return 0
        with self._cursor() as cur:
            cur.execute(
                f"UPDATE {TABLE} SET claimed_by = NULL, lease_until = NULL, "
                "attempts = GREATEST(attempts - 1, 0) "
                f"WHERE claimed_by = %s AND status = 'pending' AND lease_until IS NOT NULL{where}",
                [worker_id, *params],
            )
            return cur.rowcount

    def status(self, *, namespace_prefix: Sequence[str] | None = None) -> dict[str, Any]:
        """Counts by state, and the age of the oldest undelivered, not dead, row.

        ``namespace_prefix`` counts only rows whose namespace starts with those labels (a tenant's).

        Returns:
            ``{"pending", "in_flight", "delivered", "dead", "oldest_pending_age_seconds"}``; ``pending``
            counts rows waiting (including those waiting for a retry), ``in_flight`` rows under a live
            lease; the age is ``None`` when nothing is pending or in flight.
        """
        with self._cursor() as cur:
            cur.execute(
                f"""SELECT
                      count(*) FILTER (WHERE status = 'pending'
                                       AND (lease_until IS NULL OR lease_until <= now())) AS pending,
                      count(*) FILTER (WHERE status = 'pending' AND lease_until > now()) AS in_flight,
                      count(*) FILTER (WHERE status = 'done') AS delivered,
                      count(*) FILTER (WHERE status = 'dead') AS dead,
                      extract(epoch FROM now() - min(pruned_at) FILTER (WHERE status = 'pending'))::float8
                        AS oldest
                    FROM {TABLE}{_pg_prefix_where(namespace_prefix, "WHERE")}""",
                _pg_prefix_params(namespace_prefix),
            )
            row = cur.fetchone()
        oldest = row["oldest"]
        return {
            "pending": row["pending"],
            "in_flight": row["in_flight"],
            "delivered": row["delivered"],
            "dead": row["dead"],
            "oldest_pending_age_seconds": None if oldest is None else max(0.0, float(oldest)),
        }

    def dead_letters(self, limit: int = 100, *, namespace_prefix: Sequence[str] | None = None) -> list[OutboxEntry]:
        """Parked rows, oldest failure first, with their ``attempts`` and ``last_error`` (only those under
        ``namespace_prefix`` when given)."""
        with self._cursor() as cur:
            cur.execute(
                f"SELECT {_PG_COLUMNS} FROM {TABLE} WHERE status = 'dead'"
                f"{_pg_prefix_where(namespace_prefix, 'AND')} ORDER BY failed_at, namespace, key LIMIT %s",
                [*_pg_prefix_params(namespace_prefix), limit],
            )
            return [_pg_entry(r) for r in cur.fetchall()]

    def retry_dead(
        self, keys: Iterable[EntryKey] | None = None, *, namespace_prefix: Sequence[str] | None = None
    ) -> int:
        """Send dead letters (all, or those named; only under ``namespace_prefix`` when given) back to
        pending with a fresh attempt count.

        Returns:
            How many rows were re-driven.
        """
        where, params = _pg_keys_filter(keys)
        if where is None:
            return 0
        with self._cursor() as cur:
            cur.execute(
                f"UPDATE {TABLE} SET status = 'pending', attempts = 0, available_at = now(), "
                f"claimed_by = NULL, lease_until = NULL WHERE status = 'dead'{where}"
                f"{_pg_prefix_where(namespace_prefix, 'AND')}",
                [*params, *_pg_prefix_params(namespace_prefix)],
            )
            return cur.rowcount

    def purge_delivered(self, older_than_seconds: float) -> int:
        """Delete delivered rows older than this. A message pruned again after its row is purged would be
        extracted again (the extractor overwrites by key), so keep well beyond the length of a turn.

        Returns:
            How many rows were deleted.
        """
        with self._cursor() as cur:
            cur.execute(
                f"DELETE FROM {TABLE} WHERE status = 'done' "
                "AND delivered_at < now() - make_interval(secs => %s)",
                [float(older_than_seconds)],
            )
            return cur.rowcount


class _PgCursor:
    """A pooled connection, one transaction and a dict-row cursor, as one context manager."""

    def __init__(self, pool: Any, row_factory: Any) -> None:
        self._pool, self._row_factory = pool, row_factory

    def __enter__(self):
        self._conn_cm = self._pool.connection()
        conn = self._conn_cm.__enter__()
        try:
            self._tx = conn.transaction()
            self._tx.__enter__()
            self._cur = conn.cursor(row_factory=self._row_factory)
        except BaseException:
            self._conn_cm.__exit__(None, None, None)
            raise
        return self._cur

    def __exit__(self, *exc: object) -> None:
        try:
            self._cur.close()
            self._tx.__exit__(*exc)
        finally:
            self._conn_cm.__exit__(*exc)


def _pg_prefix_where(prefix: Sequence[str] | None, keyword: str) -> str:
    return "" if prefix is None else f" {keyword} namespace[1:%s] = %s::text[]"


def _pg_prefix_params(prefix: Sequence[str] | None) -> list[Any]:
    return [] if prefix is None else [len(prefix), list(prefix)]


def _pg_keys_filter(keys: Iterable[EntryKey] | None) -> tuple[str | None, list[Any]]:
    """``(" AND (namespace, key) IN (VALUES ...)", params)``; ``("", [])`` for all rows; ``None`` when
    ``keys`` is empty (nothing to touch)."""
    if keys is None:
        return "", []
    pairs = sorted({(tuple(ns), k) for ns, k in keys})
    if not pairs:
        return None, []
    params: list[Any] = []
    for namespace, key in pairs:
        params += [list(namespace), key]
    values = ",".join(["(%s::text[], %s::text)"] * len(pairs))
    return f" AND (namespace, key) IN (VALUES {values})", params


def _pg_entry(row: Mapping[str, Any]) -> OutboxEntry:
    return OutboxEntry(
        namespace=tuple(row["namespace"]),
        key=row["key"],
        thread_id=row["thread_id"],
        checkpoint_id=row["checkpoint_id"],
        message=row["message"],
        pruned_at=_utc(row["pruned_at"]),
        attempts=row["attempts"],
        message_class=row["message_class"],
        last_error=row["last_error"],
    )


def _claim_order(entry: OutboxEntry) -> tuple[Any, ...]:
    return (entry.namespace, entry.pruned_at, entry.key)


# -- SQLite ----------------------------------------------------------------------------------------

_SQLITE_SETUP = (
    f"""CREATE TABLE IF NOT EXISTS {TABLE} (
        namespace TEXT NOT NULL,
        key TEXT NOT NULL,
        thread_id TEXT NOT NULL,
        checkpoint_id TEXT,
        message TEXT NOT NULL,
        message_class TEXT,
        pruned_at REAL NOT NULL,
        status TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'done', 'dead')),
        attempts INTEGER NOT NULL DEFAULT 0,
        available_at REAL NOT NULL,
        claimed_by TEXT,
        lease_until REAL,
        last_error TEXT,
        failed_at REAL,
        delivered_at REAL,
        PRIMARY KEY (namespace, key)
    )""",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_ready ON {TABLE} (status, available_at)",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_claimed ON {TABLE} (claimed_by)",
)

_SQLITE_COLUMNS = _PG_COLUMNS


class SqliteOutbox:
    """The outbox as a table in a SQLite file (the service's own file, next to the checkpoints).

    SQLite has no ``SKIP LOCKED``: claims and every other change run in ``BEGIN IMMEDIATE`` transactions,
    which take the write lock up front, so several threads or processes never claim the same row. The
    namespace is stored as JSON text, which tells ``("a", "b:c")`` and ``("a:b", "c")`` apart.

    Args:
        path: The SQLite file.
        timeout: How long a statement waits for another writer's lock, in seconds.
    """

    def __init__(self, path: str, *, timeout: float = 30.0) -> None:
        self.path = str(path)
        self.timeout = timeout
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
            conn = sqlite3.connect(
                self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False
            )
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
        """Create the table and indexes (idempotent)."""
        conn = self._conn()
        conn.execute("PRAGMA journal_mode=WAL")
        with self._write() as cur:
            for statement in _SQLITE_SETUP:
                cur.execute(statement)

    def record(self, entries: Iterable[OutboxEntry]) -> int:
        """See :meth:`PostgresOutbox.record`."""
        rows = _sorted_unique(entries)
        if not rows:
            return 0
        with self._write() as cur:
            cur.executemany(
                f"INSERT INTO {TABLE} (namespace, key, thread_id, checkpoint_id, message, message_class, "
                "pruned_at, available_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (namespace, key) DO NOTHING",
                [
                    (
                        _ns_text(e.namespace),
                        e.key,
                        e.thread_id,
                        e.checkpoint_id,
                        _dumps(e.message),
                        e.message_class,
                        _utc(e.pruned_at).timestamp(),
                        time.time(),
                    )
                    for e in rows
                ],
            )
            return cur.rowcount

    def claim(self, worker_id: str, limit: int, lease_seconds: float) -> list[OutboxEntry]:
        """See :meth:`PostgresOutbox.claim`."""
        now = time.time()
        with self._write() as cur:
            picked = cur.execute(
                f"SELECT namespace, key FROM {TABLE} WHERE status = 'pending' AND available_at <= ? "
                "AND (lease_until IS NULL OR lease_until <= ?) ORDER BY available_at LIMIT ?",
                (now, now, limit),
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
                        f"SELECT {_SQLITE_COLUMNS} FROM {TABLE} WHERE namespace = ? AND key = ?",
                        (r["namespace"], r["key"]),
                    ).fetchall()
                )
        return sorted((_sqlite_entry(r) for r in rows), key=_claim_order)

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
            "status = 'done', delivered_at = ?, lease_until = NULL", (time.time(),), worker_id, keys
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
        _check_fail_args(retry_at, dead)
        now = time.time()
        if dead:
            sets, params = (
                "status = 'dead', last_error = ?, failed_at = ?, claimed_by = NULL, lease_until = NULL",
                (
                    _error_text(error),
                    now,
                ),
            )
        else:
            sets, params = (
                "available_at = ?, last_error = ?, failed_at = ?, claimed_by = NULL, lease_until = NULL",
                (_utc(retry_at).timestamp(), _error_text(error), now),
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

    def dead_letters(self, limit: int = 100, *, namespace_prefix: Sequence[str] | None = None) -> list[OutboxEntry]:
        """See :meth:`PostgresOutbox.dead_letters`."""
        where, extra = _sqlite_prefix_where(namespace_prefix, "AND")
        rows = (
            self._conn()
            .execute(
                f"SELECT {_SQLITE_COLUMNS} FROM {TABLE} WHERE status = 'dead'{where} "
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


# -- memory ----------------------------------------------------------------------------------------


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
        rows = _sorted_unique(entries)
        now = time.time()
        inserted = 0
        with self._lock:
            for e in rows:
                if e.ident not in self._rows:
                    self._rows[e.ident] = _MemoryRow(replace(e, attempts=0, last_error=None), now)
                    inserted += 1
        return inserted

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
            ]
            ready.sort(key=lambda row: row.available_at)
            claimed = []
            for row in ready[:limit]:
                row.claimed_by, row.lease_until = worker_id, now + lease_seconds
                row.attempts += 1
                claimed.append(row.snapshot())
        return sorted(claimed, key=_claim_order)

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
        _check_fail_args(retry_at, dead)
        with self._lock:
            rows = self._held(worker_id, [key])
            for row in rows:
                row.last_error, row.failed_at = _error_text(error), time.time()
                row.claimed_by = row.lease_until = None
                if dead:
                    row.status = "dead"
                else:
                    row.available_at = _utc(retry_at).timestamp()
            return bool(rows)

    def release(self, worker_id: str, keys: Iterable[EntryKey] | None = None) -> int:
        """See :meth:`PostgresOutbox.release`."""
        with self._lock:
            rows = [row for row in self._held(worker_id, keys) if row.lease_until is not None]
            for row in rows:
                row.claimed_by = row.lease_until = None
                row.attempts = max(row.attempts - 1, 0)
            return len(rows)

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

    def dead_letters(self, limit: int = 100, *, namespace_prefix: Sequence[str] | None = None) -> list[OutboxEntry]:
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


# -- choosing one ----------------------------------------------------------------------------------


def open_outbox(
    database: str, *, pool: Any = None, pool_size: int = 4
) -> PostgresOutbox | SqliteOutbox | MemoryOutbox:
    """The outbox for a service database URL, set up (tables created).

    Args:
        database: ``postgresql://...``, ``sqlite:///path`` or ``memory://`` (as ``Settings.database``).
        pool: For PostgreSQL, a ``ConnectionPool`` to use instead of opening one (the backend's).
        pool_size: For PostgreSQL without ``pool``, the size of the pool it opens.
    """
    from reducing_saver.service.settings import BACKEND_SCHEMES, sqlite_path

    kind = BACKEND_SCHEMES.get(database.split(":", 1)[0])
    outbox: PostgresOutbox | SqliteOutbox | MemoryOutbox
    if kind == "memory":
        outbox = MemoryOutbox()
    elif kind == "sqlite":
        outbox = SqliteOutbox(sqlite_path(database))
    elif kind == "postgres":
        outbox = PostgresOutbox(pool if pool is not None else database, pool_size=pool_size)
    else:
        raise ValueError(f"unsupported database URL {database!r}; use postgresql://, sqlite:/// or memory://")
    outbox.setup()
    return outbox
