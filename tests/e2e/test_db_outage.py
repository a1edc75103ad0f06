"""A database outage seen from outside: a real service process whose PostgreSQL goes away for seconds.

The service reaches PostgreSQL through a TCP proxy the test cuts (every connection closed, new ones
closed at once) and restores, so the shared server is never touched. While it is cut, agents (sync and
async ``RemoteReducingSaver``, a real LangGraph graph) keep running turns, and a probe sends per-step
calls of its own: every failed answer must be a 503 naming the database, within the database timeout
plus a little; the agents' client must retry through the outage; once the proxy forwards again the
service must recover by itself, and no pruned message may be lost.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field

import httpx
import psycopg
import pytest
from langgraph.store.postgres import PostgresStore

from reducing_saver.client import RemoteReducingSaver
from reducing_saver.service.storage.postgres.connections import ServicePool, connection_kwargs, open_pool
from tests.support.chat import build_chat_graph, human
from tests.support.postgres import PG_HOST, PG_PORT
from tests.support.proxy import tcp_proxy
from tests.support.server import CLI, ROOT, run_service

DB_TIMEOUT = 2.0
OUTAGE_SECONDS = 8.0
#: How late a 503 may come: the database timeout, plus the time to notice a broken connection.
ANSWER_BUDGET = DB_TIMEOUT + 3.0
#: How soon after the database returns per-step calls must succeed again.
RECOVERY_BUDGET = 3.0


@dataclass
class Agent:
    prefix: str
    turns: int = 0
    errors: list[BaseException] = field(default_factory=list)

    @property
    def thread_id(self) -> str:
        return f"outage-{self.prefix}"

    def config(self) -> dict:
        return {"configurable": {"thread_id": self.thread_id}}

    def expected_ids(self) -> set[str]:
        ids = set()
        for turn in range(self.turns):
            ids |= {f"{self.prefix}-h-{turn:04d}", f"{self.prefix}-ai-{turn:04d}"}
        return ids


def run_sync_agent(url: str, agent: Agent, stop: threading.Event) -> None:
    try:
        with RemoteReducingSaver(url) as saver:
            graph = build_chat_graph(saver, prefix=agent.prefix, length=100)
            while not stop.is_set():
                graph.invoke({"messages": [human(agent.turns, agent.prefix, 100)]}, agent.config())
                agent.turns += 1
                time.sleep(0.2)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        agent.errors.append(exc)


def run_async_agent(url: str, agent: Agent, stop: threading.Event) -> None:
    async def turns() -> None:
        async with RemoteReducingSaver(url) as saver:
            graph = build_chat_graph(saver, prefix=agent.prefix, length=100)
            while not stop.is_set():
                await graph.ainvoke({"messages": [human(agent.turns, agent.prefix, 100)]}, agent.config())
                agent.turns += 1
                await asyncio.sleep(0.2)

    try:
        asyncio.run(turns())
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        agent.errors.append(exc)


@dataclass
class Answer:
    at: float
    status: int
    seconds: float
    detail: str


def probe(url: str, stop: threading.Event, answers: list[Answer]) -> None:
    """Per-step calls without the client's retries: what the service answers, and how fast."""
    body = {"config": {"configurable": {"thread_id": "outage-probe", "checkpoint_ns": ""}}}
    with httpx.Client(base_url=url, timeout=60.0) as client:
        while not stop.is_set():
            started = time.monotonic()
            response = client.post("/v1/checkpoints/get", json=body)
            detail = "" if response.status_code == 200 else str(response.json().get("detail"))
            answers.append(Answer(started, response.status_code, time.monotonic() - started, detail))
            time.sleep(0.1)


def wait_drained(url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = httpx.get(f"{url}/v1/extraction/status", timeout=10).json()
        if status["pending"] == 0 and status["in_flight"] == 0:
            return status
        assert time.monotonic() < deadline, f"outbox not drained: {status}"
        time.sleep(0.2)


def test_an_outage_gives_503s_naming_the_database_the_client_retries_and_the_service_recovers(
    fresh_pg, tmp_path, record_property
):
    with tcp_proxy((PG_HOST, int(PG_PORT))) as proxy:
        args = (
            "--database", proxy.url(fresh_pg),
            "--pool-size", "3",
            "--db-timeout-seconds", str(DB_TIMEOUT),
            "--max-messages", "6",
            "--min-messages", "4",
            "--extraction-linger-seconds", "0",
        )  # fmt: skip
        with run_service(tmp_path, *args) as service:
            stop = threading.Event()
            agents = [Agent("sync"), Agent("async")]
            answers: list[Answer] = []
            threads = [
                threading.Thread(target=run_sync_agent, args=(service.url, agents[0], stop)),
                threading.Thread(target=run_async_agent, args=(service.url, agents[1], stop)),
                threading.Thread(target=probe, args=(service.url, stop, answers)),
            ]
            for thread in threads:
                thread.start()
            try:
                time.sleep(2.0)
                turns_before = [agent.turns for agent in agents]
                proxy.cut()
                cut_at = time.monotonic()
                time.sleep(OUTAGE_SECONDS)
                proxy.restore()
                restored_at = time.monotonic()
                time.sleep(8.0)
            finally:
                stop.set()
                for thread in threads:
                    thread.join(60)
            output = service.output()

            for agent in agents:
                assert not agent.errors, f"{agent.prefix} agent failed: {agent.errors!r}\n{output[-4000:]}"
            # The agents made progress before, and carried on after (every turn retried through the cut).
            assert all(before >= 2 for before in turns_before), turns_before
            assert all(
                agent.turns > before + 3 for agent, before in zip(agents, turns_before, strict=True)
            ), [(agent.turns, before) for agent, before in zip(agents, turns_before, strict=True)]

            during = [a for a in answers if cut_at <= a.at < restored_at]
            failed = [a for a in answers if a.status != 200]
            assert any(a.status == 503 for a in during), "the cut produced no 503: the test proves nothing"
            assert all(a.status == 503 for a in failed), [(a.status, a.detail) for a in failed]
            assert all("database" in a.detail for a in failed), [a.detail for a in failed]
            slowest = max(a.seconds for a in failed)
            assert slowest <= ANSWER_BUDGET, f"a 503 took {slowest:.2f} s"
            recovered = min(a.at + a.seconds for a in answers if a.status == 200 and a.at >= restored_at)
            assert recovered - restored_at <= RECOVERY_BUDGET, (
                f"recovered {recovered - restored_at:.2f} s after"
            )
            assert all(a.status == 200 for a in answers if a.at >= recovered)
            # Delivery failed its rounds while the database was gone: one warning line, no traceback, counted.
            lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
            delivery = [line for line in lines if "delivery round failed" in line["message"]]
            assert "Traceback" not in output, output[-3000:]
            assert len(delivery) == 1 and delivery[0]["level"] == "WARNING", delivery
            metrics = httpx.get(f"{service.url}/metrics", timeout=10).text
            counted = re.search(
                r'^reducing_saver_background_errors_total\{kind="transient",task="delivery"\} (\S+)$',
                metrics,
                re.M,
            )
            assert counted and float(counted.group(1)) >= 1, metrics
            record_property(
                "outage figures",
                f"503s: {len(failed)}, slowest {slowest:.2f} s, median "
                f"{sorted(a.seconds for a in failed)[len(failed) // 2]:.2f} s; recovered "
                f"{recovered - restored_at:.2f} s after the restore; turns {[a.turns for a in agents]}",
            )

            # Nothing lost: every message of every turn is in the thread's window or in long-term memory.
            wait_drained(service.url)
            with RemoteReducingSaver(service.url) as saver, PostgresStore.from_conn_string(fresh_pg) as store:
                for agent in agents:
                    window = saver.get_tuple(agent.config()).checkpoint["channel_values"]["messages"]
                    kept = {m.id for m in window}
                    stored = {item.key for item in store.search(("memories", agent.thread_id), limit=10_000)}
                    missing = agent.expected_ids() - kept - stored
                    assert not missing, f"{agent.prefix}: lost {sorted(missing)}"


GRACE = 2.0
LEASE = 6.0


def claimed_rows(database: str) -> list[tuple[str, object]]:
    with psycopg.connect(database) as conn:
        return conn.execute(
            "SELECT key, lease_until FROM reducing_saver_outbox "
            "WHERE claimed_by IS NOT NULL AND status = 'pending'"
        ).fetchall()


def test_sigterm_ends_the_service_within_the_grace_while_the_database_hangs_and_claims_come_back_by_lease(
    fresh_pg, tmp_path, record_property
):
    with tcp_proxy((PG_HOST, int(PG_PORT))) as proxy:
        args = (
            "--database", proxy.url(fresh_pg),
            "--pool-size", "3",
            "--db-timeout-seconds", "2",
            "--max-messages", "4",
            "--min-messages", "2",
            "--extractor", "tests.support.extractors:slow",
            "--extraction-lease-seconds", str(LEASE),
            "--extraction-linger-seconds", "0",
            "--shutdown-grace-seconds", str(GRACE),
        )  # fmt: skip
        env = {"RS_TEST_EXTRACT_SECONDS": "60"}
        with run_service(tmp_path, *args, env=env) as service:
            agent = Agent("term")
            with RemoteReducingSaver(service.url) as saver:
                graph = build_chat_graph(saver, prefix=agent.prefix, length=100)
                for _ in range(4):
                    graph.invoke({"messages": [human(agent.turns, agent.prefix, 100)]}, agent.config())
                    agent.turns += 1
            deadline = time.monotonic() + 30
            while not (claimed := claimed_rows(fresh_pg)):
                assert time.monotonic() < deadline, "the deliverer claimed nothing"
                time.sleep(0.2)

            # The database stops answering: connections stay open, statements and connects wait forever.
            proxy.hang()
            body = {"config": {"configurable": {"thread_id": agent.thread_id, "checkpoint_ns": ""}}}
            stuck = threading.Thread(
                target=lambda: httpx.post(f"{service.url}/v1/checkpoints/get", json=body, timeout=120),
                daemon=True,
            )
            stuck.start()  # a request in flight, waiting on the database
            time.sleep(0.5)
            started = time.monotonic()
            service.process.terminate()
            try:
                service.process.wait(timeout=GRACE + 60)
            except subprocess.TimeoutExpired:
                pass
            took = time.monotonic() - started
            assert service.process.returncode is not None, f"still running {took:.0f} s after SIGTERM"
            output = service.output()
            assert took <= GRACE + 5, f"SIGTERM took {took:.1f} s\n{output[-3000:]}"
            assert service.process.returncode == 0, output[-3000:]
            record_property("shutdown figures", f"SIGTERM to exit {took:.2f} s with a grace of {GRACE:g} s")

    # The rows it held stay claimed, as after a crash; another process delivers them once the lease ends.
    still = claimed_rows(fresh_pg)
    assert {key for key, _ in still} == {key for key, _ in claimed}
    lease_end = max(lease_until for _, lease_until in still)
    with run_service(tmp_path, "--database", fresh_pg, "--extraction-linger-seconds", "0") as service:
        wait_drained(service.url)
    with psycopg.connect(fresh_pg) as conn:
        rows = conn.execute(
            "SELECT key, status, delivered_at FROM reducing_saver_outbox WHERE key = ANY(%s)",
            [[key for key, _ in claimed]],
        ).fetchall()
    assert rows and all(status == "done" and delivered_at >= lease_end for _, status, delivered_at in rows)
    with PostgresStore.from_conn_string(fresh_pg) as store:
        stored = {item.key for item in store.search(("memories", agent.thread_id), limit=1000)}
    assert {key for key, _ in claimed} <= stored


def test_a_connection_attempt_that_gets_no_answer_gives_up_so_the_pool_recovers(fresh_pg):
    """A partition leaves connection attempts unanswered for good; the pool must not wait on them."""
    with tcp_proxy((PG_HOST, int(PG_PORT))) as proxy:
        proxy.hang()
        with pytest.raises(Exception, match="incomplete after 2.0 sec"):
            open_pool(proxy.url(fresh_pg), size=1, timeout=2.0)  # closes the pool it opened
        pool = ServicePool(
            proxy.url(fresh_pg),
            min_size=1,
            max_size=1,
            kwargs=connection_kwargs(proxy.url(fresh_pg), timeout=2.0),
            open=False,
            timeout=2.0,
        )
        pool.open(wait=False)
        try:
            time.sleep(0.5)  # its first attempt waits on a connection that will never answer
            proxy.restore(close_hung=False)
            started = time.monotonic()
            with pool.connection(timeout=10.0) as conn:
                assert conn.execute("SELECT 1").fetchone()
            assert time.monotonic() - started < 5.0
        finally:
            pool.close(timeout=1.0)


def test_sigterm_ends_a_worker_process_within_the_grace_while_the_database_hangs(fresh_pg, tmp_path):
    # Pending rows, from a service that does not deliver.
    args = ("--database", fresh_pg, "--no-extract", "--max-messages", "4", "--min-messages", "2")
    with run_service(tmp_path, *args) as service, RemoteReducingSaver(service.url) as saver:
        graph = build_chat_graph(saver, prefix="w", length=50)
        for turn in range(4):
            graph.invoke({"messages": [human(turn, "w", 50)]}, {"configurable": {"thread_id": "outage-w"}})
    with tcp_proxy((PG_HOST, int(PG_PORT))) as proxy:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")},
            "PYTHONPATH": str(ROOT),
            "RS_TEST_EXTRACT_SECONDS": "60",
            "REDUCING_SAVER_SHUTDOWN_GRACE_SECONDS": str(GRACE),
            "REDUCING_SAVER_DB_TIMEOUT_SECONDS": "2",
        }
        command = [
            str(CLI), "worker", "--database", proxy.url(fresh_pg),
            "--extractor", "tests.support.extractors:slow", "--extraction-lease-seconds", str(LEASE),
        ]  # fmt: skip
        log = tmp_path / "worker.log"
        with log.open("wb") as out:
            worker = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        try:
            deadline = time.monotonic() + 30
            while not claimed_rows(fresh_pg):
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            proxy.hang()
            time.sleep(0.5)
            started = time.monotonic()
            worker.terminate()
            try:
                worker.wait(timeout=GRACE + 60)
            except subprocess.TimeoutExpired:
                pass
            took = time.monotonic() - started
            assert worker.returncode is not None, f"still running {took:.0f} s after SIGTERM"
            assert took <= GRACE + 5, f"SIGTERM took {took:.1f} s\n{log.read_text()[-3000:]}"
            assert worker.returncode == 0, log.read_text()[-3000:]
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    assert claimed_rows(fresh_pg)  # left to their lease, as after a crash


def test_pool_connections_bound_connecting_and_notice_a_silent_peer(fresh_pg):
    """libpq takes the settings that bound a partition's effects (it ignores names it does not know)."""
    pool = open_pool(fresh_pg, size=1, timeout=3.0)
    try:
        with pool.connection() as conn:
            parameters = conn.info.get_parameters()
    finally:
        pool.close()
    assert parameters["connect_timeout"] == "3"
    assert parameters["keepalives"] == "1"
    assert int(parameters["tcp_user_timeout"]) > 0
