"""What SQLite's errors mean to a caller: sqlite3's errors become the storage errors of
:mod:`reducing_saver.service.storage` where they leave the backend (:func:`wrap_exceptions`)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

from reducing_saver.service.storage import DatabaseUnavailable, transient_test


@contextmanager
def wrap_exceptions() -> Iterator[None]:
    """Raise a file another connection kept locked past the busy timeout (``database is locked``) as
    :class:`DatabaseUnavailable`; any other error passes unchanged."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        if (reason := unavailable(exc)) is not None:
            raise DatabaseUnavailable(reason) from exc
        raise


@transient_test
def unavailable(exc: BaseException) -> str | None:
    """Why the database cannot serve now (a file locked past the busy timeout); ``None`` otherwise."""
    if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
        return f"the database is unavailable: SQLite: {exc}"
    return None
