"""The PostgreSQL backend: PostgresSaver with the lifecycle capabilities, the outbox, the TTL ledger and
PostgresStore, all on the process's one connection pool."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg

from reducing_saver.service.storage import redact_url
from reducing_saver.service.storage.latest import LatestCache
from reducing_saver.service.storage.lifecycle import PRUNED_TABLE
from reducing_saver.service.storage.migrations import (
    NO_MIGRATE,
    check_langgraph,
    check_version,
    langgraph_changes,
    refuse_newer,
)
from reducing_saver.service.storage.postgres import migrations, usage
from reducing_saver.service.storage.postgres.connections import (
    HAS_PGVECTOR,
    PGVECTOR_MISSING,
    READ_ONLY_SQL,
    SAVER_LOCK_KEY,
    STORE_LOCK_KEY,
    check_database,
    connect,
    locked_setup,
    one_row,
    open_pool,
    postgres_settings,
    require_pgvector,
)
from reducing_saver.service.storage.postgres.errors import ServerReadOnly, refused_at_start, wrap_exceptions
from reducing_saver.service.storage.postgres.ledger import PostgresLedger
from reducing_saver.service.storage.postgres.outbox import PostgresOutbox
from reducing_saver.service.storage.postgres.saver import PostgresLifecycleSaver
from reducing_saver.service.storage.postgres.store import PagingPostgresStore
from reducing_saver.service.storage.postgres.summaries import PostgresSummaryBook
from reducing_saver.service.storage.serde import VerbatimSerde
from reducing_saver.service.storage.summaries import TABLE as SUMMARIES_TABLE
from reducing_saver.service.storage.usage import Selection, ThreadStorage


class PostgresBackend:
    """See :class:`reducing_saver.service.storage.Backend`."""

    kind = "postgres"

    def __init__(
        self,
        url: str,
        *,
        pool_size: int,
        timeout: float,
        migrate: bool = True,
        options: Any = None,
        store_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.url = url
        #: The ``postgres_*`` settings every connection of this backend is opened with.
        self.options = postgres_settings(options)
        self._where = redact_url(url)
        check_database(url, timeout=timeout, options=self.options)
        with refused_at_start(self._where):
            self.pool = open_pool(url, size=pool_size, timeout=timeout, options=self.options)
        self._store: PagingPostgresStore | None = None
        #: PostgresStore's ``index`` and ``ttl`` (``service/configuration/store.py``).
        self._store_options = dict(store_options or {})
        self.migrates = migrate
        self._schema_checked = False
        self._store_set_up = False

    def setup(self) -> None:
        if self.migrates:
            self.migrate()
        else:
            self.check_schema()

    def migrate(self) -> list[str]:
        with refused_at_start(self._where):
            # The service's tables first: a database of a later release is refused before anything changes.
            with self.pool.connection() as conn:
                applied = [str(done) for done in migrations.migrate(conn)]
            self._schema_checked = True
            # Replicas that start together must not run langgraph's migrations at the same time; each
            # reports the versions it applied itself, read under the lock.
            with locked_setup(self.url, SAVER_LOCK_KEY, self.options):
                before = self._langgraph_versions("checkpoint_migrations")
                PostgresLifecycleSaver(self.pool, serde=VerbatimSerde()).setup()
                applied += langgraph_changes(before, self._langgraph_versions("checkpoint_migrations"))
            return applied + self._setup_store(self._store or self._new_store())

    def _langgraph_versions(self, table: str) -> dict[str, int]:
        with self.pool.connection() as conn:
            return {table: migrations.langgraph_versions(conn)[table]}

    def check_schema(self, why: str = NO_MIGRATE) -> None:
        with refused_at_start(self._where), self.pool.connection() as conn:
            where = migrations.where(conn)
            check_version(migrations.version(conn), migrations.LATEST, where, why)
            check_langgraph(migrations.langgraph_versions(conn), migrations.LANGGRAPH_TABLES, where, why)
        self._schema_checked = True

    def refuse_newer_schema(self) -> None:
        with refused_at_start(self._where), self.pool.connection() as conn:
            refuse_newer(migrations.version(conn), migrations.LATEST, migrations.where(conn))

    def connect(self) -> Any:
        """A connection of its own, opened as the pool's are (a caller closes it)."""
        return connect(self.url, self.options)

    def _own_schema(self) -> None:
        """The service's tables, migrated or checked once per backend (``outbox()``, ``ledger()``)."""
        if self._schema_checked:
            return
        with self.pool.connection() as conn:
            if self.migrates:
                migrations.migrate(conn)
            else:
                check_version(migrations.version(conn), migrations.LATEST, migrations.where(conn))
        self._schema_checked = True

    def savers(
        self, count: int, latest_cache: LatestCache | None = None, *, keep_checkpoints: int | None = None
    ) -> list[PostgresLifecycleSaver]:
        # The service's tables are there (setup): a thread's summary steps go with it, and what
        # --keep-checkpoints deletes is recorded.
        return [
            PostgresLifecycleSaver(
                self.pool,
                serde=VerbatimSerde(),
                keep_checkpoints=keep_checkpoints,
                pruned_table=PRUNED_TABLE,
                summaries_table=SUMMARIES_TABLE,
                latest_cache=latest_cache,
            )
            for _ in range(count)
        ]

    def outbox(self) -> PostgresOutbox:
        self._own_schema()
        return PostgresOutbox(self.pool)

    def _new_store(self) -> PagingPostgresStore:
        if "index" in self._store_options:
            require_pgvector(self.pool)
        default_ttl = (self._store_options.get("ttl") or {}).get("default_ttl")
        if default_ttl is not None and default_ttl != int(default_ttl):
            raise RuntimeError(f"store default_ttl {default_ttl:g}: PostgresStore keeps whole minutes")
        return PagingPostgresStore(self.pool, **self._store_options)

    def _setup_store(self, store: PagingPostgresStore) -> list[str]:
        """The store's ``setup()`` under its lock; one line per langgraph migration it applied."""
        with refused_at_start(self._where), locked_setup(self.url, STORE_LOCK_KEY, self.options):
            before = self._langgraph_versions("store_migrations")
            store.setup()
            changes = langgraph_changes(before, self._langgraph_versions("store_migrations"))
        self._store_set_up = True
        return changes

    def summaries(self) -> PostgresSummaryBook:
        """The book of running summaries (``storage/summaries.py``); its table is a migration."""
        self._own_schema()
        return PostgresSummaryBook(self.pool)

    def store(self) -> PagingPostgresStore:
        if self._store is None:
            store = self._new_store()
            if self.migrates and not self._store_set_up:
                self._setup_store(store)
            if (self._store_options.get("ttl") or {}).get("sweep_interval_minutes"):
                store.start_ttl_sweeper()
            self._store = store
        return self._store

    def ledger(self, *, window: Any, recorder: Any, worker_id: str) -> PostgresLedger:
        self._own_schema()
        return PostgresLedger(
            self.url, pool=self.pool, window=window, worker_id=worker_id, options=self.options
        )

    def storage(self, selection: Selection, *, messages_key: str) -> list[ThreadStorage]:
        return usage.measure(self.pool, selection, messages_key=messages_key)

    def ready(self, timeout: float) -> None:
        # Reads the checkpoint table under a lock timeout: a table another session locked (a sweep, a
        # migration, LOCK TABLE) is as unready as a database that does not answer. A server that accepts
        # no writes (a standby the URL led to, a primary being demoted) is not ready either: its
        # connections go, and the pool reconnects to the one that does.
        with self.pool.connection(timeout=timeout) as conn, conn.transaction():
            conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(timeout * 1000)}ms",))
            conn.execute("SELECT set_config('statement_timeout', %s, true)", (f"{int(timeout * 1000)}ms",))
            conn.execute("SELECT 1 FROM checkpoints LIMIT 1")
            if one_row(conn.execute(READ_ONLY_SQL))["read_only"]:
                raise ServerReadOnly("pg_is_in_recovery() or transaction_read_only")

    def wrap_exceptions(self) -> Any:
        return wrap_exceptions()

    def close(self, timeout: float = 5.0) -> None:
        if self._store is not None:
            self._store.stop_ttl_sweeper(timeout)
        self.pool.close(timeout=timeout)


#: PostgresStore keeps an item's TTL in an INT column: a refreshing read rounds a fractional TTL (0.4
#: minutes lasts 24 s, then 0 s after the first refresh). The service refuses TTLs that are not whole minutes.
STORE_TTL_WHOLE_MINUTES = True
#: PostgresStore reads every key of an object in a search filter as an operator: no nested objects.
STORE_NESTED_FILTERS = False


def store_refusal(url: str, *, index: bool, ttl: bool, postgres: Any = None) -> str | None:
    """Why this backend cannot serve the store settings: vector search needs the pgvector extension."""
    if not index:
        return None
    try:
        with connect(url, postgres) as conn:
            if conn.execute(HAS_PGVECTOR, prepare=False).fetchone() is None:
                return PGVECTOR_MISSING
    except psycopg.Error:
        return None  # unreachable or unfit now: the service's start-up checks say why, in one line
    return None


def open(  # noqa: A001
    url: str,
    *,
    pool_size: int,
    timeout: float,
    create: bool = True,
    migrate: bool = True,
    postgres: Any = None,
    store_options: Mapping[str, Any] | None = None,
) -> PostgresBackend:
    return PostgresBackend(
        url,
        pool_size=pool_size,
        timeout=timeout,
        migrate=migrate,
        options=postgres,
        store_options=store_options,
    )
