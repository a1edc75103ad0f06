"""The book of running summaries on PostgreSQL: its SQL, claims with ``FOR UPDATE SKIP LOCKED``, safe
across replicas; every call borrows a connection of the backend's pool for one transaction. The table is
a migration (``migrations.py``); what the backends' books share is ``storage/summaries.py``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from psycopg.rows import dict_row

from reducing_saver.service.storage.postgres.errors import wrap_exceptions
from reducing_saver.service.storage.summaries import COPIED, INFO, TABLE, SqlSummaryBook, SummarySql

#: The book's statements, in PostgreSQL's dialect (``%s`` markers).
SQL = SummarySql(
    mark="%s",
    steps=f"SELECT {INFO} FROM {TABLE} WHERE thread_id = %s AND checkpoint_ns = %s AND step_id IN ({{marks}})",
    children=(
        f"SELECT {INFO} FROM {TABLE} WHERE thread_id = %s AND checkpoint_ns = %s AND base_step = %s "
        "ORDER BY created_at"
    ),
    chain=f"""WITH RECURSIVE chain({INFO}, depth) AS (
        SELECT {INFO}, 0 FROM {TABLE} WHERE thread_id = %s AND checkpoint_ns = %s AND step_id = %s
        UNION ALL
        SELECT s.step_id, s.base_step, s.version, s.keys, s.status, s.covered, s.text, c.depth + 1 FROM {TABLE} s
        JOIN chain c ON s.thread_id = %s AND s.checkpoint_ns = %s AND s.step_id = c.base_step
        WHERE c.base_step <> %s)
    SELECT {INFO} FROM chain ORDER BY depth DESC""",
    request=(
        f"INSERT INTO {TABLE} (thread_id, checkpoint_ns, step_id, base_step, version, keys, batch, "
        "batch_size, covered, available_at, created_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
        "ON CONFLICT (thread_id, checkpoint_ns, step_id) DO NOTHING"
    ),
    claim=(
        f"SELECT s.* FROM {TABLE} s WHERE s.status = 'pending' AND s.available_at <= %s "
        "AND (s.lease_until IS NULL OR s.lease_until <= %s){plain_batch} AND (s.base_step = '' "
        f"OR EXISTS (SELECT 1 FROM {TABLE} b WHERE b.thread_id = s.thread_id AND b.checkpoint_ns = "
        "s.checkpoint_ns AND b.step_id = s.base_step AND b.status = 'done'{plain_base})) "
        "ORDER BY s.created_at LIMIT 1 FOR UPDATE OF s SKIP LOCKED"
    ),
    claim_plain_batch=" AND substr(s.batch, 1, %s) <> %s",
    claim_plain_base=" AND (b.text IS NULL OR substr(b.text, 1, %s) <> %s)",
    lease=(
        f"UPDATE {TABLE} SET claimed_by = %s, lease_until = %s, attempts = attempts + 1 "
        "WHERE thread_id = %s AND checkpoint_ns = %s AND step_id = %s"
    ),
    base_text=f"SELECT text FROM {TABLE} WHERE thread_id = %s AND checkpoint_ns = %s AND step_id = %s",
    renew=(
        f"UPDATE {TABLE} SET lease_until = %s WHERE thread_id = %s AND checkpoint_ns = %s "
        "AND step_id = %s AND status = 'pending' AND claimed_by = %s"
    ),
    complete=(
        f"UPDATE {TABLE} SET status = 'done', text = %s, model = %s, prompt_hash = %s, input_tokens = %s, "
        "output_tokens = %s, done_at = %s, claimed_by = NULL, lease_until = NULL "
        "WHERE thread_id = %s AND checkpoint_ns = %s AND step_id = %s AND status = 'pending'"
    ),
    retry=(
        f"UPDATE {TABLE} SET available_at = %s, last_error = %s, claimed_by = NULL, lease_until = NULL "
        "WHERE thread_id = %s AND checkpoint_ns = %s AND step_id = %s AND status = 'pending' AND claimed_by = %s"
    ),
    dead=(
        f"UPDATE {TABLE} SET status = 'dead', last_error = %s, claimed_by = NULL, lease_until = NULL "
        "WHERE thread_id = %s AND checkpoint_ns = %s AND step_id = %s AND status = 'pending' AND claimed_by = %s"
    ),
    release=(
        f"UPDATE {TABLE} SET claimed_by = NULL, lease_until = NULL, attempts = attempts - 1 "
        "WHERE claimed_by = %s AND status = 'pending' AND attempts > 0"
    ),
    retry_dead=(
        f"UPDATE {TABLE} SET status = 'pending', attempts = 0, available_at = %s, claimed_by = NULL, "
        "lease_until = NULL WHERE status = 'dead' AND substr(thread_id, 1, %s) = %s"
    ),
    dead_letters=(
        f"SELECT thread_id, checkpoint_ns, step_id, attempts, last_error, batch_size FROM {TABLE} "
        "WHERE status = 'dead' AND substr(thread_id, 1, %s) = %s ORDER BY created_at LIMIT %s"
    ),
    status=f"""SELECT
        COALESCE(SUM(CASE WHEN status = 'pending' THEN 1 ELSE 0 END), 0) AS pending,
        COALESCE(SUM(CASE WHEN status = 'pending' THEN batch_size ELSE 0 END), 0) AS messages,
        COALESCE(SUM(CASE WHEN status = 'done' THEN 1 ELSE 0 END), 0) AS done,
        COALESCE(SUM(CASE WHEN status = 'dead' THEN 1 ELSE 0 END), 0) AS dead,
        MIN(CASE WHEN status = 'pending' THEN created_at END) AS oldest
    FROM {TABLE} WHERE substr(thread_id, 1, %s) = %s""",
    delete_thread=f"DELETE FROM {TABLE} WHERE thread_id = %s",
    copy_thread=(
        f"INSERT INTO {TABLE} (thread_id, {COPIED}) SELECT %s, {COPIED} FROM {TABLE} WHERE thread_id = %s "
        "ON CONFLICT (thread_id, checkpoint_ns, step_id) DO NOTHING"
    ),
    copy_rows=f"SELECT {COPIED} FROM {TABLE} WHERE thread_id = %s",
    copy_row=(
        f"INSERT INTO {TABLE} (thread_id, {COPIED}) VALUES ({{marks}}) "
        "ON CONFLICT (thread_id, checkpoint_ns, step_id) DO NOTHING"
    ),
    forget_orphans=(
        f"DELETE FROM {TABLE} WHERE created_at < %s AND NOT EXISTS (SELECT 1 FROM checkpoints c "
        f"WHERE c.thread_id = {TABLE}.thread_id AND c.checkpoint_ns = {TABLE}.checkpoint_ns)"
    ),
)


class PostgresSummaryBook(SqlSummaryBook):
    """See :class:`SqlSummaryBook`.

    Args:
        pool: The process's ``ConnectionPool`` (the backend's).
    """

    sql = SQL

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        # A value PostgreSQL refuses is ValueRefused, an outage DatabaseUnavailable: the summarizer tells a
        # failed attempt of one step from a round that failed.
        with wrap_exceptions(), self._pool.connection() as conn, conn.transaction():
            with conn.cursor(row_factory=dict_row) as cur:
                yield cur
