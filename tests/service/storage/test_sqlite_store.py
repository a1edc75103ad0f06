"""What the SQLite backend hands SqliteStore, and what each backend's store is made with (the store's
behaviour runs end to end in tests/e2e/test_store_index_ttl.py, in the Docker image where this Python
cannot load sqlite-vec)."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from reducing_saver.service.storage import open_backend
from reducing_saver.service.storage.sqlite import SqliteBackend
from tests.support.embeddings import DIMS, embed


class _LoadsExtensions(sqlite3.Connection):
    """Passes the backend's check for a sqlite3 that loads extensions; SqliteStore's constructor loads
    none (its set-up and its searches do), it only reads the index settings."""

    def enable_load_extension(self, enabled: bool) -> None:
        raise AssertionError("the constructor loads no extension")


def test_sqlite_store_embeds_the_configured_fields(tmp_path: Path) -> None:
    """SqliteStore reads the paths to embed from ``text_fields`` (langgraph#8808): given IndexConfig's
    ``fields`` alone it embedded whole values, and a query equal to an item's text did not find it."""
    index = {"dims": DIMS, "embed": embed, "fields": ["text", "data.content"]}
    backend = SqliteBackend(str(tmp_path / "db.sqlite"), create=True, store_options={"index": index})
    try:
        with closing(sqlite3.connect(":memory:", factory=_LoadsExtensions)) as conn:
            store = backend._new_store(conn)
            assert [path for path, _ in store.index_config["__tokenized_fields"]] == ["text", "data.content"]
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_the_store_gets_the_options_the_backend_was_opened_with(kind: str, tmp_path: Path, request) -> None:
    """The store's settings are an argument of opening the backend (``open_backend(store_options=...)``),
    not an attribute set on it afterwards."""
    ttl = {"default_ttl": 5.0, "refresh_on_read": False}
    url = f"sqlite:///{tmp_path / 'db.sqlite'}" if kind == "sqlite" else request.getfixturevalue("fresh_pg")
    backend = open_backend(url, store_options={"ttl": ttl})
    try:
        backend.setup()
        assert backend.store().ttl_config == ttl
    finally:
        backend.close()
    backend = open_backend(url)
    try:
        assert backend.store().ttl_config is None
    finally:
        backend.close()


def test_the_memory_store_refuses_the_ttl_it_was_opened_with() -> None:
    backend = open_backend("memory://", store_options={"ttl": {"default_ttl": 5.0}})
    with pytest.raises(RuntimeError, match="--store-ttl needs PostgreSQL or SQLite"):
        backend.store()
    assert open_backend("memory://").store() is not None
