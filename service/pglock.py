"""The advisory lock that keeps replicas starting together from running the same migrations at once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from psycopg.rows import tuple_row

#: Seconds between attempts while another process holds the lock.
POLL_SECONDS = 0.05


@contextmanager
def setup_lock(conn: Any, key: int) -> Iterator[None]:
    """Hold session advisory lock ``key`` on ``conn`` (an autocommit psycopg connection) for the block.

    Waits by polling ``pg_try_advisory_lock`` rather than blocking in ``pg_advisory_lock``: a session
    blocked in a statement holds a transaction open, and the holder's ``CREATE INDEX CONCURRENTLY``
    (PostgresSaver's migrations run some) waits for every open transaction to end, so two processes
    starting together would wait for each other forever.
    """
    with conn.cursor(row_factory=tuple_row) as cur:
        while not cur.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]:
            time.sleep(POLL_SECONDS)
    try:
        yield
    finally:
        conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
