"""The SQLite backend (the embedded default): SqliteSaver with the lifecycle capabilities, the outbox, the
TTL ledger and SqliteStore, all in one file."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping
from contextlib import closing
from typing import Any

from reducing_saver.service.storage import sqlite_path
from reducing_saver.service.storage.lifecycle import PRUNED_TABLE
from reducing_saver.service.storage.migrations import (
    NO_MIGRATE,
    check_langgraph,
    check_version,
    langgraph_changes,
    refuse_newer,
)
from reducing_saver.service.storage.serde import VerbatimSerde
from reducing_saver.service.storage.sqlite import migrations, usage
from reducing_saver.service.storage.sqlite.connections import connect, setup_lock
from reducing_saver.service.storage.sqlite.errors import wrap_exceptions
from reducing_saver.service.storage.sqlite.ledger import SqliteLedger
from reducing_saver.service.storage.sqlite.outbox import SqliteOutbox
from reducing_saver.service.storage.sqlite.saver import SqliteLifecycleSaver
from reducing_saver.service.storage.sqlite.store import PagingSqliteStore
from reducing_saver.service.storage.sqlite.summaries import SqliteSummaryBook
from reducing_saver.service.storage.summaries import TABLE as SUMMARIES_TABLE
from reducing_saver.service.storage.usage import Selection, ThreadStorage

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

    def __init__(
        self,
        path: str,
        *,
        create: bool,
        migrate: bool = True,
        store_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = path
        self.migrates = migrate
        self._schema_checked = False
        self._store_set_up = False
        self._conn = connect(path, create=create)
        # The saver names the service's tables from the start: the backend hands it out only once they
        # are there (savers() after setup(), ledger() after _own_schema()).
        self.saver = SqliteLifecycleSaver(
            self._conn, serde=VerbatimSerde(), pruned_table=PRUNED_TABLE, summaries_table=SUMMARIES_TABLE
        )
        self._closers: list[Callable[[], object]] = [self._conn.close]
        self._store: PagingSqliteStore | None = None
        #: SqliteStore's ``index`` and ``ttl`` (``service/configuration/store.py``).
        self._store_options = dict(store_options or {})

    def setup(self) -> None:
        if self.migrates:
            self.migrate()
        else:
            self.check_schema()
        with setup_lock(self.path):
            self.saver.setup()  # SqliteSaver creates its tables on first use anyway

    def migrate(self) -> list[str]:
        # The service's tables first: a file of a later release is refused before anything changes.
        with closing(connect(self.path)) as conn:
            applied = [str(done) for done in migrations.migrate(conn)]
        self._schema_checked = True
        # Each process reports the langgraph versions it applied itself: read under the lock.
        with setup_lock(self.path):
            before = self._langgraph_versions()
            self.saver.setup()
            if self._store is not None:
                self._store.setup()
            else:
                with closing(connect(self.path)) as conn:
                    self._new_store(conn).setup()
            after = self._langgraph_versions()
        self._store_set_up = True
        return applied + langgraph_changes(before, after)

    def _langgraph_versions(self) -> dict[str, int]:
        with closing(connect(self.path)) as conn:
            return migrations.langgraph_versions(conn.cursor())

    def check_schema(self, why: str = NO_MIGRATE) -> None:
        with closing(connect(self.path)) as conn:
            cur = conn.cursor()
            check_version(migrations.version(cur), migrations.LATEST, self.path, why)
            check_langgraph(migrations.langgraph_versions(cur), migrations.LANGGRAPH_TABLES, self.path, why)
        self._schema_checked = True

    def refuse_newer_schema(self) -> None:
        with closing(connect(self.path)) as conn:
            refuse_newer(migrations.version(conn.cursor()), migrations.LATEST, self.path)

    def _own_schema(self) -> None:
        """The service's tables, migrated or checked once per backend (``outbox()``, ``ledger()``)."""
        if self._schema_checked:
            return
        with closing(connect(self.path)) as conn:
            if self.migrates:
                migrations.migrate(conn)
            else:
                check_version(migrations.version(conn.cursor()), migrations.LATEST, self.path)
        self._schema_checked = True

    def savers(
        self, count: int, latest_cache: Any = None, *, keep_checkpoints: int | None = None
    ) -> list[SqliteLifecycleSaver]:
        """The one saver (SQLite serializes writers), keeping ``keep_checkpoints``; ``latest_cache`` is not
        used: reads are local."""
        self.saver.set_keep_checkpoints(keep_checkpoints)
        return [self.saver]

    def outbox(self) -> SqliteOutbox:
        self._own_schema()
        outbox = SqliteOutbox(self.path)
        self._closers.append(outbox.close)
        return outbox

    def summaries(self) -> SqliteSummaryBook:
        """The book of running summaries (``storage/summaries.py``); its table is a migration."""
        self._own_schema()
        book = SqliteSummaryBook(self.path)
        self._closers.append(book.close)
        return book

    def _new_store(self, conn: sqlite3.Connection) -> PagingSqliteStore:
        if "index" in self._store_options and not hasattr(conn, "enable_load_extension"):
            raise RuntimeError(NO_LOADABLE_EXTENSIONS)
        options = dict(self._store_options)
        if "index" in options:
            # SqliteStore reads the paths to embed from "text_fields", not from IndexConfig's "fields" as
            # PostgresStore and InMemoryStore do (langgraph#8808): with "fields" alone it embeds whole
            # values.
            options["index"] = {**options["index"], "text_fields": options["index"]["fields"]}
        return PagingSqliteStore(conn, **options)

    def store(self) -> PagingSqliteStore:
        if self._store is None:
            conn = connect(self.path)
            self._closers.append(conn.close)
            store = self._new_store(conn)
            if self.migrates and not self._store_set_up:
                with setup_lock(self.path):
                    store.setup()
            if (self._store_options.get("ttl") or {}).get("sweep_interval_minutes"):
                store.start_ttl_sweeper()
                self._closers.append(store.stop_ttl_sweeper)
            self._store = store
        return self._store

    def ledger(self, *, window: Any, recorder: Any, worker_id: str) -> SqliteLedger:
        self._own_schema()
        return SqliteLedger(self.saver, window=window, recorder=recorder, worker_id=worker_id)

    def storage(self, selection: Selection, *, messages_key: str) -> list[ThreadStorage]:
        return usage.measure(self.path, selection, messages_key=messages_key)

    def ready(self, timeout: float) -> None:
        if not self.saver.lock.acquire(timeout=timeout):
            raise TimeoutError(f"the SQLite saver stayed busy for {timeout:g} s")
        try:
            self._conn.execute("SELECT 1 FROM checkpoints LIMIT 1")
        finally:
            self.saver.lock.release()

    def wrap_exceptions(self) -> Any:
        return wrap_exceptions()

    def close(self, timeout: float = 5.0) -> None:
        for close in reversed(self._closers):
            close()


#: SqliteStore keeps an item's TTL in minutes as REAL: fractions last, refreshes included.
STORE_TTL_WHOLE_MINUTES = False
#: SqliteStore reads every key of an object in a search filter as an operator: no nested objects.
STORE_NESTED_FILTERS = False


def store_refusal(url: str, *, index: bool, ttl: bool, postgres: Any = None) -> str | None:
    """Why this backend cannot serve the store settings: vector search needs a sqlite3 that loads
    extensions (sqlite-vec)."""
    if index:
        with closing(sqlite3.connect(":memory:")) as conn:
            if not hasattr(conn, "enable_load_extension"):
                return NO_LOADABLE_EXTENSIONS
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
) -> SqliteBackend:
    return SqliteBackend(sqlite_path(url), create=create, migrate=migrate, store_options=store_options)
