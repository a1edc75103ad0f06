"""The in-memory backend (``memory://``, tests): InMemorySaver with the lifecycle capabilities, an outbox, a
TTL ledger and InMemoryStore, all inside the service process."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

from reducing_saver.service.storage.inmemory import usage
from reducing_saver.service.storage.inmemory.ledger import MemoryLedger
from reducing_saver.service.storage.inmemory.outbox import MemoryOutbox
from reducing_saver.service.storage.inmemory.saver import InMemoryLifecycleSaver
from reducing_saver.service.storage.inmemory.store import PagingInMemoryStore
from reducing_saver.service.storage.inmemory.summaries import MemoryBook
from reducing_saver.service.storage.serde import VerbatimSerde
from reducing_saver.service.storage.usage import Selection, ThreadStorage


class MemoryBackend:
    """See :class:`reducing_saver.service.storage.Backend`. One saver, every call under its lock."""

    kind = "memory"
    pool = None
    migrates = True

    def __init__(self, store_options: Mapping[str, Any] | None = None) -> None:
        self.saver = InMemoryLifecycleSaver(serde=VerbatimSerde())
        self._outbox = MemoryOutbox()
        self._summaries: MemoryBook | None = None
        self._store: PagingInMemoryStore | None = None
        #: InMemoryStore's ``index`` (``service/configuration/store.py``).
        self._store_options = dict(store_options or {})

    def setup(self) -> None:
        """Nothing to create."""

    def migrate(self) -> list[str]:
        """Nothing to migrate: the process holds everything."""
        return []

    def check_schema(self, why: str = "") -> None:
        """Nothing to check."""

    def refuse_newer_schema(self) -> None:
        """Nothing to check."""

    def savers(
        self, count: int, latest_cache: Any = None, *, keep_checkpoints: int | None = None
    ) -> list[InMemoryLifecycleSaver]:
        """The one saver, keeping ``keep_checkpoints``; ``latest_cache`` is not used: every read is from
        memory already."""
        self.saver.set_keep_checkpoints(keep_checkpoints)
        return [self.saver]

    def outbox(self) -> MemoryOutbox:
        return self._outbox

    def summaries(self) -> MemoryBook:
        """The book of running summaries (``storage/summaries.py``), one per backend."""
        if self._summaries is None:
            saver = self.saver
            self._summaries = MemoryBook(lambda thread_id, ns: bool(saver.storage.get(thread_id, {}).get(ns)))
            saver.summary_book = self._summaries  # namespaces the saver removes lose their steps at once
        return self._summaries

    def store(self) -> PagingInMemoryStore:
        if self._store is None:
            if "ttl" in self._store_options:
                raise RuntimeError("--store-ttl needs PostgreSQL or SQLite: InMemoryStore has no TTL")
            self._store = PagingInMemoryStore(**self._store_options)
        return self._store

    def ledger(self, *, window: Any, recorder: Any, worker_id: str) -> MemoryLedger:
        return MemoryLedger(self.saver, window=window, recorder=recorder, worker_id=worker_id)

    def storage(self, selection: Selection, *, messages_key: str) -> list[ThreadStorage]:
        return usage.measure(self.saver, self._outbox, self._store, selection, messages_key=messages_key)

    def ready(self, timeout: float) -> None:
        if not self.saver.lock.acquire(timeout=timeout):
            raise TimeoutError(f"the in-memory saver stayed busy for {timeout:g} s")
        self.saver.lock.release()

    def wrap_exceptions(self) -> Any:
        """No driver: nothing to map."""
        return nullcontext()

    def close(self, timeout: float = 5.0) -> None:
        """Nothing to close."""


#: InMemoryStore has no TTL (refused with --store-ttl).
STORE_TTL_WHOLE_MINUTES = False
#: InMemoryStore matches an object in a search filter by containment, nested objects included.
STORE_NESTED_FILTERS = True


def store_refusal(url: str, *, index: bool, ttl: bool, postgres: Any = None) -> str | None:
    """Why this backend cannot serve the store settings: InMemoryStore has no TTL."""
    return "--store-ttl needs PostgreSQL or SQLite: InMemoryStore has no TTL" if ttl else None


def open(  # noqa: A001
    url: str,
    *,
    pool_size: int,
    timeout: float,
    create: bool = True,
    migrate: bool = True,
    postgres: Any = None,
    store_options: Mapping[str, Any] | None = None,
) -> MemoryBackend:
    return MemoryBackend(store_options)
