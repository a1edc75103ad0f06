"""Messages carrying standard values (datetime, UUID, Decimal, ...) through the service on PostgreSQL.

LangGraph's strict msgpack mode decodes datetime, date, time, timedelta, UUID, Decimal and a few more
standard types, and a stock PostgresSaver stores messages holding them; the service used to refuse such
a put with 422. Now the kept window is stored byte-identical to what the client sent for those messages,
and the pruned ones reach long-term memory in a JSON-clean form.
"""

from __future__ import annotations

import json
import time as clock
import uuid
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import httpx
import psycopg
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.store.postgres import PostgresStore

from reducing_saver.client import RemoteReducingSaver
from tests.support.server import run_service

SERDE = JsonPlusSerializer()
WHEN = datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=timezone(timedelta(hours=2)))


def extras(turn: int) -> dict[str, Any]:
    return {
        "when": WHEN + timedelta(days=turn),
        "day": date(2026, 1, 1) + timedelta(days=turn),
        "at": time(1, 2, 3, tzinfo=UTC),
        "took": timedelta(seconds=turn, microseconds=5),
        "request": uuid.UUID(int=turn),
        "cost": Decimal(f"0.{turn}0"),
    }


def graph_and_originals(saver: Any) -> tuple[Any, dict[str, Any]]:
    originals: dict[str, Any] = {}

    def chat(state: MessagesState) -> dict[str, Any]:
        turn = sum(1 for key in originals if key.startswith("ai-"))
        answer = AIMessage(
            f"answer {turn}",
            id=f"ai-{turn}",
            additional_kwargs=extras(turn),
            response_metadata=extras(turn + 1),
        )
        originals[answer.id] = answer
        return {"messages": [answer]}

    builder = StateGraph(MessagesState)
    builder.add_node("chat", chat)
    builder.add_edge(START, "chat")
    return builder.compile(checkpointer=saver), originals


def stored_window(database: str, thread_id: str) -> bytes:
    with psycopg.connect(database) as conn:
        row = conn.execute(
            "SELECT b.type, b.blob FROM checkpoints c JOIN checkpoint_blobs b ON b.thread_id = c.thread_id"
            " AND b.checkpoint_ns = c.checkpoint_ns AND b.channel = 'messages'"
            " AND b.version = c.checkpoint -> 'channel_versions' ->> 'messages'"
            " WHERE c.thread_id = %s ORDER BY c.checkpoint_id DESC LIMIT 1",
            (thread_id,),
        ).fetchone()
    assert row is not None and row[0] == "msgpack"
    return bytes(row[1])


def drain(url: str, timeout: float = 60.0) -> None:
    deadline = clock.monotonic() + timeout
    while clock.monotonic() < deadline:
        status = httpx.get(f"{url}/v1/extraction/status", timeout=5).json()
        if status["pending"] == 0 and status["in_flight"] == 0:
            return
        clock.sleep(0.2)
    raise AssertionError(f"outbox not drained: {status}")


def test_messages_with_standard_values_are_reduced_byte_identically_and_pruned_to_memory(tmp_path, fresh_pg):
    args = ("--database", fresh_pg, "--max-messages", "4", "--min-messages", "2", "--no-sweep")
    with run_service(tmp_path, *args) as service, RemoteReducingSaver(service.url) as saver:
        graph, originals = graph_and_originals(saver)
        config = {"configurable": {"thread_id": "t"}}
        for turn in range(5):
            human = HumanMessage(f"question {turn}", id=f"h-{turn}", additional_kwargs=extras(100 + turn))
            originals[human.id] = human
            graph.invoke({"messages": [human]}, config)

        window = graph.get_state(config).values["messages"]
        window_ids = [m.id for m in window]
        assert 2 <= len(window_ids) <= 4 and window_ids[-1] == "ai-4"
        # Read back with the values the client sent (datetimes, UUIDs, Decimals: not strings).
        for message in window:
            assert message.additional_kwargs == originals[message.id].additional_kwargs
            assert message.response_metadata == originals[message.id].response_metadata

        # Byte for byte what the client's serializer makes of the kept messages.
        expected = SERDE.dumps_typed([originals[i] for i in window_ids])
        assert stored_window(fresh_pg, "t") == expected[1]

        pruned = set(originals) - set(window_ids)
        assert pruned
        drain(service.url)

    with PostgresStore.from_conn_string(fresh_pg) as store:
        items = {item.key: item.value for item in store.search(("memories", "t"), limit=100)}
    assert set(items) == pruned
    delivered = json.dumps(items["h-0"])  # JSON-clean: the standard values as text or numbers
    assert (WHEN + timedelta(days=100)).isoformat() in delivered
    assert str(uuid.UUID(int=100)) in delivered and "0.1000" in delivered
