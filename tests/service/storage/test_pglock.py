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
    """PostgresSaver's migrations run CREATE INDEX CONCURRENTLY under the lock, which waits for every open
    transaction: a process blocked inside pg_advisory_lock would hold one, and both would wait forever."""
    acquired = threading.Event()
    with psycopg.connect(fresh_pg, autocommit=True) as holder, psycopg.connect(fresh_pg, autocommit=True) as waiter:
        holder.execute("CREATE TABLE t (x int)")
        with setup_lock(holder, KEY):
            thread = threading.Thread(target=lambda: _take(waiter, acquired), daemon=True)
            thread.start()
            time.sleep(0.3)  # the waiter is now waiting for the lock
            assert not acquired.is_set()
            holder.execute("SET statement_timeout = '10s'")
            holder.execute("CREATE INDEX CONCURRENTLY t_x ON t (x)")  # raised QueryCanceled before the fix
        thread.join(10)
        assert acquired.is_set()
        names = [row[0] for row in holder.execute("SELECT indexname FROM pg_indexes WHERE tablename = 't'")]
        assert names == ["t_x"]


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
