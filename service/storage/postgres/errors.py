"""What PostgreSQL's errors mean to a caller: psycopg's errors become the storage errors of
:mod:`reducing_saver.service.storage` where they leave the backend (:func:`wrap_exceptions`).

==============================================  ==========================  ===================
psycopg error (SQLSTATE)                        storage error               status
==============================================  ==========================  ===================
``DataError`` (class 22)                        ``ValueRefused``            422
``QueryCanceled`` (57014: statement_timeout),   ``DatabaseTimeout``         504, not retried
``LockNotAvailable`` (55P03: lock_timeout)
``ReadOnlySqlTransaction`` (25006: a standby,   ``DatabaseUnavailable``     503, retried; the
a demoted primary, default_transaction_                                     connection is dropped
read_only)
a prepared statement lost between transactions  ``DatabaseUnavailable``     503, retried; the
(42P05, 26000: a pooler in transaction mode)                                process stops preparing
no connection in time, refused, broken          ``DatabaseUnavailable``     503, retried
==============================================  ==========================  ===================
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import PoolTimeout

from reducing_saver.service.storage import (
    DatabaseTimeout,
    DatabaseUnavailable,
    StorageError,
    ValueRefused,
    transient_test,
)


class ServerReadOnly(Exception):
    """The server says it accepts no writes (``pg_is_in_recovery()``, ``transaction_read_only``), asked by a
    check that writes nothing (the readiness probe)."""


#: The server refuses writes: a standby, a primary being demoted, ``default_transaction_read_only``.
READ_ONLY_ERRORS = (pg_errors.ReadOnlySqlTransaction, ServerReadOnly)
#: A prepared statement of this connection missing on the server, or one of another connection there:
#: statements of one client connection ran on several server connections (a pooler in transaction mode).
PREPARED_STATEMENT_ERRORS = (pg_errors.DuplicatePreparedStatement, pg_errors.InvalidSqlStatementName)
#: A statement cancelled by a limit: ``statement_timeout`` (or a cancel request), ``lock_timeout``.
TIMEOUT_ERRORS = (pg_errors.QueryCanceled, pg_errors.LockNotAvailable)

#: What to do about lost prepared statements (the end of the 503's detail and of the start-up refusal).
PREPARED_STATEMENTS_ADVICE = (
    "a pooler in transaction mode sits between the service and PostgreSQL and does not keep prepared "
    "statements per client (PgBouncer before 1.21, or max_prepared_statements = 0): set "
    "REDUCING_SAVER_POSTGRES_PREPARED_STATEMENTS=false (--no-postgres-prepared-statements)"
)


@contextmanager
def refused_at_start(where: str) -> Iterator[None]:
    """Raise psycopg's errors of a start-up step (filling the pool, migrations, the schema check) as one
    line for an operator (``StorageError``): the command line prints it instead of a traceback.

    Args:
        where: The database, for the message (its URL without the password).
    """
    try:
        yield
    except PREPARED_STATEMENT_ERRORS as exc:
        raise StorageError(
            f"PostgreSQL at {where}: {first_line(exc)}: {PREPARED_STATEMENTS_ADVICE}"
        ) from None
    except READ_ONLY_ERRORS:
        raise StorageError(read_only_refusal(where)) from None
    except psycopg.Error as exc:
        raise StorageError(
            f"setting up the PostgreSQL database at {where} failed: {type(exc).__name__}: {first_line(exc)}"
        ) from None


def read_only_refusal(where: str) -> str:
    """Why the service does not start on a server that accepts no writes (one line)."""
    return (
        f"the PostgreSQL server at {where} accepts no writes (a standby in recovery, or "
        "default_transaction_read_only): point the database URL at the primary, or list the primary and its "
        "standbys (postgresql://user@primary:5432,standby:5432/db): the service connects to the one that "
        "accepts writes"
    )


def wrap_exceptions() -> AbstractContextManager[None]:
    """Raise psycopg's errors of the block as the storage errors a caller can act on (the table above).
    Any other error passes unchanged."""
    return _WRAPPING


class _Wrapping:
    """:func:`wrap_exceptions`' context manager: a class, not a generator, since every saver call runs in
    one; it holds nothing, so one serves every block."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, traceback: Any) -> None:
        if isinstance(exc, psycopg.DataError):
            raise ValueRefused(refused_value(exc)) from exc
        if isinstance(exc, TIMEOUT_ERRORS):
            raise DatabaseTimeout(timed_out(exc)) from exc
        if isinstance(exc, (psycopg.Error, ServerReadOnly)):
            reason = unavailable(exc)
            if reason is not None:
                raise DatabaseUnavailable(reason) from exc
        # Anything else (no error, or one that is none of those) goes on unchanged.


_WRAPPING = _Wrapping()


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


def timed_out(exc: BaseException) -> str:
    """The 504 detail for a statement the database cancelled: the limit it names, and what to change."""
    return (
        f"the database cancelled the statement: {first_line(exc)} (a limit set on the database or role: "
        "statement_timeout or lock_timeout; retrying unchanged is likely to take as long: raise the limit "
        "for the service's role, or ask for less, e.g. a smaller list limit)"
    )


def unavailable(exc: BaseException) -> str | None:
    """Why the database cannot serve right now, for a 503; ``None`` when ``exc`` is not that.

    No connection within the pool's timeout, a connection refused or broken, the server shutting down, a
    server that accepts no writes, prepared statements lost to a pooler: the call may succeed later,
    unchanged. A statement cancelled by a timeout is not an outage (:func:`timed_out`).
    """
    if isinstance(exc, PoolTimeout):
        return f"the database is unavailable: no connection within the timeout ({exc})"
    if isinstance(exc, READ_ONLY_ERRORS):
        return (
            f"the database is unavailable: the server accepts no writes ({first_line(exc)}: a standby, a "
            "primary being demoted or in a failover, or default_transaction_read_only); the service "
            "reconnects to the server that does"
        )
    if isinstance(exc, PREPARED_STATEMENT_ERRORS):
        return f"the database is unavailable: {first_line(exc)}; {PREPARED_STATEMENTS_ADVICE}"
    if isinstance(exc, TIMEOUT_ERRORS):
        return None
    if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        return f"the database is unavailable: {type(exc).__name__}: {first_line(exc)}"
    return None


@transient_test
def transient(exc: BaseException) -> str | None:
    """An outage (:func:`unavailable`) or a cancelled statement (:func:`timed_out`): passing trouble of
    the database, not a fault of the code (``storage.transient``)."""
    if isinstance(exc, TIMEOUT_ERRORS):
        return timed_out(exc)
    return unavailable(exc)


def first_line(exc: BaseException) -> str:
    lines = [" ".join(line.split()) for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
