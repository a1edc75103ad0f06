"""Each backend turns its driver's errors into the storage errors the service maps to statuses."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import orjson
import psycopg
import pytest
from psycopg_pool import ConnectionPool, PoolTimeout

from reducing_saver.service.http.errors import error_answer, error_body
from reducing_saver.service.storage import DatabaseTimeout, DatabaseUnavailable, ValueRefused
from reducing_saver.service.storage.postgres.errors import wrap_exceptions as pg_wrap
from reducing_saver.service.storage.sqlite.errors import wrap_exceptions as sqlite_wrap
from reducing_saver.wire import DATABASE_TIMEOUT

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
        with (
            pytest.raises(DatabaseUnavailable, match="no connection within the timeout") as raised,
            pg_wrap(),
        ):
            with pool.connection(timeout=0.1):
                pass
    assert isinstance(raised.value.__cause__, PoolTimeout)


@pytest.mark.parametrize(
    ("limit", "statement", "cancelled"),
    [
        ("statement_timeout", "SELECT pg_sleep(5)", "canceling statement due to statement timeout"),
        (
            "lock_timeout",
            "LOCK TABLE held IN ACCESS EXCLUSIVE MODE",
            "canceling statement due to lock timeout",
        ),
    ],
)
def test_a_statement_the_database_cancels_is_a_504_with_its_own_code(fresh_pg, limit, statement, cancelled):
    """A limit the operator set on the database is no outage (a 503 the client would retry): a 504 whose body
    names it, with the code the client reads (wire.DATABASE_TIMEOUT)."""
    with (
        psycopg.connect(fresh_pg, autocommit=True) as holder,
        psycopg.connect(fresh_pg, autocommit=True) as conn,
    ):
        holder.execute("CREATE TABLE held (x int)")
        holder.execute("BEGIN")
        holder.execute("LOCK TABLE held IN ACCESS EXCLUSIVE MODE")
        conn.execute(f"SET {limit} = '100ms'")
        with pytest.raises(DatabaseTimeout) as raised, pg_wrap(), conn.transaction():
            conn.execute(statement)
    status, detail = error_answer(raised.value)
    assert status == 504 and cancelled in detail and limit in detail, detail
    assert orjson.loads(error_body(detail, status)) == {"detail": detail, "code": DATABASE_TIMEOUT}
    assert "code" not in orjson.loads(error_body("x", 503))


def test_a_server_that_accepts_no_writes_is_a_503_naming_it(fresh_pg):
    with psycopg.connect(fresh_pg, autocommit=True) as conn:
        conn.execute("SET default_transaction_read_only = on")
        with pytest.raises(DatabaseUnavailable) as raised, pg_wrap():
            conn.execute("CREATE TABLE t (x int)")
    assert isinstance(raised.value.__cause__, psycopg.errors.ReadOnlySqlTransaction)
    status, detail = error_answer(raised.value)
    assert status == 503 and "accepts no writes" in detail and "standby" in detail


def test_other_postgres_errors_pass_unchanged(fresh_pg):
    with psycopg.connect(fresh_pg) as conn, pytest.raises(psycopg.errors.UndefinedTable), pg_wrap():
        conn.execute("SELECT * FROM no_such_table")


def test_a_locked_sqlite_file_is_a_503(tmp_path):
    path = tmp_path / "x.sqlite"
    with (
        closing(sqlite3.connect(path, isolation_level=None)) as holder,
        closing(sqlite3.connect(path, isolation_level=None, timeout=0.05)) as waiter,
    ):
        holder.execute("CREATE TABLE t (x)")
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(
            DatabaseUnavailable, match="the database is unavailable: SQLite: database is locked"
        ) as raised:
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
