"""Time travel to a checkpoint ``--keep-checkpoints`` deleted: a clear error, never a silent new history.

A real chat graph runs through ``RemoteReducingSaver`` against the service (in process) on PostgreSQL,
SQLite and in memory, keeping 3 checkpoints. Then ``get_state``, ``get_state_history``, ``invoke`` and
``update_state`` from a checkpoint the service deleted raise ``CheckpointPrunedError`` naming the
checkpoint and ``--keep-checkpoints``, sync and async, and a put whose parent was deleted is refused: the
thread's head stays what it was. The service knows after a restart and on another replica (the
database records, per thread and namespace, the newest checkpoint id the policy deleted). An id the
thread never had still reads as ``None``, and so does a pruned one to a stock ``PostgresSaver``, which
cannot tell the two apart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.base.id import uuid6

from reducing_saver.client import CheckpointPrunedError, NotFoundError, RemoteReducingSaver
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from tests.support.chat import build_chat_graph, human

KINDS = ("postgres", "sqlite", "memory")
KEEP, TURNS = 3, 4


@contextmanager
def _service(database: str) -> Iterator[RemoteReducingSaver]:
    """The service keeping ``KEEP`` checkpoints on ``database``, and a client of it (sync and async)."""
    app = create_app(Settings(database=database, keep_checkpoints=KEEP, extract=False, sweep=False))
    with TestClient(app) as client:
        saver = RemoteReducingSaver(
            "http://testserver",
            transport=client._transport,
            async_transport=httpx.ASGITransport(app),
            max_retries=0,
        )
        with saver:
            yield saver


@pytest.fixture(params=KINDS)
def database(request: pytest.FixtureRequest, tmp_path) -> str:
    kind = request.param
    if kind == "postgres":
        return request.getfixturevalue("fresh_pg")
    return f"sqlite:///{tmp_path}/pruned.sqlite" if kind == "sqlite" else "memory://"


def _at(thread_id: str, checkpoint_id: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": "", "checkpoint_id": checkpoint_id}}


def _chat(saver: RemoteReducingSaver, thread_id: str) -> tuple[Any, list[str]]:
    """``TURNS`` turns of a chat; the graph and every checkpoint id the thread ever had, oldest first."""
    graph = build_chat_graph(saver, prefix=thread_id, length=40)
    config = {"configurable": {"thread_id": thread_id}}
    seen: set[str] = set()
    for turn in range(TURNS):
        graph.invoke({"messages": [human(turn, thread_id, length=40)]}, config)
        seen |= {s.config["configurable"]["checkpoint_id"] for s in graph.get_state_history(config)}
    return graph, sorted(seen)


def _assert_pruned(error: pytest.ExceptionInfo, checkpoint_id: str) -> None:
    assert error.value.status_code == 410
    assert f"checkpoint {checkpoint_id!r}" in error.value.message
    assert "--keep-checkpoints" in error.value.message


def test_time_travel_to_a_pruned_checkpoint_is_a_clear_error(database: str) -> None:
    with _service(database) as saver:
        graph, ever = _chat(saver, "t")
        config = {"configurable": {"thread_id": "t"}}
        kept = [s.config["configurable"]["checkpoint_id"] for s in graph.get_state_history(config)]
        pruned = sorted(set(ever) - set(kept))
        assert len(kept) == KEEP and pruned, (kept, ever)
        head = graph.get_state(config)
        history = [s.config for s in graph.get_state_history(config)]
        old = _at("t", pruned[0])

        for attempt in (
            lambda: graph.get_state(old),
            lambda: list(graph.get_state_history(old)),
            lambda: graph.invoke(None, old),
            lambda: graph.invoke({"messages": [HumanMessage("again", id="again")]}, old),
            lambda: graph.update_state(old, {"messages": [HumanMessage("edit", id="edit")]}),
            lambda: asyncio.run(graph.aget_state(old)),
            lambda: asyncio.run(graph.ainvoke(None, old)),
            lambda: asyncio.run(graph.aupdate_state(old, {"messages": [HumanMessage("edit", id="edit")]})),
        ):
            with pytest.raises(CheckpointPrunedError) as error:
                attempt()
            _assert_pruned(error, pruned[0])
            assert isinstance(error.value, NotFoundError)

        # A put whose parent was deleted would become the thread's head: refused, nothing stored.
        stored = saver.get_tuple(_at("t", kept[0]))
        for put in (saver.put, lambda *args: asyncio.run(saver.aput(*args))):
            with pytest.raises(CheckpointPrunedError) as error:
                put(old, {**stored.checkpoint, "id": str(uuid6())}, {"source": "update", "step": 99}, {})
            _assert_pruned(error, pruned[0])
        after = graph.get_state(config)
        assert after.config == head.config and after.values == head.values
        assert [s.config for s in graph.get_state_history(config)] == history

        # What is kept still travels; an id the thread never had is no checkpoint, as before.
        assert graph.get_state(_at("t", kept[-1])).values["messages"]
        assert saver.get_tuple(_at("t", str(uuid6()))) is None
        assert saver.get_tuple(_at("other", pruned[0])) is None
        assert list(saver.list(_at("other", pruned[0]))) == []

        # Deleting the thread forgets it: a new conversation under the same id starts clean.
        saver.delete_thread("t")
        assert saver.get_tuple(old) is None


@pytest.mark.parametrize("kind", ["postgres", "sqlite"])
def test_the_service_knows_after_a_restart_and_on_another_replica(kind: str, request, tmp_path) -> None:
    database = request.getfixturevalue("fresh_pg") if kind == "postgres" else f"sqlite:///{tmp_path}/r.sqlite"
    with _service(database) as first:
        _, ever = _chat(first, "r")
        kept = {
            t.config["configurable"]["checkpoint_id"]
            for t in first.list({"configurable": {"thread_id": "r"}})
        }
        pruned = sorted(set(ever) - kept)
        with _service(database) as second, pytest.raises(CheckpointPrunedError) as error:
            second.get_tuple(_at("r", pruned[-1]))
        _assert_pruned(error, pruned[-1])
    with _service(database) as restarted:
        with pytest.raises(CheckpointPrunedError):
            restarted.get_tuple(_at("r", pruned[0]))
        restarted.copy_thread("r", "r-copy")
        with pytest.raises(CheckpointPrunedError):
            restarted.get_tuple(_at("r-copy", pruned[0]))


def test_a_stock_saver_reads_a_pruned_checkpoint_as_none(fresh_pg: str) -> None:
    """For comparison: a stock PostgresSaver reading the service's database cannot tell a deleted
    checkpoint from one that never was; LangGraph then starts from an empty state."""
    from langgraph.checkpoint.postgres import PostgresSaver

    with _service(fresh_pg) as saver:
        _, ever = _chat(saver, "s")
        kept = {
            t.config["configurable"]["checkpoint_id"]
            for t in saver.list({"configurable": {"thread_id": "s"}})
        }
    pruned = sorted(set(ever) - kept)[0]
    with PostgresSaver.from_conn_string(fresh_pg) as stock:
        assert stock.get_tuple(_at("s", pruned)) is None
        assert list(stock.list(_at("s", pruned))) == []
        graph = build_chat_graph(stock, prefix="s", length=40)
        assert graph.get_state(_at("s", pruned)).values == {}
