"""What PostgreSQL's errors mean to a caller: psycopg's errors become the storage errors of
:mod:`reducing_saver.service.storage` where they leave the backend (:func:`wrap_exceptions`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg_pool import PoolTimeout

from reducing_saver.service.storage import DatabaseUnavailable, ValueRefused


@contextmanager
def wrap_exceptions() -> Iterator[None]:
    """Raise psycopg's errors of the block as the storage errors a caller can act on.

    A value PostgreSQL refuses (``DataError``, SQLSTATE class 22) becomes :class:`ValueRefused`; no
    connection in time, a connection refused or broken, a statement cancelled become
    :class:`DatabaseUnavailable`. Any other error passes unchanged.
    """
    try:
        yield
    except psycopg.DataError as exc:
        raise ValueRefused(refused_value(exc)) from exc
    except (PoolTimeout, psycopg.OperationalError, psycopg.InterfaceError) as exc:
        raise DatabaseUnavailable(unavailable(exc)) from exc


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
