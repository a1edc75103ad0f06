"""The PostgreSQL backend: PostgresSaver with the lifecycle capabilities, the outbox, the TTL ledger and
PostgresStore, all on the process's one connection pool."""

from __future__ import annotations

from typing import Any

import psycopg
from langgraph.store.postgres import PostgresStore

from reducing_saver.service.storage.postgres.connections import (
    HAS_PGVECTOR,
    PGVECTOR_MISSING,
    SAVER_LOCK_KEY,
    STORE_LOCK_KEY,
    check_database,
    locked_setup,
    open_pool,
    require_pgvector,
)
from reducing_saver.service.storage.postgres.ledger import PostgresLedger
from reducing_saver.service.storage.postgres.outbox import PostgresOutbox
from reducing_saver.service.storage.postgres.saver import PostgresLifecycleSaver
from reducing_saver.service.storage.postgres.summaries import PostgresSummaryBook
from reducing_saver.service.storage.serde import VerbatimSerde


class PostgresBackend:
    """See :class:`reducing_saver.service.storage.Backend`."""

    kind = "postgres"

    def __init__(self, url: str, *, pool_size: int, timeout: float) -> None:
        self.url = url
        check_database(url, timeout=timeout)
        self.pool = open_pool(url, size=pool_size, timeout=timeout)
        self._store: PostgresStore | None = None
        #: PostgresStore's ``index`` and ``ttl`` (``service/store_config.py``), set before the first store().
        self.store_options: dict[str, Any] = {}

    def setup(self) -> None:
        # Replicas that start together must not run the migrations at the same time.
        with locked_setup(self.url, SAVER_LOCK_KEY):
            PostgresLifecycleSaver(self.pool, serde=VerbatimSerde()).setup()

    def savers(self, count: int) -> list[PostgresLifecycleSaver]:
        return [PostgresLifecycleSaver(self.pool, serde=VerbatimSerde()) for _ in range(count)]

    def outbox(self) -> PostgresOutbox:
        outbox = PostgresOutbox(self.pool)
        outbox.setup()
        return outbox

    def summaries(self) -> PostgresSummaryBook:
        """The book of running summaries (``service/summaries/book.py``), set up."""
        book = PostgresSummaryBook(self.pool)
        book.setup()
        return book

    def store(self) -> PostgresStore:
        if self._store is None:
            if "index" in self.store_options:
                require_pgvector(self.pool)
            store = PostgresStore(self.pool, **self.store_options)
            with locked_setup(self.url, STORE_LOCK_KEY):
                store.setup()
            if (self.store_options.get("ttl") or {}).get("sweep_interval_minutes"):
                store.start_ttl_sweeper()
            self._store = store
        return self._store

    def ledger(self, *, window: Any, recorder: Any, worker_id: str) -> PostgresLedger:
        ledger = PostgresLedger(self.url, pool=self.pool, window=window, worker_id=worker_id)
        ledger.setup()
        return ledger

    def ready(self, timeout: float) -> None:
        # Reads the checkpoint table under a lock timeout: a table another session locked (a sweep, a
        # migration, LOCK TABLE) is as unready as a database that does not answer.
        with self.pool.connection(timeout=timeout) as conn, conn.transaction():
            conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(timeout * 1000)}ms",))
            conn.execute("SELECT set_config('statement_timeout', %s, true)", (f"{int(timeout * 1000)}ms",))
            conn.execute("SELECT 1 FROM checkpoints LIMIT 1")

    def close(self, timeout: float = 5.0) -> None:
        if self._store is not None:
            self._store.stop_ttl_sweeper(timeout)
        self.pool.close(timeout=timeout)


def store_refusal(url: str, *, index: bool, ttl: bool) -> str | None:
    """Why this backend cannot serve the store settings: vector search needs the pgvector extension."""
    if not index:
        return None
    try:
        with psycopg.connect(url, connect_timeout=5) as conn:
            if conn.execute(HAS_PGVECTOR).fetchone() is None:
                return PGVECTOR_MISSING
    except psycopg.OperationalError:
        return None  # unreachable now: the service starts and reports it as it does for any outage
    return None


def open(url: str, *, pool_size: int, timeout: float, create: bool = True) -> PostgresBackend:  # noqa: A001
    return PostgresBackend(url, pool_size=pool_size, timeout=timeout)
