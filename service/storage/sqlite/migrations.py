"""The SQLite schema of the service's own tables, as versioned migrations.

``MIGRATIONS[v]`` is version ``v``, one statement each. Append new statements at the end; never edit or
remove a released one (see :mod:`..migrations`). They run in one ``BEGIN IMMEDIATE`` transaction, which
takes the file's write lock first: processes starting together apply each statement once, and a
failure leaves the file at the version it had.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from langgraph.store.sqlite import SqliteStore

from reducing_saver.service.storage.migrations import NO_VERSION, TABLE, Applied, latest, refuse_newer

MIGRATIONS: list[str] = [
    # 0: the version table itself.
    "CREATE TABLE IF NOT EXISTS reducing_saver_migrations (v INTEGER PRIMARY KEY)",
    # 1-3: the extraction outbox, as the first release created it.
    """CREATE TABLE IF NOT EXISTS reducing_saver_outbox (
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
    "CREATE INDEX IF NOT EXISTS reducing_saver_outbox_ready ON reducing_saver_outbox (status, available_at)",
    "CREATE INDEX IF NOT EXISTS reducing_saver_outbox_claimed ON reducing_saver_outbox (claimed_by)",
    # 4-6: the TTL ledger.
    """CREATE TABLE IF NOT EXISTS reducing_saver_threads (
        thread_id TEXT PRIMARY KEY,
        last_write_at REAL NOT NULL,
        ttl_seconds REAL,
        expires_at REAL,
        namespace TEXT,
        swept_at REAL
    )""",
    "CREATE INDEX IF NOT EXISTS reducing_saver_threads_due_own ON reducing_saver_threads (expires_at) "
    "WHERE swept_at IS NULL",
    "CREATE INDEX IF NOT EXISTS reducing_saver_threads_due_default ON reducing_saver_threads (last_write_at) "
    "WHERE swept_at IS NULL AND ttl_seconds IS NULL",
    # 7-8: the sweep log.
    """CREATE TABLE IF NOT EXISTS reducing_saver_sweep_log (
        thread_id TEXT NOT NULL,
        action TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        swept_at REAL NOT NULL,
        swept_by TEXT NOT NULL
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
        keys BLOB NOT NULL,
        batch BLOB NOT NULL,
        batch_size INTEGER NOT NULL,
        covered INTEGER NOT NULL,
        status TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'done', 'dead')),
        text TEXT,
        model TEXT,
        prompt_hash TEXT,
        input_tokens INTEGER,
        output_tokens INTEGER,
        attempts INTEGER NOT NULL DEFAULT 0,
        available_at REAL NOT NULL,
        claimed_by TEXT,
        lease_until REAL,
        last_error TEXT,
        created_at REAL NOT NULL,
        done_at REAL,
        PRIMARY KEY (thread_id, checkpoint_ns, step_id)
    )""",
    "CREATE INDEX IF NOT EXISTS reducing_saver_summaries_base "
    "ON reducing_saver_summaries (thread_id, checkpoint_ns, base_step)",
    "CREATE INDEX IF NOT EXISTS reducing_saver_summaries_ready ON reducing_saver_summaries (status, available_at)",
    # 16 (PostgreSQL) / 12 (SQLite): what each outbox message says (storage/outbox.py), so a newer
    # version of a message (an edit with the same id) replaces the one recorded; NULL for older rows.
    "ALTER TABLE reducing_saver_outbox ADD COLUMN fingerprint TEXT",
    # 13 (SQLite) / 17 (PostgreSQL): what --keep-checkpoints deleted, per thread and namespace: the newest
    # checkpoint id it deleted (storage/lifecycle.py: time travel there is an error, not an empty state).
    """CREATE TABLE IF NOT EXISTS reducing_saver_pruned (
        thread_id TEXT NOT NULL,
        checkpoint_ns TEXT NOT NULL,
        pruned_through TEXT NOT NULL,
        PRIMARY KEY (thread_id, checkpoint_ns)
    )""",
]

#: The version this code reads and writes.
LATEST = latest(MIGRATIONS)


def where(cur: Any) -> str:
    """The file the connection of ``cur`` has open, for messages."""
    row = cur.execute("PRAGMA database_list").fetchone()
    return str(row[2] or ":memory:")


def version(cur: Any) -> int:
    """The newest version recorded in the file (:data:`NO_VERSION` without a version table)."""
    if (
        cur.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (TABLE,)).fetchone()
        is None
    ):
        return NO_VERSION
    found = cur.execute(f"SELECT max(v) FROM {TABLE}").fetchone()[0]
    return NO_VERSION if found is None else found


def apply(cur: Any) -> list[Applied]:
    """Apply the migrations the file lacks, on ``cur``, inside a ``BEGIN IMMEDIATE`` transaction the
    caller opened and commits (the write lock is held: nobody else migrates meanwhile).

    Raises:
        SchemaError: If the file records a version newer than :data:`LATEST` (nothing is changed).
    """
    found = version(cur)
    refuse_newer(found, LATEST, where(cur))
    applied = []
    for v in range(found + 1, len(MIGRATIONS)):
        cur.execute(MIGRATIONS[v])
        cur.execute(f"INSERT INTO {TABLE} (v) VALUES (?)", (v,))
        applied.append(Applied(v, MIGRATIONS[v]))
    return applied


def migrate(conn: sqlite3.Connection) -> list[Applied]:
    """:func:`apply` in a transaction of its own on ``conn`` (an autocommit connection), committed
    when every migration is applied, rolled back otherwise."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        applied = apply(conn.cursor())
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return applied


#: langgraph's own version tables in the SQLite file -> the version its code applies last. (SqliteSaver
#: creates its tables itself on first use and keeps no version.)
LANGGRAPH_TABLES = {"store_migrations": latest(SqliteStore.MIGRATIONS)}


def langgraph_versions(cur: Any) -> dict[str, int]:
    """The version each of langgraph's tables in :data:`LANGGRAPH_TABLES` records."""
    found = {}
    for table in LANGGRAPH_TABLES:
        exists = cur.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
        ).fetchone()
        found[table] = (
            cur.execute(f"SELECT coalesce(max(v), -1) FROM {table}").fetchone()[0] if exists else NO_VERSION
        )
    return found
