"""The book of running summaries on PostgreSQL: claims with ``FOR UPDATE SKIP LOCKED``, safe across
replicas; every call borrows a connection of the backend's pool for one transaction."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from psycopg.rows import dict_row

from reducing_saver.service.storage.postgres.connections import setup_lock
from reducing_saver.service.summaries.book import DDL, SqlSummaryBook

#: Advisory lock key of the table's set-up ("rs-summa").
SUMMARIES_LOCK_KEY = 0x72732D73756D6D61


class PostgresSummaryBook(SqlSummaryBook):
    """See :class:`SqlSummaryBook`.

    Args:
        pool: The process's ``ConnectionPool`` (the backend's).
    """

    placeholder = "%s"
    lock_clause = " FOR UPDATE OF s SKIP LOCKED"
    types = {"blob": "BYTEA", "real": "DOUBLE PRECISION"}

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        with self._pool.connection() as conn, conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            yield cur

    def setup(self) -> None:
        """Create the table under an advisory lock, so replicas starting together do not race."""
        with self._pool.connection() as conn, setup_lock(conn, SUMMARIES_LOCK_KEY):
            for statement in DDL:
                with conn.transaction():
                    conn.execute(statement.format(**self.types))
