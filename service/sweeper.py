"""TTL sweeps: threads idle for longer than their time to live are pruned to their head, or deleted.

A thread's age counts from its last write. When it is older than its TTL — its own, set by a put's
``config["configurable"]["checkpoint_ttl"]``, else the ``default_ttl`` setting — a sweep applies the
``ttl_strategy``: ``keep_latest`` prunes it to its head checkpoint (with that checkpoint's writes and
blobs) through the saver's ``prune(..., strategy="keep_latest")``; ``delete`` removes it, after recording
the messages still in its window in the extraction outbox, so they reach long-term memory like any
pruned message. Sweeps run in a background thread of each service process (``--sweep``, every
``--sweep-interval``) and as ``reducing-saver sweep [--dry-run]`` for cron.

Design: a per-thread ledger, ``reducing_saver_threads``
-----------------------------------------------------------
One row per thread: ``thread_id``, ``last_write_at``, ``ttl_seconds`` (the thread's own, or NULL for the
default), ``expires_at`` (``last_write_at + ttl_seconds``), ``namespace`` (the memory namespace its puts
name, or NULL for ``("memories", thread_id)``) and ``swept_at`` (set by a ``keep_latest`` sweep, cleared by
the next write). A table in the service's database on PostgreSQL and SQLite, a dictionary on memory.
Why a table rather than reading the checkpoints:

* **The memory namespace must survive until sweep time**, and the checkpoints do not keep it: it is a
  list, and savers merge only primitive ``configurable`` values into checkpoint metadata. (The TTL, a
  primitive, does land in the metadata too; the ledger keeps it where a sweep can find it by index.)
* **Finding expired threads is an index range scan**, not a scan of every checkpoint: the partial
  indexes on ``expires_at`` and ``last_write_at`` hold only threads not yet swept, so threads pruned
  long ago cost a sweep nothing. (PostgreSQL 15 has no skip scan: ``max(checkpoint_id) GROUP BY
  thread_id`` reads the whole primary-key index.)
* **The ledger row is the lock** that makes sweeps safe, below.
* **Clocks**: ``last_write_at`` is the database's clock (PostgreSQL ``now()``; the service host's clock on
  SQLite and memory). Checkpoint ids (uuid6) and ``ts`` carry the clock of whichever agent wrote them.

The cost on the put path is bounded: a put *touches* the row (one upsert) before it stores the
checkpoint, but a process skips the touch when it touched the same thread less than
``min(1 h, ttl / 10)`` ago with the same TTL and namespace (a skipped touch costs ~5 µs, a written one
one upsert, ~0.5–1 ms here). A busy thread costs one upsert an hour per process; a thread therefore expires
between ``ttl`` and ``ttl + min(1 h, ttl / 10)`` after its last write. The skip is safe: a row touched less
than ``ttl / 10`` ago cannot be expired. (A thread's TTL is expected to stay put: a process that cached
a longer one than another replica set since skips touches for a tenth of the longer one.)

Threads written before the ledger existed (or by a stock saver on the same database) are *discovered*
by each process's first sweep and by ``reducing-saver sweep``: a row per thread without one, with the
last-write time of its newest checkpoint — the timestamp inside its uuid6 id (``max(checkpoint_id)`` is
an index-only read), or the checkpoint's ``ts`` when the id is not a uuid6.

Several sweepers at once, and writes during a sweep
------------------------------------------------------
Each thread is handled in a transaction that first locks its ledger row and re-checks, on that row,
that the thread is still expired (and, for ``keep_latest``, not already swept). On PostgreSQL the lock
is ``SELECT ... FOR UPDATE SKIP LOCKED``: two replicas never handle one thread, and a thread another
replica is sweeping is skipped. A put touches the row before it writes, so:

* a put whose touch committed first makes the thread young again: the re-check skips it, the thread is
  not touched;
* a put that arrives while its thread is being swept waits on the row lock and writes after the sweep
  (the thread is then pruned, or gone, as if the put had come a moment later).

``delete`` on PostgreSQL is one transaction with the check: the window's messages go into the outbox
table, the thread's rows are deleted and the ledger row with them, all or nothing. ``keep_latest`` runs
PostgresSaver's ``prune`` (its own REPEATABLE READ transaction, on a second connection) while the row is
held. SQLite sweeps hold the database's write lock (``BEGIN IMMEDIATE``) over the check and the change;
``delete`` records the window in the outbox (a connection of its own) just before. Memory sweeps run
under the saver's lock.

Every handled thread leaves a row in ``reducing_saver_sweep_log`` (thread, action, bytes, when, by
whom), kept 30 days: ``/v1/sweeps/status`` adds it up across replicas and cron runs.

Bytes reclaimed: PostgreSQL counts ``pg_column_size`` of the thread's rows in the three checkpoint
tables, SQLite the length of its checkpoint, metadata and write blobs, memory the length of its
serialized bytes; a sweep reports the size before minus the size after. A dry run reports the whole
thread for ``delete``, and for ``keep_latest`` all but each namespace's head checkpoint, its writes and
the blobs it references.

Explicit ``delete_thread`` calls do not extract, unless the ``extract_on_delete`` setting says so.

Limits: only the root namespace's messages channel is extracted before a delete; a messages channel the
service cannot read (another serde, a DeltaChannel) is deleted unextracted, as the put path stores it
unreduced. A turn that loaded a thread before a ``delete`` sweep and writes after it starts the thread
anew from those writes.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

import orjson
from pydantic import BaseModel, Field

from reducing_saver.service.durations import parse_duration
from reducing_saver.service.extraction import default_worker_id, validate_namespace
from reducing_saver.service.memory import escape_label
from reducing_saver.service.messages_codec import SafeMessagesCodec
from reducing_saver.service.outbox import OutboxEntry, make_entries
from reducing_saver.service.pglock import setup_lock
from reducing_saver.service.serde import VerbatimSerde

__all__ = [
    "TTL_KEY",
    "InvalidTTLError",
    "Policy",
    "SweepReport",
    "SweepStatus",
    "Sweeper",
    "open_sweeper",
    "uuid6_time",
]

logger = logging.getLogger(__name__)

#: The ``configurable`` key of a put that sets its thread's own TTL.
TTL_KEY = "checkpoint_ttl"
TABLE = "reducing_saver_threads"
LOG_TABLE = "reducing_saver_sweep_log"
#: How long the sweep log keeps a handled thread's row.
LOG_DAYS = 30
#: A process re-touches a thread at most this often (seconds), and at most every tenth of its TTL.
TOUCH_EVERY = 3600.0
#: Threads a process remembers having touched (least recently touched forgotten first).
TOUCH_CACHE_SIZE = 100_000
#: Advisory lock key for the ledger set-up, apart from the saver's and the outbox's.
_SETUP_LOCK_KEY = 0x72732D7377656570  # "rs-sweep"
_UUID_EPOCH = 0x01B21DD213814000  # 100 ns intervals from 1582-10-15 to 1970-01-01

Strategy = Literal["keep_latest", "delete"]


class InvalidTTLError(ValueError):
    """A put's ``checkpoint_ttl`` is not a duration (the put is refused with 422)."""


@dataclass(frozen=True)
class Policy:
    """What a sweep does: the strategy, and the TTL of threads without one of their own (None: none)."""

    strategy: Strategy
    default_ttl: float | None


@dataclass(frozen=True)
class Outcome:
    """One thread handled by a sweep: ``pruned``, ``deleted`` or ``refused`` (keep_latest on a thread
    that uses a DeltaChannel), and the bytes that freed."""

    thread_id: str
    action: Literal["pruned", "deleted", "refused"]
    bytes: int


@dataclass
class SweepReport:
    """What one sweep did (or, with ``dry_run``, would do)."""

    strategy: Strategy
    default_ttl_seconds: float | None
    dry_run: bool = False
    threads_pruned: int = 0
    threads_deleted: int = 0
    threads_refused: int = 0
    bytes_reclaimed: int = 0
    errors: int = 0
    seconds: float = 0.0
    threads: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = {
            "dry_run": self.dry_run,
            "strategy": self.strategy,
            "default_ttl_seconds": self.default_ttl_seconds,
            "threads_pruned": self.threads_pruned,
            "threads_deleted": self.threads_deleted,
            "threads_refused": self.threads_refused,
            "bytes_reclaimed": self.bytes_reclaimed,
            "errors": self.errors,
            "seconds": round(self.seconds, 3),
        }
        if self.dry_run:
            out = {
                "dry_run": True,
                "strategy": self.strategy,
                "default_ttl_seconds": self.default_ttl_seconds,
                "threads": self.threads,
                "thread_count": len(self.threads),
                "bytes_reclaimable": sum(t["bytes"] for t in self.threads),
            }
        return out


def uuid6_time(checkpoint_id: str) -> float | None:
    """The Unix time inside a uuid6 checkpoint id (LangGraph's ids), or None for any other id."""
    try:
        value = uuid.UUID(checkpoint_id)
    except (ValueError, TypeError, AttributeError):
        return None
    if value.version != 6:
        return None
    high = value.int >> 64
    ticks = ((high >> 32) << 28) | (((high >> 16) & 0xFFFF) << 12) | (high & 0x0FFF)
    return (ticks - _UUID_EPOCH) / 1e7


def _iso_time(ts: Any) -> float | None:
    if not isinstance(ts, str):
        return None
    try:
        when = datetime.fromisoformat(ts)
    except ValueError:
        return None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def default_namespace(thread_id: str) -> tuple[str, ...]:
    """The memory namespace of a thread whose puts name none (as ``memory.store_namespace`` makes it)."""
    return ("memories", escape_label(thread_id))


#: ``window(saver, thread_id, namespace)``: outbox entries for the messages in the thread's head.
Window = Callable[[Any, str, tuple[str, ...]], list[OutboxEntry]]


class _Recorder(Protocol):
    def record(self, entries: Sequence[OutboxEntry]) -> int: ...


# -- PostgreSQL ------------------------------------------------------------------------------------

_PG_SETUP = (
    f"""CREATE TABLE IF NOT EXISTS {TABLE} (
        thread_id text PRIMARY KEY,
        last_write_at timestamptz NOT NULL DEFAULT now(),
        ttl_seconds double precision,
        expires_at timestamptz,
        namespace text[],
        swept_at timestamptz
    )""",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_due_own ON {TABLE} (expires_at) WHERE swept_at IS NULL",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_due_default ON {TABLE} (last_write_at) "
    "WHERE swept_at IS NULL AND ttl_seconds IS NULL",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_swept ON {TABLE} (swept_at) WHERE swept_at IS NOT NULL",
    f"""CREATE TABLE IF NOT EXISTS {LOG_TABLE} (
        thread_id text NOT NULL,
        action text NOT NULL CHECK (action IN ('pruned', 'deleted')),
        bytes bigint NOT NULL,
        swept_at timestamptz NOT NULL DEFAULT now(),
        swept_by text NOT NULL
    )""",
    f"CREATE INDEX IF NOT EXISTS {LOG_TABLE}_at ON {LOG_TABLE} (swept_at)",
)

# The thread's TTL is kept when a put names none; a write clears swept_at (the thread is live again).
_PG_TOUCH = f"""
INSERT INTO {TABLE} AS t (thread_id, last_write_at, ttl_seconds, expires_at, namespace)
VALUES (%(thread)s, now(), %(ttl)s, now() + make_interval(secs => %(ttl)s), %(namespace)s::text[])
ON CONFLICT (thread_id) DO UPDATE SET
    last_write_at = now(),
    ttl_seconds = COALESCE(EXCLUDED.ttl_seconds, t.ttl_seconds),
    expires_at = now() + make_interval(secs => COALESCE(EXCLUDED.ttl_seconds, t.ttl_seconds)),
    namespace = COALESCE(EXCLUDED.namespace, t.namespace),
    swept_at = NULL
"""

_PG_COPY = f"""
INSERT INTO {TABLE} AS t (thread_id, last_write_at, ttl_seconds, expires_at)
SELECT %(target)s, now(), s.ttl_seconds, now() + make_interval(secs => s.ttl_seconds)
FROM (SELECT 1) AS one LEFT JOIN {TABLE} AS s ON s.thread_id = %(source)s
ON CONFLICT (thread_id) DO UPDATE SET
    last_write_at = now(),
    ttl_seconds = COALESCE(EXCLUDED.ttl_seconds, t.ttl_seconds),
    expires_at = now() + make_interval(secs => COALESCE(EXCLUDED.ttl_seconds, t.ttl_seconds)),
    swept_at = NULL
"""

_PG_EXPIRED = (
    "(t.expires_at < now() OR (t.ttl_seconds IS NULL "
    "AND t.last_write_at < now() - make_interval(secs => %(default)s::float8)))"
)

# One index range per branch, oldest first, each stopping at the limit.
_PG_DUE_OWN = f"""(SELECT thread_id FROM {TABLE}
    WHERE swept_at IS NULL AND expires_at < now() AND thread_id <> ALL(%(skip)s)
    ORDER BY expires_at LIMIT %(limit)s)"""
_PG_DUE_DEFAULT = f"""(SELECT thread_id FROM {TABLE}
    WHERE swept_at IS NULL AND ttl_seconds IS NULL
      AND last_write_at < now() - make_interval(secs => %(default)s::float8) AND thread_id <> ALL(%(skip)s)
    ORDER BY last_write_at LIMIT %(limit)s)"""
# Only ``delete`` wants threads a ``keep_latest`` sweep already pruned (the strategy changed since).
_PG_DUE_SWEPT = f"""(SELECT thread_id FROM {TABLE} AS t
    WHERE swept_at IS NOT NULL AND {_PG_EXPIRED} AND thread_id <> ALL(%(skip)s)
    ORDER BY swept_at LIMIT %(limit)s)"""

_PG_LOCK = f"""
SELECT thread_id, namespace FROM {TABLE} AS t
WHERE thread_id = %(thread)s AND {_PG_EXPIRED} {{swept}}
FOR UPDATE SKIP LOCKED
"""

_PG_THREAD_BYTES = """
SELECT (SELECT COALESCE(sum(pg_column_size(c.*)), 0) FROM checkpoints c WHERE c.thread_id = %(thread)s)
     + (SELECT COALESCE(sum(pg_column_size(b.*)), 0) FROM checkpoint_blobs b WHERE b.thread_id = %(thread)s)
     + (SELECT COALESCE(sum(pg_column_size(w.*)), 0) FROM checkpoint_writes w WHERE w.thread_id = %(thread)s)
     AS bytes
"""

# What keep_latest keeps: each namespace's head, its writes, and the blobs its channel_versions name.
_PG_HEAD_BYTES = """
WITH heads AS (
    SELECT DISTINCT ON (checkpoint_ns) checkpoint_ns, checkpoint_id, checkpoint -> 'channel_versions' AS versions
    FROM checkpoints WHERE thread_id = %(thread)s
    ORDER BY checkpoint_ns, checkpoint_id DESC
)
SELECT (SELECT COALESCE(sum(pg_column_size(c.*)), 0) FROM checkpoints c
        JOIN heads h ON c.checkpoint_ns = h.checkpoint_ns AND c.checkpoint_id = h.checkpoint_id
        WHERE c.thread_id = %(thread)s)
     + (SELECT COALESCE(sum(pg_column_size(w.*)), 0) FROM checkpoint_writes w
        JOIN heads h ON w.checkpoint_ns = h.checkpoint_ns AND w.checkpoint_id = h.checkpoint_id
        WHERE w.thread_id = %(thread)s)
     + (SELECT COALESCE(sum(pg_column_size(b.*)), 0) FROM checkpoint_blobs b
        JOIN heads h ON b.checkpoint_ns = h.checkpoint_ns AND h.versions ->> b.channel = b.version
        WHERE b.thread_id = %(thread)s)
     AS bytes
"""

_PG_UNLEDGERED_HEADS = f"""
SELECT h.thread_id, h.head FROM (
    SELECT thread_id, max(checkpoint_id) AS head FROM checkpoints GROUP BY thread_id
) AS h
WHERE NOT EXISTS (SELECT 1 FROM {TABLE} t WHERE t.thread_id = h.thread_id)
"""

_PG_LOG = f"INSERT INTO {LOG_TABLE} (thread_id, action, bytes, swept_by) VALUES (%s, %s, %s, %s)"


class _OneConnection:
    """One open connection dressed as a pool, so a ``PostgresOutbox`` records inside its transaction."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    @contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[Any]:
        yield self._conn


def _pg_connect(database: str) -> Any:
    import psycopg
    from psycopg.rows import dict_row

    return psycopg.connect(database, autocommit=True, prepare_threshold=0, row_factory=dict_row)


class PostgresLedger:
    """The ledger as a PostgreSQL table next to the checkpoints.

    Args:
        database: The service's database URL.
        pool: The backend's connection pool, for touches and explicit deletes (the put path); without
            one (the ``sweep`` command) a pool of two connections is opened on first use.
        window: Reads the messages in a thread's head, as outbox entries.
        worker_id: Written in the sweep log.

    A sweep runs on two connections of its own, opened for it (its queries and ledger transactions, and
    PostgresSaver's ``prune``), never on the backend's pool: requests keep the pool, and puts that wait on
    a row the sweep holds may hold every pooled connection.
    """

    kind = "postgres"
    #: The memory namespace of a thread whose puts named none (tenant mode: open_sweeper's).
    fallback_namespace = staticmethod(default_namespace)

    def __init__(self, database: str, *, pool: Any = None, window: Window, worker_id: str) -> None:
        self.database = database
        self._pool = pool
        self._own_pool: Any = None
        self.window = window
        self.worker_id = worker_id

    def _connection(self) -> Any:
        if self._pool is None:
            from psycopg.rows import dict_row
            from psycopg_pool import ConnectionPool

            self._own_pool = self._pool = ConnectionPool(
                self.database,
                min_size=1,
                max_size=2,
                kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
                open=False,
                name="reducing-saver-sweeper",
            )
            self._pool.open(wait=True, timeout=30.0)
        return self._pool.connection()

    @contextmanager
    def _conn_for(self, session: _PgSession | None) -> Iterator[Any]:
        """The sweep's own connection, or (request path, status) one from the pool."""
        if session is not None:
            yield session._ledger_conn()
        else:
            with self._connection() as conn:
                yield conn

    def setup(self) -> None:
        """Create the ledger and log tables (idempotent), under an advisory lock."""
        import psycopg

        with psycopg.connect(self.database, autocommit=True) as conn:
            with setup_lock(conn, _SETUP_LOCK_KEY):
                for statement in _PG_SETUP:
                    conn.execute(statement)

    def close(self) -> None:
        if self._own_pool is not None:
            self._own_pool.close()
            self._own_pool = self._pool = None

    def touch(self, thread_id: str, ttl: float | None, namespace: tuple[str, ...] | None) -> None:
        with self._connection() as conn:
            conn.execute(
                _PG_TOUCH,
                {"thread": thread_id, "ttl": ttl, "namespace": list(namespace) if namespace else None},
            )

    def copy(self, source: str, target: str) -> None:
        with self._connection() as conn:
            conn.execute(_PG_COPY, {"source": source, "target": target})

    def discover(self, session: _PgSession | None = None) -> int:
        with self._conn_for(session) as conn:
            heads = conn.execute(_PG_UNLEDGERED_HEADS).fetchall()
            rows = []
            for row in heads:
                when = uuid6_time(row["head"])
                if when is None:
                    found = conn.execute(
                        "SELECT checkpoint ->> 'ts' AS ts FROM checkpoints "
                        "WHERE thread_id = %s AND checkpoint_id = %s LIMIT 1",
                        (row["thread_id"], row["head"]),
                    ).fetchone()
                    when = _iso_time(found["ts"] if found else None)
                rows.append((row["thread_id"], datetime.fromtimestamp(when or time.time(), UTC)))
            if rows:
                with conn.cursor() as cur:
                    cur.executemany(
                        f"INSERT INTO {TABLE} (thread_id, last_write_at) VALUES (%s, %s) "
                        "ON CONFLICT (thread_id) DO NOTHING",
                        rows,
                    )
        return len(rows)

    def candidates(
        self, policy: Policy, limit: int | None, skip: Sequence[str], session: _PgSession | None = None
    ) -> list[str]:
        params = {"default": policy.default_ttl, "skip": list(skip), "limit": limit}
        parts = [_PG_DUE_OWN]
        if policy.default_ttl is not None:
            parts.append(_PG_DUE_DEFAULT)
        if policy.strategy == "delete":
            parts.append(_PG_DUE_SWEPT)
        with self._conn_for(session) as conn:
            rows = conn.execute(" UNION ALL ".join(parts), params).fetchall()
        ids = list(dict.fromkeys(r["thread_id"] for r in rows))
        return ids if limit is None else ids[:limit]

    @contextmanager
    def session(self, policy: Policy) -> Iterator[_PgSession]:
        session = _PgSession(self, policy)
        try:
            yield session
        finally:
            session.close()

    def delete_extracting(self, thread_id: str, recorder: _Recorder | None) -> None:
        """Delete a thread after recording its window, in one transaction (waits on a sweep of it)."""
        from langgraph.checkpoint.postgres.base import PRUNE_DELETE_THREADS_SQL

        from reducing_saver.service.outbox import PostgresOutbox
        from reducing_saver.service.savers import PostgresLifecycleSaver

        with self._connection() as conn, conn.transaction():
            row = conn.execute(
                f"SELECT namespace FROM {TABLE} WHERE thread_id = %s FOR UPDATE", (thread_id,)
            ).fetchone()
            namespace = _namespace(self, thread_id, row["namespace"] if row else None)
            entries = self.window(PostgresLifecycleSaver(conn, serde=VerbatimSerde()), thread_id, namespace)
            if entries:
                PostgresOutbox(_OneConnection(conn)).record(entries)
            for statement in PRUNE_DELETE_THREADS_SQL:
                conn.execute(statement, ([thread_id],))

    def database_status(self, policy: Policy) -> dict[str, Any]:
        swept = "AND t.swept_at IS NULL" if policy.strategy == "keep_latest" else ""
        with self._connection() as conn:
            threads = conn.execute(
                f"SELECT count(*) AS tracked, count(*) FILTER (WHERE {_PG_EXPIRED} {swept}) AS expired "
                f"FROM {TABLE} AS t",
                {"default": policy.default_ttl},
            ).fetchone()
            log = conn.execute(
                "SELECT count(*) FILTER (WHERE action = 'pruned') AS pruned, "
                "count(*) FILTER (WHERE action = 'deleted') AS deleted, "
                f"COALESCE(sum(bytes), 0)::bigint AS bytes, max(swept_at) AS last FROM {LOG_TABLE}"
            ).fetchone()
        return _database_figures(threads["tracked"], threads["expired"], log)

    def forget_log(self, older_than_days: int, session: _PgSession | None = None) -> int:
        with self._conn_for(session) as conn:
            cur = conn.execute(
                f"DELETE FROM {LOG_TABLE} WHERE swept_at < now() - make_interval(days => %s)",
                (older_than_days,),
            )
            return cur.rowcount


class _PgSession:
    """One sweep's two connections, opened on first use."""

    def __init__(self, ledger: PostgresLedger, policy: Policy) -> None:
        self.ledger = ledger
        self.policy = policy
        self._conn: Any = None
        self._prune_conn: Any = None
        self._saver: Any = None

    def close(self) -> None:
        for conn in (self._conn, self._prune_conn):
            if conn is not None:
                conn.close()

    def _ledger_conn(self) -> Any:
        if self._conn is None or self._conn.closed:
            self._conn = _pg_connect(self.ledger.database)
        return self._conn

    def _pruner(self) -> Any:
        from reducing_saver.service.savers import PostgresLifecycleSaver

        if self._prune_conn is None or self._prune_conn.closed:
            self._prune_conn = _pg_connect(self.ledger.database)
            self._saver = PostgresLifecycleSaver(self._prune_conn, serde=VerbatimSerde())
        return self._saver

    def measure(self, thread_id: str) -> int:
        conn = self._ledger_conn()
        total = conn.execute(_PG_THREAD_BYTES, {"thread": thread_id}).fetchone()["bytes"]
        if self.policy.strategy == "delete":
            return int(total)
        kept = conn.execute(_PG_HEAD_BYTES, {"thread": thread_id}).fetchone()["bytes"]
        return max(0, int(total) - int(kept))

    def handle(self, thread_id: str) -> Outcome | None:
        from langgraph.checkpoint.postgres.base import PRUNE_DELETE_THREADS_SQL

        from reducing_saver.service.outbox import PostgresOutbox
        from reducing_saver.service.savers import PostgresLifecycleSaver

        conn = self._ledger_conn()
        keep_latest = self.policy.strategy == "keep_latest"
        params = {"thread": thread_id, "default": self.policy.default_ttl}
        with conn.transaction():
            row = conn.execute(
                _PG_LOCK.format(swept="AND t.swept_at IS NULL" if keep_latest else ""), params
            ).fetchone()
            if row is None:
                return None  # written since, swept by another process, or being swept right now
            before = int(conn.execute(_PG_THREAD_BYTES, params).fetchone()["bytes"])
            if before == 0:
                # Nothing stored (deleted by a client): the row goes, nothing is counted.
                conn.execute(f"DELETE FROM {TABLE} WHERE thread_id = %s", (thread_id,))
                return None
            if not keep_latest:
                namespace = _namespace(self.ledger, thread_id, row["namespace"])
                reader = PostgresLifecycleSaver(conn, serde=VerbatimSerde())
                entries = self.ledger.window(reader, thread_id, namespace)
                if entries:
                    PostgresOutbox(_OneConnection(conn)).record(entries)
                for statement in PRUNE_DELETE_THREADS_SQL:
                    conn.execute(statement, ([thread_id],))
                conn.execute(f"DELETE FROM {TABLE} WHERE thread_id = %s", (thread_id,))
                conn.execute(_PG_LOG, (thread_id, "deleted", before, self.ledger.worker_id))
                return Outcome(thread_id, "deleted", before)
            try:
                self._pruner().prune([thread_id], strategy="keep_latest")
            except NotImplementedError as exc:
                conn.execute(f"UPDATE {TABLE} SET swept_at = now() WHERE thread_id = %s", (thread_id,))
                logger.warning("TTL sweep left thread %r as it is: %s", thread_id, exc)
                return Outcome(thread_id, "refused", 0)
            freed = max(0, before - int(conn.execute(_PG_THREAD_BYTES, params).fetchone()["bytes"]))
            conn.execute(f"UPDATE {TABLE} SET swept_at = now() WHERE thread_id = %s", (thread_id,))
            conn.execute(_PG_LOG, (thread_id, "pruned", freed, self.ledger.worker_id))
            return Outcome(thread_id, "pruned", freed)


# -- SQLite ----------------------------------------------------------------------------------------

_SQ_SETUP = (
    f"""CREATE TABLE IF NOT EXISTS {TABLE} (
        thread_id TEXT PRIMARY KEY,
        last_write_at REAL NOT NULL,
        ttl_seconds REAL,
        expires_at REAL,
        namespace TEXT,
        swept_at REAL
    )""",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_due_own ON {TABLE} (expires_at) WHERE swept_at IS NULL",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_due_default ON {TABLE} (last_write_at) "
    "WHERE swept_at IS NULL AND ttl_seconds IS NULL",
    f"""CREATE TABLE IF NOT EXISTS {LOG_TABLE} (
        thread_id TEXT NOT NULL,
        action TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        swept_at REAL NOT NULL,
        swept_by TEXT NOT NULL
    )""",
    f"CREATE INDEX IF NOT EXISTS {LOG_TABLE}_at ON {LOG_TABLE} (swept_at)",
)

_SQ_TOUCH = f"""
INSERT INTO {TABLE} (thread_id, last_write_at, ttl_seconds, expires_at, namespace, swept_at)
VALUES (:thread, :now, :ttl, :now + :ttl, :namespace, NULL)
ON CONFLICT (thread_id) DO UPDATE SET
    last_write_at = excluded.last_write_at,
    ttl_seconds = COALESCE(excluded.ttl_seconds, ttl_seconds),
    expires_at = excluded.last_write_at + COALESCE(excluded.ttl_seconds, ttl_seconds),
    namespace = COALESCE(excluded.namespace, namespace),
    swept_at = NULL
"""

_SQ_EXPIRED = (
    "(expires_at < :now OR (ttl_seconds IS NULL AND :default IS NOT NULL AND last_write_at < :now - :default))"
)

_SQ_THREAD_BYTES = """
SELECT (SELECT COALESCE(SUM(LENGTH(checkpoint) + COALESCE(LENGTH(metadata), 0)), 0)
        FROM checkpoints WHERE thread_id = :thread)
     + (SELECT COALESCE(SUM(COALESCE(LENGTH(value), 0)), 0) FROM writes WHERE thread_id = :thread)
"""

_SQ_HEAD_BYTES = """
WITH heads AS (
    SELECT checkpoint_ns, MAX(checkpoint_id) AS checkpoint_id FROM checkpoints
    WHERE thread_id = :thread GROUP BY checkpoint_ns
)
SELECT (SELECT COALESCE(SUM(LENGTH(c.checkpoint) + COALESCE(LENGTH(c.metadata), 0)), 0) FROM checkpoints c
        JOIN heads h ON c.checkpoint_ns = h.checkpoint_ns AND c.checkpoint_id = h.checkpoint_id
        WHERE c.thread_id = :thread)
     + (SELECT COALESCE(SUM(COALESCE(LENGTH(w.value), 0)), 0) FROM writes w
        JOIN heads h ON w.checkpoint_ns = h.checkpoint_ns AND w.checkpoint_id = h.checkpoint_id
        WHERE w.thread_id = :thread)
"""


class SqliteLedger:
    """The ledger as a table in the service's SQLite file, used through the saver's own connection and
    lock, so a sweep's check and change are one ``BEGIN IMMEDIATE`` transaction with the checkpoints.

    Args:
        saver: The backend's ``SqliteLifecycleSaver`` (or one of the ``sweep`` command's own).
        window: Reads the messages in a thread's head, as outbox entries.
        recorder: The outbox a ``delete`` records windows in.
        worker_id: Written in the sweep log.
    """

    kind = "sqlite"
    #: The memory namespace of a thread whose puts named none (tenant mode: open_sweeper's).
    fallback_namespace = staticmethod(default_namespace)

    def __init__(self, saver: Any, *, window: Window, recorder: _Recorder | None, worker_id: str) -> None:
        self.saver = saver
        self.window = window
        self.recorder = recorder
        self.worker_id = worker_id

    def setup(self) -> None:
        with self.saver._transaction() as cur:
            for statement in _SQ_SETUP:
                cur.execute(statement)

    def close(self) -> None:
        """The connection is the saver's: nothing to close."""

    @contextmanager
    def _read(self) -> Iterator[Any]:
        with self.saver.lock:
            yield self.saver.conn

    def touch(self, thread_id: str, ttl: float | None, namespace: tuple[str, ...] | None) -> None:
        with self._read() as conn:
            conn.execute(
                _SQ_TOUCH,
                {"thread": thread_id, "now": time.time(), "ttl": ttl, "namespace": _ns_json(namespace)},
            )

    def copy(self, source: str, target: str) -> None:
        with self._read() as conn:
            found = conn.execute(f"SELECT ttl_seconds FROM {TABLE} WHERE thread_id = ?", (source,)).fetchone()
            conn.execute(
                _SQ_TOUCH,
                {"thread": target, "now": time.time(), "ttl": found[0] if found else None, "namespace": None},
            )

    def discover(self, session: Any = None) -> int:
        with self._read() as conn:
            heads = conn.execute(
                f"SELECT c.thread_id, MAX(c.checkpoint_id) FROM checkpoints c "
                f"WHERE NOT EXISTS (SELECT 1 FROM {TABLE} t WHERE t.thread_id = c.thread_id) "
                "GROUP BY c.thread_id"
            ).fetchall()
        rows = []
        for thread_id, head in heads:
            when = uuid6_time(head)
            if when is None:
                found = self.saver.get_tuple(
                    {"configurable": {"thread_id": thread_id, "checkpoint_ns": "", "checkpoint_id": head}}
                )
                when = _iso_time(found.checkpoint.get("ts") if found else None)
            rows.append((thread_id, when or time.time()))
        if rows:
            with self._read() as conn:
                conn.executemany(
                    f"INSERT INTO {TABLE} (thread_id, last_write_at) VALUES (?, ?) ON CONFLICT DO NOTHING", rows
                )
        return len(rows)

    def candidates(self, policy: Policy, limit: int | None, skip: Sequence[str], session: Any = None) -> list[str]:
        swept = "AND swept_at IS NULL" if policy.strategy == "keep_latest" else ""
        params = {"now": time.time(), "default": policy.default_ttl, "skip": orjson.dumps(list(skip)).decode()}
        limit_sql = f"LIMIT {int(limit)}" if limit is not None else ""
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT thread_id FROM {TABLE} WHERE {_SQ_EXPIRED} {swept} "
                f"AND thread_id NOT IN (SELECT value FROM json_each(:skip)) ORDER BY last_write_at {limit_sql}",
                params,
            ).fetchall()
        return [r[0] for r in rows]

    @contextmanager
    def session(self, policy: Policy) -> Iterator[_SqliteSession]:
        yield _SqliteSession(self, policy)

    def delete_extracting(self, thread_id: str, recorder: _Recorder | None) -> None:
        with self._read() as conn:
            row = conn.execute(f"SELECT namespace FROM {TABLE} WHERE thread_id = ?", (thread_id,)).fetchone()
        entries = self.window(self.saver, thread_id, _namespace(self, thread_id, row[0] if row else None))
        if entries and recorder is not None:
            recorder.record(entries)
        self.saver.delete_thread(thread_id)

    def database_status(self, policy: Policy) -> dict[str, Any]:
        swept = "AND swept_at IS NULL" if policy.strategy == "keep_latest" else ""
        with self._read() as conn:
            tracked, expired = conn.execute(
                f"SELECT COUNT(*), COALESCE(SUM({_SQ_EXPIRED} {swept}), 0) FROM {TABLE}",
                {"now": time.time(), "default": policy.default_ttl},
            ).fetchone()
            pruned, deleted, total, last = conn.execute(
                f"SELECT COALESCE(SUM(action = 'pruned'), 0), COALESCE(SUM(action = 'deleted'), 0), "
                f"COALESCE(SUM(bytes), 0), MAX(swept_at) FROM {LOG_TABLE}"
            ).fetchone()
        log = {"pruned": pruned, "deleted": deleted, "bytes": total, "last": _from_epoch(last)}
        return _database_figures(tracked, expired, log)

    def forget_log(self, older_than_days: int, session: Any = None) -> int:
        with self._read() as conn:
            cur = conn.execute(
                f"DELETE FROM {LOG_TABLE} WHERE swept_at < ?", (time.time() - older_than_days * 86400,)
            )
            return cur.rowcount


class _SqliteSession:
    def __init__(self, ledger: SqliteLedger, policy: Policy) -> None:
        self.ledger = ledger
        self.policy = policy

    def _lock_row(self, cur: Any, thread_id: str) -> Any:
        swept = "AND swept_at IS NULL" if self.policy.strategy == "keep_latest" else ""
        return cur.execute(
            f"SELECT namespace FROM {TABLE} WHERE thread_id = :thread AND {_SQ_EXPIRED} {swept}",
            {"thread": thread_id, "now": time.time(), "default": self.policy.default_ttl},
        ).fetchone()

    def measure(self, thread_id: str) -> int:
        with self.ledger._read() as conn:
            total = conn.execute(_SQ_THREAD_BYTES, {"thread": thread_id}).fetchone()[0]
            if self.policy.strategy == "delete":
                return int(total)
            kept = conn.execute(_SQ_HEAD_BYTES, {"thread": thread_id}).fetchone()[0]
        return max(0, int(total) - int(kept))

    def handle(self, thread_id: str) -> Outcome | None:
        saver, ledger = self.ledger.saver, self.ledger
        if self.policy.strategy == "delete":
            # The outbox has a connection of its own, which cannot write while this one holds the write
            # lock: the window is recorded first (idempotent; if the thread turns out to be young again,
            # its messages merely reach memory early), then checked and deleted in one transaction.
            with ledger._read() as conn:
                row = self._lock_row(conn, thread_id)
            if row is None:
                return None
            entries = ledger.window(saver, thread_id, _namespace(ledger, thread_id, row[0]))
            if entries and ledger.recorder is not None:
                ledger.recorder.record(entries)
        with saver._transaction() as cur:
            row = self._lock_row(cur, thread_id)
            if row is None:
                return None
            before = int(cur.execute(_SQ_THREAD_BYTES, {"thread": thread_id}).fetchone()[0])
            if before == 0:
                cur.execute(f"DELETE FROM {TABLE} WHERE thread_id = ?", (thread_id,))
                return None
            if self.policy.strategy == "delete":
                for table in ("writes", "checkpoints", TABLE):
                    cur.execute(f"DELETE FROM {table} WHERE thread_id = ?", (thread_id,))
                self._log(cur, thread_id, "deleted", before)
                return Outcome(thread_id, "deleted", before)
            if saver._delta_threads(cur, [thread_id]):
                cur.execute(f"UPDATE {TABLE} SET swept_at = ? WHERE thread_id = ?", (time.time(), thread_id))
                logger.warning("TTL sweep left thread %r as it is: it uses a DeltaChannel", thread_id)
                return Outcome(thread_id, "refused", 0)
            saver._keep_latest(cur, thread_id)
            freed = max(0, before - int(cur.execute(_SQ_THREAD_BYTES, {"thread": thread_id}).fetchone()[0]))
            cur.execute(f"UPDATE {TABLE} SET swept_at = ? WHERE thread_id = ?", (time.time(), thread_id))
            self._log(cur, thread_id, "pruned", freed)
            return Outcome(thread_id, "pruned", freed)

    def _log(self, cur: Any, thread_id: str, action: str, freed: int) -> None:
        cur.execute(
            f"INSERT INTO {LOG_TABLE} (thread_id, action, bytes, swept_at, swept_by) VALUES (?, ?, ?, ?, ?)",
            (thread_id, action, freed, time.time(), self.ledger.worker_id),
        )


# -- memory ----------------------------------------------------------------------------------------


@dataclass
class _Row:
    last_write_at: float
    ttl_seconds: float | None = None
    namespace: tuple[str, ...] | None = None
    swept_at: float | None = None

    def expired(self, policy: Policy, now: float) -> bool:
        ttl = self.ttl_seconds if self.ttl_seconds is not None else policy.default_ttl
        return ttl is not None and self.last_write_at + ttl < now


class MemoryLedger:
    """The ledger as a dictionary, for ``memory://``; every call runs under the saver's lock."""

    kind = "memory"
    #: The memory namespace of a thread whose puts named none (tenant mode: open_sweeper's).
    fallback_namespace = staticmethod(default_namespace)

    def __init__(self, saver: Any, *, window: Window, recorder: _Recorder | None, worker_id: str) -> None:
        self.saver = saver
        self.window = window
        self.recorder = recorder
        self.worker_id = worker_id
        self.rows: dict[str, _Row] = {}
        self.log: list[tuple[str, str, int, float, str]] = []

    def setup(self) -> None:
        """Nothing to create."""

    def close(self) -> None:
        """Nothing to close."""

    def touch(self, thread_id: str, ttl: float | None, namespace: tuple[str, ...] | None) -> None:
        with self.saver.lock:
            row = self.rows.get(thread_id)
            if row is None:
                self.rows[thread_id] = _Row(time.time(), ttl, namespace)
                return
            row.last_write_at, row.swept_at = time.time(), None
            row.ttl_seconds = ttl if ttl is not None else row.ttl_seconds
            row.namespace = namespace if namespace is not None else row.namespace

    def copy(self, source: str, target: str) -> None:
        with self.saver.lock:
            found = self.rows.get(source)
            self.touch(target, found.ttl_seconds if found else None, None)

    def discover(self, session: Any = None) -> int:
        with self.saver.lock:
            found = 0
            for thread_id, namespaces in self.saver.storage.items():
                heads = [max(cps) for cps in namespaces.values() if cps]
                if thread_id in self.rows or not heads:
                    continue
                when = uuid6_time(max(heads))
                self.rows[thread_id] = _Row(when or time.time())
                found += 1
            return found

    def candidates(self, policy: Policy, limit: int | None, skip: Sequence[str], session: Any = None) -> list[str]:
        now, skipped = time.time(), set(skip)
        with self.saver.lock:
            due = sorted(
                (row.last_write_at, thread_id)
                for thread_id, row in self.rows.items()
                if thread_id not in skipped
                and row.expired(policy, now)
                and (policy.strategy == "delete" or row.swept_at is None)
            )
        ids = [thread_id for _, thread_id in due]
        return ids if limit is None else ids[:limit]

    @contextmanager
    def session(self, policy: Policy) -> Iterator[_MemorySession]:
        yield _MemorySession(self, policy)

    def delete_extracting(self, thread_id: str, recorder: _Recorder | None) -> None:
        with self.saver.lock:
            row = self.rows.get(thread_id)
            entries = self.window(self.saver, thread_id, _namespace(self, thread_id, row.namespace if row else None))
            if entries and recorder is not None:
                recorder.record(entries)
            self.saver.delete_thread(thread_id)

    def thread_bytes(self, thread_id: str, *, heads_only: bool = False) -> int:
        saver, total = self.saver, 0
        for ns, checkpoints in saver.storage.get(thread_id, {}).items():
            if not checkpoints:
                continue
            head = max(checkpoints)
            for checkpoint_id, (checkpoint, metadata, _) in checkpoints.items():
                if heads_only and checkpoint_id != head:
                    continue
                total += len(checkpoint[1]) + len(metadata[1])
                for _, _, value, _ in saver.writes.get((thread_id, ns, checkpoint_id), {}).values():
                    total += len(value[1])
            versions = saver.serde.loads_typed(checkpoints[head][0])["channel_versions"] if heads_only else None
            for (t, blob_ns, channel, version), value in saver.blobs.items():
                if t == thread_id and blob_ns == ns and (versions is None or versions.get(channel) == version):
                    total += len(value[1])
        return total

    def database_status(self, policy: Policy) -> dict[str, Any]:
        now = time.time()
        with self.saver.lock:
            expired = sum(
                1
                for row in self.rows.values()
                if row.expired(policy, now) and (policy.strategy == "delete" or row.swept_at is None)
            )
            log = {
                "pruned": sum(1 for entry in self.log if entry[1] == "pruned"),
                "deleted": sum(1 for entry in self.log if entry[1] == "deleted"),
                "bytes": sum(entry[2] for entry in self.log),
                "last": _from_epoch(max((entry[3] for entry in self.log), default=None)),
            }
            return _database_figures(len(self.rows), expired, log)

    def forget_log(self, older_than_days: int, session: Any = None) -> int:
        cutoff = time.time() - older_than_days * 86400
        with self.saver.lock:
            kept = [entry for entry in self.log if entry[3] >= cutoff]
            gone, self.log[:] = len(self.log) - len(kept), kept
            return gone


class _MemorySession:
    def __init__(self, ledger: MemoryLedger, policy: Policy) -> None:
        self.ledger = ledger
        self.policy = policy

    def measure(self, thread_id: str) -> int:
        with self.ledger.saver.lock:
            total = self.ledger.thread_bytes(thread_id)
            if self.policy.strategy == "delete":
                return total
            return max(0, total - self.ledger.thread_bytes(thread_id, heads_only=True))

    def handle(self, thread_id: str) -> Outcome | None:
        ledger, policy = self.ledger, self.policy
        with ledger.saver.lock:
            row = ledger.rows.get(thread_id)
            if row is None or not row.expired(policy, time.time()):
                return None
            if policy.strategy == "keep_latest" and row.swept_at is not None:
                return None
            before = ledger.thread_bytes(thread_id)
            if before == 0:
                del ledger.rows[thread_id]
                return None
            if policy.strategy == "delete":
                entries = ledger.window(ledger.saver, thread_id, _namespace(ledger, thread_id, row.namespace))
                if entries and ledger.recorder is not None:
                    ledger.recorder.record(entries)
                ledger.saver.prune([thread_id], strategy="delete")
                del ledger.rows[thread_id]
                ledger.log.append((thread_id, "deleted", before, time.time(), ledger.worker_id))
                return Outcome(thread_id, "deleted", before)
            try:
                ledger.saver.prune([thread_id], strategy="keep_latest")
            except NotImplementedError as exc:
                row.swept_at = time.time()
                logger.warning("TTL sweep left thread %r as it is: %s", thread_id, exc)
                return Outcome(thread_id, "refused", 0)
            freed = max(0, before - ledger.thread_bytes(thread_id))
            row.swept_at = time.time()
            ledger.log.append((thread_id, "pruned", freed, time.time(), ledger.worker_id))
            return Outcome(thread_id, "pruned", freed)


# -- shared helpers ----------------------------------------------------------------------------------


def _ns_json(namespace: tuple[str, ...] | None) -> str | None:
    return orjson.dumps(list(namespace)).decode() if namespace else None


def _namespace(ledger: Any, thread_id: str, stored: Any) -> tuple[str, ...]:
    """A ledger row's namespace (a list, or JSON text on SQLite), else the thread's default
    (``ledger.fallback_namespace``)."""
    if isinstance(stored, str):
        stored = orjson.loads(stored)
    return tuple(stored) if stored else ledger.fallback_namespace(thread_id)


def _from_epoch(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, UTC)


def _database_figures(tracked: int, expired: int, log: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "threads_tracked": int(tracked),
        "threads_expired": int(expired),
        "threads_pruned": int(log["pruned"]),
        "threads_deleted": int(log["deleted"]),
        "bytes_reclaimed": int(log["bytes"]),
        "last_swept_at": log["last"],
        "log_days": LOG_DAYS,
    }


# -- the status route's body -----------------------------------------------------------------------


class ProcessSweepFigures(BaseModel):
    """Sweeps run by the process that answers, since it started."""

    last_sweep_at: datetime | None = Field(description="When this process's last sweep finished.")
    last_sweep_seconds: float | None = Field(description="How long it took.")
    sweeps: int
    threads_pruned: int
    threads_deleted: int
    threads_refused: int = Field(description="keep_latest refused (the thread uses a DeltaChannel).")
    bytes_reclaimed: int
    errors: int = Field(description="Threads a sweep failed on (retried by the next sweep).")


class DatabaseSweepFigures(BaseModel):
    """Every process and ``reducing-saver sweep`` run on this database, from the sweep log."""

    threads_tracked: int = Field(description="Threads in the ledger.")
    threads_expired: int = Field(description="Threads past their TTL, waiting for a sweep.")
    threads_pruned: int
    threads_deleted: int
    bytes_reclaimed: int
    last_swept_at: datetime | None = Field(description="When a sweep last handled a thread.")
    log_days: int = Field(description="How many days the sweep log (and so these totals) covers.")


class SweepStatus(BaseModel):
    """``GET /v1/sweeps/status``."""

    strategy: Strategy
    default_ttl_seconds: float | None = Field(description="TTL of threads without their own; null: none.")
    sweep_interval_seconds: float
    sweeping: bool = Field(description="This process runs the background sweeper.")
    process: ProcessSweepFigures
    database: DatabaseSweepFigures


# -- the sweeper -----------------------------------------------------------------------------------


class _Metrics:
    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge

        self.sweeps = Counter("reducing_saver_sweeps", "TTL sweeps run by this process.", registry=registry)
        self.pruned = Counter(
            "reducing_saver_sweep_threads_pruned",
            "Expired threads pruned to their head checkpoint (keep_latest) by this process.",
            registry=registry,
        )
        self.deleted = Counter(
            "reducing_saver_sweep_threads_deleted",
            "Expired threads deleted (delete) by this process, after recording their window.",
            registry=registry,
        )
        self.bytes = Counter(
            "reducing_saver_sweep_bytes_reclaimed",
            "Bytes of checkpoint rows removed by this process's TTL sweeps.",
            registry=registry,
        )
        self.errors = Counter(
            "reducing_saver_sweep_errors", "Threads a TTL sweep failed on (retried next sweep).", registry=registry
        )
        self.last = Gauge(
            "reducing_saver_sweep_last_timestamp_seconds",
            "Unix time this process's last TTL sweep finished (0: none yet).",
            registry=registry,
        )


_METRICS: weakref.WeakKeyDictionary[Any, _Metrics] = weakref.WeakKeyDictionary()
_METRICS_LOCK = threading.Lock()


def _metrics_for(registry: Any) -> _Metrics:
    """The sweep metrics of a registry, registered once (an app's lifespan may run more than once)."""
    with _METRICS_LOCK:
        metrics = _METRICS.get(registry)
        if metrics is None:
            metrics = _METRICS[registry] = _Metrics(registry)
        return metrics


class Sweeper:
    """TTL bookkeeping on the put path, and the sweeps.

    Args:
        ledger: The backend's ledger (:func:`open_sweeper` builds it).
        policy: Strategy and default TTL.
        namespace_key: The ``configurable`` key naming a run's memory namespace.
        interval: Seconds between background sweeps.
        batch_size: Expired threads listed at a time.
        extract_on_delete: Whether :meth:`delete_thread` records the thread's window first.
        recorder: The outbox explicit deletes record in (SQLite, memory; PostgreSQL records in the
            transaction's own connection).
        registry: A Prometheus registry for the sweep metrics (None: no metrics).
    """

    def __init__(
        self,
        ledger: Any,
        policy: Policy,
        *,
        namespace_key: str = "memory_namespace",
        interval: float = 300.0,
        batch_size: int = 100,
        extract_on_delete: bool = False,
        recorder: _Recorder | None = None,
        registry: Any = None,
    ) -> None:
        self.ledger = ledger
        self.policy = policy
        self.namespace_key = namespace_key
        self.interval = interval
        self.batch_size = batch_size
        self.extract_on_delete = extract_on_delete
        self.recorder = recorder
        self._metrics = _metrics_for(registry) if registry is not None else None
        self._touched: OrderedDict[str, tuple[float, float | None, tuple[str, ...] | None]] = OrderedDict()
        self._touched_lock = threading.Lock()
        self._figures = {
            "last_sweep_at": None,
            "last_sweep_seconds": None,
            "sweeps": 0,
            "threads_pruned": 0,
            "threads_deleted": 0,
            "threads_refused": 0,
            "bytes_reclaimed": 0,
            "errors": 0,
        }
        self._figures_lock = threading.Lock()
        self._sweep_lock = threading.Lock()
        self._discovered = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the put path --------------------------------------------------------------------------------

    def thread_ttl(self, configurable: Mapping[str, Any]) -> float | None:
        """A put's own TTL (``checkpoint_ttl``: a duration string or seconds), or None.

        Raises:
            InvalidTTLError: If the value is not a positive duration.
        """
        value = configurable.get(TTL_KEY)
        if value is None:
            return None
        try:
            return parse_duration(value, name=f"config.configurable.{TTL_KEY}")
        except ValueError as exc:
            raise InvalidTTLError(str(exc)) from None

    def touch(self, config: Mapping[str, Any]) -> None:
        """Note a write to the config's thread, before it is stored: its age restarts, its TTL and memory
        namespace are kept. Skipped when this process touched the thread with the same TTL and
        namespace less than ``min(1 h, ttl / 10)`` ago.

        Raises:
            InvalidTTLError: If the put's ``checkpoint_ttl`` is not a duration (nothing is noted).
        """
        configurable = config.get("configurable") or {}
        thread_id = str(configurable["thread_id"])
        ttl = self.thread_ttl(configurable)
        given = configurable.get(self.namespace_key)
        namespace = None
        if isinstance(given, (str, list, tuple)):
            namespace = (given,) if isinstance(given, str) else tuple(given)
            try:
                validate_namespace(namespace)
            except ValueError:
                # Refused (422) by puts that write messages; never kept for the thread's last window.
                namespace = None
        now = time.monotonic()
        with self._touched_lock:
            seen = self._touched.get(thread_id)
        if seen is not None:
            at, seen_ttl, seen_namespace = seen
            same = (ttl is None or ttl == seen_ttl) and (namespace is None or namespace == seen_namespace)
            effective = seen_ttl if seen_ttl is not None else self.policy.default_ttl
            every = TOUCH_EVERY if effective is None else min(TOUCH_EVERY, effective / 10)
            if same and now - at < every:
                return
            ttl = ttl if ttl is not None else seen_ttl
            namespace = namespace if namespace is not None else seen_namespace
        self.ledger.touch(thread_id, ttl, namespace)
        with self._touched_lock:
            self._touched[thread_id] = (now, ttl, namespace)
            self._touched.move_to_end(thread_id)
            while len(self._touched) > TOUCH_CACHE_SIZE:
                self._touched.popitem(last=False)

    def copied(self, source_thread_id: str, target_thread_id: str) -> None:
        """Note, before a copy, that ``target`` is written now, with ``source``'s own TTL."""
        self.ledger.copy(str(source_thread_id), str(target_thread_id))
        with self._touched_lock:
            self._touched.pop(str(target_thread_id), None)

    def delete_extracting(self, thread_id: str) -> None:
        """A client's ``delete_thread`` under ``extract_on_delete``: the messages in the thread's window go
        to the outbox, then the thread is deleted (on PostgreSQL in one transaction, which waits for a
        sweep of the thread to finish). The ledger row stays: a later sweep removes it."""
        self.ledger.delete_extracting(str(thread_id), self.recorder)

    # -- sweeps --------------------------------------------------------------------------------------

    def sweep(self, *, dry_run: bool = False) -> SweepReport:
        """Handle every expired thread (or, with ``dry_run``, list them with the bytes they hold that the
        strategy would free, changing nothing). Failures are logged and counted; the thread is retried
        by the next sweep."""
        report = SweepReport(self.policy.strategy, self.policy.default_ttl, dry_run=dry_run)
        started = time.monotonic()
        with self._sweep_lock, self.ledger.session(self.policy) as session:
            if not self._discovered:
                found = self.ledger.discover(session=session)
                self._discovered = True
                if found:
                    logger.info("TTL ledger: %d thread(s) found without a row, aged by their newest checkpoint", found)
            if dry_run:
                for thread_id in self.ledger.candidates(self.policy, None, (), session=session):
                    report.threads.append({"thread_id": thread_id, "bytes": session.measure(thread_id)})
            else:
                self._sweep(session, report)
                self.ledger.forget_log(LOG_DAYS, session=session)
        report.seconds = time.monotonic() - started
        if not dry_run:
            self._settle(report)
        return report

    def _sweep(self, session: Any, report: SweepReport) -> None:
        skip: list[str] = []
        seen: set[str] = set()
        while not self._stop.is_set():
            ids = self.ledger.candidates(self.policy, self.batch_size, skip, session=session)
            if not ids:
                return
            for thread_id in ids:
                if self._stop.is_set():
                    return
                if thread_id in seen:
                    skip.append(thread_id)  # still listed after being handled: never loop on it
                    continue
                seen.add(thread_id)
                try:
                    outcome = session.handle(thread_id)
                except Exception:
                    logger.exception("TTL sweep failed on thread %r; the next sweep retries it", thread_id)
                    report.errors += 1
                    skip.append(thread_id)
                    continue
                if outcome is None:
                    skip.append(thread_id)
                elif outcome.action == "pruned":
                    report.threads_pruned += 1
                elif outcome.action == "deleted":
                    report.threads_deleted += 1
                else:
                    report.threads_refused += 1
                if outcome is not None:
                    report.bytes_reclaimed += outcome.bytes

    def _settle(self, report: SweepReport) -> None:
        with self._figures_lock:
            figures = self._figures
            figures["last_sweep_at"] = datetime.now(UTC)
            figures["last_sweep_seconds"] = round(report.seconds, 6)
            figures["sweeps"] += 1
            for name in ("threads_pruned", "threads_deleted", "threads_refused", "bytes_reclaimed", "errors"):
                figures[name] += getattr(report, name)
        if self._metrics is not None:
            self._metrics.sweeps.inc()
            self._metrics.pruned.inc(report.threads_pruned)
            self._metrics.deleted.inc(report.threads_deleted)
            self._metrics.bytes.inc(report.bytes_reclaimed)
            self._metrics.errors.inc(report.errors)
            self._metrics.last.set(time.time())
        handled = report.threads_pruned + report.threads_deleted + report.threads_refused + report.errors
        logger.log(
            logging.INFO if handled else logging.DEBUG,
            "TTL sweep (%s): %d pruned, %d deleted, %d refused, %d failed, %d bytes reclaimed in %.3f s",
            report.strategy,
            report.threads_pruned,
            report.threads_deleted,
            report.threads_refused,
            report.errors,
            report.bytes_reclaimed,
            report.seconds,
        )

    # -- the background thread -------------------------------------------------------------------------

    def start(self) -> None:
        """Sweep now and then every ``interval`` seconds, in a daemon thread, until :meth:`stop`."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="reducing-saver-sweeper", daemon=True)
        self._thread.start()
        logger.info(
            "TTL sweeper started (%s, default TTL %s, every %g s)",
            self.policy.strategy,
            "none" if self.policy.default_ttl is None else f"{self.policy.default_ttl:g} s",
            self.interval,
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sweep()
            except Exception:
                logger.exception("TTL sweep failed; retrying in %g s", self.interval)
            self._stop.wait(self.interval)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the background thread; a sweep in progress stops after the thread it is handling."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def close(self, timeout: float | None = 30.0) -> None:
        self.stop(timeout)
        self.ledger.close()

    def status(self, interval: float | None = None) -> dict[str, Any]:
        """The body of ``/v1/sweeps/status`` (see :class:`SweepStatus`)."""
        with self._figures_lock:
            process = dict(self._figures)
        return {
            "strategy": self.policy.strategy,
            "default_ttl_seconds": self.policy.default_ttl,
            "sweep_interval_seconds": self.interval if interval is None else interval,
            "sweeping": self.running,
            "process": process,
            "database": self.ledger.database_status(self.policy),
        }


def window_reader(
    codec: SafeMessagesCodec, messages_key: str, agent_thread_id: Callable[[str], str] = str
) -> Window:
    """Reads the messages in the head checkpoint of a thread's root namespace, as outbox entries.

    ``agent_thread_id`` maps a stored thread id to the one the entries carry (tenant mode strips the
    tenant, as ``Memory.record`` does).
    """

    def window(saver: Any, thread_id: str, namespace: tuple[str, ...]) -> list[OutboxEntry]:
        item = saver.get_tuple({"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}})
        if item is None:
            return []
        value = (item.checkpoint.get("channel_values") or {}).get(messages_key)
        messages = codec.decode(value) if value is not None else None
        if messages is None:
            if value is not None:
                logger.warning("thread %r: its messages channel cannot be read; nothing extracted", thread_id)
            return []
        return make_entries(
            messages, namespace, thread_id=agent_thread_id(thread_id), checkpoint_id=item.checkpoint["id"]
        )

    return window


def open_sweeper(
    settings: Any,
    *,
    backend: Any = None,
    recorder: _Recorder | None = None,
    registry: Any = None,
) -> Sweeper:
    """The sweeper for the service's settings, its ledger set up.

    Args:
        settings: The service ``Settings``.
        backend: The service's open backend (its pool, or its SQLite or memory saver); None for the
            ``sweep`` command, which opens what it needs (memory cannot be swept from another process).
        recorder: The outbox windows are recorded in (SQLite and memory; PostgreSQL records in the sweep's
            own transaction).
        registry: Prometheus registry for the sweep metrics.

    Raises:
        ValueError: For ``memory://`` without a backend.
    """
    from reducing_saver.service.security import TenantScope, load_api_keys, stored_thread_to_agent

    tenant_mode = load_api_keys(settings) is not None

    def tenant_namespace(thread_id: str) -> tuple[str, ...]:
        # As security.TenantScope.config_in makes it: ("tenants", tenant, "memories", thread).
        tenant, _, agent_thread = thread_id.partition(":")
        return TenantScope(tenant).namespace(default_namespace(agent_thread))
    window = window_reader(
        SafeMessagesCodec(settings.allowed_message_classes),
        settings.messages_key,
        lambda thread_id: stored_thread_to_agent(thread_id, tenant_mode),
    )
    worker_id = default_worker_id()
    ledger: Any
    if settings.backend == "postgres":
        ledger = PostgresLedger(
            settings.database, pool=getattr(backend, "pool", None), window=window, worker_id=worker_id
        )
    else:
        if backend is not None:
            with backend.borrow() as saver:
                inner = saver.inner
        elif settings.backend == "sqlite":
            inner = _open_sqlite_saver(settings.database)
        else:
            raise ValueError("memory:// keeps its threads inside the service process: nothing to sweep from here")
        cls = SqliteLedger if settings.backend == "sqlite" else MemoryLedger
        ledger = cls(inner, window=window, recorder=recorder, worker_id=worker_id)
    if tenant_mode:
        ledger.fallback_namespace = tenant_namespace
    ledger.setup()
    return Sweeper(
        ledger,
        Policy(settings.ttl_strategy, settings.default_ttl),
        namespace_key=settings.namespace_key,
        interval=settings.sweep_interval,
        batch_size=settings.sweep_batch_size,
        extract_on_delete=settings.extract_on_delete,
        recorder=recorder,
        registry=registry,
    )


def _open_sqlite_saver(database: str) -> Any:
    import sqlite3
    from pathlib import Path

    from reducing_saver.service.savers import SqliteLifecycleSaver
    from reducing_saver.service.settings import sqlite_path

    path = Path(sqlite_path(database))
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30.0)
    conn.execute("PRAGMA journal_mode=WAL")
    saver = SqliteLifecycleSaver(conn, serde=VerbatimSerde())
    saver.setup()
    return saver
