"""The SQLite backend (the embedded default): SqliteSaver with the lifecycle capabilities, the outbox, the
TTL ledger and SqliteStore, all in one file."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from typing import Any

from langgraph.store.sqlite import SqliteStore

from reducing_saver.service.storage import sqlite_path
from reducing_saver.service.storage.serde import VerbatimSerde
from reducing_saver.service.storage.sqlite.connections import connect
from reducing_saver.service.storage.sqlite.ledger import SqliteLedger
from reducing_saver.service.storage.sqlite.outbox import SqliteOutbox
from reducing_saver.service.storage.sqlite.saver import SqliteLifecycleSaver
from reducing_saver.service.storage.sqlite.summaries import SqliteSummaryBook

#: Why semantic search cannot start on SQLite under this Python (one line).
NO_LOADABLE_EXTENSIONS = (
    "--store-index on SQLite needs the sqlite-vec extension, and this Python's sqlite3 cannot load "
    "extensions (built without --enable-loadable-sqlite-extensions): use a Python that can, or start "
    "without --store-index"
)


class SqliteBackend:
    """See :class:`reducing_saver.service.storage.Backend`. SqliteSaver serializes every call on its
    lock: the backend has one saver."""

    kind = "sqlite"
    pool = None

    def __init__(self, path: str, *, create: bool) -> None:
        self.path = path
        self._conn = connect(path, create=create)
        self.saver = SqliteLifecycleSaver(self._conn, serde=VerbatimSerde())
        self._closers = [self._conn.close]
        self._store: SqliteStore | None = None
        #: SqliteStore's ``index`` and ``ttl`` (``service/store_config.py``), set before the first store().
        self.store_options: dict[str, Any] = {}

    def setup(self) -> None:
        self.saver.setup()

    def savers(self, count: int) -> list[SqliteLifecycleSaver]:
        return [self.saver]

    def outbox(self) -> SqliteOutbox:
        outbox = SqliteOutbox(self.path)
        outbox.setup()
        self._closers.append(outbox.close)
        return outbox

    def summaries(self) -> SqliteSummaryBook:
        """The book of running summaries (``service/summaries/book.py``), set up."""
        book = SqliteSummaryBook(self.path)
        book.setup()
        self._closers.append(book.close)
        return book

    def store(self) -> SqliteStore:
        if self._store is None:
            conn = connect(self.path)
            self._closers.append(conn.close)
            if "index" in self.store_options and not hasattr(conn, "enable_load_extension"):
                raise RuntimeError(NO_LOADABLE_EXTENSIONS)
            store = SqliteStore(conn, **self.store_options)
            store.setup()
            if (self.store_options.get("ttl") or {}).get("sweep_interval_minutes"):
                store.start_ttl_sweeper()
                self._closers.append(store.stop_ttl_sweeper)
            self._store = store
        return self._store

    def ledger(self, *, window: Any, recorder: Any, worker_id: str) -> SqliteLedger:
        ledger = SqliteLedger(self.saver, window=window, recorder=recorder, worker_id=worker_id)
        ledger.setup()
        return ledger

    def ready(self, timeout: float) -> None:
        if not self.saver.lock.acquire(timeout=timeout):
            raise TimeoutError(f"the SQLite saver stayed busy for {timeout:g} s")
        try:
            self._conn.execute("SELECT 1 FROM checkpoints LIMIT 1")
        finally:
            self.saver.lock.release()

    def close(self, timeout: float = 5.0) -> None:
        for close in reversed(self._closers):
            close()


def store_refusal(url: str, *, index: bool, ttl: bool) -> str | None:
    """Why this backend cannot serve the store settings: vector search needs a sqlite3 that loads
    extensions (sqlite-vec)."""
    if index:
        with closing(sqlite3.connect(":memory:")) as conn:
            if not hasattr(conn, "enable_load_extension"):
                return NO_LOADABLE_EXTENSIONS
    return None


def open(url: str, *, pool_size: int, timeout: float, create: bool = True) -> SqliteBackend:  # noqa: A001
    return SqliteBackend(sqlite_path(url), create=create)
