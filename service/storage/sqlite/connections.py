"""The one way the service opens its SQLite file."""

from __future__ import annotations

import sqlite3
from pathlib import Path

#: How long a statement waits for another connection's write lock before ``database is locked``.
BUSY_TIMEOUT_SECONDS = 30.0


def connect(path: str | Path, *, create: bool = True) -> sqlite3.Connection:
    """An autocommit connection to the SQLite file at ``path``, usable from any thread, in WAL mode.

    Args:
        path: The file.
        create: Create the file (and its folder) when missing; otherwise a missing file raises.

    Raises:
        FileNotFoundError: If ``create`` is false and there is no such file.
    """
    path = Path(path)
    if not path.exists():
        if not create:
            raise FileNotFoundError(f"the SQLite database {path} does not exist")
        path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_SECONDS)
    conn.execute("PRAGMA journal_mode=WAL")
    return conn
