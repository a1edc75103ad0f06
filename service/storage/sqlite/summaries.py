"""The book of running summaries in the service's SQLite file: its SQL, ``BEGIN IMMEDIATE`` transactions.
What the backends' books share is ``storage/summaries.py``."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from reducing_saver.service.storage.sqlite.connections import connect
from reducing_saver.service.storage.summaries import COPIED, INFO, TABLE, SqlSummaryBook, SummarySql

#: The book's statements, in SQLite's dialect (``?`` markers).
SQL = SummarySql(
    mark="?",
    steps=f"SELECT {INFO} FROM {TABLE} WHERE thread_id = ? AND checkpoint_ns = ? AND step_id IN ({{marks}})",
    children=(
        f"SELECT {INFO} FROM {TABLE} WHERE thread_id = ? AND checkpoint_ns = ? AND base_step = ? "
        "ORDER BY created_at"
    ),
    chain=f"""WITH RECURSIVE chain({INFO}, depth) AS (
        SELECT {INFO}, 0 FROM {TABLE} WHERE thread_id = ? AND checkpoint_ns = ? AND step_id = ?
        UNION ALL
        SELECT s.step_id, s.base_step, s.version, s.keys, s.status, s.covered, s.text, c.depth + 1 FROM {TABLE} s
        JOIN chain c ON s.thread_id = ? AND s.checkpoint_ns = ? AND s.step_id = c.base_step
        WHERE c.base_step <> ?)
    SELECT {INFO} FROM chain ORDER BY depth DESC""",
    request=(
        f"INSERT INTO {TABLE} (thread_id, checkpoint_ns, step_id, base_step, version, keys, batch, "
        "batch_size, covered, available_at, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (thread_id, checkpoint_ns, step_id) DO NOTHING"
    ),
    claim=(
        f"SELECT s.* FROM {TABLE} s WHERE s.status = 'pending' AND s.available_at <= ? "
        "AND (s.lease_until IS NULL OR s.lease_until <= ?){plain_batch} AND (s.base_step = '' "
        f"OR EXISTS (SELECT 1 FROM {TABLE} b WHERE b.thread_id = s.thread_id AND b.checkpoint_ns = "
        "s.checkpoint_ns AND b.step_id = s.base_step AND b.status = 'done'{plain_base})) "
        "ORDER BY s.created_at LIMIT 1"
    ),
    claim_plain_batch=" AND substr(s.batch, 1, ?) <> ?",
    claim_plain_base=" AND (b.text IS NULL OR substr(b.text, 1, ?) <> ?)",
    lease=(
        f"UPDATE {TABLE} SET claimed_by = ?, lease_until = ?, attempts = attempts + 1 "
        "WHERE thread_id = ? AND checkpoint_ns = ? AND step_id = ?"
    ),
    base_text=f"SELECT text FROM {TABLE} WHERE thread_id = ? AND checkpoint_ns = ? AND step_id = ?",
    renew=(
        f"UPDATE {TABLE} SET lease_until = ? WHERE thread_id = ? AND checkpoint_ns = ? "
        "AND step_id = ? AND status = 'pending' AND claimed_by = ?"
    ),
    complete=(
        f"UPDATE {TABLE} SET status = 'done', text = ?, model = ?, prompt_hash = ?, input_tokens = ?, "
        "output_tokens = ?, done_at = ?, claimed_by = NULL, lease_until = NULL "
        "WHERE thread_id = ? AND checkpoint_ns = ? AND step_id = ? AND status = 'pending'"
    ),
    retry=(
        f"UPDATE {TABLE} SET available_at = ?, last_error = ?, claimed_by = NULL, lease_until = NULL "
        "WHERE thread_id = ? AND checkpoint_ns = ? AND step_id = ? AND status = 'pending' AND claimed_by = ?"
    ),
    dead=(
        f"UPDATE {TABLE} SET status = 'dead', last_error = ?, claimed_by = NULL, lease_until = NULL "
        "WHERE thread_id = ? AND checkpoint_ns = ? AND step_id = ? AND status = 'pending' AND claimed_by = ?"
    ),
    release=(
        f"UPDATE {TABLE} SET claimed_by = NULL, lease_until = NULL, attempts = attempts - 1 "
        "WHERE claimed_by = ? AND status = 'pending' AND attempts > 0"
    ),
    retry_dead=(
        f"UPDATE {TABLE} SET status = 'pending', attempts = 0, available_at = ?, claimed_by = NULL, "
        "lease_until = NULL WHERE status = 'dead' AND substr(thread_id, 1, ?) = ?"
    ),
    dead_letters=(
        f"SELECT thread_id, checkpoint_ns, step_id, attempts, last_error, batch_size FROM {TABLE} "
        "WHERE status = 'dead' AND substr(thread_id, 1, ?) = ? ORDER BY created_at LIMIT ?"
    ),
    status=f"""SELECT
        COALESCE(SUM(CASE WHEN status = 'pending' THEN 1 ELSE 0 END), 0) AS pending,
        COALESCE(SUM(CASE WHEN status = 'pending' THEN batch_size ELSE 0 END), 0) AS messages,
        COALESCE(SUM(CASE WHEN status = 'done' THEN 1 ELSE 0 END), 0) AS done,
        COALESCE(SUM(CASE WHEN status = 'dead' THEN 1 ELSE 0 END), 0) AS dead,
        MIN(CASE WHEN status = 'pending' THEN created_at END) AS oldest
    FROM {TABLE} WHERE substr(thread_id, 1, ?) = ?""",
    delete_thread=f"DELETE FROM {TABLE} WHERE thread_id = ?",
    copy_thread=(
        f"INSERT INTO {TABLE} (thread_id, {COPIED}) SELECT ?, {COPIED} FROM {TABLE} WHERE thread_id = ? "
        "ON CONFLICT (thread_id, checkpoint_ns, step_id) DO NOTHING"
    ),
    copy_rows=f"SELECT {COPIED} FROM {TABLE} WHERE thread_id = ?",
    copy_row=(
        f"INSERT INTO {TABLE} (thread_id, {COPIED}) VALUES ({{marks}}) "
        "ON CONFLICT (thread_id, checkpoint_ns, step_id) DO NOTHING"
    ),
    forget_orphans=(
        f"DELETE FROM {TABLE} WHERE created_at < ? AND NOT EXISTS (SELECT 1 FROM checkpoints c "
        f"WHERE c.thread_id = {TABLE}.thread_id AND c.checkpoint_ns = {TABLE}.checkpoint_ns)"
    ),
)


class SqliteSummaryBook(SqlSummaryBook):
    """See :class:`SqlSummaryBook`. SQLite has no ``SKIP LOCKED``: every transaction takes the write lock
    up front, so two threads or processes never claim the same step.

    Args:
        path: The SQLite file.
    """

    sql = SQL

    def __init__(self, path: str) -> None:
        self.path = str(path)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = connect(self.path)
            conn.row_factory = sqlite3.Row
            self._local.conn = conn
            with self._connections_lock:
                self._connections.append(conn)
        return conn

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        cur = conn.cursor()
        try:
            yield cur
        except BaseException:
            cur.close()
            conn.execute("ROLLBACK")
            raise
        cur.close()
        conn.execute("COMMIT")

    def close(self) -> None:
        """Close every connection this book opened (one per thread that used it)."""
        with self._connections_lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()
        self._local = threading.local()
