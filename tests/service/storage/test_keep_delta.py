"""``--keep-checkpoints K`` on DeltaChannel threads, through the service, on the three backends.

A DeltaChannel stores its value only in snapshots; every other checkpoint is rebuilt from the writes of its
ancestors back to one. Keeping the last K checkpoints of such a thread keeps, besides them, the ancestors
back to each channel's snapshot, and the service has LangGraph snapshot a channel whose snapshot is K or
more steps back, so what a thread keeps stays flat however long it runs. Every turn, the state and every
kept checkpoint read back as an unpruned in-process saver reads them, with ``--encryption`` too.
"""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

import pytest
from fastapi.testclient import TestClient
from langchain_core.messages import AIMessage, AnyMessage
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import _messages_delta_reducer

from reducing_saver.client import RemoteReducingSaver
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from tests.support.chat import build_chat_graph, human
from tests.support.encryption import new_key, ring_json

KEEP, TURNS = 3, 14


def _merge(state: dict | None, writes: list[dict]) -> dict:
    merged = dict(state or {})
    for write in writes:
        merged.update(write)
    return merged


class _State(TypedDict):
    # Snapshots far apart, as deepagents' files (written rarely) get them: without the service's help
    # a read needs the thread's whole history.
    messages: Annotated[list[AnyMessage], DeltaChannel(_messages_delta_reducer, snapshot_frequency=1000)]
    notes: Annotated[dict, DeltaChannel(_merge, snapshot_frequency=1000)]


def _graph(checkpointer: Any):
    def chat(state: _State) -> dict:
        turn = len(state["messages"]) // 2
        update: dict = {"messages": [AIMessage(f"answer {turn}", id=f"k-ai-{turn:04d}")]}
        if turn % 4 == 0:  # a rarely written channel
            update["notes"] = {f"n{turn}": turn}
        return update

    def tidy(state: _State) -> dict:
        return {}

    builder = StateGraph(_State)
    builder.add_node("chat", chat)
    builder.add_node("tidy", tidy)
    builder.add_edge(START, "chat")
    builder.add_edge("chat", "tidy")
    builder.add_edge("tidy", END)
    return builder.compile(checkpointer=checkpointer)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def database(request, tmp_path) -> str:
    if request.param == "postgres":
        return request.getfixturevalue("fresh_pg")
    return {"memory": "memory://", "sqlite": f"sqlite:///{tmp_path}/k.sqlite"}[request.param]


@pytest.mark.parametrize("mode", ["off", "required"])
def test_a_delta_channel_thread_keeps_a_flat_history_that_reads_as_the_reference(
    database: str, mode: str
) -> None:
    keys = {} if mode == "off" else {"encryption_keys": ring_json("k1", k1=new_key())}
    settings = Settings(
        database=database, keep_checkpoints=KEEP, encryption=mode, extract=False, sweep=False, **keys
    )
    reference = _graph(InMemorySaver())
    config = {"configurable": {"thread_id": "keep-delta"}}
    with TestClient(create_app(settings)) as client:
        saver = RemoteReducingSaver("http://testserver", transport=client._transport)
        graph = _graph(saver)
        kept = []
        for turn in range(TURNS):
            graph.invoke({"messages": [human(turn, "k")]}, config)
            reference.invoke({"messages": [human(turn, "k")]}, config)
            assert graph.get_state(config).values == reference.get_state(config).values
            history = list(graph.get_state_history(config))
            kept.append(len(history))
            # Every kept checkpoint (the newest ones, in a chain) reads as the unpruned saver's does.
            # strict=False: the reference keeps every checkpoint, the kept history only the newest.
            for snapshot, expected in zip(history, reference.get_state_history(config), strict=False):
                assert snapshot.values == expected.values, (turn, snapshot.metadata)
                assert (snapshot.next, snapshot.metadata["step"]) == (
                    expected.next,
                    expected.metadata["step"],
                )
        # What the storage route says of it, and of a thread whose messages are a plain list.
        build_chat_graph(saver, prefix="p").invoke(
            {"messages": [human(0, "p")]}, {"configurable": {"thread_id": "plain"}}
        )
        saver.close()
        said = client.get("/v1/threads/keep-delta/storage").json()
        assert said["delta_channels"] == ["messages", "notes"]
        assert {name: use["kind"] for name, use in said["channels"].items()} == {
            "messages": "delta",
            "notes": "delta",
        }
        assert "does not apply" in said["channels"]["messages"]["service"]
        assert f"keep_checkpoints={KEEP}" in said["channels"]["notes"]["service"]
        plain = client.get("/v1/threads/plain/storage").json()
        assert plain["delta_channels"] == [] and plain["channels"]["messages"]["kind"] == "windowed"
    assert len(reference.get_state(config).values["messages"]) == 2 * TURNS
    # Flat: from the second half on, what a thread keeps no longer grows with its length.
    assert max(kept[TURNS // 2 :]) <= KEEP + 4, kept
    assert kept[-1] < len(list(reference.get_state_history(config))) // 4
