"""Upgrading from the previous release: its databases, its clients, and this release's clients against it.

The previous release runs from its wheel in a virtual environment of its own
(``tests/support/previous_release.py``), as real uvicorn processes and real LangGraph graphs.
"""

from __future__ import annotations

import importlib.metadata
import json
import sqlite3
import subprocess
import time
from collections import Counter
from contextlib import ExitStack, closing

import httpx
import psycopg
import pytest

from reducing_saver.client import RemoteReducingSaver, RemoteStore
from reducing_saver.service.storage.postgres import migrations as pg_migrations
from reducing_saver.service.storage.sqlite import migrations as sqlite_migrations
from reducing_saver.service.version import __version__
from tests.support.chat import build_chat_graph, human
from tests.support.fleet import Agent, lost_turns, running, wait_delivered
from tests.support.previous_release import VERSION, build, run_previous_service, version_key
from tests.support.server import run_service

#: A small window, so a few turns prune messages into the outbox.
WINDOW = ("--max-messages", "6", "--min-messages", "4")
TURNS = 5
KEPT, DOOMED, PENDING = ["kept-1", "kept-2"], ["doomed-1"], ["pending-1", "pending-2"]
NOTES = ["notes", "user-1"]


@pytest.fixture(scope="session")
def previous_release(tmp_path_factory):
    return build(tmp_path_factory.mktemp("previous-release") / "venv")


class Database:
    """The rows of the service's tables, read the same way on both backends."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.postgres = url.startswith("postgres")

    def rows(self, sql: str) -> list[tuple]:
        if self.postgres:
            with psycopg.connect(self.url) as conn:
                return conn.execute(sql).fetchall()
        with closing(sqlite3.connect(self.url.removeprefix("sqlite:///"))) as conn:
            return conn.execute(sql).fetchall()

    def outbox(self) -> dict[tuple, str]:
        """``(namespace, key) -> status`` of every outbox row."""
        rows = self.rows("SELECT namespace, key, status FROM reducing_saver_outbox")
        return {
            (tuple(ns) if self.postgres else tuple(json.loads(ns)), key): status for ns, key, status in rows
        }

    def version(self) -> int:
        if self.postgres:
            with psycopg.connect(self.url) as conn:
                return pg_migrations.version(conn)
        with closing(sqlite3.connect(self.url.removeprefix("sqlite:///"))) as conn:
            return sqlite_migrations.version(conn.cursor())

    def latest(self) -> int:
        return pg_migrations.LATEST if self.postgres else sqlite_migrations.LATEST


def _statuses(outbox: dict[tuple, str]) -> Counter:
    return Counter(outbox.values())


def _wait(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture(params=["postgres", "sqlite"])
def database_url(request, tmp_path):
    if request.param == "postgres":
        return request.getfixturevalue("fresh_pg")
    return f"sqlite:///{tmp_path}/service.sqlite"


def test_a_database_of_the_previous_release_is_migrated_and_served(
    previous_release, database_url, tmp_path, make_database
):
    db = Database(database_url)
    # -- the previous release creates and fills the database ------------------------------------------
    with run_previous_service(
        previous_release,
        tmp_path,
        "--database",
        database_url,
        *WINDOW,
        "--extractor",
        "tests.support.previous_release:refuses_doomed",
        "--extraction-max-attempts",
        "1",
    ) as url:
        before = previous_release.agent("chat", url=url, threads=KEPT + DOOMED, turns=TURNS)
        _wait(lambda: "pending" not in _statuses(db.outbox()), "the previous release to deliver")
    with run_previous_service(
        previous_release, tmp_path, "--database", database_url, *WINDOW, "--no-extract"
    ) as url:
        before |= previous_release.agent("chat", url=url, threads=PENDING, turns=TURNS)
        stored = previous_release.agent(
            "store", url=url, namespace=NOTES, items={"a": {"n": 1}, "b": {"n": 2}}
        )
        assert stored["got"] == {"a": {"n": 1}, "b": {"n": 2}}
    old_outbox = db.outbox()
    figures = _statuses(old_outbox)
    assert figures["done"] > 0 and figures["dead"] > 0 and figures["pending"] > 0, figures
    pending = {ident for ident, status in old_outbox.items() if status == "pending"}
    assert {ns[-1] for ns, _ in pending} == set(PENDING)
    old_ledger = set(db.rows("SELECT thread_id FROM reducing_saver_threads"))
    assert {row[0] for row in old_ledger} == set(KEPT + DOOMED + PENDING)
    old_items = set(db.rows("SELECT prefix, key FROM store"))
    assert ("notes.user-1", "a") in old_items and len(old_items) > 2  # notes and delivered memories
    assert db.version() == previous_release.schema["postgres" if db.postgres else "sqlite"]

    # -- this release opens it: migrates, serves every old thread, delivers the pending rows once ------
    calls_db = make_database()
    with run_service(
        tmp_path,
        "--database",
        database_url,
        *WINDOW,
        "--extractor",
        "tests.support.extractors:counting",
        "--log-format",
        "text",
        env={"RS_TEST_CALLS_DB": calls_db},
    ) as service:
        _wait(lambda: "pending" not in _statuses(db.outbox()), "the new service to deliver")
        time.sleep(1.0)  # a second delivery, if there were one, would have happened by now
        with RemoteReducingSaver(service.url) as saver:
            for thread, ids in before.items():
                stored = saver.get_tuple({"configurable": {"thread_id": thread}})
                assert [m.id for m in stored.checkpoint["channel_values"]["messages"]] == ids, thread
            graph = build_chat_graph(saver, prefix="kept-1", length=60)
            config = {"configurable": {"thread_id": "kept-1"}}
            graph.invoke({"messages": [human(TURNS, "kept-1", 60)]}, config)
            assert len(graph.get_state(config).values["messages"]) <= 6
        # The previous release's client reads the same threads from this release's service.
        assert previous_release.agent("threads", url=service.url, threads=PENDING + DOOMED) == {
            thread: before[thread] for thread in PENDING + DOOMED
        }
    assert f"reducing-saver schema from none to version {db.latest()}" in service.output()
    assert db.version() == db.latest()

    with psycopg.connect(calls_db) as conn:
        delivered = Counter(
            (tuple(ns), key) for ns, key in conn.execute("SELECT namespace, key FROM extractor_calls")
        )
    new_rows = {ident for ident in db.outbox() if ident not in old_outbox}  # the turn on kept-1
    assert set(delivered) == pending | new_rows  # the pending rows, none delivered before
    assert set(delivered.values()) == {1}  # each exactly once
    outbox = db.outbox()
    assert {ident: outbox[ident] for ident in old_outbox} == {
        ident: "done" if status == "pending" else status for ident, status in old_outbox.items()
    }  # delivered and dead rows kept as they were
    assert old_ledger <= set(db.rows("SELECT thread_id FROM reducing_saver_threads"))
    assert old_items <= set(db.rows("SELECT prefix, key FROM store"))


def test_the_previous_releases_clients_work_against_this_service(previous_release, fresh_pg, tmp_path):
    """Agents upgrade later than the service: the old RemoteReducingSaver runs a chat graph, the old
    RemoteStore puts, gets, searches, lists and deletes."""
    with run_service(tmp_path, "--database", fresh_pg, *WINDOW, "--no-extract") as service:
        seen = previous_release.agent("chat", url=service.url, threads=["old-client"], turns=TURNS)
        assert len(seen["old-client"]) <= 6 and seen["old-client"][-1] == f"old-client-ai-{TURNS - 1:04d}"
        assert previous_release.agent("threads", url=service.url, threads=["old-client"]) == seen
        stored = previous_release.agent(
            "store", url=service.url, namespace=NOTES, items={"a": {"n": 1}, "gone": {"n": 0}}
        )
        assert stored == {
            "got": {"a": {"n": 1}, "gone": {"n": 0}},
            "searched": ["a", "gone"],
            "namespaces": [NOTES],
            "deleted": True,
        }
        with RemoteReducingSaver(service.url) as saver:  # what the old client wrote, read by the new one
            stored_tuple = saver.get_tuple({"configurable": {"thread_id": "old-client"}})
            assert [m.id for m in stored_tuple.checkpoint["channel_values"]["messages"]] == seen["old-client"]


def test_this_releases_clients_work_against_the_previous_service(previous_release, fresh_pg, tmp_path):
    """A service upgrades later than its agents: this release's clients against the previous release's."""
    with run_previous_service(
        previous_release, tmp_path, "--database", fresh_pg, *WINDOW, "--no-extract"
    ) as url:
        with RemoteReducingSaver(url) as saver:
            graph = build_chat_graph(saver, prefix="new-client", length=60)
            config = {"configurable": {"thread_id": "new-client"}}
            for turn in range(TURNS):
                graph.invoke({"messages": [human(turn, "new-client", 60)]}, config)
            ids = [m.id for m in graph.get_state(config).values["messages"]]
            assert len(ids) <= 6 and ids[-1] == f"new-client-ai-{TURNS - 1:04d}"
        with RemoteStore(url) as store:
            store.put(tuple(NOTES), "a", {"n": 1})
            assert store.get(tuple(NOTES), "a").value == {"n": 1}
            assert [item.key for item in store.search(tuple(NOTES))] == ["a"]
        assert previous_release.agent("threads", url=url, threads=["new-client"]) == {"new-client": ids}
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200


def test_the_previous_release_is_what_runs(previous_release):
    """The old environment imports the wheel's code, of the newest release before this one, whose schema is
    this one's or older."""
    seen = previous_release.agent("identify")
    assert seen["version"] == VERSION and version_key(VERSION) < version_key(
        importlib.metadata.version("reducing-saver")
    )
    assert (
        seen["schema"]["postgres"] <= pg_migrations.LATEST
        and seen["schema"]["sqlite"] <= sqlite_migrations.LATEST
    )
    result = subprocess.run(
        [str(previous_release.cli), "--version"], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == f"reducing-saver {VERSION}"


def test_the_previous_release_and_this_one_serve_one_database_together(
    previous_release, fresh_pg, tmp_path, make_database
):
    """The first rollout of an upgrade from the previous release (docs/migrations.md): this release migrates
    the database while a previous-release replica serves it, then both serve the same threads, turn by turn
    in alternation, with the settings the previous release knows (no summarizer, no encryption). Every
    pruned message is delivered once, by one of the two, and both read every thread alike."""
    db = Database(fresh_pg)
    calls_db = make_database()
    extract = ("--extractor", "tests.support.extractors:counting", "--extraction-linger-seconds", "0")
    with (
        run_previous_service(
            previous_release,
            tmp_path,
            "--database",
            fresh_pg,
            *WINDOW,
            "--extractor",
            "tests.support.extractors:counting",
            env={"RS_TEST_CALLS_DB": calls_db},
        ) as old_url,
        run_service(
            tmp_path, "--database", fresh_pg, *WINDOW, *extract, env={"RS_TEST_CALLS_DB": calls_db}
        ) as new,
        RemoteReducingSaver(old_url) as old_saver,
        RemoteReducingSaver(new.url) as new_saver,
    ):
        assert db.version() == db.latest()
        threads = ["mixed-1", "mixed-2"]
        graphs = {thread: build_chat_graph(old_saver, prefix=thread, length=60) for thread in threads}
        for turn in range(8):
            for index, thread in enumerate(threads):
                graph = graphs[thread]
                graph.checkpointer = old_saver if (turn + index) % 2 else new_saver  # a load balancer's pick
                graph.invoke({"messages": [human(turn, thread, 60)]}, {"configurable": {"thread_id": thread}})
        _wait(lambda: set(_statuses(db.outbox())) == {"done"}, "both releases to deliver")
        time.sleep(1.0)  # a second delivery, if there were one, would have happened by now
        for thread in threads:
            config = {"configurable": {"thread_id": thread}}
            windows = [
                [m.id for m in s.get_tuple(config).checkpoint["channel_values"]["messages"]]
                for s in (old_saver, new_saver)
            ]
            assert windows[0] == windows[1] and len(windows[0]) <= 6
            assert windows[0][-1] == f"{thread}-ai-0007"
    with psycopg.connect(calls_db) as conn:
        delivered = Counter(
            (tuple(ns), key) for ns, key in conn.execute("SELECT namespace, key FROM extractor_calls")
        )
    assert set(delivered) == set(db.outbox()) and len(delivered) == 2 * (16 - 4)
    assert set(delivered.values()) == {1}  # each exactly once, by one release or the other


def test_a_rolling_upgrade_serves_one_database_with_both_releases_at_once(
    previous_release, fresh_pg, tmp_path, record_property
):
    """A rollout, replica by replica: the previous release serves the database; this release starts on it
    (migrating it) while agents run; then their turns go to both releases at once, each thread's turns
    alternating between them, and a replica of the previous release restarts meanwhile on the migrated
    database; then the previous release stops and this one serves alone. No call fails, nothing is lost,
    and each replica says which release it runs."""
    agents = [Agent(f"rollout-{n}", []) for n in range(4)]
    with ExitStack() as rollout:
        with run_previous_service(previous_release, tmp_path, "--database", fresh_pg, *WINDOW) as old:
            for agent in agents:
                agent.urls = [old]
            with running(agents) as fleet:
                fleet.wait_for(20)
                # This release starts, and migrates the database, under the previous release's traffic.
                new = rollout.enter_context(run_service(tmp_path, "--database", fresh_pg, *WINDOW))
                fleet.wait_for(10)
            for agent in agents:
                agent.urls = [old, new.url]
            with running(agents) as fleet:
                fleet.wait_for(80, timeout=180)
                with run_previous_service(
                    previous_release, tmp_path, "--database", fresh_pg, *WINDOW
                ) as restarted:
                    old_again = httpx.get(f"{restarted}/v1/capabilities", timeout=10).json()["version"]
                fleet.wait_for(20)
            old_version = httpx.get(f"{old}/v1/capabilities", timeout=10).json()["version"]
        # The previous release is gone: this one alone.
        for agent in agents:
            agent.urls = [new.url]
        with running(agents) as fleet:
            fleet.wait_for(20)
        new_version = httpx.get(f"{new.url}/v1/capabilities", timeout=10).json()["version"]
        metrics = httpx.get(f"{new.url}/metrics", timeout=10).text
        wait_delivered(new.url)
        lost = lost_turns(agents, new.url, fresh_pg)
        outputs = new.output() + "".join(
            log.read_text(errors="replace") for log in tmp_path.glob("previous-*.log")
        )

    failures = [error for agent in agents for _, error in agent.failures]
    acknowledged = sum(len(agent.acknowledged) for agent in agents)
    record_property(
        "rolling upgrade figures",
        f"{old_version} and {new_version} on one database: {acknowledged} turns acknowledged, {len(failures)} "
        f"failed, {sum(map(len, lost.values()))} messages lost; a replica of {old_again} restarted mid-rollout",
    )
    assert not failures, failures[:3]
    assert not lost, lost
    assert old_version == old_again == VERSION
    assert new_version == __version__
    assert f'reducing_saver_build_info{{version="{__version__}"}} 1.0' in metrics
    assert new_version != old_version, "this release reports the previous release's version"
    assert "Traceback" not in outputs, outputs[-3000:]
