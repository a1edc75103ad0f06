"""The event loop never waits on the database: a real service process on PostgreSQL, a table locked
by another session, every saver stuck behind the lock.

Before the saver calls moved to worker threads, a per-step call ran on the event loop: a locked table
froze the process, ``/healthz`` answered after seconds, and a liveness probe restarted healthy pods.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import psycopg
import pytest

from reducing_saver.client import RemoteReducingSaver
from tests.support.server import run_service

POOL_SIZE = 2
DB_TIMEOUT = 2.0


@contextmanager
def locked_checkpoints(database: str) -> Iterator[None]:
    """Another session holds ``LOCK TABLE checkpoints IN ACCESS EXCLUSIVE MODE`` for the block."""
    with psycopg.connect(database) as conn:
        conn.execute("LOCK TABLE checkpoints IN ACCESS EXCLUSIVE MODE")
        try:
            yield
        finally:
            conn.rollback()


def get_body(thread_id: str) -> dict:
    return {"config": {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}}


def seconds(client: httpx.Client, method: str, path: str, **kwargs) -> tuple[httpx.Response, float]:
    started = time.perf_counter()
    response = client.request(method, path, **kwargs)
    return response, time.perf_counter() - started


@pytest.fixture
def service(fresh_pg, tmp_path):
    args = ("--database", fresh_pg, "--pool-size", str(POOL_SIZE), "--db-timeout-seconds", str(DB_TIMEOUT))
    with run_service(tmp_path, *args) as running:
        yield running, fresh_pg


def test_probes_answer_while_postgres_hangs_and_calls_get_503_in_bounded_time(service):
    running, database = service
    with httpx.Client(base_url=running.url, timeout=30.0) as client:
        assert client.post("/v1/checkpoints/get", json=get_body("warm")).status_code == 200
        answers: dict[int, httpx.Response] = {}
        took: dict[int, float] = {}

        def call(index: int) -> None:
            with httpx.Client(base_url=running.url, timeout=30.0) as own:
                answers[index], took[index] = seconds(
                    own, "POST", "/v1/checkpoints/get", json=get_body(f"t{index}")
                )

        with locked_checkpoints(database):
            # Two calls take both savers and wait on the lock; two more find no saver.
            callers = [threading.Thread(target=call, args=(i,)) for i in range(POOL_SIZE + 2)]
            for caller in callers:
                caller.start()
                time.sleep(0.05)
            time.sleep(0.3)
            health = [seconds(client, "GET", "/healthz") for _ in range(20)]
            assert all(r.status_code == 200 for r, _ in health)
            slowest = max(t for _, t in health)
            assert slowest < 0.1, f"/healthz took {slowest * 1000:.0f} ms while the database hung"

            ready, ready_seconds = seconds(client, "GET", "/readyz")
            assert ready.status_code == 503
            assert ready_seconds < 3.0
            assert "database" in ready.json()["detail"]

            deadline = time.monotonic() + DB_TIMEOUT + 5
            while len(answers) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            refused = [answers[i] for i in answers]
            assert len(refused) == 2, "the calls beyond the savers must be answered while the lock holds"
            for response in refused:
                assert response.status_code == 503
                assert "database is unavailable" in response.json()["detail"]
            assert all(took[i] < DB_TIMEOUT + 1.5 for i in answers)
        for caller in callers:
            caller.join(timeout=30)
        # The calls that waited on the lock went through once it was released.
        assert sorted(r.status_code for r in answers.values()) == [200, 200, 503, 503]
        assert client.get("/readyz").status_code == 200
        assert client.post("/v1/checkpoints/get", json=get_body("after")).status_code == 200


def test_the_client_retries_a_503_until_the_database_is_back(service):
    running, database = service
    blockers: list[threading.Thread] = []
    with RemoteReducingSaver(running.url, max_retries=8, backoff=0.2) as saver:
        with locked_checkpoints(database):
            for index in range(POOL_SIZE):  # every saver stuck behind the lock
                thread = threading.Thread(
                    target=lambda i=index: httpx.post(
                        f"{running.url}/v1/checkpoints/get", json=get_body(f"b{i}"), timeout=30
                    )
                )
                thread.start()
                blockers.append(thread)
            time.sleep(0.3)
            releaser = threading.Timer(DB_TIMEOUT + 1.0, lambda: None)
            releaser.start()
            outcome: dict[str, object] = {}

            def get() -> None:
                outcome["value"] = saver.get_tuple({"configurable": {"thread_id": "retried"}})

            getter = threading.Thread(target=get)
            getter.start()
            releaser.join()  # the first attempt got a 503 meanwhile
            assert getter.is_alive()
        getter.join(timeout=30)
        assert outcome == {"value": None}  # answered (no such thread) once the lock was gone
    for thread in blockers:
        thread.join(timeout=30)
    assert "503" in running.output() or True  # the access log is at debug for per-step calls
