"""The service's own tables are versioned: each migration applied once, on PostgreSQL and SQLite alike."""

from __future__ import annotations

import sqlite3
import threading
from contextlib import closing

import psycopg
import pytest

from reducing_saver.service.storage import open_backend
from reducing_saver.service.storage.migrations import NO_VERSION, SchemaError
from reducing_saver.service.storage.postgres import migrations as pg_migrations
from reducing_saver.service.storage.sqlite import migrations as sqlite_migrations

#: The tables the service owns, as the first release (without a version table) created them.
OWN_TABLES = {
    "reducing_saver_outbox",
    "reducing_saver_threads",
    "reducing_saver_sweep_log",
    "reducing_saver_summaries",
    "reducing_saver_pruned",
}


@pytest.fixture(params=["postgres", "sqlite"])
def database(request, tmp_path):
    """``(url, migrations module, run(sql, params) -> rows)`` of an empty database."""
    if request.param == "postgres":
        url = request.getfixturevalue("fresh_pg")

        def run(sql, params=()):
            with psycopg.connect(url, autocommit=True) as conn:
                cur = conn.execute(sql, params or None)
                return cur.fetchall() if cur.description else []

        return url, pg_migrations, run
    path = tmp_path / "service.sqlite"

    def run(sql, params=()):
        with closing(sqlite3.connect(path, isolation_level=None)) as conn:
            return conn.execute(sql.replace("%s", "?"), params).fetchall()

    return f"sqlite:///{path}", sqlite_migrations, run


def recorded(run) -> list[int]:
    return [row[0] for row in run("SELECT v FROM reducing_saver_migrations ORDER BY v")]


def tables(run, url) -> set[str]:
    if url.startswith("sqlite"):
        rows = run("SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'reducing_saver_%'")
    else:
        rows = run("SELECT tablename FROM pg_tables WHERE tablename LIKE 'reducing_saver_%'")
    return {row[0] for row in rows}


def test_an_empty_database_gets_every_migration_once(database):
    url, migrations, run = database
    backend = open_backend(url, pool_size=2, timeout=10)
    try:
        applied = backend.migrate()
        own = [line for line in applied if line.startswith("applied migration ")]
        assert own == [f"applied migration {v}: " + line.split(": ", 1)[1] for v, line in enumerate(own)]
        assert len(own) == len(migrations.MIGRATIONS)
        assert recorded(run) == list(range(len(migrations.MIGRATIONS)))
        assert tables(run, url) == OWN_TABLES | {"reducing_saver_migrations"}
        assert backend.migrate() == []  # the schema is current: nothing again
        backend.check_schema()
    finally:
        backend.close()
    assert recorded(run) == list(range(len(migrations.MIGRATIONS)))


def test_a_database_of_the_first_release_keeps_its_rows(database):
    """The first release created the tables with no version table: its rows survive the migration."""
    url, migrations, run = database
    for statement in migrations.MIGRATIONS[1:]:  # what its CREATE ... IF NOT EXISTS made
        if statement.lstrip().upper().startswith("CREATE"):
            run(statement)
    if url.startswith("sqlite"):
        run(
            "INSERT INTO reducing_saver_outbox (namespace, key, thread_id, message, pruned_at, available_at) "
            "VALUES ('[\"m\"]', 'k', 't', '{}', 0, 0)"
        )
        run("INSERT INTO reducing_saver_threads (thread_id, last_write_at) VALUES ('t', 0)")
    else:
        run(
            "INSERT INTO reducing_saver_outbox (namespace, key, thread_id, message, pruned_at) "
            "VALUES ('{m}', 'k', 't', '{}', now())"
        )
        run("INSERT INTO reducing_saver_threads (thread_id) VALUES ('t')")
    backend = open_backend(url, pool_size=2, timeout=10)
    try:
        assert len([line for line in backend.migrate() if line.startswith("applied migration")]) == len(
            migrations.MIGRATIONS
        )
    finally:
        backend.close()
    assert run("SELECT key FROM reducing_saver_outbox") == [("k",)]
    assert run("SELECT thread_id FROM reducing_saver_threads") == [("t",)]
    assert recorded(run) == list(range(len(migrations.MIGRATIONS)))


def test_replicas_starting_together_apply_each_migration_once(database):
    url, migrations, run = database
    backends = [open_backend(url, pool_size=1, timeout=30) for _ in range(4)]
    results: list[list[str]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(len(backends))

    def migrate(backend):
        start.wait()
        try:
            results.append([line for line in backend.migrate() if line.startswith("applied migration")])
        except BaseException as exc:  # pragma: no cover - the failure being tested for
            errors.append(exc)

    threads = [threading.Thread(target=migrate, args=(backend,)) for backend in backends]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for backend in backends:
        backend.close()
    assert errors == []
    applied = sorted(line for lines in results for line in lines)
    assert len(applied) == len(migrations.MIGRATIONS) == len(set(applied))  # each once, by one replica
    assert recorded(run) == list(range(len(migrations.MIGRATIONS)))


def test_a_database_of_a_later_release_is_refused_in_one_line(database):
    url, migrations, run = database
    backend = open_backend(url, pool_size=1, timeout=10)
    try:
        backend.migrate()
        newer = migrations.LATEST + 3
        run("INSERT INTO reducing_saver_migrations (v) VALUES (%s)", (newer,))
        for attempt in (backend.migrate, backend.check_schema):
            with pytest.raises(SchemaError) as raised:
                attempt()
            message = str(raised.value)
            assert "\n" not in message
            assert f"version {newer}" in message and f"version {migrations.LATEST}" in message
            assert "upgrade reducing-saver" in message
    finally:
        backend.close()
    assert recorded(run)[-1] == newer  # nothing was changed


def test_without_migrating_a_database_that_is_behind_is_refused(database):
    url, migrations, run = database
    backend = open_backend(url, pool_size=1, timeout=10, migrate=False)
    try:
        with pytest.raises(
            SchemaError,
            match=r"version none, this reducing-saver needs version \d+: run `reducing-saver migrate`",
        ):
            backend.setup()
        with pytest.raises(SchemaError, match="run `reducing-saver migrate`"):
            backend.outbox()
    finally:
        backend.close()
    assert tables(run, url) == set()  # --no-migrate created nothing
    migrated = open_backend(url, pool_size=1, timeout=10)
    try:
        migrated.migrate()
    finally:
        migrated.close()
    backend = open_backend(url, pool_size=1, timeout=10, migrate=False)
    try:
        backend.setup()
        assert backend.outbox().status()["pending"] == 0
    finally:
        backend.close()


def test_every_postgres_migration_is_one_statement():
    """The pool's connections use prepare_threshold=0, under which PostgreSQL refuses several statements
    (a function's body, quoted between ``$$``, holds statements of its own)."""
    for statement in pg_migrations.MIGRATIONS + sqlite_migrations.MIGRATIONS:
        outside_bodies = statement.split("$$")[::2]
        assert len(statement.split("$$")) % 2 == 1 and ";" not in "".join(outside_bodies)


def test_the_version_of_a_database_without_a_version_table(fresh_pg, tmp_path):
    with psycopg.connect(fresh_pg) as conn:
        assert pg_migrations.version(conn) == NO_VERSION
    with closing(sqlite3.connect(tmp_path / "x.sqlite")) as conn:
        assert sqlite_migrations.version(conn.cursor()) == NO_VERSION


def test_sqlite_processes_take_turns_at_langgraphs_setup(tmp_path):
    """langgraph's SqliteStore set-up reads a version, then alters tables: two at once fail ("duplicate
    column name"). The backend runs it under the file's set-up lock, as PostgreSQL runs it under an
    advisory lock."""
    from reducing_saver.service.storage.sqlite.connections import setup_lock

    path = tmp_path / "service.sqlite"
    backend = open_backend(f"sqlite:///{path}")
    done = threading.Event()
    try:
        with setup_lock(path):  # another process setting up
            thread = threading.Thread(target=lambda: (backend.migrate(), done.set()), daemon=True)
            thread.start()
            assert not done.wait(0.5)  # waits for the lock, with the store's tables not yet set up
            with closing(sqlite3.connect(path)) as conn:
                assert sqlite_migrations.langgraph_versions(conn.cursor()) == {"store_migrations": NO_VERSION}
        assert done.wait(30)
    finally:
        backend.close()
    with closing(sqlite3.connect(path)) as conn:
        assert sqlite_migrations.langgraph_versions(conn.cursor()) == sqlite_migrations.LANGGRAPH_TABLES


#: Every command that opens the database, as the command line takes it; serve and worker (which start
#: servers and threads) are checked from outside in tests/e2e/test_migrate_command.py.
COMMANDS = {
    "migrate": ["migrate"],
    "extraction status": ["extraction", "status"],
    "extraction retry-dead": ["extraction", "retry-dead"],
    "sweep": ["sweep"],
    "sweep --dry-run": ["sweep", "--dry-run"],
    "report": ["report"],
    "encrypt-sweep": ["encrypt-sweep"],
}


def test_every_command_is_checked_for_a_newer_schema():
    from reducing_saver.service.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    named = {"serve", "worker"} | {words[0] for words in COMMANDS.values()}
    assert set(commands) == named
    actions = commands["extraction"]._subparsers._group_actions[0].choices
    assert {f"extraction {action}" for action in actions} <= set(COMMANDS)


@pytest.fixture
def root_logging():
    """The commands install their log handler on the root logger: put back what was there."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_refuses_a_database_of_a_later_release_and_changes_nothing(
    database, command, monkeypatch, capsys, root_logging
):
    """One line naming both versions, exit 1, before any work: a sweep that rewrote or measured a newer
    schema's tables would misread them (encrypt-sweep rewrote every row, report read them)."""
    from langgraph.checkpoint.base import empty_checkpoint

    from reducing_saver.service.cli import main
    from tests.support.encryption import new_key, ring_json

    url, migrations, run = database
    backend = open_backend(url, pool_size=1, timeout=10)
    try:
        backend.setup()
        config = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
        checkpoint = {**empty_checkpoint(), "channel_values": {"note": "plain text"}}
        backend.savers(1)[0].put(config, checkpoint, {"source": "input", "step": 1, "user": "x"}, {})
    finally:
        backend.close()
    newer = migrations.LATEST + 1
    run("INSERT INTO reducing_saver_migrations (v) VALUES (%s)", (newer,))
    before = run(
        "SELECT thread_id, checkpoint::text, metadata::text FROM checkpoints"
        if url.startswith("postgres")
        else "SELECT thread_id, checkpoint, metadata FROM checkpoints"
    )
    for name in list(__import__("os").environ):
        if name.startswith("REDUCING_SAVER_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("REDUCING_SAVER_ENCRYPTION_KEYS", ring_json("k1", k1=new_key()))
    assert main([*COMMANDS[command], "--database", url]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("reducing-saver: "), err
    assert (
        f"schema version {newer}, newer than this reducing-saver knows (version {migrations.LATEST})"
        in lines[-1]
    )
    assert "Traceback" not in err
    assert recorded(run)[-1] == newer
    after = run(
        "SELECT thread_id, checkpoint::text, metadata::text FROM checkpoints"
        if url.startswith("postgres")
        else "SELECT thread_id, checkpoint, metadata FROM checkpoints"
    )
    assert after == before  # nothing rewritten


def test_no_postgres_migration_needs_to_run_outside_a_transaction():
    """The service's PostgreSQL migrations apply in one transaction with their lock: CONCURRENTLY cannot."""
    from reducing_saver.service.storage.postgres.migrations import MIGRATIONS

    assert not [statement for statement in MIGRATIONS if "CONCURRENTLY" in statement.upper()]
