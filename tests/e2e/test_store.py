"""The long-term memory store over HTTP: RemoteStore's BaseStore semantics and langgraph_sdk's store client.

One real service (``reducing-saver serve``, an API key configured) per backend serves this module: memory,
SQLite and PostgreSQL. Each test works under a root label of its own, so tests share the service without
seeing each other's items.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, TypedDict

import httpx
import orjson
import psycopg
import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langgraph.config import get_store
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.store.base import BaseStore, GetOp, ListNamespacesOp, MatchCondition, PutOp, SearchOp
from langgraph.store.memory import InMemoryStore
from langgraph.store.postgres import PostgresStore
from langgraph.store.sqlite import SqliteStore

from reducing_saver.client import AuthenticationError, BadRequestError, RemoteReducingSaver, RemoteStore
from tests.support.postgres import pg_url
from tests.support.server import ServiceProcess, run_service

BACKENDS = ["memory", "sqlite", "postgres"]
KEY = "store-tests-key-0123456789abcdef"


@pytest.fixture(scope="module", params=BACKENDS)
def service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    backend = request.param
    root = tmp_path_factory.mktemp(f"store-{backend}")
    database, drop = None, None
    if backend == "memory":
        database = "memory://"
    elif backend == "sqlite":
        database = f"sqlite:///{root}/db.sqlite"
    else:
        name = f"rs_store_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(pg_url("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        database = pg_url(name)

        def drop() -> None:
            with psycopg.connect(pg_url("postgres"), autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    try:
        args = ["--database", database, "--max-messages", "4", "--min-messages", "2"]
        with run_service(root, *args, env={"REDUCING_SAVER_API_KEYS": f"tests={KEY}"}) as svc:
            yield svc
    finally:
        if drop is not None:
            drop()


@pytest.fixture
def store(service: ServiceProcess) -> Iterator[RemoteStore]:
    with RemoteStore(service.url, api_key=KEY) as remote:
        yield remote


@pytest.fixture
def root() -> str:
    """A first label of this test's own."""
    return f"t{uuid.uuid4().hex[:10]}"


# -- put, get, delete --------------------------------------------------------------------------------


def test_put_get_update_delete(store: RemoteStore, root: str) -> None:
    ns = (root, "docs")
    assert store.get(ns, "a") is None
    store.put(ns, "a", {"text": "first", "n": 1})
    item = store.get(ns, "a")
    assert (
        item is not None
        and item.namespace == ns
        and item.key == "a"
        and item.value == {"text": "first", "n": 1}
    )
    store.put(ns, "a", {"text": "second"})
    updated = store.get(ns, "a")
    assert updated is not None and updated.value == {"text": "second"}
    assert updated.updated_at >= item.updated_at
    store.delete(ns, "a")
    assert store.get(ns, "a") is None
    store.delete(ns, "never-there")  # deleting a missing item is no error, and creates nothing
    assert store.get(ns, "never-there") is None
    assert [item.key for item in store.search(ns)] == []


async def test_async_convenience_methods(store: RemoteStore, root: str) -> None:
    ns = (root, "async")
    await store.aput(ns, "k", {"v": [1, 2, {"deep": True}], "unicode": "ünï 🧠"})
    item = await store.aget(ns, "k")
    assert item is not None and item.value == {"v": [1, 2, {"deep": True}], "unicode": "ünï 🧠"}
    assert [i.key for i in await store.asearch((root,))] == ["k"]
    assert await store.alist_namespaces(prefix=(root,)) == [ns]
    await store.adelete(ns, "k")
    assert await store.aget(ns, "k") is None


# -- search ------------------------------------------------------------------------------------------


def _fill(store: RemoteStore, root: str) -> None:
    store.put((root, "a"), "1", {"kind": "note", "score": 1, "tag": "x"})
    store.put((root, "a"), "2", {"kind": "note", "score": 5, "tag": "y"})
    store.put((root, "a", "deep"), "3", {"kind": "fact", "score": 9, "tag": "x"})
    store.put((root, "b"), "4", {"kind": "fact", "score": 3, "tag": None})


def test_search_by_prefix_and_filters(store: RemoteStore, root: str) -> None:
    _fill(store, root)

    def keys(items: list) -> list[str]:
        return sorted(i.key for i in items)

    assert keys(store.search((root,))) == ["1", "2", "3", "4"]
    assert keys(store.search((root, "a"))) == ["1", "2", "3"]
    assert keys(store.search((root, "a", "deep"))) == ["3"]
    assert keys(store.search((root, "zzz"))) == []
    assert keys(store.search((root,), filter={"kind": "fact"})) == ["3", "4"]
    assert keys(store.search((root,), filter={"kind": "note", "tag": "x"})) == ["1"]
    assert keys(store.search((root,), filter={"score": {"$gt": 3}})) == ["2", "3"]
    assert keys(store.search((root,), filter={"score": {"$gte": 3, "$lt": 9}})) == ["2", "4"]
    assert keys(store.search((root,), filter={"kind": {"$ne": "note"}})) == ["3", "4"]
    for item in store.search((root,)):
        assert item.score is None and item.namespace[0] == root


def test_search_pagination(store: RemoteStore, root: str) -> None:
    for i in range(7):
        store.put((root, "p"), f"k{i}", {"i": i})
    pages = [store.search((root,), limit=3, offset=offset) for offset in (0, 3, 6, 9)]
    assert [len(page) for page in pages] == [3, 3, 1, 0]
    seen = [item.key for page in pages for item in page]
    assert sorted(seen) == [f"k{i}" for i in range(7)] and len(set(seen)) == 7
    assert store.search((root,), limit=0) == [] or len(store.search((root,), limit=0)) == 0


# -- list_namespaces ---------------------------------------------------------------------------------


def test_list_namespaces(store: RemoteStore, root: str) -> None:
    for ns in [
        (root, "users", "alice", "prefs"),
        (root, "users", "bob", "prefs"),
        (root, "users", "bob", "notes"),
        (root, "docs", "alice"),
    ]:
        store.put(ns, "k", {"v": 1})

    def listed(**kw) -> list[tuple[str, ...]]:
        return sorted(store.list_namespaces(**kw))

    assert listed(prefix=(root,)) == sorted(
        [
            (root, "docs", "alice"),
            (root, "users", "alice", "prefs"),
            (root, "users", "bob", "notes"),
            (root, "users", "bob", "prefs"),
        ]
    )
    assert listed(prefix=(root, "users")) == [
        (root, "users", "alice", "prefs"),
        (root, "users", "bob", "notes"),
        (root, "users", "bob", "prefs"),
    ]
    assert listed(prefix=(root,), suffix=("prefs",)) == [
        (root, "users", "alice", "prefs"),
        (root, "users", "bob", "prefs"),
    ]
    assert listed(prefix=(root, "*", "alice")) == [(root, "docs", "alice"), (root, "users", "alice", "prefs")]
    assert listed(prefix=(root,), suffix=("bob", "*")) == [
        (root, "users", "bob", "notes"),
        (root, "users", "bob", "prefs"),
    ]
    assert listed(prefix=(root,), max_depth=2) == [(root, "docs"), (root, "users")]
    assert listed(prefix=(root, "users"), max_depth=3) == [(root, "users", "alice"), (root, "users", "bob")]
    first = store.list_namespaces(prefix=(root,), limit=2)
    rest = store.list_namespaces(prefix=(root,), limit=10, offset=2)
    assert len(first) == 2 and len(rest) == 2 and sorted(first + rest) == listed(prefix=(root,))
    assert (root, "docs", "alice") in store.list_namespaces(suffix=("docs", "alice"), limit=1000)


# -- batch -------------------------------------------------------------------------------------------


def test_batch_mixed_ops_in_order(store: RemoteStore, root: str) -> None:
    store.put((root, "b"), "existing", {"v": 0})
    results = store.batch(
        [
            GetOp((root, "b"), "existing"),
            PutOp((root, "b"), "new", {"v": 1}),
            SearchOp((root,), None, 10, 0),
            ListNamespacesOp((MatchCondition("prefix", (root,)),), None, 10, 0),
            GetOp((root, "b"), "missing"),
        ]
    )
    assert len(results) == 5
    assert results[0] is not None and results[0].value == {"v": 0}
    assert results[1] is None
    assert {i.key for i in results[2]} >= {"existing"}
    assert results[3] == [(root, "b")]
    assert results[4] is None
    assert store.get((root, "b"), "new").value == {"v": 1}
    assert store.batch([]) == []


def test_batch_deduplicates_puts_and_gets(store: RemoteStore, root: str) -> None:
    ns = (root, "dedup")
    results = store.batch(
        [
            PutOp(ns, "k", {"v": 1}),
            PutOp(ns, "k", {"v": 2}),
            PutOp(ns, "gone", {"v": 1}),
            PutOp(ns, "gone", None),
        ]
    )
    assert results == [None, None, None, None]
    assert store.get(ns, "k").value == {"v": 2}, "the last put of a key in a batch wins"
    assert store.get(ns, "gone") is None
    first, second = store.batch([GetOp(ns, "k"), GetOp(ns, "k")])
    assert first is not None and second is not None and first.value == second.value == {"v": 2}


async def test_concurrent_async_batches(store: RemoteStore, root: str) -> None:
    async def worker(n: int) -> None:
        ns = (root, "c", f"w{n}")
        await store.abatch([PutOp(ns, f"k{i}", {"n": n, "i": i}) for i in range(5)])
        got = await store.abatch([GetOp(ns, f"k{i}") for i in range(5)])
        assert [item.value for item in got] == [{"n": n, "i": i} for i in range(5)]

    await asyncio.gather(*(worker(n) for n in range(20)))
    assert len(await store.alist_namespaces(prefix=(root, "c"), limit=100)) == 20
    assert len(await store.asearch((root, "c"), limit=1000)) == 100


# -- refusals ----------------------------------------------------------------------------------------


def test_bad_input_is_a_422_naming_the_field(store: RemoteStore, root: str) -> None:
    cases = [
        ([PutOp(("langgraph", "x"), "k", {"v": 1})], "ops[0].namespace"),
        ([PutOp((root, "a" * 300), "k", {"v": 1})], "ops[0].namespace[1]"),
        ([PutOp(tuple(f"l{i}" for i in range(20)), "k", {"v": 1})], "ops[0].namespace"),
        ([PutOp((root,), "", {"v": 1})], "ops[0].key"),
        ([PutOp((root,), "k", {"v": "x" * (1024 * 1024 + 1)})], "ops[0].value"),
        ([SearchOp((root,), None, 5000, 0)], "ops[0].limit"),
        ([SearchOp((root,), {"a') OR 1=1 --": 1}, 10, 0)], "ops[0].filter"),
        ([GetOp((root,), "k"), PutOp((root,), "k", {"v": 1}, ttl=5)], "ops[1].ttl"),
    ]
    for ops, field in cases:
        with pytest.raises(BadRequestError) as caught:
            store.batch(ops)
        assert field in str(caught.value), (field, str(caught.value))
    assert store.search((root,)) == [], "nothing of a refused batch was stored"


def test_a_filter_across_value_types_is_no_500(store: RemoteStore, root: str) -> None:
    store.put((root,), "number", {"score": 5})
    store.put((root,), "text", {"score": "high"})
    try:
        found = store.search((root,), filter={"score": {"$gt": 3}})
    except BadRequestError as exc:  # InMemoryStore cannot compare a string with a number
        assert "filter compares values of different types" in str(exc)
    else:  # the SQL stores compare as they can
        assert "number" in {item.key for item in found}


def test_a_key_is_required(service: ServiceProcess) -> None:
    with (
        RemoteStore(service.url, api_key="not-a-key-0123456789") as wrong,
        pytest.raises(AuthenticationError),
    ):
        wrong.get(("a",), "k")


# -- langgraph_sdk's store client --------------------------------------------------------------------


def test_langgraph_sdk_sync_store_client(service: ServiceProcess, root: str) -> None:
    from langgraph_sdk import get_sync_client

    with get_sync_client(url=service.url, api_key=KEY) as client:
        client.store.put_item([root, "sdk"], key="k1", value={"title": "hello", "n": 1})
        client.store.put_item([root, "sdk", "deep"], key="k2", value={"title": "world", "n": 2})
        item = client.store.get_item([root, "sdk"], key="k1")
        assert (
            item["namespace"] == [root, "sdk"]
            and item["key"] == "k1"
            and item["value"] == {"title": "hello", "n": 1}
        )
        assert item["created_at"] and item["updated_at"]
        assert client.store.get_item([root, "sdk"], key="missing") is None
        found = client.store.search_items([root], filter={"n": 2}, limit=5, offset=0)
        assert [i["key"] for i in found["items"]] == ["k2"]
        assert len(client.store.search_items([root], limit=1)["items"]) == 1
        listed = client.store.list_namespaces(prefix=[root], max_depth=2, limit=10, offset=0)
        assert listed["namespaces"] == [[root, "sdk"]]
        assert client.store.list_namespaces(prefix=[root], suffix=["deep"])["namespaces"] == [
            [root, "sdk", "deep"]
        ]
        client.store.delete_item([root, "sdk"], key="k1")
        assert client.store.get_item([root, "sdk"], key="k1") is None


async def test_langgraph_sdk_async_store_client(service: ServiceProcess, root: str) -> None:
    from langgraph_sdk import get_client

    async with get_client(url=service.url, api_key=KEY) as client:
        await client.store.put_item([root, "sdk"], key="k", value={"x": 1})
        assert (await client.store.get_item([root, "sdk"], key="k"))["value"] == {"x": 1}
        assert [i["key"] for i in (await client.store.search_items([root]))["items"]] == ["k"]
        assert (await client.store.list_namespaces(prefix=[root]))["namespaces"] == [[root, "sdk"]]
        await client.store.delete_item([root, "sdk"], key="k")
        assert await client.store.get_item([root, "sdk"], key="k") is None
    # The SDK's key is the service's key: a wrong one is a 401.
    async with get_client(url=service.url, api_key="wrong-key-0123456789abcd") as anonymous:
        with pytest.raises(httpx.HTTPStatusError) as caught:
            await anonymous.store.get_item([root, "sdk"], key="k")
    assert caught.value.response.status_code == 401


# -- a graph with RemoteReducingSaver and RemoteStore ------------------------------------------------


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    recalled: int


def test_graph_nodes_use_the_remote_store(service: ServiceProcess, root: str) -> None:
    """A node writes and searches memories through ``get_store()``; the messages the service prunes from
    the thread's window are found in the same store under ``("memories", thread_id)``."""

    def remember(state: State) -> dict:
        store = get_store()
        last = state["messages"][-1]
        store.put((root, "facts"), last.id, {"text": last.content})
        recalled = store.search((root, "facts"), filter={"text": last.content})
        return {
            "messages": [AIMessage(f"noted {last.content}", id=f"ai-{last.id}")],
            "recalled": len(recalled),
        }

    builder = StateGraph(State)
    builder.add_node("remember", remember)
    builder.add_edge(START, "remember")
    thread = f"{root}-thread"
    config = {"configurable": {"thread_id": thread}}
    with (
        RemoteReducingSaver(service.url, api_key=KEY) as saver,
        RemoteStore(service.url, api_key=KEY) as store,
    ):
        graph = builder.compile(checkpointer=saver, store=store)
        for i in range(4):
            out = graph.invoke({"messages": [HumanMessage(f"fact {i}", id=f"h{i}")]}, config)
            assert out["recalled"] == 1
        assert len(out["messages"]) <= 4, "the service keeps the window"
        assert sorted(i.key for i in store.search((root, "facts"))) == ["h0", "h1", "h2", "h3"]
        deadline = time.monotonic() + 60
        while not (pruned := store.search(("memories", thread), limit=100)):
            assert time.monotonic() < deadline, "the pruned messages never reached the store"
            time.sleep(0.1)
        assert all(item.value["thread_id"] == thread for item in pruned)
        assert "h0" in {item.key for item in pruned}, "the first message left the window and is a memory"


# -- numbers JSON writers differ on: beyond 64 bits, NaN and infinities ------------------------------


def _backend(service: ServiceProcess) -> str:
    answer = httpx.get(f"{service.url}/v1/capabilities", headers={"Authorization": f"Bearer {KEY}"})
    return answer.raise_for_status().json()["backend"]


@contextlib.contextmanager
def _stock_store(backend: str, make_database: Any, tmp_path: Path) -> Iterator[BaseStore]:
    """The store the service's backend runs, used directly: what each value must read back as."""
    if backend == "memory":
        yield InMemoryStore()
    elif backend == "sqlite":
        with SqliteStore.from_conn_string(str(tmp_path / "stock.sqlite")) as stock:
            stock.setup()
            yield stock
    else:
        with PostgresStore.from_conn_string(make_database()) as stock:
            stock.setup()
            yield stock


def _stock_result(stock: BaseStore, value: dict[str, Any]) -> Any:
    """What ``stock`` gives back for ``value`` (its value), or the exception class it raises."""
    try:
        stock.put(("stock",), "k", value)
    except Exception as exc:  # noqa: BLE001 - compared with the service's answer
        return type(exc)
    return stock.get(("stock",), "k").value


BIG_VALUES = {
    "float-1e20": {"x": 1e20, "nested": [{"score": -3.5e25}]},
    "ints-beyond-64-bits": {"x": 10**20, "y": -(2**70), "z": 2**64 - 1},
}


@pytest.mark.parametrize("name", sorted(BIG_VALUES))
def test_a_number_beyond_64_bits_reads_back_as_the_stock_store_keeps_it(
    service: ServiceProcess, store: RemoteStore, root: str, name: str, make_database: Any, tmp_path: Path
) -> None:
    """PostgreSQL's JSONB reads 1e20 back as the int 100000000000000000000; every get and search of its
    namespace, and of the tenant's whole store, answered 500 with it."""
    value = BIG_VALUES[name]
    with _stock_store(_backend(service), make_database, tmp_path) as stock:
        expected = _stock_result(stock, value)
    ns = (root, "numbers")
    if isinstance(expected, type):  # the stock store refuses it: the service says so, and stores nothing
        with pytest.raises(BadRequestError, match="ops\\[0\\].value"):
            store.put(ns, "k", value)
        assert store.get(ns, "k") is None
        return
    store.put(ns, "k", value)
    store.put(ns, "plain", {"x": 1})
    item = store.get(ns, "k")
    assert item is not None and item.value == expected
    assert repr(item.value) == repr(expected), "the same types as the stock store's"
    assert {i.key: i.value for i in store.search(ns)} == {"k": expected, "plain": {"x": 1}}
    assert "k" in {i.key for i in store.search((), limit=1000)}, "the tenant's whole store searches"
    store.put(ns, "again", item.value)  # what was read can be written back
    assert repr(store.get(ns, "again").value) == repr(expected)

    from langgraph_sdk import get_sync_client

    with get_sync_client(url=service.url, api_key=KEY) as client:
        # langgraph_sdk parses JSON with orjson, which reads an int beyond 64 bits as the nearest float.
        read = client.store.get_item(list(ns), key="k")["value"]
        assert read == orjson.loads(json.dumps(expected))
        assert {i["key"] for i in client.store.search_items(list(ns))["items"]} == {"k", "plain", "again"}


@pytest.mark.parametrize("number", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_infinities_are_refused_before_they_change(
    store: RemoteStore, root: str, number: float
) -> None:
    """JSON has neither: orjson wrote them as null, silently (PostgresStore refuses them)."""
    with pytest.raises(BadRequestError, match="ops\\[0\\].value.x.deep\\[1\\]"):
        store.put((root,), "k", {"x": {"deep": [1, number]}})
    assert store.get((root,), "k") is None


def test_an_int_too_long_to_write_is_the_client_s_error(store: RemoteStore, root: str) -> None:
    with pytest.raises(BadRequestError, match="ops\\[0\\].value.x"):
        store.put((root,), "k", {"x": 10**5000})


def test_an_extracted_memory_holding_1e20_reads_back(service: ServiceProcess, root: str) -> None:
    """A pruned message with ``additional_kwargs={"score": 1e20}`` made its thread's memory namespace, and
    every search of the tenant's store, answer 500 on PostgreSQL."""
    builder = StateGraph(State)

    def chat(state: State) -> dict:
        scored = AIMessage("scored", id=f"ai-{len(state['messages'])}", additional_kwargs={"score": 1e20})
        return {"messages": [scored]}

    builder.add_node("chat", chat)
    builder.add_edge(START, "chat")
    thread = f"{root}-scored"
    config = {"configurable": {"thread_id": thread}}
    with (
        RemoteReducingSaver(service.url, api_key=KEY) as saver,
        RemoteStore(service.url, api_key=KEY) as store,
    ):
        graph = builder.compile(checkpointer=saver)
        for i in range(4):
            graph.invoke({"messages": [HumanMessage(f"turn {i}", id=f"h{i}")]}, config)
        deadline = time.monotonic() + 60
        while True:
            memories = {item.key: item.value for item in store.search(("memories", thread), limit=100)}
            if {"ai-1", "h0"} <= memories.keys():
                break
            assert time.monotonic() < deadline, "the pruned messages never reached the store"
            time.sleep(0.1)
        scored = memories["ai-1"]
        assert scored["data"]["additional_kwargs"]["score"] == 1e20
        everything = store.search((), limit=1000)
        assert "ai-1" in {item.key for item in everything}
    from langgraph_sdk import get_sync_client

    with get_sync_client(url=service.url, api_key=KEY) as client:
        found = client.store.search_items(["memories", thread], limit=100)["items"]
        assert {"ai-1", "h0"} <= {item["key"] for item in found}
        assert client.store.search_items([], limit=1000)["items"]
