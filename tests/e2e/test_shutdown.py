"""Shutting a real service down: what the in-flight requests answer, what the log says, how long it takes."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from reducing_saver.wire import blob_to_wire
from tests.support.bodies import messages_put_body
from tests.support.postgres import PG_HOST, PG_PORT
from tests.support.proxy import tcp_proxy
from tests.support.server import run_service

pytestmark = pytest.mark.e2e

STUCK_WARNING = "still wait on the database"


def _database(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if backend == "postgres":
        return request.getfixturevalue("fresh_pg")
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'shutdown.sqlite'}"
    return "memory://"


def _get_body(thread_id: str) -> dict:
    return {"config": {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}}


def _stop(process: subprocess.Popen, timeout: float = 30.0) -> float:
    """SIGTERM, wait for the exit; the seconds it took."""
    started = time.monotonic()
    process.terminate()
    process.wait(timeout=timeout)
    return time.monotonic() - started


@pytest.mark.parametrize("backend", ["memory", "sqlite", "postgres"])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_clean_shutdown_reports_no_stuck_thread(
    backend: str, workers: int, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    database = _database(backend, tmp_path, request)
    with run_service(tmp_path, "--database", database, "--workers", str(workers)) as service:
        # The service has worked: probes, metrics and saver calls ran in its worker threads.
        with httpx.Client(base_url=service.url, timeout=30) as http:
            for _ in range(4):
                assert http.get("/readyz").status_code == 200
                assert http.get("/metrics").status_code == 200
                assert http.post("/v1/checkpoints/get", json=_get_body("idle")).status_code == 200
        _stop(service.process)
        output = service.output()
    assert service.process.returncode == 0, output[-3000:]
    assert "shutdown complete" in output, output[-3000:]
    assert STUCK_WARNING not in output, output[-3000:]


GRACE = 2.0
DB_TIMEOUT = 2.0


def test_sigterm_ends_two_workers_within_the_grace_while_the_database_hangs(
    fresh_pg: str, tmp_path: Path
) -> None:
    """Each worker has calls stuck on a silent database; the whole service still exits in bounded time."""
    with tcp_proxy((PG_HOST, int(PG_PORT))) as proxy:
        args = (
            "--database", proxy.url(fresh_pg),
            "--workers", "2",
            "--pool-size", "2",
            "--db-timeout-seconds", str(DB_TIMEOUT),
            "--shutdown-grace-seconds", str(GRACE),
            "--no-sweep",
            "--no-extract",
        )  # fmt: skip
        with run_service(tmp_path, *args) as service:
            # Both workers up first: this case is about workers stuck while serving, not while starting
            # (uvicorn's supervisor waits out a worker's start before it acts on SIGTERM).
            deadline = time.monotonic() + 60
            while service.output().count("Application startup complete") < 2:
                assert time.monotonic() < deadline, service.output()[-3000:]
                time.sleep(0.1)
            proxy.hang()

            def call(path: str, body: dict | None) -> None:
                try:
                    if body is None:
                        httpx.get(f"{service.url}{path}", timeout=120)
                    else:
                        httpx.post(f"{service.url}{path}", json=body, timeout=120)
                except httpx.HTTPError:
                    pass

            # Enough probes that both workers hold some: each takes a pooled connection and waits on it in
            # a worker thread of the service for good (the probe answers 503 after its own budget).
            calls = [("/readyz", None)] * 8
            threads = [threading.Thread(target=call, args=c, daemon=True) for c in calls]
            for thread in threads:
                thread.start()
            time.sleep(3.0)  # past the probes' own budget: their threads stay stuck in the database
            started = time.monotonic()
            service.process.terminate()
            try:
                service.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            took = time.monotonic() - started
            output = service.output()
            assert service.process.returncode is not None, f"still running {took:.0f} s after SIGTERM"
            budget = GRACE + DB_TIMEOUT + 5
            assert took <= budget, f"SIGTERM took {took:.1f} s\n{output[-3000:]}"
            assert service.process.returncode == 0, output[-3000:]
            assert STUCK_WARNING in output, "a thread really was stuck: the log says so"


def test_requests_in_flight_when_the_grace_ends_answer_503_never_500(fresh_pg: str, tmp_path: Path) -> None:
    """Two workers, the checkpoint tables locked by another session, six puts waiting on the lock: at the
    end of the grace each put answers 503 (which the client retries), and the log holds no traceback."""
    grace = 3.0
    args = (
        "--database", fresh_pg,
        "--workers", "2",
        "--shutdown-grace-seconds", str(grace),
        "--db-timeout-seconds", "30",  # the grace ends first
        "--no-sweep",
        "--no-extract",
    )  # fmt: skip
    with run_service(tmp_path, *args) as service:
        statuses: list[int] = []
        details: list[str] = []

        def put(index: int) -> None:
            body = messages_put_body(blob_to_wire("msgpack", b"\x90"), thread_id=f"grace-{index}")
            try:
                response = httpx.post(f"{service.url}/v1/checkpoints/put", json=body, timeout=60)
            except httpx.HTTPError as exc:  # a connection cut without an answer
                details.append(repr(exc))
                return
            statuses.append(response.status_code)
            details.append(response.text)

        with psycopg.connect(fresh_pg) as locker:
            locker.execute(
                "LOCK TABLE checkpoints, checkpoint_blobs, checkpoint_writes IN ACCESS EXCLUSIVE MODE"
            )
            threads = [threading.Thread(target=put, args=(i,)) for i in range(6)]
            for thread in threads:
                thread.start()
            time.sleep(1.5)  # every put waits on the lock
            took = _stop(service.process, timeout=60)
            for thread in threads:
                thread.join(30)
            locker.rollback()
        output = service.output()
    assert statuses == [503] * 6, (statuses, details, output[-3000:])
    assert all("shutting down" in detail for detail in details), details
    assert "Traceback" not in output and "CancelledError" not in output, output[-4000:]
    assert "Exception in ASGI application" not in output and " 500 " not in output
    assert service.process.returncode == 0 and took <= grace + 30 + 5, (took, output[-3000:])
