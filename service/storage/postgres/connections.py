"""PostgreSQL connections: the one pool of a process, single connections, set-up locks, and what the
database's errors mean to a caller.

Every part of a service process (saver calls, recording pruned messages, delivery, the store, TTL
touches) borrows from the one pool :func:`open_pool` makes, so a process never holds more than
``pool_size`` connections. Borrowing waits at most ``timeout`` seconds: past that the pool raises
``PoolTimeout``, which :func:`unavailable` reads as "the database is unavailable" (a 503), instead of
psycopg_pool's default of 30 s.

When the database goes away, every connection in use fails (``OperationalError``, a 503) and the pool
replaces it in the background. psycopg_pool waits 1, 2, 4, 8... seconds between reconnection attempts,
so after an outage of seconds the service would answer 503 for as long again once the database is
back; :class:`ServicePool` keeps trying every :data:`RECONNECT_MAX_DELAY` seconds at most instead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.rows import dict_row, tuple_row
from psycopg_pool import ConnectionPool, PoolTimeout
from psycopg_pool.base import AttemptWithBackoff

from reducing_saver.service.storage import StorageError, redact_url

#: Advisory lock keys, one per set-up that replicas starting together must not run at once. Two-key
#: locks (``copy_thread``'s) live apart from these one-key ones.
SAVER_LOCK_KEY = 0x7265647563696E67  # "reducing": PostgresSaver's migrations
#: The service's own migrations (``migrations.py``). The first release created the outbox under this
#: key, so one of its processes starting during an upgrade waits for the migrations to finish.
SCHEMA_LOCK_KEY = 0x72732D6F7574626F  # "rs-outbo"
STORE_LOCK_KEY = 0x72732D73746F7265  # "rs-store": PostgresStore's migrations
COPY_LOCK_CLASS = 0x72736374  # "rsct"

#: Seconds between attempts while another process holds a set-up lock.
POLL_SECONDS = 0.05

#: What PostgresSaver's own ``from_conn_string`` opens connections with.
CONNECTION_KWARGS = {"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row}


#: The one server encoding the service accepts: under SQL_ASCII psycopg returns text as bytes, and
#: under LATIN1 and the like a message's characters beyond the encoding fail at run time (a 500).
REQUIRED_ENCODING = "UTF8"


def check_database(url: str, *, timeout: float) -> None:
    """Connect once, within ``timeout`` seconds, and check the database's encoding.

    Done before the pool opens: psycopg_pool retries a failing connection in the background for its
    whole wait, logging a warning per attempt, then raises an error that does not say why.

    Raises:
        StorageError: If the server cannot be reached, refuses the connection (no such database, no such
            role, a wrong password) or the database's encoding is not UTF-8; one line, naming it.
    """
    where = redact_url(url)
    try:
        # connect_timeout counts whole seconds (libpq); below 2 it is raised to 2.
        with psycopg.connect(url, autocommit=True, connect_timeout=max(2, math.ceil(timeout))) as conn:
            # From the start-up parameters, not SHOW: under SQL_ASCII a query answers text as bytes.
            encoding = conn.info.parameter_status("server_encoding") or "unknown"
    except psycopg.Error as exc:
        raise StorageError(f"cannot connect to PostgreSQL at {where}: {_first_line(exc)}") from None
    if encoding.upper() != REQUIRED_ENCODING:
        raise StorageError(
            f"the PostgreSQL database at {where} uses the encoding {encoding}; reducing-saver needs UTF8 "
            "(CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0)"
        )


def _first_line(exc: BaseException) -> str:
    lines = [" ".join(line.split()) for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


#: The longest wait between two attempts to replace a broken pooled connection: how late, at most, the
#: service notices that the database is back. One connection attempt a second per lost connection costs
#: a database that is down nothing.
RECONNECT_MAX_DELAY = 1.0


#: How long sent bytes may stay unacknowledged before the kernel drops the connection (milliseconds).
TCP_USER_TIMEOUT_MS = 15_000


class _PromptReconnect(AttemptWithBackoff):
    """psycopg_pool's reconnection backoff, capped at :data:`RECONNECT_MAX_DELAY`."""

    def update_delay(self, now: float) -> None:
        super().update_delay(now)
        self.delay = min(self.delay, RECONNECT_MAX_DELAY)


class ServicePool(ConnectionPool):
    """A ``ConnectionPool`` that replaces broken connections at most a second apart, not 1, 2, 4, 8 s...

    psycopg_pool has no setting for it: the attempt object its reconnection starts with is swapped for
    one whose delay is capped; it still gives up after ``reconnect_timeout`` as psycopg_pool does (and
    grows again on demand after that).
    """

    def _add_connection(self, attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        if attempt is None:
            attempt = _PromptReconnect(timeout=self.reconnect_timeout)
        super()._add_connection(attempt, growing=growing)


def pool_connection_kwargs(timeout: float) -> dict[str, Any]:
    """What the pool opens its connections with: PostgresSaver's settings, plus a bound on connecting.

    Without libpq's ``connect_timeout`` a connection attempt that gets no answer (a partition, a
    firewall dropping packets) waits forever, and psycopg_pool's few maintenance threads with it: the
    pool would never replace its connections, even once the database answers again. Keepalives let the
    kernel notice a peer that went silent under an idle connection, and ``tcp_user_timeout`` one that
    stopped acknowledging what was sent (a statement sent into a partition would otherwise wait for the
    kernel's retransmissions, about 15 minutes).
    """
    return {
        **CONNECTION_KWARGS,
        "connect_timeout": max(2, math.ceil(timeout)),  # libpq's minimum is 2 s
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "tcp_user_timeout": TCP_USER_TIMEOUT_MS,
    }


def open_pool(url: str, *, size: int, timeout: float, name: str = "reducing-saver") -> ConnectionPool:
    """The process's pool of ``size`` autocommit, dict-row connections, open and filled.

    Args:
        url: The database URL.
        size: Connections (minimum and maximum: a service keeps them open).
        timeout: Seconds a borrower waits for a connection before ``PoolTimeout``; also how long opening
            waits for the first connections, and (at least 2 s) how long one connection attempt may take.
        name: The pool's name in psycopg_pool's logs.
    """
    pool = ServicePool(
        url,
        min_size=size,
        max_size=size,
        kwargs=pool_connection_kwargs(timeout),
        open=False,
        name=name,
        timeout=timeout,
    )
    try:
        pool.open(wait=True, timeout=timeout)
    except BaseException:
        pool.close(timeout=0)  # its threads would go on connecting in the background
        raise
    return pool


def connect(url: str) -> psycopg.Connection:
    """One connection of its own (set-up locks, a sweep's transactions), set up as the pool's are."""
    return psycopg.connect(url, **CONNECTION_KWARGS)


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


@contextmanager
def locked_setup(url: str, key: int) -> Iterator[None]:
    """:func:`setup_lock` on a connection of its own: the set-up inside may take pool connections."""
    with psycopg.connect(url, autocommit=True) as conn, setup_lock(conn, key):
        yield


def refused_value(exc: Exception) -> str:
    """The 422 detail for a value the database refused to store or compare (SQLSTATE class 22, a
    ``psycopg.DataError``: PostgreSQL's text and JSONB cannot hold U+0000, say)."""
    diag = getattr(exc, "diag", None)
    reason = (getattr(diag, "message_primary", None) or str(exc).splitlines()[0]).rstrip(".")
    detail = getattr(diag, "message_detail", None)
    text = f"PostgreSQL refused a value of this request: {reason}"
    if detail:
        text += f" ({detail.rstrip('.')})"
    if "\\u0000" in text:
        text += "; PostgreSQL JSON cannot hold the NUL character (U+0000) in keys or strings"
    return text


def unavailable(exc: BaseException) -> str | None:
    """Why the database cannot serve right now, for a 503; ``None`` when ``exc`` is not that.

    No connection within the pool's timeout, a connection refused or broken, the server shutting down,
    a statement cancelled by a timeout: the call may succeed later, unchanged.
    """
    if isinstance(exc, PoolTimeout):
        return f"the database is unavailable: no connection within the timeout ({exc})"
    if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"the database is unavailable: {type(exc).__name__}: {first}"
    return None


#: Why semantic search cannot start on a PostgreSQL server without pgvector (one line).
PGVECTOR_MISSING = (
    "--store-index needs the pgvector extension on PostgreSQL, and this server has none "
    "(pg_available_extensions lists no 'vector'): install pgvector, or start without --store-index"
)
HAS_PGVECTOR = "SELECT 1 FROM pg_available_extensions WHERE name = 'vector'"


def require_pgvector(pool: Any) -> None:
    """Raise ``RuntimeError`` (:data:`PGVECTOR_MISSING`) unless the server offers pgvector."""
    with pool.connection() as conn:
        if conn.execute(HAS_PGVECTOR).fetchone() is None:
            raise RuntimeError(PGVECTOR_MISSING)
