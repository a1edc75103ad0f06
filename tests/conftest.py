"""Shared fixtures and hooks: a PostgreSQL database of this test run's own, a PostgreSQL with pgvector, the
test lanes. Helpers the tests import live in tests/support/."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from tests.support.postgres import pg_url
from tests.support.windows import api_window_problems

#: The test lanes, by where a test lives: ``tests/e2e/`` starts real processes (the service under uvicorn,
#: the command line, agents, ``langgraph dev``) and is left out of the fast lane (``scripts/test``);
#: the compose tests also need a Docker engine (so does a test that runs the service in the image: it marks
#: itself). Everything else runs in-process.
LANES = {"e2e": ("tests/e2e/",), "compose": ("tests/e2e/test_compose.py",)}
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with the lanes its path puts it in (``-m "not e2e"`` is the fast lane)."""
    for item in items:
        where = "tests/" + item.path.resolve().relative_to(TESTS).as_posix()
        for marker, prefixes in LANES.items():
            if where.startswith(prefixes):
                item.add_marker(marker)


@pytest.fixture(autouse=True)
def _no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loopback requests must never go through a proxy configured on the machine."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "*")


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A database created for this test run (and dropped after it), so runs never see each other's rows."""
    name = f"rs_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url("postgres"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield pg_url(name)
    finally:
        with psycopg.connect(pg_url("postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def make_database(pg_database: str) -> Iterator[Callable[[], str]]:
    """Create empty databases for one test (dropped after it); returns their URLs."""
    prefix = pg_database.rsplit("/", 1)[1]
    names: list[str] = []

    def create() -> str:
        name = f"{prefix}_{len(names)}_{uuid.uuid4().hex[:6]}"
        with psycopg.connect(pg_url("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        names.append(name)
        return pg_url(name)

    yield create
    with psycopg.connect(pg_url("postgres"), autocommit=True) as conn:
        for name in names:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def fresh_pg(make_database: Callable[[], str]) -> str:
    """A database of its own for one test: the saver tables start empty."""
    return make_database()


@pytest.fixture(scope="session")
def pgvector_server() -> Iterator[str]:
    """A PostgreSQL with the pgvector extension for this run, stopped and deleted after it; its URL.

    The server at ``PG_HOST:PG_PORT`` may have no pgvector (Debian packages none for PostgreSQL 15), so
    vector search runs on the PostgreSQL 16 with pgvector that the test extra's ``pgserver`` ships
    in its wheel. It listens on a unix socket in its data folder only (``postgresql://postgres:@/postgres
    ?host=DATA``). As root, pgserver runs it as a ``pgserver`` user and makes every folder above the data
    folder and above its binaries (in the virtual environment) readable and traversable by all, hence a
    data folder of its own directly in the temporary directory rather than under pytest's private one.
    """
    with warnings.catch_warnings():
        # platformdirs warns at pgserver's import when XDG_RUNTIME_DIR is unset (as for root in CI).
        warnings.simplefilter("ignore")
        import pgserver

    data = Path(tempfile.mkdtemp(prefix="reducing-saver-pgvector-"))
    try:
        server = pgserver.get_server(data, cleanup_mode="delete")
        try:
            with psycopg.connect(server.get_uri(), autocommit=True) as conn:
                # A throwaway cluster: no waiting for the disk.
                conn.execute("ALTER SYSTEM SET fsync = off")
                conn.execute("ALTER SYSTEM SET synchronous_commit = off")
                conn.execute("SELECT pg_reload_conf()")
            yield server.get_uri()
        finally:
            server.cleanup()
    finally:
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def pgvector_db(pgvector_server: str) -> Iterator[str]:
    """A database of its own on :func:`pgvector_server` for one test (dropped after it); its URL."""
    name = f"rs_vec_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pgvector_server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base, _, query = pgvector_server.partition("?")
    try:
        yield f"{base.rsplit('/', 1)[0]}/{name}?{query}"
    finally:
        with psycopg.connect(pgvector_server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def window_problems():
    """:func:`api_window_problems`, for tests that check stored windows."""
    return api_window_problems


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the figures tests recorded (``record_property("<topic> figures", ...)``) after the run."""
    lines = [
        f"{report.nodeid}: {value}"
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", ())
        if name.endswith(" figures")
    ]
    if lines:
        terminalreporter.section("figures")
        for line in lines:
            terminalreporter.write_line(line)
