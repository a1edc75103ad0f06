"""The extraction outbox as a PostgreSQL table, shared by every replica and worker (``FOR UPDATE SKIP
LOCKED`` claims).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Self

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Json

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
from reducing_saver.service.storage.postgres import migrations

#: Rows per INSERT statement (8 parameters each; PostgreSQL allows 65535 per statement).
_INSERT_CHUNK = 1000


#: The columns a record writes.
_RECORDED = "namespace, key, thread_id, checkpoint_id, message, message_class, pruned_at, fingerprint"


def _insert_statement(chunk: Sequence[OutboxEntry], *, counting: bool = False) -> tuple[str, list[Any]]:
    """One statement: rows of new keys are inserted; a row whose message has another fingerprint (a newer
    version of it) is replaced and sent back to ``pending``; every other row is left as it is (locked
    until the caller commits, as by any upsert: the deliverer's claims and purges skip it meanwhile, and
    its other statements lock their rows in the same order, key order: ``_update_in_key_order``).

    Every row is found through the key's unique index (the upsert's conflict check), never through a
    join the planner could make otherwise: a connection keeps a prepared statement's plan, and one made
    while the table was empty (a new deployment's first puts) would read the whole table at each run
    once it had grown, until its first ANALYZE.

    With ``counting``, the statement returns one row per row written, true for an inserted one.
    """
    params: list[Any] = []
    for e in chunk:
        params += [
            list(e.namespace),
            e.key,
            e.thread_id,
            e.checkpoint_id,
            Json(e.message, dumps=json_text),
            e.message_class,
            as_utc(e.pruned_at),
            e.fingerprint,
        ]
    row = "(%s::text[], %s::text, %s::text, %s::text, %s::json, %s::text, %s::timestamptz, %s::text)"
    values = ",".join([row] * len(chunk))
    sql = (
        f"INSERT INTO {TABLE} AS o ({_RECORDED}) VALUES {values} "
        "ON CONFLICT (namespace, key) DO UPDATE SET message = excluded.message, "
        "message_class = excluded.message_class, thread_id = excluded.thread_id, "
        "checkpoint_id = excluded.checkpoint_id, pruned_at = excluded.pruned_at, "
        "fingerprint = excluded.fingerprint, status = 'pending', attempts = 0, available_at = now(), "
        "claimed_by = NULL, lease_until = NULL, last_error = NULL, failed_at = NULL, delivered_at = NULL "
        "WHERE o.fingerprint <> excluded.fingerprint"
    )
    if counting:
        sql += " RETURNING o.xmax = 0"  # an inserted row has no deleting transaction; a replaced one has ours
    return sql, params


def insert_entries(cur: Any, entries: Iterable[OutboxEntry]) -> None:
    """Queue the INSERTs of ``entries`` on ``cur`` (in a pipeline or transaction the caller commits), in key
    order, keys already present left alone unless the message is a newer version."""
    rows = sorted_unique(entries)
    for start in range(0, len(rows), _INSERT_CHUNK):
        cur.execute(*_insert_statement(rows[start : start + _INSERT_CHUNK]))


class PostgresOutbox:
    """The outbox as a PostgreSQL table, shared by every replica and worker.

    Args:
        pool: The process's ``ConnectionPool`` (the backend's): every call borrows a connection from it.

    Each call borrows a connection for one explicit transaction and gives it back, so the outbox works on
    autocommit pools (the backend's) and on transactional ones alike, and never holds a connection between
    calls.
    """

    #: The savers of the PostgreSQL backend insert a put's entries in its pipeline (``insert_entries``).
    records_with_checkpoint = True
    #: See ``storage.outbox.Outbox``.
    claims_sealed = False

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to close: the pool is the backend's."""

    def _cursor(self):
        return _PgCursor(self._pool, dict_row)

    def setup(self) -> None:
        """Bring the service's tables up to date (``migrations.migrate``: each migration once, under the
        set-up lock, so replicas starting together do not race)."""
        with self._pool.connection() as conn:
            migrations.migrate(conn)

    def record(self, entries: Iterable[OutboxEntry]) -> int:
        """Record entries for extraction, once per ``(namespace, key)``; durable when it returns.

        Idempotent: keys already present (pending, done or dead) are left alone, unless the entry's
        fingerprint differs from the row's (the message was edited since: the row takes the newer version
        and is delivered again). All or nothing (one statement, or one transaction over several); rows go
        in key order.

        Returns:
            How many rows were inserted (revised rows not counted).

        Raises:
            psycopg.Error: If the rows could not be written (nothing is recorded then).
        """
        rows = sorted_unique(entries)
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

    def forget(self, entries: Iterable[OutboxEntry]) -> int:
        """Make each entry's key a deletion: pending again, with no message, so the deliverer removes it
        from the store (``Deliverer``), and a later record of the key is refused as every repeat is.

        A row a deliverer holds is taken from it (its completion then finds nothing to complete), so a
        delivery racing the deletion ends before it, never after. Idempotent; one transaction.

        Returns:
            How many rows were written.
        """
        rows = sorted_unique(entries)
        if not rows:
            return 0
        with self._pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
            for e in rows:
                cur.execute(
                    f"INSERT INTO {TABLE} (namespace, key, thread_id, checkpoint_id, message, message_class, "
                    "pruned_at) VALUES (%s, %s, %s, %s, 'null', NULL, %s) ON CONFLICT (namespace, key) DO UPDATE "
                    "SET status = 'pending', message = 'null', message_class = NULL, claimed_by = NULL, "
                    "lease_until = NULL, available_at = now(), attempts = 0, last_error = NULL, "
                    "failed_at = NULL, delivered_at = NULL",
                    (list(e.namespace), e.key, e.thread_id, e.checkpoint_id, as_utc(e.pruned_at)),
                )
        return len(rows)

    @staticmethod
    def _insert(cur: Any, chunks: list[list[OutboxEntry]]) -> int:
        inserted = 0
        for chunk in chunks:
            cur.execute(*_insert_statement(chunk, counting=True))
            inserted += sum(1 for (fresh,) in cur.fetchall() if fresh)
        return inserted

    def claim(self, worker_id: str, limit: int, lease_seconds: float) -> list[OutboxEntry]:
        """Claim up to ``limit`` ready rows for ``worker_id`` with a lease of ``lease_seconds``.

        Ready: pending, past its ``retry_at``, and not under a live lease; sealed only when
        ``claims_sealed``. Concurrent claimers skip each other's rows (``FOR UPDATE SKIP LOCKED``). Each
        claim counts one attempt.

        Returns:
            The claimed entries, ordered by namespace, then pruned_at, then key.
        """
        with self._cursor() as cur:
            cur.execute(
                f"""WITH picked AS (
                        SELECT namespace, key FROM {TABLE}
                        WHERE status = 'pending' AND available_at <= now()
                          AND (lease_until IS NULL OR lease_until <= now()){self._sealed_filter()}
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
                {
                    "limit": limit,
                    "worker": worker_id,
                    "lease": float(lease_seconds),
                    "sealed": SEALED_START,
                    "sealed_length": len(SEALED_START),
                },
            )
            rows = cur.fetchall()
        return sorted((_pg_entry(r) for r in rows), key=claim_order)

    def _sealed_filter(self) -> str:
        # By the stored text's start (every writer puts the envelope's one key first, no space): json's
        # operators would parse the message, and fail on a \u0000 anywhere in it.
        return "" if self.claims_sealed else " AND left(message::text, %(sealed_length)s) <> %(sealed)s"

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
                _update_in_key_order(
                    "lease_until = now() + make_interval(secs => %s)",
                    f"claimed_by = %s AND status = 'pending' AND lease_until IS NOT NULL{where}",
                ),
                [float(lease_seconds), worker_id, *params],
            )
            return cur.rowcount

    def complete(self, worker_id: str, keys: Iterable[EntryKey]) -> int:
        """Mark rows ``worker_id`` holds as delivered, dropping their message (and what only delivery
        needed, ``DELIVERED_DROPS``): the store has it, and the key alone keeps a later put from
        recording it again.

        A row whose lease expired is still completed when nobody else claimed it meanwhile.

        Returns:
            How many rows were marked done.
        """
        where, params = _pg_keys_filter(keys)
        if not where:
            return 0
        with self._cursor() as cur:
            cur.execute(
                _update_in_key_order(
                    f"status = 'done', delivered_at = now(), lease_until = NULL, {DELIVERED_DROPS}",
                    f"claimed_by = %s AND status = 'pending'{where}",
                ),
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
        check_fail_args(retry_at, dead)
        namespace, message_key_ = key
        with self._cursor() as cur:
            if retry_at is None:  # dead (check_fail_args: one of the two)
                cur.execute(
                    f"UPDATE {TABLE} SET status = 'dead', last_error = %s, failed_at = now(), "
                    "claimed_by = NULL, lease_until = NULL "
                    "WHERE namespace = %s AND key = %s AND claimed_by = %s AND status = 'pending'",
                    [error_text(error), list(namespace), message_key_, worker_id],
                )
            else:
                cur.execute(
                    f"UPDATE {TABLE} SET available_at = %s, last_error = %s, failed_at = now(), "
                    "claimed_by = NULL, lease_until = NULL "
                    "WHERE namespace = %s AND key = %s AND claimed_by = %s AND status = 'pending'",
                    [as_utc(retry_at), error_text(error), list(namespace), message_key_, worker_id],
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
                _update_in_key_order(
                    "claimed_by = NULL, lease_until = NULL, attempts = GREATEST(o.attempts - 1, 0)",
                    f"claimed_by = %s AND status = 'pending' AND lease_until IS NOT NULL{where}",
                ),
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

    def dead_letters(
        self, limit: int = 100, *, namespace_prefix: Sequence[str] | None = None
    ) -> list[OutboxEntry]:
        """Parked rows, oldest failure first, with their ``attempts`` and ``last_error`` (only those under
        ``namespace_prefix`` when given)."""
        with self._cursor() as cur:
            cur.execute(
                f"SELECT {COLUMNS} FROM {TABLE} WHERE status = 'dead'"
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
                _update_in_key_order(
                    "status = 'pending', attempts = 0, available_at = now(), claimed_by = NULL, "
                    "lease_until = NULL",
                    f"status = 'dead'{where}{_pg_prefix_where(namespace_prefix, 'AND')}",
                ),
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
            # Rows a put holds (recording a delivered message again) wait for the next purge: waiting here
            # for them while holding others could deadlock with that put.
            cur.execute(
                f"DELETE FROM {TABLE} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {TABLE} WHERE status = 'done' "
                "AND delivered_at < now() - make_interval(secs => %s) FOR UPDATE SKIP LOCKED))",
                [float(older_than_seconds)],
            )
            return cur.rowcount


class _PlannedEachRun(psycopg.Cursor):
    """A cursor whose statements are never prepared: PostgreSQL plans each one for the table as it is.

    A connection keeps a prepared statement's plan; one made on a new deployment's empty outbox finds
    rows by key by reading the whole table, and keeps doing so as the table grows, until its first
    ANALYZE (2,000 pages read to complete, renew, fail or release two rows of 20,000, measured). The
    outbox's own transactions (the deliverer's, the commands') come some ten times a second under load
    (a claim and its completion), so planning each costs little; a put's recording, which runs at every
    put that cuts, is an upsert found through the key's index instead (``_insert_statement``).
    """

    def execute(
        self, query: Any, params: Any = None, *, prepare: bool | None = None, binary: bool | None = None
    ) -> Any:
        return super().execute(query, params, prepare=False, binary=binary)


class _PgCursor:
    """A pooled connection, one transaction and a dict-row cursor whose statements are planned at each
    run (:class:`_PlannedEachRun`), as one context manager."""

    def __init__(self, pool: Any, row_factory: Any) -> None:
        self._pool, self._row_factory = pool, row_factory

    def __enter__(self):
        self._conn_cm = self._pool.connection()
        conn = self._conn_cm.__enter__()
        try:
            self._tx = conn.transaction()
            self._tx.__enter__()
            self._cur = _PlannedEachRun(conn, row_factory=self._row_factory)
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


def _update_in_key_order(assignments: str, where: str) -> str:
    """``UPDATE`` of the rows ``where`` selects, each locked first in key order (``COLLATE "C"``: the order
    of ``sorted_unique``, whatever the database's collation).

    A put's recording locks every row it finds, in key order (an upsert), until the put commits; a
    statement that locked several rows in the order of its plan could hold one the put wants while
    waiting for one the put holds, and PostgreSQL would end one of them with ``deadlock detected``.
    """
    return (
        f"UPDATE {TABLE} AS o SET {assignments} "
        f"FROM (SELECT namespace, key FROM {TABLE} WHERE {where} "
        'ORDER BY namespace COLLATE "C", key COLLATE "C" FOR UPDATE) AS locked '
        "WHERE o.namespace = locked.namespace AND o.key = locked.key"
    )


def _pg_entry(row: Mapping[str, Any]) -> OutboxEntry:
    return OutboxEntry(
        namespace=tuple(row["namespace"]),
        key=row["key"],
        thread_id=row["thread_id"],
        checkpoint_id=row["checkpoint_id"],
        message=row["message"],
        pruned_at=as_utc(row["pruned_at"]),
        attempts=row["attempts"],
        message_class=row["message_class"],
        last_error=row["last_error"],
    )
