"""The one way the service opens its SQLite file."""

from __future__ import annotations

import fcntl
import logging
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from reducing_saver.service.storage import StorageError

logger = logging.getLogger(__name__)

#: How long a statement waits for another connection's write lock before ``database is locked``.
BUSY_TIMEOUT_SECONDS = 30.0


def connect(path: str | Path, *, create: bool = True) -> sqlite3.Connection:
    """An autocommit connection to the SQLite file at ``path``, usable from any thread, in WAL mode.

    Args:
        path: The file.
        create: Create the file when missing, and its folder (said in a log line: a mistyped path then
            shows up in the log, not as a silently new database); otherwise a missing file raises.

    Raises:
        StorageError: If ``create`` is false and there is no such file, or the file or its folder cannot
            be created or opened.
    """
    path = Path(path)
    where = path.absolute()
    if not path.exists():
        if not create:
            raise StorageError(
                f"the SQLite database {where} does not exist (only serve and worker create one)"
            )
        if not path.parent.exists():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StorageError(
                    f"cannot create the folder {where.parent} for the SQLite database: {exc.strerror or exc}"
                ) from None
            logger.warning("created the folder %s for the SQLite database %s", where.parent, path.name)
    try:
        conn = sqlite3.connect(
            path, check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_SECONDS
        )
        conn.execute("PRAGMA journal_mode=WAL")
    except sqlite3.Error as exc:
        raise StorageError(f"cannot open the SQLite database {where}: {exc}") from None
    return conn


@contextmanager
def setup_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on the file ``<path>.lock`` (created when missing) for the block.

    Processes setting up the same SQLite file take turns, as PostgreSQL's set-up locks make them:
    langgraph's ``SqliteSaver`` and ``SqliteStore`` set-ups (``ALTER TABLE ... ADD COLUMN`` after reading
    a version) fail when two run at once. The service's own migrations need no such lock (one
    ``BEGIN IMMEDIATE`` transaction); the lock is a file of its own because closing any descriptor of
    the database file would drop the locks SQLite holds on it in this process.
    """
    with open(f"{path}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
