"""DeltaChannel history in one request under every encryption mode, on the three backends.

LangGraph rebuilds a DeltaChannel from the writes of the checkpoint's ancestors back to a snapshot. A saver
that cannot answer ``get_delta_channel_history`` leaves LangGraph walking ``get_tuple`` one ancestor at a
time: over HTTP, one request per ancestor on every read. The service opens sealed writes and snapshots
itself, so a thread costs the same requests per turn whatever its length, with ``--encryption`` too.
"""

from __future__ import annotations

from collections import Counter
from typing import Annotated, TypedDict

import httpx
import pytest
from fastapi.testclient import TestClient
from langchain_core.messages import AnyMessage
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph.message import _messages_delta_reducer

from reducing_saver.client import RemoteReducingSaver
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from reducing_saver.wire import DELTA_HISTORY_PATH, GET_PATH
from tests.support.chat import build_chat_graph, human
from tests.support.encryption import new_key, ring_json

TURNS = 12


class _DeltaMessages(TypedDict):
    # No snapshot within the test: every read needs the whole history back to the thread's first write.
    messages: Annotated[list[AnyMessage], DeltaChannel(_messages_delta_reducer, snapshot_frequency=1000)]


class _Counting(httpx.BaseTransport):
    """The in-process app's transport, counting requests by path."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner
        self.paths: Counter[str] = Counter()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths[request.url.path] += 1
        return self.inner.handle_request(request)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def database(request, tmp_path) -> str:
    if request.param == "postgres":
        return request.getfixturevalue("fresh_pg")
    return {"memory": "memory://", "sqlite": f"sqlite:///{tmp_path}/d.sqlite"}[request.param]


@pytest.mark.parametrize("mode", ["off", "migrate", "required"])
def test_delta_history_is_one_request_per_read_under_every_mode(database: str, mode: str) -> None:
    keys = {} if mode == "off" else {"encryption_keys": ring_json("k1", k1=new_key())}
    app = create_app(Settings(database=database, encryption=mode, extract=False, sweep=False, **keys))
    reference = build_chat_graph(InMemorySaver(), prefix="d", state_schema=_DeltaMessages)
    config = {"configurable": {"thread_id": "delta"}}
    with TestClient(app) as client:
        counting = _Counting(client._transport)
        saver = RemoteReducingSaver("http://testserver", transport=counting)
        assert "delta_channel_history" in saver.capabilities
        graph = build_chat_graph(saver, prefix="d", state_schema=_DeltaMessages)
        per_turn = []
        for turn in range(TURNS):
            before = counting.paths.copy()
            answer = graph.invoke({"messages": [human(turn, "d")]}, config)
            assert answer == reference.invoke({"messages": [human(turn, "d")]}, config)
            per_turn.append(counting.paths - before)
        # From the second turn on (the first has no history), the same requests every turn: one history
        # read and one latest-checkpoint read, whatever the thread's length.
        assert all(turn == per_turn[1] for turn in per_turn[1:]), per_turn
        assert per_turn[-1][DELTA_HISTORY_PATH] == 1 and per_turn[-1][GET_PATH] == 1
        state = graph.get_state(config)
        assert state.values == reference.get_state(config).values
        assert len(state.values["messages"]) == 2 * TURNS
        saver.close()


class _Snapshotting(TypedDict):
    messages: Annotated[list[AnyMessage], DeltaChannel(_messages_delta_reducer, snapshot_frequency=3)]


def test_placed_history_is_the_backends_own_history_with_places(database: str) -> None:
    """At every checkpoint of a thread with snapshots and a fork, ``placed_delta_history`` holds exactly
    what the backend's ``get_delta_channel_history`` returns, plus where each value was stored."""
    app = create_app(Settings(database=database, extract=False, sweep=False))
    with TestClient(app) as client:
        saver = RemoteReducingSaver("http://testserver", transport=client._transport)
        graph = build_chat_graph(saver, prefix="p", state_schema=_Snapshotting)
        config = {"configurable": {"thread_id": "placed"}}
        for turn in range(5):
            graph.invoke({"messages": [human(turn, "p")]}, config)
        middle = list(graph.get_state_history(config))[6]
        graph.invoke(None, graph.update_state(middle.config, {"messages": [human(90, "fork")]}))
        saver.close()
        with app.state.service.open_savers().borrow() as reducing:
            inner = reducing.inner
            seeded = 0
            items = list(inner.list({"configurable": {"thread_id": "placed"}}))
            parents = {
                i.checkpoint["id"]: (i.parent_config or {}).get("configurable", {}).get("checkpoint_id")
                for i in items
            }
            for item in items:
                stock = inner.get_delta_channel_history(config=item.config, channels=["messages"])["messages"]
                placed = inner.placed_delta_history(item.config, ["messages"])["messages"]
                assert [(task_id, value) for _, task_id, value in placed["writes"]] == [
                    (task_id, value) for task_id, _, value in stock["writes"]
                ]
                assert ("seed" in placed) == ("seed" in stock)
                if "seed" in stock:
                    version, value = placed["seed"]
                    assert value == stock["seed"] and version is not None
                    seeded += 1
                ancestors, current = set(), parents[item.checkpoint["id"]]
                while current is not None:
                    ancestors.add(current)
                    current = parents[current]
                assert all(checkpoint_id in ancestors for checkpoint_id, _, _ in placed["writes"])
            assert seeded > 5
