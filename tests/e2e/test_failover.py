"""A primary with a streaming standby, as managed PostgreSQL runs it, and the service through a failover.

Each test gets a pair of its own (``tests/support/standby.py``: PostgreSQL 15, initdb'd once per module,
the standby made with pg_basebackup, replicating synchronously), on free ports, removed afterwards. The
service is a real ``reducing-saver serve`` process given a URL that lists both servers and nothing else
(the service asks for the server that takes writes itself); agents run real LangGraph graphs through
``RemoteReducingSaver`` with its default retries while the primary dies and the standby is promoted.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.fleet import Agent, lost_turns, running, wait_delivered
from tests.support.quotes import quoted_line
from tests.support.server import CLI, ROOT, free_port, run_service
from tests.support.standby import make_pair, pair_template

DATABASE = "app"
ARGS = (
    "--pool-size", "3",
    "--db-timeout-seconds", "2",
    "--max-messages", "6",
    "--min-messages", "4",
    "--extraction-linger-seconds", "0",
)  # fmt: skip
#: How long the database takes no writes in each scenario: well inside the client's 30 s retry budget.
OUTAGE_SECONDS = 4.0


@pytest.fixture(scope="module")
def template():
    with pair_template() as folder:
        yield folder


@pytest.fixture
def pair(template):
    made = make_pair(template)
    try:
        made.create_database(DATABASE)
        yield made
    finally:
        made.close()


class ReadyProbe:
    """Asks /readyz every 0.5 s, each time in a thread of its own (an unready answer may take the probe's
    2 s): ``(asked, answered, status)`` of every answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(6)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _ask(self) -> None:
        asked = time.monotonic()
        status = httpx.get(f"{self.url}/readyz", timeout=10).status_code
        self.answers.append((asked, time.monotonic(), status))

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._pool.submit(self._ask)

    def __enter__(self) -> ReadyProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)
        self._pool.shutdown(wait=True)

    def between(self, start: float, end: float) -> list[int]:
        """The statuses of the answers asked for and given between ``start`` and ``end``."""
        return [status for asked, answered, status in self.answers if start <= asked and answered <= end]

    def ready_after(self, moment: float) -> float | None:
        """Seconds from ``moment`` to the first 200 asked for after it."""
        return min(
            (
                answered - moment
                for asked, answered, status in self.answers
                if asked > moment and status == 200
            ),
            default=None,
        )


def test_serve_pointed_at_a_standby_refuses_in_one_line(pair, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")}
    command = [str(CLI), "serve", "--port", str(free_port()), "--database", pair.standby.url(DATABASE)]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=60, env={**env, "PYTHONPATH": str(ROOT)}
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "accepts no writes" in lines[0] and "standby" in lines[0], lines
    quoted = quoted_line("docs/operations.md", "reducing-saver: the PostgreSQL server at ")  # for pg-2:5432
    assert quoted.replace("postgresql://app@pg-2:5432/app", pair.standby.url(DATABASE)) == lines[0]


@pytest.mark.parametrize("standby_first", [False, True], ids=["primary-first", "standby-first"])
def test_failover_to_the_promoted_standby_loses_no_acknowledged_turn(
    pair, tmp_path, standby_first, record_property
):
    """The primary crashes (pg_ctl stop -m immediate) with agents running; the standby is promoted 3 s later.
    Meanwhile calls get 503 and are retried, /readyz says not ready; afterwards the same process serves
    from the new primary: no restart, no acknowledged turn lost, none failed."""
    url = pair.multi_host_url(DATABASE, standby_first=standby_first)
    with run_service(tmp_path, "--database", url, *ARGS) as service, ReadyProbe(service.url) as ready:
        agents = [Agent(f"failover-{n}", [service.url]) for n in range(3)]
        with running(agents) as fleet:
            fleet.wait_for(30)
            before = fleet.acknowledged()
            pair.primary.stop("immediate")
            crashed = time.monotonic()
            time.sleep(OUTAGE_SECONDS)
            promoting = time.monotonic()
            pair.standby.promote()
            promoted = time.monotonic()
            fleet.wait_for(30, timeout=60)
        back = fleet.back_after(promoted)
        wait_delivered(service.url)
        lost = lost_turns(agents, service.url, pair.standby.url(DATABASE))
        unready = ready.between(crashed, promoting)
        ready_again = ready.ready_after(promoted)
        output = service.output()
        same_process = service.process.poll() is None

    record_property(
        "failover figures",
        f"{'standby' if standby_first else 'primary'} listed first: {fleet.figures()} ({before} before the crash), "
        f"{sum(map(len, lost.values()))} messages lost; turns of every agent through again "
        f"{back:.2f} s after promotion; /readyz 503 {unready.count(503)} of {len(unready)} times while no server took "
        f"writes, 200 again {ready_again:.2f} s after promotion",
    )
    assert fleet.failed() == 0, [error for agent in agents for _, error in agent.failures][:5]
    assert not lost, lost
    assert back is not None and back < 10, back
    assert unready and set(unready) == {503}, unready
    assert ready_again is not None, "/readyz never said ready after the promotion"
    assert same_process  # no restart
    assert "Traceback" not in output, output[-3000:]


def test_a_server_that_stops_taking_writes_is_an_outage_of_its_connections(pair, tmp_path, record_property):
    """The primary turns read-only under the service's open connections (default_transaction_read_only, set
    and reloaded as a failover tool or a full disk would): writes answer 503, never 500, and are retried;
    /readyz says not ready; once it takes writes again the same process serves, having dropped the
    connections that were read-only (psycopg_pool alone would keep them, and answer 500 for ever)."""
    with (
        run_service(tmp_path, "--database", pair.primary.url(DATABASE), *ARGS) as service,
        ReadyProbe(service.url) as ready,
    ):
        answers: list[tuple[float, float, int, str]] = []
        stop_probe = threading.Event()
        probe = threading.Thread(target=_put_probe, args=(service.url, stop_probe, answers), daemon=True)
        agents = [Agent(f"read-only-{n}", [service.url]) for n in range(2)]
        probe.start()
        with running(agents) as fleet:
            fleet.wait_for(20)
            turning = time.monotonic()
            pair.primary.sql("ALTER SYSTEM SET default_transaction_read_only = on")
            pair.primary.sql("SELECT pg_reload_conf()")
            turned = time.monotonic()
            time.sleep(OUTAGE_SECONDS)
            # Read-only until a probe put asked meanwhile was answered (a busy machine slows the probe).
            deadline = time.monotonic() + 30
            while not any(asked >= turned for asked, *_ in answers) and time.monotonic() < deadline:
                time.sleep(0.1)
            restoring = time.monotonic()
            pair.primary.sql("ALTER SYSTEM RESET default_transaction_read_only")
            pair.primary.sql("SELECT pg_reload_conf()")
            restored = time.monotonic()
            fleet.wait_for(20, timeout=60)
        stop_probe.set()
        probe.join(30)
        back = fleet.back_after(restored)
        wait_delivered(service.url)
        lost = lost_turns(agents, service.url, pair.primary.url(DATABASE))
        unready = ready.between(turned, restoring)

    # Every put that failed: while the server took no writes (each waiting up to twice the database timeout,
    # for a saver and then a connection), and only then.
    failed = [(status, detail) for _, _, status, detail in answers if status != 200]
    failed_at = [asked for asked, _, status, _ in answers if status != 200]
    record_property(
        "read-only figures",
        f"{fleet.figures()}, {sum(map(len, lost.values()))} messages lost; probe puts (no retries) {len(answers)}, "
        f"{len(failed)} answered 503 (none 500) while the server took no writes; turns of every agent through again "
        f"{back:.2f} s after it took writes again",
    )
    assert failed and all(status == 503 and "database" in detail for status, detail in failed), failed[:5]
    # Only puts asked while the server took no writes failed (or right after: the pool reconnects within 1 s).
    assert all(turning <= asked <= restored + 1.0 for asked in failed_at), [
        (round(asked - turning, 2), round(restored - turning, 2)) for asked in failed_at
    ]
    assert fleet.failed() == 0 and not lost, (fleet.figures(), lost)
    assert back is not None and back < 10
    assert unready and set(unready) == {503}, unready
    assert answers[-1][2] == 200


def _put_probe(url: str, stop: threading.Event, answers: list[tuple[float, float, int, str]]) -> None:
    """Writes without the client's retries: ``(asked, answered, status, detail)`` of each."""
    body = {
        "config": {"configurable": {"thread_id": "probe", "checkpoint_ns": ""}},
        "checkpoint": {"v": 4, "id": "", "ts": "2025-01-01T00:00:00+00:00", "channel_versions": {},
                       "versions_seen": {}},
        "values": {},
        "metadata": {},
        "new_versions": {},
    }  # fmt: skip
    with httpx.Client(base_url=url, timeout=30) as client:
        n = 0
        while not stop.is_set():
            body["checkpoint"]["id"] = f"1ef00000-0000-6000-8000-{n:012d}"
            asked = time.monotonic()
            response = client.post("/v1/checkpoints/put", json=body)
            detail = "" if response.status_code == 200 else str(response.json().get("detail"))
            answers.append((asked, time.monotonic(), response.status_code, detail))
            n += 1
            stop.wait(0.1)
