"""How the PostgreSQL backend opens and keeps its connections: every connection with the ``postgres_*``
settings, idle ones checked before they are lent, all of them dropped when the server stops taking writes.
Real connections to the test server throughout (a proxy of the test's own cuts idle ones)."""

from __future__ import annotations

import time

import psycopg
import pytest

from reducing_saver.service.storage import PostgresSettings, open_backend
from reducing_saver.service.storage.ledger import Policy
from reducing_saver.service.storage.postgres import connections
from reducing_saver.service.storage.postgres.connections import connection_kwargs, open_pool
from tests.support.postgres import PG_HOST, PG_PORT
from tests.support.proxy import tcp_proxy

OPTIONS = PostgresSettings(
    postgres_prepared_statements=False,
    postgres_keepalives_idle_seconds=7,
    postgres_keepalives_interval_seconds=3,
    postgres_keepalives_count=4,
    postgres_tcp_user_timeout_seconds=9,
)


@pytest.fixture
def opened(monkeypatch):
    """Every psycopg connection made while the test runs (the pool's, the set-up locks', the sweeps'), as
    ``(connection, its libpq parameters, its prepare_threshold)`` when it was made."""
    made: list[tuple[psycopg.Connection, dict[str, str], int | None]] = []
    connect = psycopg.Connection.connect.__func__

    def recording(cls, *args, **kwargs):
        conn = connect(cls, *args, **kwargs)
        made.append((conn, conn.info.get_parameters(), conn.prepare_threshold))
        return conn

    monkeypatch.setattr(psycopg.Connection, "connect", classmethod(recording))
    monkeypatch.setattr(
        psycopg, "connect", lambda *args, **kwargs: recording(psycopg.Connection, *args, **kwargs)
    )
    return made


def test_every_connection_the_backend_opens_takes_the_settings(fresh_pg, opened):
    """Prepared statements off (PgBouncer in transaction mode) must hold for the start-up checks, the
    set-up locks, the pool, and the connections a sweep opens of its own, or one of them breaks there."""
    backend = open_backend(fresh_pg, pool_size=2, timeout=5.0, postgres=OPTIONS)
    try:
        backend.setup()
        ledger = backend.ledger(window=lambda *args: [], recorder=None, worker_id="test")
        with ledger.session(Policy("keep_latest", 1.0)) as session:
            session._ledger_conn()
            session._pruner()
    finally:
        backend.close()
    assert len(opened) >= 6  # the checks, the locks, the pool's two, the sweep's two
    for _, parameters, prepare_threshold in opened:
        assert prepare_threshold is None
        assert (
            parameters["keepalives_idle"],
            parameters["keepalives_interval"],
            parameters["keepalives_count"],
        ) == (
            "7",
            "3",
            "4",
        )
        assert parameters["tcp_user_timeout"] == "9000"


def test_prepared_statements_are_on_by_default_as_postgres_saver_has_them(fresh_pg):
    pool = open_pool(fresh_pg, size=1, timeout=5.0)
    try:
        with pool.connection() as conn:
            assert conn.prepare_threshold == 0
    finally:
        pool.close()


def test_the_server_that_takes_writes_is_asked_for_unless_the_url_names_its_own():
    assert connection_kwargs("postgresql://u@h1:5432,h2:5432/db")["target_session_attrs"] == "read-write"
    assert (
        connection_kwargs("postgresql://u@h/db?target_session_attrs=any").get("target_session_attrs") is None
    )
    assert (
        connection_kwargs("host=h1,h2 dbname=db target_session_attrs=primary").get("target_session_attrs")
        is None
    )


def test_an_idle_connection_cut_by_the_network_is_replaced_before_it_is_lent(fresh_pg):
    """A proxy closes connections idle for 0.5 s (a load balancer's idle timeout): the pool checks one idle
    that long before lending it and lends a working one instead; the caller sees nothing."""
    with tcp_proxy((PG_HOST, int(PG_PORT)), idle_cut=0.5) as proxy:
        pool = open_pool(
            proxy.url(fresh_pg),
            size=2,
            timeout=5.0,
            options=PostgresSettings(postgres_check_idle_seconds=0.3),
        )
        try:
            for _ in range(3):
                time.sleep(0.8)  # both connections cut meanwhile
                with pool.connection() as conn:
                    assert conn.execute("SELECT 1").fetchone()
            assert proxy.idle_cuts >= 3 and pool.replaced_idle >= 3
        finally:
            pool.close()


def test_without_the_check_a_cut_connection_fails_its_caller(fresh_pg):
    """What the check saves a caller from (a check after 60 s of idleness never runs here)."""
    with tcp_proxy((PG_HOST, int(PG_PORT)), idle_cut=0.5) as proxy:
        pool = open_pool(
            proxy.url(fresh_pg), size=1, timeout=5.0, options=PostgresSettings(postgres_check_idle_seconds=60)
        )
        try:
            time.sleep(0.8)
            with pytest.raises(psycopg.OperationalError), pool.connection() as conn:
                conn.execute("SELECT 1")
        finally:
            pool.close()


def test_a_server_that_stops_taking_writes_drops_every_pooled_connection(fresh_pg):
    """psycopg_pool keeps a connection that answered ReadOnlySqlTransaction (it works, read-only); the pool
    drops them all, so they reconnect to the server that takes writes after a failover."""
    pool = open_pool(fresh_pg, size=2, timeout=5.0)
    try:
        with pool.connection() as first, pool.connection() as second:
            before = {first.info.backend_pid, second.info.backend_pid}
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction), pool.connection() as conn:
            conn.execute("SET default_transaction_read_only = on")
            conn.execute("CREATE TABLE t (x int)")
        deadline = time.monotonic() + 10
        while True:
            with pool.connection() as first, pool.connection() as second:
                after = {first.info.backend_pid, second.info.backend_pid}
            if not after & before:
                break
            assert time.monotonic() < deadline, (before, after)
            time.sleep(0.1)
    finally:
        pool.close()


def test_lost_prepared_statements_stop_the_pool_preparing(fresh_pg, caplog):
    """A prepared statement missing on the server (a pooler gave the transaction to another server
    connection): the pool opens its connections without prepared statements from then on, and says which
    setting starts it that way."""
    pool = open_pool(fresh_pg, size=1, timeout=5.0)
    try:
        with pytest.raises(psycopg.errors.InvalidSqlStatementName), pool.connection() as conn:
            conn.execute("EXECUTE no_such_statement")
        with pool.connection() as conn:
            assert conn.prepare_threshold is None
    finally:
        pool.close()
    assert "REDUCING_SAVER_POSTGRES_PREPARED_STATEMENTS=false" in caplog.text


def test_a_block_leaving_a_transaction_open_ends_it_as_a_connection_context_would(fresh_pg, caplog):
    """The pool's connections are autocommit and every block the service runs ends its transactions; one
    left open is committed at the end of a block that succeeds and rolled back after one that raised
    (``psycopg.Connection``'s context), before the connection goes back idle and unwarned."""
    pool = open_pool(fresh_pg, size=1, timeout=5.0)
    try:
        with pool.connection() as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS lent_blocks (x int)")
            conn.execute("BEGIN")
            conn.execute("INSERT INTO lent_blocks VALUES (1)")
        with pytest.raises(ZeroDivisionError), pool.connection() as conn:
            conn.execute("BEGIN")
            conn.execute("INSERT INTO lent_blocks VALUES (2)")
            raise ZeroDivisionError
        with pool.connection() as conn:
            assert conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
            assert conn.execute("SELECT array_agg(x) FROM lent_blocks").fetchone() == {"array_agg": [1]}
            conn.execute("DROP TABLE lent_blocks")
    finally:
        pool.close()
    assert "rolling back returned connection" not in caplog.text


def test_the_set_up_lock_is_taken_on_a_connection_opened_with_the_settings(fresh_pg, opened):
    with connections.locked_setup(fresh_pg, 0x5EED, OPTIONS):
        conn, parameters, prepare_threshold = opened[-1]
        assert prepare_threshold is None and parameters["keepalives_idle"] == "7"
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
