"""What SQLite's errors mean to a caller: sqlite3's errors become the storage errors of
:mod:`reducing_saver.service.storage` where they leave the backend (:func:`wrap_exceptions`)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

from reducing_saver.service.storage import DatabaseUnavailable


@contextmanager
def wrap_exceptions() -> Iterator[None]:
    """Raise a file another connection kept locked past the busy timeout (``database is locked``) as
    :class:`DatabaseUnavailable`; any other error passes unchanged."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc):
            raise DatabaseUnavailable(f"the database is unavailable: SQLite: {exc}") from exc
        raise
