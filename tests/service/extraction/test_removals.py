"""Messages an agent removes from its state reach long-term memory through the service's outbox, once each;
deliberate deletions leave it. On the three backends, with ``--encryption required`` on PostgreSQL.

The agent trims with ``RemoveMessage`` (LangGraph's pattern) or summarizes with ``REMOVE_ALL_MESSAGES``
and the messages it keeps (LangChain's ``SummarizationMiddleware``), on ``add_messages`` and on a
DeltaChannel; the service's window is wider than what the agent keeps, so memory holds exactly what left
the agent's state.
"""

from __future__ import annotations

import time
from typing import Annotated, TypedDict

import pytest
from fastapi.testclient import TestClient
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, RemoveMessage
from langgraph.channels.delta import DeltaChannel
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import REMOVE_ALL_MESSAGES, _messages_delta_reducer, add_messages

from reducing_saver.client import RemoteReducingSaver, RemoteStore
from reducing_saver.client._saver_calls import ParentLists
from reducing_saver.reducer import ReducingSaver
from reducing_saver.reducer._removals import Removals
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from tests.support.encryption import new_key, ring_json

TURNS = 10


class _Added(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


class _Delta(TypedDict):
    messages: Annotated[list[AnyMessage], DeltaChannel(_messages_delta_reducer, snapshot_frequency=5)]


def _trim(messages):
    return [RemoveMessage(id=m.id) for m in messages[:-4]]


def _summarize(messages):
    if len(messages) <= 5:
        return []
    summary = HumanMessage(
        "summary", id=f"summary-{messages[-1].id}", additional_kwargs={"lc_source": "summarization"}
    )
    return [RemoveMessage(id=REMOVE_ALL_MESSAGES), summary, *messages[-3:]]


def _graph(saver, schema, manage):
    def chat(state):
        turn = state["messages"][-1].id.removeprefix("h-")
        return {"messages": [AIMessage(f"answer {turn}", id=f"ai-{turn}")]}

    def tidy(state):
        return {"messages": manage(state["messages"])}

    builder = StateGraph(schema)
    builder.add_node("chat", chat)
    builder.add_node("tidy", tidy)
    builder.add_edge(START, "chat")
    builder.add_edge("chat", "tidy")
    builder.add_edge("tidy", END)
    return builder.compile(checkpointer=saver)


def _memories(store: RemoteStore, thread_id: str, expected: int, timeout: float = 20.0) -> list[str]:
    """The keys of the thread's memories once ``expected`` are there (and a moment for any extra)."""
    deadline = time.monotonic() + timeout
    while True:
        keys = [item.key for item in store.search(("memories", thread_id), limit=1000)]
        if len(keys) >= expected or time.monotonic() > deadline:
            time.sleep(0.3)
            return sorted(item.key for item in store.search(("memories", thread_id), limit=1000))
        time.sleep(0.05)


@pytest.fixture(params=["memory", "sqlite", "postgres", "postgres-encrypted"])
def settings(request, tmp_path) -> Settings:
    extra: dict = {}
    if request.param.startswith("postgres"):
        database = request.getfixturevalue("fresh_pg")
        if request.param.endswith("encrypted"):
            extra = {"encryption": "required", "encryption_keys": ring_json("k1", k1=new_key())}
    else:
        database = {"memory": "memory://", "sqlite": f"sqlite:///{tmp_path}/r.sqlite"}[request.param]
    return Settings(
        database=database, max_messages=50, min_messages=40, sweep=False, extraction_linger_seconds=0, **extra
    )


@pytest.mark.parametrize("schema", [_Added, _Delta], ids=["add_messages", "delta"])
@pytest.mark.parametrize("manage", [_trim, _summarize], ids=["trim", "summarize"])
def test_every_removed_message_reaches_memory_once_and_a_deletion_leaves_it(settings, schema, manage) -> None:
    _check_removals(settings, schema, manage)


def _stored_elsewhere(monkeypatch) -> None:
    """Every put reaches a process that did not store its parent (a service of several workers or
    replicas): the service holds no note of the parent's list."""
    monkeypatch.setattr(Removals, "last", lambda self, thread_id, checkpoint_ns, checkpoint_id: None)


@pytest.mark.parametrize("manage", [_trim, _summarize], ids=["trim", "summarize"])
def test_removed_messages_reach_memory_when_another_process_stored_each_parent(
    settings, manage, monkeypatch
) -> None:
    """The client tells a put whose agent removed nothing (``Reducing-Saver-Parent-Messages: kept``), so the
    service reads the parent only for the others: those that remove must still reach memory."""
    _stored_elsewhere(monkeypatch)
    _check_removals(settings, _Added, manage)


@pytest.mark.parametrize("client", ["this release", "without the header"])
def test_a_put_that_removes_nothing_reads_no_parent_when_its_client_says_so(
    fresh_pg, monkeypatch, client
) -> None:
    """A put stored by another process of the service finds removals by reading its parent, unless its
    client says the agent removed nothing: then it reads none. A client that does not say so (an earlier
    release's) still gets every removal found."""
    _stored_elsewhere(monkeypatch)
    if client == "without the header":
        monkeypatch.setattr(ParentLists, "parent", lambda self, config: None)
    reads: list[str] = []
    read = ReducingSaver._stored_messages

    def counting(self, config):
        reads.append(config["configurable"]["checkpoint_id"])
        return read(self, config)

    monkeypatch.setattr(ReducingSaver, "_stored_messages", counting)
    settings = Settings(database=fresh_pg, max_messages=50, sweep=False, extraction_linger_seconds=0)
    with TestClient(create_app(settings)) as app:
        saver = RemoteReducingSaver("http://testserver", transport=app._transport)
        graph = _graph(saver, _Added, lambda messages: [])
        config = {"configurable": {"thread_id": "keeps-all"}}
        for turn in range(TURNS):
            graph.invoke({"messages": [HumanMessage(f"q {turn}", id=f"h-{turn}")]}, config)
        puts = sum(1 for _ in saver.list(config))
        saver.close()
    if client == "this release":
        assert reads == []
    else:
        assert len(reads) >= puts - TURNS  # every put with a parent that writes messages


def _check_removals(settings, schema, manage) -> None:
    with TestClient(create_app(settings)) as client:
        saver = RemoteReducingSaver("http://testserver", transport=client._transport)
        store = RemoteStore("http://testserver", transport=client._transport)
        graph = _graph(saver, schema, manage)
        config = {"configurable": {"thread_id": "removals"}}
        for turn in range(TURNS):
            graph.invoke({"messages": [HumanMessage(f"q {turn}", id=f"h-{turn}")]}, config)
        state = {m.id for m in graph.get_state(config).values["messages"]}
        every = {f"h-{t}" for t in range(TURNS)} | {f"ai-{t}" for t in range(TURNS)}
        left = every - state
        assert left, "the agent removed nothing"
        assert _memories(store, "removals", len(left)) == sorted(left)  # once each (keys are unique)

        # "Forget what I said": a deliberate deletion of a message memory already holds, and of one it
        # does not hold yet (still in the state).
        newest_human = max(k for k in state if k.startswith("h-"))
        oldest_left = min(left)
        graph.update_state(config, {"messages": [RemoveMessage(id=newest_human)]})
        graph.invoke({"messages": [HumanMessage("q 99", id="h-99")]}, config)
        graph.update_state(config, {"messages": [AIMessage("again", id=oldest_left)]})  # re-added, same id
        graph.invoke({"messages": [HumanMessage("q 98", id="h-98")]}, config)
        final = {m.id for m in graph.get_state(config).values["messages"]}
        # Memory keeps what ever left the state (the re-added message too, once), less the deletion.
        expected = sorted(
            ((every | {"h-99", "ai-99", "h-98", "ai-98"}) - final | {oldest_left}) - {newest_human}
        )
        deadline = time.monotonic() + 20
        while (found := _memories(store, "removals", len(expected), timeout=1)) != expected:
            assert time.monotonic() < deadline, (sorted(set(found) ^ set(expected)), final, newest_human)
        saver.close()
        store.close()
