"""PgBouncer between the service and PostgreSQL, in transaction mode: each transaction of a client runs on
whichever server connection is free, so nothing of a session (a prepared statement, a session-level
advisory lock) outlives a transaction. Debian 12's PgBouncer 1.18 cannot keep prepared statements per
client (no ``max_prepared_statements``).

One PgBouncer for the module (Debian's package, installed if missing, on a free port, fewer server
connections than the replicas have), in front of the shared PostgreSQL; every replica is a real
``reducing-saver serve`` process, the agents real LangGraph graphs on ``RemoteReducingSaver``.
"""

from __future__ import annotations

import os
import subprocess
import time

import httpx
import psycopg
import pytest

from reducing_saver.service.storage.postgres.connections import setup_lock
from tests.support.fleet import Agent, lost_turns, running, wait_delivered
from tests.support.pgbouncer import pgbouncer
from tests.support.postgres import PG_HOST, PG_PORT
from tests.support.quotes import quoted_line
from tests.support.server import CLI, ROOT, free_port, run_services

REPLICAS = 4
#: Server connections PgBouncer opens to PostgreSQL: fewer than the replicas' pools hold (4 x 3).
SERVER_CONNECTIONS = 5
OFF = "--no-postgres-prepared-statements"
WINDOW = ("--max-messages", "6", "--min-messages", "4")
#: Every background task at work: delivery (at once), running summaries, TTL sweeps every second of
#: threads idle for 2 s (keep_latest: a swept thread keeps its state).
BACKGROUND = (
    "--summarizer", "tests.support.summarizers:verbatim",
    "--extraction-linger-seconds", "0",
    "--default-ttl", "2s",
    "--sweep-interval", "1s",
)  # fmt: skip


@pytest.fixture(scope="module")
def bouncer():
    with pgbouncer(
        (PG_HOST, int(PG_PORT)), mode="transaction", server_connections=SERVER_CONNECTIONS
    ) as running:
        yield running


def _command_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def test_prepared_statements_behind_transaction_pooling_are_refused_in_one_line(bouncer, fresh_pg, tmp_path):
    """Left on (the default), prepared statements behind PgBouncer 1.18 in transaction mode collide: ``serve``
    refuses to start, in one line naming the setting, before it binds anything of the database."""
    command = [str(CLI), "serve", "--port", str(free_port()), "--database", bouncer.url(fresh_pg)]
    started = time.monotonic()
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env=_command_env(), cwd=tmp_path
    )
    took = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output, output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, output
    assert lines[0].startswith("reducing-saver: PostgreSQL at ")
    assert "REDUCING_SAVER_POSTGRES_PREPARED_STATEMENTS=false" in lines[0] and OFF in lines[0]
    assert took < 30, f"the refusal took {took:.1f} s"
    # docs/operations.md quotes the line, for a PgBouncer at pgbouncer:6432.
    quoted = quoted_line("docs/operations.md", "reducing-saver: PostgreSQL at ")
    assert quoted.replace("postgresql://app@pgbouncer:6432/app", bouncer.url(fresh_pg)) == lines[0]


def test_replicas_starting_together_through_transaction_pooling_serve_deliver_summarize_and_sweep(
    bouncer, fresh_pg, tmp_path, record_property
):
    """Four replicas through PgBouncer and one straight to PostgreSQL start at the same moment on an empty
    database (the migrations run once, under a transaction-level lock), then agents run turns spread over
    all five while every replica delivers, summarizes and sweeps: no turn fails, none is lost."""
    through = bouncer.url(fresh_pg)
    replicas = [
        ("--database", through, OFF, "--pool-size", "3", *WINDOW, *BACKGROUND) for _ in range(REPLICAS)
    ]
    direct = ("--database", fresh_pg, "--pool-size", "3", *WINDOW, *BACKGROUND)  # prepared statements on
    started = time.monotonic()
    with run_services(tmp_path, *replicas, direct, timeout=90) as services:
        ready_after = time.monotonic() - started
        urls = [service.url for service in services]
        # Two threads that go idle: the sweeps prune them once they have been idle for 2 s.
        idle = [Agent(f"pgb-idle-{n}", urls) for n in range(2)]
        with running(idle) as fleet:
            fleet.wait_for(4)
        agents = [Agent(f"pgb-{n}", urls) for n in range(6)]
        with running(agents) as fleet:
            fleet.wait_for(150, timeout=180)
        outputs = {service.url: service.output() for service in services}
        wait_delivered(urls[0])
        lost = lost_turns(agents + idle, urls[0], fresh_pg)
        status = httpx.get(f"{urls[0]}/v1/extraction/status", timeout=10).json()
        deadline = time.monotonic() + 30
        while not (swept := _swept(fresh_pg)):
            assert time.monotonic() < deadline, "no thread was swept"
            time.sleep(0.5)

    failures = [error for agent in agents + idle for _, error in agent.failures]
    acknowledged = sum(len(agent.acknowledged) for agent in agents + idle)
    record_property(
        "pgbouncer figures",
        f"{bouncer.version}, transaction mode, {SERVER_CONNECTIONS} server connections; {REPLICAS} replicas "
        f"through it + 1 direct ready {ready_after:.1f} s after starting together; {acknowledged} turns "
        f"acknowledged, {len(failures)} failed, {sum(map(len, lost.values()))} messages lost; summary steps done "
        f"{status['summaries']['done_steps']}, outbox delivered {status['delivered']}, threads swept {swept}",
    )
    assert not failures, failures[:5]
    assert not lost, lost
    assert status["summaries"]["done_steps"] > 0 and status["delivered"] > 0, status
    for url, output in outputs.items():
        assert "Traceback" not in output and " ERROR " not in output, f"{url}:\n{output[-3000:]}"
    assert "you don't own a lock" not in bouncer.output()


def _swept(database: str) -> int:
    with psycopg.connect(database) as conn:
        return conn.execute("SELECT count(*) FROM reducing_saver_sweep_log").fetchone()[0]


@pytest.mark.parametrize(
    "command",
    [("migrate",), ("extraction", "status"), ("sweep",), ("report",)],
    ids=lambda command: " ".join(command),
)
def test_the_commands_work_through_transaction_pooling(bouncer, make_database, tmp_path, command):
    """Every command opens its connections with the setting, the set-up ones included."""
    database = make_database()
    through = bouncer.url(database)
    setup = subprocess.run(
        [str(CLI), "migrate", "--database", through, OFF], capture_output=True, text=True, timeout=120,
        env=_command_env(), cwd=tmp_path,
    )  # fmt: skip
    assert setup.returncode == 0, setup.stderr
    result = subprocess.run(
        [str(CLI), *command, "--database", through], capture_output=True, text=True, timeout=120,
        env=_command_env(REDUCING_SAVER_POSTGRES_PREPARED_STATEMENTS="false"), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_the_set_up_lock_is_released_through_transaction_pooling(bouncer, fresh_pg):
    """A session-level advisory lock taken through PgBouncer in transaction mode stays with the server
    connection that took it: once another client's transaction holds that one, the unlock runs elsewhere
    ("you don't own a lock") and the lock stays held for good, so the next replica to start waits forever.
    The set-up lock is held by a transaction: the same server connection from lock to release."""
    key = 0x5EED
    through = bouncer.url(fresh_pg)
    with (
        psycopg.connect(through, autocommit=True, prepare_threshold=None) as holder,
        psycopg.connect(through, autocommit=True, prepare_threshold=None) as other,
        psycopg.connect(fresh_pg, autocommit=True) as direct,
    ):
        with setup_lock(holder, key):
            other.execute("BEGIN")  # another client's transaction, on the server connection freed last
            other.execute("SELECT 1")
        other.execute("COMMIT")
        held = direct.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid = (%s::bigint >> 32)::oid AND objid = (%s::bigint & 4294967295)::oid AND objsubid = 1",
            (key, key),
        ).fetchone()[0]
    assert held == 0, "the set-up lock outlived its holder"
