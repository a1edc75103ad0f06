"""The book of running summaries in the service's SQLite file (``BEGIN IMMEDIATE`` transactions)."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from reducing_saver.service.storage.sqlite.connections import connect
from reducing_saver.service.summaries.book import SqlSummaryBook


class SqliteSummaryBook(SqlSummaryBook):
    """See :class:`SqlSummaryBook`. SQLite has no ``SKIP LOCKED``: every transaction takes the write lock
    up front, so two threads or processes never claim the same step.

    Args:
        path: The SQLite file.
    """

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
