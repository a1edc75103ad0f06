"""``--keep-checkpoints`` through the service: two replicas on one PostgreSQL, a thread's own count, and
a DeltaChannel thread under encryption.

Two ``reducing-saver serve --keep-checkpoints 4`` processes share a database; chat threads run at once,
each turn of a thread sent to the other replica than the turn before. Every thread ends with its newest
4 checkpoints, a full history of 4 steps, the same answers as an unpruned in-process run, and a stock
PostgresSaver reads it. A thread whose messages are a DeltaChannel keeps its newest checkpoints and what
they are rebuilt from, with ``--encryption required`` as with ``--encryption off``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Annotated, Any, TypedDict

import psycopg
import pytest
from fastapi.testclient import TestClient
from langchain_core.messages import AnyMessage
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.graph.message import _messages_delta_reducer
from psycopg.rows import dict_row

from reducing_saver.client import RemoteReducingSaver
from reducing_saver.reducer import MessageReducer, ReducerConfig, ReducingSaver
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from reducing_saver.wire import blob_to_wire
from tests.support.bodies import messages_put_body
from tests.support.chat import build_chat_graph, human
from tests.support.encryption import new_key, ring_json
from tests.support.server import run_service

pytestmark = pytest.mark.e2e

KEEP, TURNS, THREADS = 4, 12, 3


def _turns(urls: list[str], thread_id: str) -> list:
    """Turns of one chat thread, each through the other replica than the turn before."""
    config = {"configurable": {"thread_id": thread_id}}
    savers = [RemoteReducingSaver(url) for url in urls]
    graph = build_chat_graph(savers[0], prefix=thread_id)
    for turn in range(TURNS):
        graph.checkpointer = savers[turn % len(savers)]
        graph.invoke({"messages": [human(turn, thread_id)]}, config)
    messages = graph.get_state(config).values["messages"]
    for saver in savers:
        saver.close()
    return messages


def test_two_replicas_keep_the_last_k_of_threads_they_write_in_turn(tmp_path: Path, fresh_pg: str) -> None:
    args = (
        "--database",
        fresh_pg,
        "--keep-checkpoints",
        str(KEEP),
        "--max-messages",
        "6",
        "--min-messages",
        "4",
    )
    with run_service(tmp_path, *args) as first, run_service(tmp_path, *args) as second:
        urls = [first.url, second.url]
        results: dict[str, list] = {}
        errors: list[BaseException] = []

        def run(thread_id: str) -> None:
            try:
                results[thread_id] = _turns(urls, thread_id)
            except BaseException as exc:  # reported by the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(f"kk-{i}",)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors

        reference = ReducingSaver(
            InMemorySaver(), MessageReducer(ReducerConfig(max_messages=6, min_messages=4))
        )
        with psycopg.connect(fresh_pg, autocommit=True, row_factory=dict_row) as conn:
            stock = PostgresSaver(conn)
            for thread_id, messages in results.items():
                graph = build_chat_graph(reference, prefix=thread_id)
                config = {"configurable": {"thread_id": thread_id}}
                for turn in range(TURNS):
                    graph.invoke({"messages": [human(turn, thread_id)]}, config)
                assert [m.content for m in messages] == [
                    m.content for m in graph.get_state(config).values["messages"]
                ]
                history = list(stock.list(config))
                assert len(history) == KEEP
                assert history[0].checkpoint["channel_values"]["messages"] == messages
                remote = RemoteReducingSaver(urls[1])
                assert len(list(build_chat_graph(remote).get_state_history(config))) == KEEP
                remote.close()
                orphans = conn.execute(
                    "SELECT count(*) AS n FROM checkpoint_blobs b WHERE thread_id = %s AND NOT EXISTS ("
                    " SELECT 1 FROM checkpoints c WHERE c.thread_id = b.thread_id"
                    " AND c.checkpoint_ns = b.checkpoint_ns AND c.checkpoint -> 'channel_versions' ->> b.channel"
                    " = b.version)",
                    (thread_id,),
                ).fetchone()["n"]
                assert orphans == 0


def test_a_threads_own_count_and_a_bad_one() -> None:
    app = create_app(Settings(database="memory://", extract=False, sweep=False))
    with TestClient(app) as client:
        saver = RemoteReducingSaver("http://testserver", transport=client._transport)
        graph = build_chat_graph(saver, prefix="own")
        own = {"configurable": {"thread_id": "own", "keep_checkpoints": 2}}
        plain = {"configurable": {"thread_id": "plain"}}
        for turn in range(4):
            graph.invoke({"messages": [human(turn, "own")]}, own)
            graph.invoke({"messages": [human(turn, "plain")]}, plain)
        assert len(list(saver.list(own))) == 2
        assert len(list(saver.list(plain))) == 4 * 3  # input, chat, and the step in between
        for bad in (-1, "2", 1.5, True):
            empty = blob_to_wire(*JsonPlusSerializer().dumps_typed([]))
            body = messages_put_body(empty, thread_id="bad", keep_checkpoints=bad)
            answer = client.post("/v1/checkpoints/put", json=body)
            assert answer.status_code == 422, answer.text
            assert (
                "config.configurable.keep_checkpoints must be a whole number >= 0" in answer.json()["detail"]
            )
        assert list(saver.list({"configurable": {"thread_id": "bad"}})) == []


class _DeltaMessages(TypedDict):
    messages: Annotated[list[AnyMessage], DeltaChannel(_messages_delta_reducer, snapshot_frequency=2)]


def _delta_thread(url: str) -> dict[str, Any]:
    """Four turns of a chat whose messages are a DeltaChannel, then its history, each kept checkpoint read
    back, and a fork."""
    saver = RemoteReducingSaver(url)
    graph = build_chat_graph(saver, prefix="delta", state_schema=_DeltaMessages)
    config = {"configurable": {"thread_id": "delta"}}
    for turn in range(4):
        graph.invoke({"messages": [human(turn, "delta")]}, config)
    history = list(graph.get_state_history(config))
    read = {
        "history": [
            (s.metadata["step"], s.metadata["source"], [m.id for m in s.values.get("messages", [])])
            for s in history
        ]
    }
    # Every kept checkpoint reads back (time travel), then a fork from the oldest kept one runs on.
    read["kept"] = [[m.id for m in graph.get_state(past.config).values["messages"]] for past in history]
    forked = graph.update_state(history[-1].config, {"messages": [human(90, "fork")]})
    read["fork"] = [m.id for m in graph.invoke(None, forked)["messages"]]
    saver.close()
    return read


def _stored_checkpoints(database: str) -> int:
    with psycopg.connect(database, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM checkpoints").fetchone()[0]


def test_a_delta_channel_thread_keeps_the_same_under_encryption(tmp_path: Path, fresh_pg: str) -> None:
    args = ("--database", fresh_pg, "--keep-checkpoints", "3", "--no-extract")
    env = {"REDUCING_SAVER_ENCRYPTION_KEYS": ring_json("k1", k1=new_key())}
    with run_service(tmp_path, *args, "--encryption", "off") as plain:
        off = _delta_thread(plain.url)
    stored_off = _stored_checkpoints(fresh_pg)
    with psycopg.connect(fresh_pg, autocommit=True) as conn:
        conn.execute("DELETE FROM checkpoints; DELETE FROM checkpoint_blobs; DELETE FROM checkpoint_writes")
    with run_service(tmp_path, *args, "--encryption", "required", env=env) as sealed:
        required = _delta_thread(sealed.url)
    # Four turns of three checkpoints, pruned to the newest 3 and the checkpoints they are rebuilt from.
    assert 3 <= len(off["history"]) < 12
    assert required == off
    assert _stored_checkpoints(fresh_pg) == stored_off
