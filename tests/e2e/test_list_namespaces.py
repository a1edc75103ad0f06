"""``list`` of a thread without ``checkpoint_ns`` returns every namespace, as the stock savers do.

A graph with a subgraph stores the subgraph's checkpoints under ``checkpoint_ns = "child:<task id>"``.
PostgresSaver, SqliteSaver and InMemorySaver list them all when the config names no namespace; the
service used to fill in ``""`` and list the root namespace only.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any, TypedDict

import pytest
from fastapi.testclient import TestClient
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, StateGraph

from reducing_saver.client import RemoteReducingSaver
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from reducing_saver.wire import config_to_wire


class State(TypedDict):
    value: int


def graph_with_subgraph(checkpointer: Any) -> Any:
    child = StateGraph(State)
    child.add_node("inc", lambda state: {"value": state["value"] + 1})
    child.add_edge(START, "inc")
    parent = StateGraph(State)
    parent.add_node("child", child.compile())
    parent.add_node("double", lambda state: {"value": state["value"] * 2})
    parent.add_edge(START, "child")
    parent.add_edge("child", "double")
    return parent.compile(checkpointer=checkpointer)


def run(checkpointer: Any, thread_id: str) -> None:
    graph = graph_with_subgraph(checkpointer)
    for start in (1, 5):
        graph.invoke({"value": start}, {"configurable": {"thread_id": thread_id}})


def signature(items: list) -> list[tuple[str, int, str]]:
    """What two runs of the same graph share: namespace (without task ids), step and source, in order."""
    return [
        (
            item.config["configurable"]["checkpoint_ns"].split(":", 1)[0],
            item.metadata["step"],
            item.metadata["source"],
        )
        for item in items
    ]


@contextmanager
def remote(database: str, **settings: Any) -> Iterator[RemoteReducingSaver]:
    app = create_app(Settings(database=database, sweep=False, extract=False, **settings))
    with (
        TestClient(app) as http,
        RemoteReducingSaver("http://testserver", transport=http._transport) as saver,
    ):
        yield saver


@contextmanager
def stock_saver(backend: str, tmp_path: Path, make_database: Callable[[], str]) -> Iterator[Any]:
    if backend == "postgres":
        with PostgresSaver.from_conn_string(make_database()) as saver:
            saver.setup()
            yield saver
    elif backend == "sqlite":
        with closing(sqlite3.connect(tmp_path / "stock.sqlite", check_same_thread=False)) as conn:
            yield SqliteSaver(conn)
    else:
        yield InMemorySaver()


def service_database(backend: str, tmp_path: Path, make_database: Callable[[], str]) -> str:
    return {
        "postgres": make_database,
        "sqlite": lambda: f"sqlite:///{tmp_path / 'service.sqlite'}",
        "memory": lambda: "memory://",
    }[backend]()


@pytest.mark.parametrize("backend", ["postgres", "sqlite", "memory"])
def test_list_without_namespace_returns_every_namespace(backend, tmp_path, make_database):
    with stock_saver(backend, tmp_path, make_database) as stock:
        run(stock, "t")
        expected = list(stock.list({"configurable": {"thread_id": "t"}}))
        expected_inputs = list(stock.list({"configurable": {"thread_id": "t"}}, filter={"source": "input"}))
    assert {ns for ns, _, _ in signature(expected)} == {"", "child"}  # the graph does store a subgraph

    with remote(service_database(backend, tmp_path, make_database)) as saver:
        run(saver, "t")
        got = list(saver.list({"configurable": {"thread_id": "t"}}))
        # The same checkpoints (InMemorySaver orders per namespace, the service newest first overall).
        assert sorted(signature(got)) == sorted(signature(expected))
        # Naming a namespace still lists that namespace only.
        root = list(saver.list({"configurable": {"thread_id": "t", "checkpoint_ns": ""}}))
        assert signature(root) == [entry for entry in signature(expected) if entry[0] == ""]
        # Filters and limits apply across namespaces as they do on the stock saver.
        inputs = list(saver.list({"configurable": {"thread_id": "t"}}, filter={"source": "input"}))
        assert sorted(signature(inputs)) == sorted(signature(expected_inputs))


def test_list_matches_a_stock_postgres_saver_on_the_same_database(make_database):
    database = make_database()
    with remote(database) as saver:
        run(saver, "t")
        got = [item.config["configurable"] for item in saver.list({"configurable": {"thread_id": "t"}})]
    with PostgresSaver.from_conn_string(database) as stock:
        expected = [item.config["configurable"] for item in stock.list({"configurable": {"thread_id": "t"}})]
    assert got == expected
    assert any(entry["checkpoint_ns"] for entry in expected)


def test_the_wire_adds_no_namespace():
    assert config_to_wire({"configurable": {"thread_id": "t"}}) == {"configurable": {"thread_id": "t"}}


@pytest.mark.parametrize("backend", ["postgres", "sqlite", "memory"])
def test_pages_of_a_list_across_namespaces_miss_nothing(backend, tmp_path, make_database):
    # The client pages with ``before``, which needs newest-first order across namespaces and threads;
    # InMemorySaver orders within a namespace only, so the memory backend sorts.
    stock = InMemorySaver()
    run(stock, "t")
    per_thread = sorted(signature(list(stock.list({"configurable": {"thread_id": "t"}}))))
    with remote(service_database(backend, tmp_path, make_database), max_list_limit=2) as saver:
        run(saver, "t")
        run(saver, "u")
        for config, threads in (({"configurable": {"thread_id": "t"}}, 1), (None, 2)):
            listed = list(saver.list(config))
            listed_ids = [item.config["configurable"]["checkpoint_id"] for item in listed]
            assert listed_ids == sorted(set(listed_ids), reverse=True)
            assert sorted(signature(listed)) == sorted(per_thread * threads)
