"""The book of running summaries on PostgreSQL: claims with ``FOR UPDATE SKIP LOCKED``, safe across
replicas; every call borrows a connection of the backend's pool for one transaction. The table is a
migration (``migrations.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from psycopg.rows import dict_row

from reducing_saver.service.storage.postgres.errors import wrap_exceptions
from reducing_saver.service.summaries.book import SqlSummaryBook


class PostgresSummaryBook(SqlSummaryBook):
    """See :class:`SqlSummaryBook`.

    Args:
        pool: The process's ``ConnectionPool`` (the backend's).
    """

    placeholder = "%s"
    lock_clause = " FOR UPDATE OF s SKIP LOCKED"

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        # A value PostgreSQL refuses is ValueRefused, an outage DatabaseUnavailable: the summarizer tells a
        # failed attempt of one step from a round that failed.
        with wrap_exceptions(), self._pool.connection() as conn, conn.transaction():
            with conn.cursor(row_factory=dict_row) as cur:
                yield cur
