"""`reducing-saver migrate`, and `--no-migrate` on serve and worker."""

from __future__ import annotations

import sqlite3
import subprocess
from contextlib import closing

import httpx
import psycopg
import pytest

from reducing_saver.service.storage.postgres import migrations as pg_migrations
from reducing_saver.service.storage.sqlite import migrations as sqlite_migrations
from tests.support.server import CLI, run_service


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=90, cwd=cwd, check=False)


def _one_line(result: subprocess.CompletedProcess) -> str:
    output = result.stdout + result.stderr
    assert "Traceback" not in output and "listening" not in output, output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(params=["postgres", "sqlite"])
def database(request, tmp_path):
    """``(url, migrations module, version())`` of an empty database."""
    if request.param == "postgres":
        url = request.getfixturevalue("fresh_pg")

        def version():
            with psycopg.connect(url) as conn:
                return pg_migrations.version(conn)

        return url, pg_migrations, version
    path = tmp_path / "service.sqlite"

    def version():
        with closing(sqlite3.connect(path)) as conn:
            return sqlite_migrations.version(conn.cursor())

    return f"sqlite:///{path}", sqlite_migrations, version


def test_migrate_prints_each_migration_then_that_the_schema_is_current(database, tmp_path):
    url, migrations, version = database
    first = _run("migrate", "--database", url, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    own = [line for line in lines if line.startswith("applied migration ")]
    assert [line.split(":")[0] for line in own] == [
        f"applied migration {v}" for v in range(len(migrations.MIGRATIONS))
    ]
    assert (
        own[0].lower()
        == "applied migration 0: create table if not exists reducing_saver_migrations (v integer primary key)"
    )
    # langgraph's own tables are set up too, and said so (its store's migrations on both backends).
    assert any(line.startswith("applied langgraph's store_migrations versions 0 to ") for line in lines), (
        lines
    )
    assert version() == migrations.LATEST
    again = _run("migrate", "--database", url, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [f"the schema of {url} is current"]


def test_serve_without_migrating_refuses_a_database_that_is_behind(database, tmp_path):
    url, migrations, version = database
    result = _run("serve", "--database", url, "--port", "0", "--no-migrate", cwd=tmp_path)
    assert result.returncode == 1
    line = _one_line(result)
    assert (
        f"has reducing-saver schema version none, this reducing-saver needs version {migrations.LATEST}"
        in line
    )
    assert "run `reducing-saver migrate`" in line
    assert version() == -1  # nothing created
    result = _run("worker", "--database", url, "--no-migrate", cwd=tmp_path)
    assert result.returncode == 1
    assert "run `reducing-saver migrate`" in _one_line(result)

    assert _run("migrate", "--database", url, cwd=tmp_path).returncode == 0
    with run_service(tmp_path, "--database", url, "--no-migrate", "--log-format", "text") as service:
        assert httpx.get(f"{service.url}/readyz", timeout=10).status_code == 200
    assert "applied migration" not in service.output()


def test_serve_migrates_at_start_and_says_what_it_applied(database, tmp_path):
    url, migrations, version = database
    with run_service(tmp_path, "--database", url, "--log-format", "text") as service:
        assert httpx.get(f"{service.url}/readyz", timeout=10).status_code == 200
    assert version() == migrations.LATEST
    assert (
        f"reducing-saver schema from none to version {migrations.LATEST} ({migrations.LATEST + 1} migrations)"
        in (service.output())
    )


def test_a_database_of_a_later_release_is_refused_by_every_command(database, tmp_path):
    url, migrations, version = database
    assert _run("migrate", "--database", url, cwd=tmp_path).returncode == 0
    newer = migrations.LATEST + 1
    if url.startswith("postgres"):
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("INSERT INTO reducing_saver_migrations (v) VALUES (%s)", (newer,))
    else:
        with closing(sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)) as conn:
            conn.execute("INSERT INTO reducing_saver_migrations (v) VALUES (?)", (newer,))
    for command in (["migrate"], ["serve", "--port", "0"], ["worker"], ["extraction", "status"], ["sweep"]):
        result = _run(*command, "--database", url, cwd=tmp_path)
        assert result.returncode == 1, (command, result.stderr)
        line = _one_line(result)
        assert (
            f"schema version {newer}, newer than this reducing-saver knows (version {migrations.LATEST})"
            in line
        )
    assert version() == newer


def test_migrate_on_memory_says_there_is_nothing_to_migrate():
    result = _run("migrate", "--database", "memory://")
    assert result.returncode == 0
    assert "nothing to migrate" in result.stdout


def test_migrate_run_by_four_processes_at_once_reports_each_migration_once(database, tmp_path):
    """Each process reports what it applied itself, read under the set-up locks: every migration, the
    service's and langgraph's, is reported by exactly one of them; the others say the schema is current
    or report the rest."""
    url, migrations, version = database
    command = [str(CLI), "migrate", "--database", url]
    processes = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        for _ in range(4)
    ]
    outputs = [process.communicate(timeout=120) for process in processes]
    assert [process.returncode for process in processes] == [0] * 4, outputs
    lines = [line for stdout, _ in outputs for line in stdout.splitlines()]
    own = sorted(
        int(line.split(":")[0].removeprefix("applied migration "))
        for line in lines
        if line.startswith("applied migration ")
    )
    assert own == list(range(len(migrations.MIGRATIONS))), lines
    langgraph = [line for line in lines if line.startswith("applied langgraph's ")]
    tables = [line.split()[2] for line in langgraph]
    assert sorted(tables) == sorted(migrations.LANGGRAPH_TABLES), langgraph  # once per table
    assert version() == migrations.LATEST
