"""Each backend turns its driver's errors into the storage errors the service maps to statuses."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import psycopg
import pytest
from psycopg_pool import ConnectionPool, PoolTimeout

from reducing_saver.service.http.errors import error_answer
from reducing_saver.service.storage import DatabaseUnavailable, ValueRefused
from reducing_saver.service.storage.postgres.errors import wrap_exceptions as pg_wrap
from reducing_saver.service.storage.sqlite.errors import wrap_exceptions as sqlite_wrap

SERVICE = Path(__file__).resolve().parents[3] / "service"


def test_a_value_postgres_refuses_is_a_422_naming_it(fresh_pg):
    with psycopg.connect(fresh_pg) as conn, pytest.raises(ValueRefused) as raised, pg_wrap():
        conn.execute("SELECT %s::jsonb", ('{"a": "nul \\u0000 here"}',))
    assert isinstance(raised.value.__cause__, psycopg.DataError)
    status, detail = error_answer(raised.value)
    assert status == 422
    assert detail.startswith("PostgreSQL refused a value of this request: ")
    assert "cannot hold the NUL character (U+0000)" in detail


def test_postgres_out_of_reach_is_a_503():
    with pytest.raises(DatabaseUnavailable) as raised, pg_wrap():
        psycopg.connect("postgresql://postgres@127.0.0.1:1/x", connect_timeout=2)
    assert error_answer(raised.value) == (503, str(raised.value))
    assert str(raised.value).startswith("the database is unavailable: OperationalError: ")


def test_no_pooled_connection_in_time_is_a_503(fresh_pg):
    with ConnectionPool(fresh_pg, min_size=1, max_size=1, open=True) as pool, pool.connection():
        with pytest.raises(DatabaseUnavailable, match="no connection within the timeout") as raised, pg_wrap():
            with pool.connection(timeout=0.1):
                pass
    assert isinstance(raised.value.__cause__, PoolTimeout)


def test_other_postgres_errors_pass_unchanged(fresh_pg):
    with psycopg.connect(fresh_pg) as conn, pytest.raises(psycopg.errors.UndefinedTable), pg_wrap():
        conn.execute("SELECT * FROM no_such_table")


def test_a_locked_sqlite_file_is_a_503(tmp_path):
    path = tmp_path / "x.sqlite"
    with closing(sqlite3.connect(path, isolation_level=None)) as holder, closing(
        sqlite3.connect(path, isolation_level=None, timeout=0.05)
    ) as waiter:
        holder.execute("CREATE TABLE t (x)")
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(DatabaseUnavailable, match="the database is unavailable: SQLite: database is locked") as raised:
            with sqlite_wrap():
                waiter.execute("BEGIN IMMEDIATE")
        holder.execute("ROLLBACK")
    assert error_answer(raised.value)[0] == 503
    with closing(sqlite3.connect(path)) as conn, pytest.raises(sqlite3.OperationalError), sqlite_wrap():
        conn.execute("SELECT * FROM no_such_table")  # not a lock: unchanged


def test_the_status_table_knows_no_driver():
    """The mapping to statuses sees the service's own errors only: drivers stay inside their backends."""
    source = (SERVICE / "http" / "errors.py").read_text()
    assert "psycopg" not in source and "sqlite3" not in source
