"""What the SQLite backend hands SqliteStore (the store's behaviour runs end to end in
tests/e2e/test_store_index_ttl.py, in the Docker image where this Python cannot load sqlite-vec)."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

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
    backend = SqliteBackend(str(tmp_path / "db.sqlite"), create=True)
    backend.store_options = {"index": {"dims": DIMS, "embed": embed, "fields": ["text", "data.content"]}}
    try:
        with closing(sqlite3.connect(":memory:", factory=_LoadsExtensions)) as conn:
            store = backend._new_store(conn)
            assert [path for path, _ in store.index_config["__tokenized_fields"]] == ["text", "data.content"]
    finally:
        backend.close()
