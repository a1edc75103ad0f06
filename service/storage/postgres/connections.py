"""PostgreSQL connections: the one pool of a process, single connections, set-up locks (what the
database's errors mean to a caller is ``errors.py``).

Every part of a process borrows from the one pool :func:`open_pool` makes (at most ``pool_size``
connections, a bounded wait, then a 503); every connection is opened by :func:`connection_kwargs` from the
``postgres_*`` settings; :class:`ServicePool` reconnects quickly after an outage, checks idle connections
and drops them after a failover. docs/operations.md ("Connection budget", "Running on managed PostgreSQL")
says why.
"""

from __future__ import annotations

import logging
import math
import os
import time
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg.rows import DictRow, Row, dict_row, tuple_row
from psycopg_pool import ConnectionPool
from psycopg_pool.base import AttemptWithBackoff

from reducing_saver.service.storage import PostgresSettings, StorageError, redact_url
from reducing_saver.service.storage.postgres.errors import (
    PREPARED_STATEMENT_ERRORS,
    PREPARED_STATEMENTS_ADVICE,
    READ_ONLY_ERRORS,
    first_line,
    read_only_refusal,
)

logger = logging.getLogger(__name__)

#: Advisory lock keys, one per set-up that replicas starting together must not run at once. Two-key
#: locks (``copy_thread``'s) live apart from these one-key ones.
SAVER_LOCK_KEY = 0x7265647563696E67  # "reducing": PostgresSaver's migrations
#: The service's own migrations (``migrations.py``). The first release created the outbox under this
#: key (a session-level lock, which conflicts with the transaction-level one taken now), so one of its
#: processes starting during an upgrade waits for the migrations to finish.
SCHEMA_LOCK_KEY = 0x72732D6F7574626F  # "rs-outbo"
STORE_LOCK_KEY = 0x72732D73746F7265  # "rs-store": PostgresStore's migrations
COPY_LOCK_CLASS = 0x72736374  # "rsct"

#: Seconds between attempts while another process holds a set-up lock.
POLL_SECONDS = 0.05

#: The one server encoding the service accepts: under SQL_ASCII psycopg returns text as bytes, and
#: under LATIN1 and the like a message's characters beyond the encoding fail at run time (a 500).
REQUIRED_ENCODING = "UTF8"

#: The longest wait between two attempts to replace a broken pooled connection: how late, at most, the
#: service notices that the database is back. One connection attempt a second per lost connection costs
#: a database that is down nothing.
RECONNECT_MAX_DELAY = 1.0

#: Whether the server refuses writes, asked in one round trip (a standby is in recovery; a primary may
#: be read-only by default_transaction_read_only).
READ_ONLY_SQL = "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on' AS read_only"


def postgres_settings(options: PostgresSettings | None) -> PostgresSettings:
    """``options``, or the settings' defaults."""
    return options if options is not None else PostgresSettings()


def connection_kwargs(
    url: str, options: PostgresSettings | None = None, *, timeout: float = 5.0
) -> dict[str, Any]:
    """What every connection the service opens is opened with, besides the URL.

    PostgresSaver's own settings (autocommit, dict rows), prepared statements as the settings say, a
    bound on connecting, TCP keepalives and a TCP user timeout, and ``target_session_attrs=read-write``
    unless the URL (or ``PGTARGETSESSIONATTRS``) names its own.

    Without libpq's ``connect_timeout`` a connection attempt that gets no answer (a partition, a firewall
    dropping packets) waits forever, and psycopg_pool's few maintenance threads with it: the pool would
    never replace its connections, even once the database answers again. Keepalives let the kernel notice
    a peer that went silent under an idle connection, and ``tcp_user_timeout`` one that stopped
    acknowledging what was sent (a statement sent into a partition would otherwise wait for the kernel's
    retransmissions, about 15 minutes).

    Args:
        url: The database URL (a ``postgresql://`` URL or a conninfo string).
        options: The ``postgres_*`` settings; their defaults when omitted.
        timeout: Seconds one connection attempt may take (libpq counts whole seconds, at least 2).
    """
    options = postgres_settings(options)
    kwargs: dict[str, Any] = {
        "autocommit": True,
        "prepare_threshold": 0 if options.postgres_prepared_statements else None,
        "row_factory": dict_row,
        "connect_timeout": max(2, math.ceil(timeout)),
        "keepalives": 1,
        "keepalives_idle": options.postgres_keepalives_idle_seconds,
        "keepalives_interval": options.postgres_keepalives_interval_seconds,
        "keepalives_count": options.postgres_keepalives_count,
        "tcp_user_timeout": int(options.postgres_tcp_user_timeout_seconds * 1000),
    }
    if not names_session_attrs(url):
        kwargs["target_session_attrs"] = "read-write"
    return kwargs


def names_session_attrs(url: str) -> bool:
    """Whether the URL (or the environment, ``PGTARGETSESSIONATTRS``) says which server of its hosts to use."""
    try:
        named = "target_session_attrs" in conninfo_to_dict(url)
    except psycopg.ProgrammingError:  # not a URL libpq reads: psycopg.connect will say so
        named = False
    return named or bool(os.environ.get("PGTARGETSESSIONATTRS"))


def connect(url: str, options: PostgresSettings | None = None, *, timeout: float = 5.0) -> psycopg.Connection:
    """One connection of its own (set-up locks, a sweep's transactions), opened as the pool's are."""
    return psycopg.connect(url, **connection_kwargs(url, options, timeout=timeout))


def check_database(url: str, *, timeout: float, options: PostgresSettings | None = None) -> None:
    """Connect once, within ``timeout`` seconds, and check that the database can serve the service.

    Done before the pool opens: psycopg_pool retries a failing connection in the background for its
    whole wait, logging a warning per attempt, then raises an error that does not say why.

    Raises:
        StorageError: If the server cannot be reached, refuses the connection (no such database, no such
            role, a wrong password), accepts no writes (a standby) or the database's encoding is not
            UTF-8; one line, naming it.
    """
    where = redact_url(url)
    kwargs = connection_kwargs(url, options, timeout=timeout)
    read_only = False
    try:
        with psycopg.connect(url, **kwargs) as conn:
            # From the start-up parameters, not SHOW: under SQL_ASCII a query answers text as bytes.
            encoding = conn.info.parameter_status("server_encoding") or "unknown"
            if encoding.upper() == REQUIRED_ENCODING:
                read_only = _read_only(conn)
                if kwargs["prepare_threshold"] is not None and not read_only:
                    _check_prepared_statements(url, kwargs, conn)
    except PREPARED_STATEMENT_ERRORS as exc:
        raise StorageError(
            f"PostgreSQL at {where}: {first_line(exc)}: {PREPARED_STATEMENTS_ADVICE}"
        ) from None
    except psycopg.Error as exc:
        # libpq refused every server it reached for being read-only ("session is read-only"): say which
        # kind of server that was, rather than quote libpq (asked only then: an unreachable host would
        # cost a second connect timeout).
        if "read-only" in str(exc) and _only_read_only_servers(url, kwargs):
            raise StorageError(read_only_refusal(where)) from None
        raise StorageError(f"cannot connect to PostgreSQL at {where}: {first_line(exc)}") from None
    if encoding.upper() != REQUIRED_ENCODING:
        raise StorageError(
            f"the PostgreSQL database at {where} uses the encoding {encoding}; reducing-saver needs UTF8 "
            "(CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0)"
        )
    if read_only:
        raise StorageError(read_only_refusal(where))


def _read_only(conn: psycopg.Connection) -> bool:
    with conn.cursor(row_factory=tuple_row) as cur:
        return bool(one_row(cur.execute(READ_ONLY_SQL, prepare=False))[0])


def one_row(cursor: psycopg.Cursor[Row]) -> Row:
    """The row of a statement that always answers one (``SELECT <expressions>``), which psycopg's
    ``fetchone`` types as optional."""
    row = cursor.fetchone()
    if row is None:
        raise StorageError("PostgreSQL answered no row to a statement that always answers one")
    return row


def _check_prepared_statements(url: str, kwargs: dict[str, Any], first: psycopg.Connection) -> None:
    """Raise when a statement prepared by one connection is not that connection's alone: the driver's
    error for a name taken or missing (``errors.PREPARED_STATEMENT_ERRORS``), or ``StorageError`` when one
    connection's statement ran another's.

    Behind a pooler in transaction mode that does not keep prepared statements per client, two client
    connections share server connections, and psycopg names its statements alike on each (``_pg3_0``...).
    A pooler hands the most recently freed server connection out first, so preparing on ``first``, then on
    a second connection, then running ``first``'s again shows it: the second one finds the name taken, or
    ``first``'s statement runs the second one's. Directly on PostgreSQL, or through a pooler in session
    mode (or PgBouncer 1.21+ with ``max_prepared_statements``), each connection keeps its own.
    """
    with first.cursor(row_factory=tuple_row) as cur:
        cur.execute("SELECT 1", prepare=True)
        with psycopg.connect(url, **kwargs) as second, second.cursor(row_factory=tuple_row) as other:
            other.execute("SELECT 2", prepare=True)
        answer = one_row(cur.execute("SELECT 1", prepare=True))[0]
    if answer != 1:
        raise StorageError(
            f"PostgreSQL at {redact_url(url)} ran another connection's prepared statement: "
            f"{PREPARED_STATEMENTS_ADVICE}"
        )


def _only_read_only_servers(url: str, kwargs: dict[str, Any]) -> bool:
    """After a refused read-write connection: whether a server of the URL answers, read-only (a standby)."""
    try:
        with psycopg.connect(url, **{**kwargs, "target_session_attrs": "any"}) as conn:
            return _read_only(conn)
    except psycopg.Error:
        return False


class _PromptReconnect(AttemptWithBackoff):
    """psycopg_pool's reconnection backoff, capped at :data:`RECONNECT_MAX_DELAY`."""

    def update_delay(self, now: float) -> None:
        super().update_delay(now)
        self.delay = min(self.delay, RECONNECT_MAX_DELAY)


class ServicePool(ConnectionPool[psycopg.Connection[DictRow]]):
    """A ``ConnectionPool`` that replaces broken connections at most a second apart, checks idle
    connections before lending them, and reconnects when the server stops taking writes.

    * Reconnection: psycopg_pool has no setting for it: the attempt object its reconnection starts with is
      swapped for one whose delay is capped; it still gives up after ``reconnect_timeout`` as psycopg_pool
      does (and grows again on demand after that).
    * Idle connections: one idle for ``check_idle`` seconds or more is checked with one round trip
      (psycopg_pool's ``check_connection``) before it is lent; a broken one is replaced and the next one
      lent at once, so a connection a load balancer or proxy cut while idle is never seen by a caller.
      (psycopg_pool's own ``check`` waits a second, then two..., between two failed checks.)
    * A server that accepts no writes (``ReadOnlySqlTransaction``: a standby, a demoted primary): every
      connection is dropped (``drain``), so the pool reconnects to the server that takes writes.
    * Prepared statements lost to a pooler in transaction mode: the pool stops preparing statements (new
      connections are opened with ``prepare_threshold=None``) and drops its connections; the error is
      logged once, naming the setting to start that way.

    Args:
        check_idle: Seconds of idleness after which a connection is checked before it is lent (0: always).
        Other arguments: as ``ConnectionPool``'s (``configure`` is the pool's own).
    """

    def __init__(self, conninfo: str = "", *, check_idle: float = 1.0, **kwargs: Any) -> None:
        self.check_idle = check_idle
        #: When each connection was made or last given back.
        self._idle_since: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
        self._stopped_preparing = False
        #: Idle connections found broken by the check before lending, and replaced.
        self.replaced_idle = 0
        super().__init__(conninfo, configure=self._note_idle, **kwargs)

    def _add_connection(self, attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        if attempt is None:
            attempt = _PromptReconnect(timeout=self.reconnect_timeout)
        super()._add_connection(attempt, growing=growing)

    def _note_idle(self, conn: psycopg.Connection[DictRow]) -> None:
        self._idle_since[conn] = time.monotonic()

    def getconn(self, timeout: float | None = None) -> psycopg.Connection[DictRow]:
        """A connection, checked first if it was idle for ``check_idle`` seconds; broken ones are replaced
        and the next one taken, within the same ``timeout``."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            conn = super().getconn(timeout=max(deadline - time.monotonic(), 0.0))
            if time.monotonic() - self._idle_since.get(conn, 0.0) < self.check_idle or self._works(conn):
                return conn
            self.replaced_idle += 1
            # Handed back broken: the pool opens a replacement in the background (logged at INFO only).
            self._putconn(conn, from_getconn=True)

    @staticmethod
    def _works(conn: psycopg.Connection[DictRow]) -> bool:
        try:
            ConnectionPool.check_connection(conn)
        except psycopg.Error:
            conn.close()
            return False
        return True

    def connection(  # type: ignore[override]  # a context manager, not a generator's
        self, timeout: float | None = None
    ) -> AbstractContextManager[psycopg.Connection[DictRow]]:
        """As ``ConnectionPool.connection``; an error that shows the pool's connections unfit drops them."""
        return _Lent(self, timeout)

    def _reconnect_all(self, conn: psycopg.Connection[DictRow]) -> None:
        """Close ``conn`` (the pool replaces it when it comes back) and every other connection of the pool
        (idle ones now, lent ones when they come back): they all reached the same server."""
        conn.close()
        self.drain()

    def _stop_preparing(self, exc: BaseException) -> None:
        # open_pool's kwargs are a dict (psycopg_pool takes a callable too, which this pool is never given).
        kwargs = self.kwargs
        if (
            self._stopped_preparing
            or not isinstance(kwargs, dict)
            or kwargs.get("prepare_threshold", 0) is None
        ):
            return
        self._stopped_preparing = True
        self.kwargs = {**kwargs, "prepare_threshold": None}
        logger.error(
            "PostgreSQL lost a prepared statement of this process (%s): %s; this process prepares no more "
            "statements",
            first_line(exc),
            PREPARED_STATEMENTS_ADVICE,
        )


class _Lent:
    """``ServicePool.connection``: a connection of the pool for the block, given back at its end; an error
    inside it that shows the pool's connections unfit drops them all (a server taking no writes, prepared
    statements lost), and the connection's idle time starts.

    What ``ConnectionPool.connection`` does, by the pool's ``getconn`` and ``putconn``: the connection's
    own context exit (commit, or roll back after an error) runs when the block leaves a transaction open;
    on an idle connection (the pool's are autocommit: every block the service runs ends its own
    transactions) it would do nothing. A class rather than generators around the pool's context manager
    and the connection's: every saver call borrows a connection, and this way costs half as much.
    """

    __slots__ = ("_conn", "_pool", "_timeout")

    def __init__(self, pool: ServicePool, timeout: float | None) -> None:
        self._pool, self._timeout = pool, timeout

    def __enter__(self) -> psycopg.Connection[DictRow]:
        self._conn = self._pool.getconn(self._timeout)
        return self._conn

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> None:
        pool, conn = self._pool, self._conn
        try:
            if isinstance(error, READ_ONLY_ERRORS):
                pool._reconnect_all(conn)
            elif isinstance(error, PREPARED_STATEMENT_ERRORS):
                pool._stop_preparing(error)
                pool._reconnect_all(conn)
        except BaseException as failed:  # it replaces the block's error, as it would in a generator
            self._give_back(type(failed), failed, failed.__traceback__)
            raise
        self._give_back(kind, error, traceback)

    def _give_back(self, kind: Any, error: BaseException | None, traceback: Any) -> None:
        pool, conn = self._pool, self._conn
        pool._idle_since[conn] = time.monotonic()
        try:
            if conn.pgconn.transaction_status != TransactionStatus.IDLE:
                conn.__exit__(kind, error, traceback)
        finally:
            pool.putconn(conn)


def open_pool(
    url: str,
    *,
    size: int,
    timeout: float,
    name: str = "reducing-saver",
    options: PostgresSettings | None = None,
) -> ServicePool:
    """The process's pool of ``size`` autocommit, dict-row connections, open and filled.

    Args:
        url: The database URL.
        size: Connections (minimum and maximum: a service keeps them open).
        timeout: Seconds a borrower waits for a connection before ``PoolTimeout``; also how long opening
            waits for the first connections, and (at least 2 s) how long one connection attempt may take.
        name: The pool's name in psycopg_pool's logs.
        options: The ``postgres_*`` settings (:func:`connection_kwargs`, ``postgres_check_idle_seconds``).
    """
    options = postgres_settings(options)
    pool = ServicePool(
        url,
        min_size=size,
        max_size=size,
        kwargs=connection_kwargs(url, options, timeout=timeout),
        open=False,
        name=name,
        timeout=timeout,
        check_idle=options.postgres_check_idle_seconds,
    )
    try:
        pool.open(wait=True, timeout=timeout)
    except BaseException:
        pool.close(timeout=0)  # its threads would go on connecting in the background
        raise
    return pool


@contextmanager
def setup_lock(conn: Any, key: int) -> Iterator[None]:
    """Hold transaction-level advisory lock ``key`` for the block, in a transaction left open on ``conn``.

    ``conn`` is an autocommit psycopg connection that runs nothing else until the block ends (the set-up
    runs on other connections, or on this one inside the transaction). A transaction-level lock belongs to
    the transaction, not to the server session, so a pooler in transaction mode keeps it where it was
    taken, and it is released whatever happens: at the end of the block (``COMMIT``), or when the
    connection is closed or lost (the server rolls the transaction back). A session-level lock would be
    released on whichever server connection the pooler picked for the unlock, that is, often not at all.

    Waits by polling ``pg_try_advisory_xact_lock``, one short transaction per attempt, rather than blocking
    in ``pg_advisory_xact_lock``: a session blocked in a statement holds a snapshot, and the holder's
    ``CREATE INDEX CONCURRENTLY`` (PostgresSaver's migrations run some) waits for every older snapshot, so
    two processes starting together would wait for each other. The holder's own open transaction keeps
    no snapshot between its statements (they go by the simple query protocol: no portal stays open), and
    does not hold the index up.
    """
    # The key as a literal, not a parameter: a statement without parameters goes by the simple query
    # protocol, which leaves no portal (and no snapshot) behind in the open transaction.
    take = sql.SQL("SELECT pg_try_advisory_xact_lock({})").format(sql.Literal(int(key)))
    with conn.cursor(row_factory=tuple_row) as cur:
        while True:
            cur.execute("BEGIN", prepare=False)
            if cur.execute(take, prepare=False).fetchone()[0]:
                break
            cur.execute("ROLLBACK", prepare=False)
            time.sleep(POLL_SECONDS)
    try:
        yield
    except BaseException:
        _end_transaction(conn, "ROLLBACK")
        raise
    _end_transaction(conn, "COMMIT")


def _end_transaction(conn: Any, statement: str) -> None:
    """End the lock's transaction; a connection lost meanwhile released the lock already."""
    try:
        conn.execute(statement, prepare=False)
    except psycopg.Error as exc:
        # idle_in_transaction_session_timeout, a pooler's idle_transaction_timeout, a restart: the server
        # ended the transaction, and the lock with it. What ran under the lock is done.
        logger.warning("the set-up lock's connection was lost before its release (%s)", first_line(exc))


@contextmanager
def locked_setup(url: str, key: int, options: PostgresSettings | None = None) -> Iterator[None]:
    """:func:`setup_lock` on a connection of its own: the set-up inside takes pool connections."""
    with connect(url, options) as conn, setup_lock(conn, key):
        yield


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
