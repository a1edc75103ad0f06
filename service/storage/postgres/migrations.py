"""The PostgreSQL schema of the service's own tables, as versioned migrations.

``MIGRATIONS[v]`` is version ``v``: one statement each (the pool's connections may prepare statements,
and PostgreSQL refuses several statements in one prepared statement), never ``CONCURRENTLY`` (the
migrations apply in one transaction). Append new statements at the end; never edit or remove a released
one (see :mod:`..migrations`).
"""

from __future__ import annotations

from typing import Any

from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.store.postgres import PostgresStore
from psycopg.rows import tuple_row

from reducing_saver.service.storage.migrations import NO_VERSION, TABLE, Applied, latest, refuse_newer
from reducing_saver.service.storage.postgres.connections import SCHEMA_LOCK_KEY, setup_lock

MIGRATIONS: list[str] = [
    # 0: the version table itself.
    "CREATE TABLE IF NOT EXISTS reducing_saver_migrations (v integer PRIMARY KEY)",
    # 1-6: the extraction outbox, as the first release created it.
    """CREATE TABLE IF NOT EXISTS reducing_saver_outbox (
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
    "CREATE INDEX IF NOT EXISTS reducing_saver_outbox_ready ON reducing_saver_outbox (available_at) "
    "WHERE status = 'pending'",
    "CREATE INDEX IF NOT EXISTS reducing_saver_outbox_age ON reducing_saver_outbox (pruned_at) "
    "WHERE status = 'pending'",
    "CREATE INDEX IF NOT EXISTS reducing_saver_outbox_dead ON reducing_saver_outbox (failed_at) "
    "WHERE status = 'dead'",
    "CREATE INDEX IF NOT EXISTS reducing_saver_outbox_claimed ON reducing_saver_outbox (claimed_by) "
    "WHERE status = 'pending'",
    # Sweeps purge delivered rows past the retention without reading the whole table.
    "CREATE INDEX IF NOT EXISTS reducing_saver_outbox_delivered ON reducing_saver_outbox (delivered_at) "
    "WHERE status = 'done'",
    # 7-10: the TTL ledger.
    """CREATE TABLE IF NOT EXISTS reducing_saver_threads (
        thread_id text PRIMARY KEY,
        last_write_at timestamptz NOT NULL DEFAULT now(),
        ttl_seconds double precision,
        expires_at timestamptz,
        namespace text[],
        swept_at timestamptz
    )""",
    "CREATE INDEX IF NOT EXISTS reducing_saver_threads_due_own ON reducing_saver_threads (expires_at) "
    "WHERE swept_at IS NULL",
    "CREATE INDEX IF NOT EXISTS reducing_saver_threads_due_default ON reducing_saver_threads (last_write_at) "
    "WHERE swept_at IS NULL AND ttl_seconds IS NULL",
    "CREATE INDEX IF NOT EXISTS reducing_saver_threads_swept ON reducing_saver_threads (swept_at) "
    "WHERE swept_at IS NOT NULL",
    # 11-12: the sweep log.
    """CREATE TABLE IF NOT EXISTS reducing_saver_sweep_log (
        thread_id text NOT NULL,
        action text NOT NULL CHECK (action IN ('pruned', 'deleted')),
        bytes bigint NOT NULL,
        swept_at timestamptz NOT NULL DEFAULT now(),
        swept_by text NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS reducing_saver_sweep_log_at ON reducing_saver_sweep_log (swept_at)",
    # 13-15 (PostgreSQL) / 9-11 (SQLite): running summaries, the steps of every thread's summary
    # (storage/summaries.py). Times are epoch seconds; batches and keys JSON bytes (NUL-safe).
    """CREATE TABLE IF NOT EXISTS reducing_saver_summaries (
        thread_id TEXT NOT NULL,
        checkpoint_ns TEXT NOT NULL,
        step_id TEXT NOT NULL,
        base_step TEXT NOT NULL,
        version INTEGER NOT NULL,
        keys BYTEA NOT NULL,
        batch BYTEA NOT NULL,
        batch_size INTEGER NOT NULL,
        covered INTEGER NOT NULL,
        status TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'done', 'dead')),
        text TEXT,
        model TEXT,
        prompt_hash TEXT,
        input_tokens INTEGER,
        output_tokens INTEGER,
        attempts INTEGER NOT NULL DEFAULT 0,
        available_at DOUBLE PRECISION NOT NULL,
        claimed_by TEXT,
        lease_until DOUBLE PRECISION,
        last_error TEXT,
        created_at DOUBLE PRECISION NOT NULL,
        done_at DOUBLE PRECISION,
        PRIMARY KEY (thread_id, checkpoint_ns, step_id)
    )""",
    "CREATE INDEX IF NOT EXISTS reducing_saver_summaries_base "
    "ON reducing_saver_summaries (thread_id, checkpoint_ns, base_step)",
    "CREATE INDEX IF NOT EXISTS reducing_saver_summaries_ready ON reducing_saver_summaries (status, available_at)",
    # 16 (PostgreSQL) / 12 (SQLite): what each outbox message says (storage/outbox.py), so a newer
    # version of a message (an edit with the same id) replaces the one recorded; NULL for older rows.
    "ALTER TABLE reducing_saver_outbox ADD COLUMN IF NOT EXISTS fingerprint text",
    # 17-18 (PostgreSQL) / 13 (SQLite): what --keep-checkpoints deleted, per thread and namespace: the
    # newest checkpoint id it deleted (storage/lifecycle.py: time travel there is an error, not an empty
    # state); and the check a put runs in its own pipeline, refusing a parent the policy deleted
    # (SQLSTATE RSP01, the newest deleted id as its detail).
    """CREATE TABLE IF NOT EXISTS reducing_saver_pruned (
        thread_id text NOT NULL,
        checkpoint_ns text NOT NULL,
        pruned_through text NOT NULL,
        PRIMARY KEY (thread_id, checkpoint_ns)
    )""",
    """CREATE OR REPLACE FUNCTION reducing_saver_refuse_pruned_parent(thread text, ns text, parent text)
    RETURNS void LANGUAGE plpgsql AS $$
    DECLARE
        through text;
    BEGIN
        SELECT p.pruned_through INTO through FROM reducing_saver_pruned p
        WHERE p.thread_id = thread AND p.checkpoint_ns = ns;
        IF through IS NOT NULL AND parent COLLATE "C" <= through COLLATE "C" AND NOT EXISTS (
            SELECT 1 FROM checkpoints c
            WHERE c.thread_id = thread AND c.checkpoint_ns = ns AND c.checkpoint_id = parent
        ) THEN
            RAISE EXCEPTION USING ERRCODE = 'RSP01', MESSAGE = 'the parent checkpoint was pruned',
                DETAIL = through;
        END IF;
    END
    $$""",
    # 19-20 (PostgreSQL): a claim (postgres/outbox.py) changes only columns no index holds, and finds room
    # on the row's page for the row's new version, so PostgreSQL writes it as a HOT update: no new entry
    # in any index. The queries naming a worker's rows name their keys too, which the primary key finds
    # (or a read of the pending rows, while they are few); the hand-back at shutdown reads the pending rows.
    "DROP INDEX IF EXISTS reducing_saver_outbox_claimed",
    # Inserts fill a page to 45%: a claim takes the rows of a page at once (the oldest pending rows,
    # inserted together), and each new version takes its row's room plus the worker id and lease it adds.
    "ALTER TABLE reducing_saver_outbox SET (fillfactor = 45)",
]

#: The version this code reads and writes.
LATEST = latest(MIGRATIONS)


def version(conn: Any) -> int:
    """The newest version recorded in the database (:data:`NO_VERSION` without a version table)."""
    with conn.cursor(row_factory=tuple_row) as cur:
        if cur.execute("SELECT to_regclass(%s)", (TABLE,)).fetchone()[0] is None:
            return NO_VERSION
        row = cur.execute(f"SELECT max(v) FROM {TABLE}").fetchone()
    return NO_VERSION if row[0] is None else row[0]


def where(conn: Any) -> str:
    """The database ``conn`` is connected to, for messages: ``"mydb" on host:port``."""
    info = conn.info
    return f"{info.dbname!r} on {info.host}:{info.port}"


def migrate(conn: Any) -> list[Applied]:
    """Apply the migrations the database lacks, each once, in one transaction holding the set-up lock.

    The lock, every statement applied and the rows recording them share one transaction (PostgreSQL's
    DDL is transactional): a failure applies none of them, and a pooler in transaction mode keeps the
    whole of it on one server connection. A process that waited for the lock reads the version inside
    it, so it applies nothing another one applied meanwhile. No statement may be ``CONCURRENTLY``
    (which cannot run in a transaction).

    Args:
        conn: An autocommit psycopg connection (the pool's) that runs nothing else meanwhile.

    Returns:
        The migrations applied, oldest first (empty when the schema was current).

    Raises:
        SchemaError: If the database records a version newer than :data:`LATEST`.
    """
    applied = []
    with setup_lock(conn, SCHEMA_LOCK_KEY):
        found = version(conn)
        refuse_newer(found, LATEST, where(conn))
        for v in range(found + 1, len(MIGRATIONS)):
            conn.execute(MIGRATIONS[v], prepare=False)
            conn.execute(f"INSERT INTO {TABLE} (v) VALUES (%s)", (v,), prepare=False)
            applied.append(Applied(v, MIGRATIONS[v]))
    return applied


#: langgraph's own version tables on PostgreSQL -> the version its code applies last. PostgresSaver and
#: PostgresStore keep their migrations as the service does; the backend runs them (``setup()``) under
#: set-up locks of their own, and reports and checks them with the service's.
LANGGRAPH_TABLES = {
    "checkpoint_migrations": latest(PostgresSaver.MIGRATIONS),
    "store_migrations": latest(PostgresStore.MIGRATIONS),
}


def langgraph_versions(conn: Any) -> dict[str, int]:
    """The version each of langgraph's tables in :data:`LANGGRAPH_TABLES` records (:data:`NO_VERSION`
    when it has none)."""
    found = {}
    with conn.cursor(row_factory=tuple_row) as cur:
        for table in LANGGRAPH_TABLES:
            if cur.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is None:
                found[table] = NO_VERSION
            else:
                found[table] = cur.execute(
                    f"SELECT coalesce(max(v), %s) FROM {table}", (NO_VERSION,)
                ).fetchone()[0]
    return found
