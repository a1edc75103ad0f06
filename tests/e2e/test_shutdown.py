"""Shutting a real service down: what the in-flight requests answer, what the log says, how long it takes."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.conftest import PG_HOST, PG_PORT
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
