"""Backend parts on their own, for tests that drive an outbox or a store without a service."""

from __future__ import annotations

from typing import Any

from reducing_saver.service.storage import open_backend
from reducing_saver.service.storage.postgres.connections import open_pool
from reducing_saver.service.storage.postgres.outbox import PostgresOutbox


class OwnPoolOutbox(PostgresOutbox):
    """A PostgreSQL outbox over a pool of its own (a service shares its process's one pool)."""

    def __init__(self, url: str, pool_size: int = 2) -> None:
        super().__init__(open_pool(url, size=pool_size, timeout=30.0, name="test-outbox"))
        self.setup()

    def close(self) -> None:
        self._pool.close()


def open_outbox(url: str, pool_size: int = 2) -> Any:
    """The outbox of the backend ``url`` names, set up; ``close()`` closes what it opened."""
    if url.startswith("postgres"):
        return OwnPoolOutbox(url, pool_size)
    backend = open_backend(url)
    outbox = backend.outbox()
    outbox.close = backend.close  # type: ignore[method-assign]
    return outbox


def open_store(url: str, pool_size: int = 2) -> tuple[Any, Any]:
    """``(store, close)`` for the backend ``url`` names, set up."""
    backend = open_backend(url, pool_size=pool_size, timeout=30.0)
    return backend.store(), backend.close
