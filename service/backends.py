"""The checkpointer the service hosts, chosen by database URL, wrapped by the reducer.

PostgresSaver serializes every call on one lock per instance, so one instance would serialize the
whole service. The PostgreSQL backend therefore keeps ``pool_size`` saver instances over one
connection pool of the same size: calls for different threads run in parallel, and the service never
holds more connections than the pool.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from langgraph.checkpoint.base import BaseCheckpointSaver

from reducing_saver.service.pglock import setup_lock
from reducing_saver.service.reducer import MessageReducer
from reducing_saver.service.saver import MessagesCodec, RecordPruned, ReducingSaver
from reducing_saver.service.savers import InMemoryLifecycleSaver, PostgresLifecycleSaver, SqliteLifecycleSaver
from reducing_saver.service.serde import VerbatimSerde
from reducing_saver.service.settings import Settings, sqlite_path

logger = logging.getLogger(__name__)

#: Fixed key for the advisory lock that keeps replicas starting together from migrating at once.
_SETUP_LOCK_KEY = 0x7265647563696E67  # "reducing"


class Backend:
    """A fixed set of ``ReducingSaver`` instances over one database; borrow one per call."""

    def __init__(self, kind: str, savers: list[ReducingSaver], close: list, pool: Any = None) -> None:
        self.kind = kind
        #: The PostgreSQL connection pool the savers share (None on other backends).
        self.pool = pool
        self.capabilities = savers[0].capabilities
        self._idle: queue.SimpleQueue[ReducingSaver] = queue.SimpleQueue()
        for saver in savers:
            self._idle.put(saver)
        self._size = len(savers)
        self._close = close

    @property
    def size(self) -> int:
        return self._size

    @property
    def borrowed(self) -> int:
        """Savers lent to a call right now."""
        return self._size - self._idle.qsize()

    @contextmanager
    def borrow(self) -> Iterator[ReducingSaver]:
        """A saver for the length of one call; waits while all are busy."""
        saver = self._idle.get()
        try:
            yield saver
        finally:
            self._idle.put(saver)

    def ready(self) -> None:
        """Raise if the database does not answer."""
        with self.borrow() as saver:
            inner = saver.inner
            if self.kind == "postgres":
                with inner.conn.connection(timeout=2.0) as conn:
                    conn.execute("SELECT 1")
            elif self.kind == "sqlite":
                with inner.lock:
                    inner.conn.execute("SELECT 1")

    def close(self) -> None:
        for closer in self._close:
            try:
                closer()
            except Exception:
                logger.exception("closing the %s backend failed", self.kind)


def open_backend(
    settings: Settings,
    reducer: MessageReducer,
    codec: MessagesCodec,
    record_pruned: RecordPruned | None = None,
) -> Backend:
    """Open the database named by ``settings.database``, create its tables, and wrap the savers."""

    def wrap(inner: BaseCheckpointSaver) -> ReducingSaver:
        return ReducingSaver(
            inner, reducer, messages_key=settings.messages_key, codec=codec, record_pruned=record_pruned
        )

    if settings.backend == "memory":
        return Backend("memory", [wrap(InMemoryLifecycleSaver(serde=VerbatimSerde()))], [])
    if settings.backend == "sqlite":
        return _open_sqlite(settings, wrap)
    return _open_postgres(settings, wrap)


def _open_sqlite(settings: Settings, wrap) -> Backend:
    path = Path(sqlite_path(settings.database))
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    inner = SqliteLifecycleSaver(conn, serde=VerbatimSerde())
    inner.setup()
    return Backend("sqlite", [wrap(inner)], [conn.close])


def _open_postgres(settings: Settings, wrap) -> Backend:
    import psycopg
    from psycopg.rows import dict_row
    from psycopg_pool import ConnectionPool

    pool = ConnectionPool(
        settings.database,
        min_size=settings.pool_size,
        max_size=settings.pool_size,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
        open=False,
        name="reducing-saver",
    )
    pool.open(wait=True, timeout=30.0)
    savers = [PostgresLifecycleSaver(pool, serde=VerbatimSerde()) for _ in range(settings.pool_size)]
    # Replicas that start together must not run the migrations at the same time.
    with psycopg.connect(settings.database, autocommit=True) as lock_conn:
        with setup_lock(lock_conn, _SETUP_LOCK_KEY):
            savers[0].setup()
    return Backend("postgres", [wrap(saver) for saver in savers], [pool.close], pool=pool)


def refused_value(exc: Exception) -> str:
    """The 422 detail for a value the database refused to store or compare (SQLSTATE class 22, a
    ``psycopg.DataError``: PostgreSQL's text and JSONB cannot hold U+0000, say)."""
    diag = getattr(exc, "diag", None)
    reason = (getattr(diag, "message_primary", None) or str(exc).splitlines()[0]).rstrip(".")
    detail = getattr(diag, "message_detail", None)
    text = f"PostgreSQL refused a value of this request: {reason}"
    if detail:
        text += f" ({detail.rstrip('.')})"
    if "\\u0000" in text:
        text += "; PostgreSQL JSON cannot hold the NUL character (U+0000) in keys or strings"
    return text


__all__ = ["Backend", "open_backend", "refused_value"]
