"""Shared fixtures: a PostgreSQL database of this test run's own, and small chat graphs."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest

PG_HOST = os.environ.get("REDUCING_SAVER_TEST_PGHOST", "127.0.0.1")
PG_PORT = os.environ.get("REDUCING_SAVER_TEST_PGPORT", "5432")
PG_USER = os.environ.get("REDUCING_SAVER_TEST_PGUSER", "postgres")


def pg_url(database: str) -> str:
    return f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{database}"


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
def fresh_pg(pg_database: str) -> Iterator[str]:
    """A database of its own for one test: the saver tables start empty."""
    name = f"rs_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url("postgres"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield pg_url(name)
    finally:
        with psycopg.connect(pg_url("postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
