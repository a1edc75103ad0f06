"""Delivered outbox rows are purged after ``--outbox-retention``: by each sweep of a serving process, and
by ``reducing-saver sweep``; the figures show in ``/v1/extraction/status`` and ``/metrics``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import httpx
import psycopg
import pytest
from langchain_core.messages import HumanMessage
from langgraph.store.memory import InMemoryStore
from langgraph.store.postgres import PostgresStore

from reducing_saver.client import RemoteReducingSaver
from reducing_saver.service.extraction.deliverer import Deliverer
from reducing_saver.service.extraction.extractors import StoreExtractor
from reducing_saver.service.storage.inmemory.outbox import MemoryOutbox
from reducing_saver.service.storage.outbox import make_entries
from tests.support.chat import build_chat_graph, human
from tests.support.server import CLI, ROOT, run_service

THREAD = "retention-thread"
ARGS = ("--max-messages", "4", "--min-messages", "2", "--extraction-linger-seconds", "0")


def chat(url: str, turns: int) -> None:
    with RemoteReducingSaver(url) as saver:
        graph = build_chat_graph(saver, prefix="r", length=50)
        for index in range(turns):
            graph.invoke({"messages": [human(index, "r", 50)]}, {"configurable": {"thread_id": THREAD}})


def done_rows(database: str) -> int:
    with psycopg.connect(database) as conn:
        return conn.execute("SELECT count(*) FROM reducing_saver_outbox WHERE status = 'done'").fetchone()[0]


def wait_for(what: str, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.2)
    return value


def stored_keys(database: str) -> set[str]:
    with PostgresStore.from_conn_string(database) as store:
        return {item.key for item in store.search(("memories", THREAD), limit=1000)}


@pytest.mark.e2e
def test_a_serving_process_purges_delivered_rows_after_the_retention(fresh_pg, tmp_path):
    args = ("--database", fresh_pg, "--outbox-retention", "1s", "--sweep-interval", "1s", *ARGS)
    with run_service(tmp_path, *args) as service:
        chat(service.url, 5)
        status = wait_for(
            "delivery",
            lambda: (s := httpx.get(f"{service.url}/v1/extraction/status").json())["delivered"] >= 4 and s,
        )
        delivered = status["delivered"]
        assert status["retention_seconds"] == 1.0 and status["purging"] is True
        # Delivered rows go once older than the retention; the memories stay in the store.
        wait_for("the purge", lambda: done_rows(fresh_pg) == 0)
        status = wait_for(
            "the figures",
            lambda: (
                (s := httpx.get(f"{service.url}/v1/extraction/status").json())["purged_by_this_process"]
                >= delivered
                and s
            ),
        )
        assert status["delivered"] == 0
        metrics = httpx.get(f"{service.url}/metrics").text
        purged = [
            line for line in metrics.splitlines() if line.startswith("reducing_saver_outbox_purged_total ")
        ]
        assert purged and float(purged[0].split()[1]) >= delivered
        assert "reducing_saver_outbox_retention_seconds 1.0" in metrics
    assert len(stored_keys(fresh_pg)) >= delivered


@pytest.mark.e2e
def test_the_sweep_command_purges_delivered_rows_after_the_retention(fresh_pg, tmp_path):
    # This process does not sweep: its delivered rows stay until the cron command runs.
    with run_service(tmp_path, "--database", fresh_pg, "--no-sweep", *ARGS) as service:
        chat(service.url, 5)
        status = wait_for(
            "delivery",
            lambda: (s := httpx.get(f"{service.url}/v1/extraction/status").json())["delivered"] >= 4 and s,
        )
        assert status["purging"] is False and status["purged_by_this_process"] == 0
    delivered = done_rows(fresh_pg)
    assert delivered == status["delivered"]
    time.sleep(1.1)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")},
        "PYTHONPATH": str(ROOT),
    }
    command = [str(CLI), "sweep", "--database", fresh_pg]
    kept = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, check=True)
    assert json.loads(kept.stdout)["outbox_rows_purged"] == 0  # the default retention is 7 days
    assert json.loads(kept.stdout)["outbox_retention_seconds"] == 7 * 86400
    purge = subprocess.run(
        [*command, "--outbox-retention", "1s"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    )
    assert json.loads(purge.stdout)["outbox_rows_purged"] == delivered
    assert done_rows(fresh_pg) == 0
    assert len(stored_keys(fresh_pg)) >= delivered


def test_a_message_pruned_again_after_its_row_is_purged_is_extracted_again_and_stored_once():
    outbox, store = MemoryOutbox(), InMemoryStore()
    deliverer = Deliverer(outbox, StoreExtractor(store))
    namespace = ("memories", "t-1")
    entries = make_entries([HumanMessage("hello", id="h-1")], namespace, thread_id="t-1")
    assert outbox.record(entries) == 1
    assert deliverer.run_once() == 1
    assert outbox.record(entries) == 0  # within the retention: recorded once, extracted once
    assert outbox.purge_delivered(0.0) == 1
    assert outbox.record(entries) == 1  # purged: the same message is a new row
    assert deliverer.run_once() == 1
    assert [item.key for item in store.search(namespace)] == ["h-1"]  # the store holds it once
