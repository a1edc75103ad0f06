"""Replicas starting together on an empty database: the migration lock must not deadlock them."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from reducing_saver.service.storage.postgres.connections import setup_lock
from tests.support.server import run_service

KEY = 0x5EED


def test_a_waiting_process_does_not_block_the_holders_concurrent_index(fresh_pg):
    """PostgresSaver's migrations run CREATE INDEX CONCURRENTLY under the lock, which waits for every older
    snapshot: a process blocked inside pg_advisory_lock would hold one, and both would wait forever; so
    would the holder's own open transaction, if it kept a snapshot between its statements."""
    acquired = threading.Event()
    with (
        psycopg.connect(fresh_pg, autocommit=True) as holder,
        psycopg.connect(fresh_pg, autocommit=True) as setup,
        psycopg.connect(fresh_pg, autocommit=True) as waiter,
    ):
        setup.execute("CREATE TABLE t (x int)")
        with setup_lock(holder, KEY):
            thread = threading.Thread(target=lambda: _take(waiter, acquired), daemon=True)
            thread.start()
            time.sleep(0.3)  # the waiter is now waiting for the lock
            assert not acquired.is_set()
            setup.execute("SET statement_timeout = '10s'")
            setup.execute("CREATE INDEX CONCURRENTLY t_x ON t (x)")  # raised QueryCanceled before the fix
        thread.join(10)
        assert acquired.is_set()
        names = [row[0] for row in setup.execute("SELECT indexname FROM pg_indexes WHERE tablename = 't'")]
        assert names == ["t_x"]


def _advisory_holders(conn: psycopg.Connection, key: int) -> list[int]:
    """Backends holding the one-key advisory lock ``key`` (pg_locks splits it into two 32-bit halves)."""
    return [
        row[0]
        for row in conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid = (%s::bigint >> 32)::oid AND objid = (%s::bigint & 4294967295)::oid AND objsubid = 1",
            (key, key),
        )
    ]


def test_the_lock_lives_and_dies_with_a_transaction_not_a_session(fresh_pg):
    """A pooler in transaction mode may run each transaction of one client on another server connection: a
    session-level lock would stay held by whichever took it. The set-up lock is held by one open
    transaction: released when the block ends, and when its connection is lost mid-block."""
    with (
        psycopg.connect(fresh_pg, autocommit=True) as holder,
        psycopg.connect(fresh_pg, autocommit=True) as other,
    ):
        with setup_lock(holder, KEY):
            assert _advisory_holders(other, KEY) == [holder.info.backend_pid]
            assert holder.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert _advisory_holders(other, KEY) == []
        assert holder.info.transaction_status == psycopg.pq.TransactionStatus.IDLE

        # The holder's connection is lost while it holds the lock: the lock goes with its transaction.
        with setup_lock(holder, KEY):
            other.execute("SELECT pg_terminate_backend(%s)", (holder.info.backend_pid,))
            time.sleep(0.2)
            assert _advisory_holders(other, KEY) == []
        acquired = threading.Event()
        _take(other, acquired)
        assert acquired.is_set()


def _take(conn: psycopg.Connection, acquired: threading.Event) -> None:
    with setup_lock(conn, KEY):
        acquired.set()


@pytest.mark.e2e
def test_two_workers_start_together_on_an_empty_database(tmp_path, fresh_pg):
    with run_service(tmp_path, "--database", fresh_pg, "--workers", "2", "--pool-size", "2") as service:
        deadline = time.monotonic() + 60
        while service.output().count("Application startup complete") < 2:
            assert time.monotonic() < deadline, service.output()[-3000:]
            time.sleep(0.2)
