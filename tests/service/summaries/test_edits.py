"""An edit of a message (``update_state`` with its id) made while its batch waits for a summary: the
service's summary and long-term memory keep the edit, not the text it replaced."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from langchain_core.messages import HumanMessage

from reducing_saver.client import RemoteReducingSaver, RemoteStore
from reducing_saver.reducer import summary_message_id
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from tests.support import summarizers
from tests.support.chat import build_chat_graph, human
from tests.support.encryption import new_key, ring_json


def _wait(what: str, check, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(params=["postgres", "sqlite", "postgres-encrypted"])
def database(request, tmp_path):
    """``(url, settings)``: the database, and under encryption its mode and key ring (the step ids and
    outbox fingerprints are then keyed)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/e.sqlite", {}
    encrypted = {"encryption": "required", "encryption_keys": ring_json("k1", k1=new_key())}
    return request.getfixturevalue("fresh_pg"), encrypted if request.param.endswith("encrypted") else {}


def test_an_edit_made_while_its_batch_waits_for_the_summary_survives_in_summary_and_memory(database):
    url, encryption = database
    settings = Settings(
        database=url,
        max_messages=6,
        min_messages=4,
        summarizer="tests.support.summarizers:gated",
        extraction_idle_seconds=0.05,
        extraction_linger_seconds=0,
        sweep=False,
        **encryption,
    )
    summarizers.GATE.clear()
    try:
        with TestClient(create_app(settings)) as http:
            service = http.app.state.service
            options = {"transport": http._transport, "max_retries": 0}
            with (
                RemoteReducingSaver("http://testserver", **options) as saver,
                RemoteStore("http://testserver", **options) as store,
            ):
                graph = build_chat_graph(saver, prefix="e", length=40)
                config = {"configurable": {"thread_id": "t"}}
                graph.invoke({"messages": [HumanMessage("my name is Alice", id="first")]}, config)
                for n in range(1, 4):
                    graph.invoke({"messages": [human(n, "e", 40)]}, config)
                book = service.running_summaries.book
                _wait("the batch to be asked for", lambda: book.status()["pending_steps"] == 1)
                # The summarizer holds that batch (its model call takes long); the user corrects herself.
                graph.update_state(
                    config, {"messages": [HumanMessage("CORRECTION: my name is Bob", id="first")]}
                )
                summarizers.GATE.set()
                _wait("the summaries", lambda: book.status()["pending_steps"] == 0)
                graph.invoke({"messages": [human(4, "e", 40)]}, config)
                window = graph.get_state(config).values["messages"]
                (summary,) = [m for m in window if m.id == summary_message_id("t", "")]
                assert "CORRECTION: my name is Bob" in summary.content, summary.content
                assert "Alice" not in summary.content
                assert "first" not in [m.id for m in window]
                _wait(
                    "delivery",
                    lambda: (
                        service.open_memory().outbox.status()["pending"] == 0
                        and service.open_memory().outbox.status()["in_flight"] == 0
                    ),
                )
                item = store.get(("memories", "t"), "first")
                assert item is not None and item.value["data"]["content"] == "CORRECTION: my name is Bob", (
                    item
                )
    finally:
        summarizers.GATE.set()
