"""Limits an operator sets on the database: ``statement_timeout`` and ``lock_timeout``.

A statement the database cancels is no outage: the same call would run as long again, so the service
answers 504 with ``code: database_timeout`` and the client raises ``DatabaseTimeoutError`` at once instead of
retrying for half a minute. The limits are set as an operator sets them (``ALTER DATABASE ... SET``), on a
database of the test's own on the shared server; a table locked from another session makes a statement
wait past them, every time.
"""

from __future__ import annotations

import re
import statistics
import time

import httpx
import psycopg
import pytest
from langgraph.checkpoint.postgres import PostgresSaver

from reducing_saver.client import DatabaseTimeoutError, RemoteReducingSaver
from tests.support.fleet import Agent, lost_turns, running, wait_delivered
from tests.support.server import run_service

ARGS = ("--pool-size", "3", "--db-timeout-seconds", "2", "--max-messages", "6", "--min-messages", "4")


def _set(database: str, **limits: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        name = conn.info.dbname
        for setting, value in limits.items():
            conn.execute(f"ALTER DATABASE \"{name}\" SET {setting} = '{value}'")


def _requests(url: str, route: str, status: int) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = rf'reducing_saver_http_requests_total\{{method="POST",route="{re.escape(route)}",status="{status}"\}} (\S+)'
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize(
    ("limit", "cancelled"),
    [("statement_timeout", "statement timeout"), ("lock_timeout", "lock timeout")],
)
def test_a_statement_the_database_cancels_is_a_504_the_client_raises_without_retrying(
    fresh_pg, tmp_path, limit, cancelled, record_property
):
    _set(fresh_pg, **{limit: "300ms"})
    with run_service(tmp_path, "--database", fresh_pg, *ARGS) as service:
        agent = Agent("timeout", [service.url])
        with running([agent]) as fleet:
            fleet.wait_for(3)
        with RemoteReducingSaver(service.url) as saver, psycopg.connect(fresh_pg) as locker:
            # Another session holds the checkpoint table: the list waits for it until the limit cancels it.
            locker.execute("SET statement_timeout = 0")
            locker.execute("LOCK TABLE checkpoints IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            with pytest.raises(DatabaseTimeoutError) as raised:
                list(saver.list(agent.config()))
            took = time.monotonic() - started
            locker.rollback()
            assert len(list(saver.list(agent.config()))) > 0  # the lock gone, the same call goes through
        answered_504 = _requests(service.url, "/v1/checkpoints/list", 504)
        answered_503 = _requests(service.url, "/v1/checkpoints/list", 503)

    record_property(
        f"{limit} figures",
        f"list under {limit}=300ms with the table locked: 504 after {took:.2f} s, not retried",
    )
    error = raised.value
    assert error.status_code == 504 and cancelled in str(error) and limit in str(error), str(error)
    assert (answered_504, answered_503) == (1, 0)  # asked once: no retry, and never called an outage
    assert took < 5


def test_per_step_calls_fit_a_short_statement_timeout_and_lists_take_what_they_read(
    fresh_pg, tmp_path, record_property
):
    """The smallest statement_timeout docs/operations.md names (100 ms), set on the database: agents' turns,
    delivery, sweeps and the storage figures run under it with no failure. A list reads every checkpoint it
    answers with its values: timed here for a 360-checkpoint thread, whole and in pages."""
    # One thread of 360 checkpoints, listed whole and a page of 50 (timed, without a limit).
    with (
        run_service(tmp_path, "--database", fresh_pg, *ARGS) as service,
        RemoteReducingSaver(service.url) as saver,
    ):
        long = Agent("long", [service.url])
        with running([long]) as writer:
            writer.wait_for(120, timeout=180)
        checkpoints = len(list(saver.list(long.config(), limit=1000)))
        whole = _timed(lambda: list(saver.list(long.config(), limit=1000)))
        pages = _timed(lambda: list(saver.list(long.config(), limit=50)))
    # What the database alone takes for it: a stock PostgresSaver's list, on one connection.
    with PostgresSaver.from_conn_string(fresh_pg) as stock:
        stock_whole = _timed(lambda: list(stock.list(long.config(), limit=1000)))

    _set(fresh_pg, statement_timeout="100ms")
    args = (*ARGS, "--extraction-linger-seconds", "0", "--default-ttl", "2s", "--sweep-interval", "1s",
            "--storage-refresh-seconds", "1")  # fmt: skip
    with run_service(tmp_path, "--database", fresh_pg, *args) as service:
        agents = [Agent(f"short-{n}", [service.url]) for n in range(3)]
        with running(agents) as fleet:
            fleet.wait_for(180, timeout=180)
        wait_delivered(service.url)
        lost = lost_turns(agents, service.url, fresh_pg)
        metrics = httpx.get(f"{service.url}/metrics", timeout=10).text
        background = sum(
            float(value)
            for value in re.findall(r"^reducing_saver_background_errors_total\{.*\} (\S+)$", metrics, re.M)
        )

    record_property(
        "statement_timeout figures",
        f"under statement_timeout=100ms: {fleet.figures()}, {sum(map(len, lost.values()))} messages lost, "
        f"{background:g} background errors; a list of {checkpoints} checkpoints: {whole * 1000:.0f} ms whole, "
        f"{pages * 1000:.0f} ms for its first page of 50 (a stock PostgresSaver's list of it in process: "
        f"{stock_whole * 1000:.0f} ms)",
    )
    assert fleet.failed() == 0, [error for agent in agents for _, error in agent.failures][:3]
    assert not lost and background == 0
    assert checkpoints >= 360


def _timed(call) -> float:
    """The median of five runs of ``call``, in seconds."""
    runs = []
    for _ in range(5):
        started = time.monotonic()
        call()
        runs.append(time.monotonic() - started)
    return statistics.median(runs)
