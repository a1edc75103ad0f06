"""The TTL ledger and sweep log as PostgreSQL tables (row locks with ``FOR UPDATE SKIP LOCKED``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from langgraph.checkpoint.postgres.base import PRUNE_DELETE_THREADS_SQL

from reducing_saver.reducer import thread_namespace
from reducing_saver.service.storage.ledger import (
    LOG_TABLE,
    TABLE,
    Outcome,
    Policy,
    Recorder,
    Window,
    database_figures,
    iso_time,
    row_namespace,
    uuid6_time,
)
from reducing_saver.service.storage.lifecycle import PRUNED_TABLE
from reducing_saver.service.storage.postgres import migrations
from reducing_saver.service.storage.postgres.connections import connect
from reducing_saver.service.storage.postgres.outbox import PostgresOutbox
from reducing_saver.service.storage.postgres.saver import PostgresLifecycleSaver
from reducing_saver.service.storage.serde import VerbatimSerde
from reducing_saver.service.storage.summaries import TABLE as SUMMARIES_TABLE

logger = logging.getLogger(__name__)

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

# A deleted thread's running-summary steps, and its record of what --keep-checkpoints deleted, go in the
# transaction that deletes its checkpoints.
_PG_FORGET_SUMMARIES = f"DELETE FROM {SUMMARIES_TABLE} WHERE thread_id = %s"
_PG_FORGET_PRUNED = f"DELETE FROM {PRUNED_TABLE} WHERE thread_id = %s"

_PG_LOG = f"INSERT INTO {LOG_TABLE} (thread_id, action, bytes, swept_by) VALUES (%s, %s, %s, %s)"


class _OneConnection:
    """One open connection dressed as a pool, so a ``PostgresOutbox`` records inside its transaction."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    @contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[Any]:
        yield self._conn


class PostgresLedger:
    """The ledger as a PostgreSQL table next to the checkpoints.

    Args:
        database: The service's database URL.
        pool: The process's connection pool, for touches and explicit deletes (the put path) and status.
        window: Reads the messages in a thread's head, as outbox entries.
        worker_id: Written in the sweep log.
        options: The ``postgres_*`` settings the sweep's own connections are opened with (the pool's).

    A sweep runs on two connections of its own, opened for it (its queries and ledger transactions, and
    PostgresSaver's ``prune``), never on the backend's pool: requests keep the pool, and puts that wait on
    a row the sweep holds may hold every pooled connection.
    """

    kind = "postgres"
    #: The memory namespace of a thread whose puts named none (tenant mode: open_sweeper's).
    fallback_namespace = staticmethod(thread_namespace)

    def __init__(
        self, database: str, *, pool: Any, window: Window, worker_id: str, options: Any = None
    ) -> None:
        self.database = database
        self.options = options
        self._pool = pool
        self.window = window
        self.worker_id = worker_id

    def _connection(self) -> Any:
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
        """Bring the service's tables up to date (``migrations.migrate``, under the set-up lock)."""
        with self._connection() as conn:
            migrations.migrate(conn)

    def close(self) -> None:
        """Nothing to close: the pool is the backend's."""

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
                    when = iso_time(found["ts"] if found else None)
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

    def delete_extracting(self, thread_id: str, recorder: Recorder | None) -> None:
        """Delete a thread after recording its window, in one transaction (waits on a sweep of it)."""

        with self._connection() as conn, conn.transaction():
            row = conn.execute(
                f"SELECT namespace FROM {TABLE} WHERE thread_id = %s FOR UPDATE", (thread_id,)
            ).fetchone()
            namespace = row_namespace(self, thread_id, row["namespace"] if row else None)
            entries = self.window(PostgresLifecycleSaver(conn, serde=VerbatimSerde()), thread_id, namespace)
            if entries:
                PostgresOutbox(_OneConnection(conn)).record(entries)
            for statement in PRUNE_DELETE_THREADS_SQL:
                conn.execute(statement, ([thread_id],))
            conn.execute(_PG_FORGET_SUMMARIES, (thread_id,))
            conn.execute(_PG_FORGET_PRUNED, (thread_id,))

    def database_status(self, policy: Policy, *, thread_prefix: str = "") -> dict[str, Any]:
        swept = "AND t.swept_at IS NULL" if policy.strategy == "keep_latest" else ""
        # starts_with, not LIKE: a tenant name may hold "_", LIKE's one-character wildcard.
        params = {"default": policy.default_ttl, "prefix": thread_prefix}
        with self._connection() as conn:
            threads = conn.execute(
                f"SELECT count(*) AS tracked, count(*) FILTER (WHERE {_PG_EXPIRED} {swept}) AS expired "
                f"FROM {TABLE} AS t WHERE starts_with(t.thread_id, %(prefix)s)",
                params,
            ).fetchone()
            log = conn.execute(
                "SELECT count(*) FILTER (WHERE action = 'pruned') AS pruned, "
                "count(*) FILTER (WHERE action = 'deleted') AS deleted, "
                f"COALESCE(sum(bytes), 0)::bigint AS bytes, max(swept_at) AS last FROM {LOG_TABLE} "
                "WHERE starts_with(thread_id, %(prefix)s)",
                params,
            ).fetchone()
        return database_figures(threads["tracked"], threads["expired"], log)

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
            self._conn = connect(self.ledger.database, self.ledger.options)
        return self._conn

    def _pruner(self) -> Any:

        if self._prune_conn is None or self._prune_conn.closed:
            self._prune_conn = connect(self.ledger.database, self.ledger.options)
            # The summary steps of the subgraph calls keep_latest deletes go right after it; a deleted
            # thread's record of what --keep-checkpoints deleted goes with it (the ledger's tables are
            # set up: PostgresBackend.ledger).
            self._saver = PostgresLifecycleSaver(
                self._prune_conn,
                serde=VerbatimSerde(),
                pruned_table=PRUNED_TABLE,
                summaries_table=SUMMARIES_TABLE,
            )
        return self._saver

    def measure(self, thread_id: str) -> int:
        conn = self._ledger_conn()
        total = conn.execute(_PG_THREAD_BYTES, {"thread": thread_id}).fetchone()["bytes"]
        if self.policy.strategy == "delete":
            return int(total)
        kept = conn.execute(_PG_HEAD_BYTES, {"thread": thread_id}).fetchone()["bytes"]
        return max(0, int(total) - int(kept))

    def handle(self, thread_id: str) -> Outcome | None:

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
                namespace = row_namespace(self.ledger, thread_id, row["namespace"])
                reader = PostgresLifecycleSaver(conn, serde=VerbatimSerde())
                entries = self.ledger.window(reader, thread_id, namespace)
                if entries:
                    PostgresOutbox(_OneConnection(conn)).record(entries)
                for statement in PRUNE_DELETE_THREADS_SQL:
                    conn.execute(statement, ([thread_id],))
                conn.execute(_PG_FORGET_SUMMARIES, (thread_id,))
                conn.execute(_PG_FORGET_PRUNED, (thread_id,))
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
