"""The client says, once per thread, that the service's window cannot apply to a DeltaChannel messages
channel (it is rebuilt from writes, so the service stores it as written)."""

from __future__ import annotations

import logging
from typing import Annotated, TypedDict

from fastapi.testclient import TestClient
from langchain_core.messages import AnyMessage
from langgraph.channels.delta import DeltaChannel
from langgraph.graph.message import _messages_delta_reducer

from reducing_saver.client import RemoteReducingSaver
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from tests.support.chat import build_chat_graph, human


class _Delta(TypedDict):
    messages: Annotated[list[AnyMessage], DeltaChannel(_messages_delta_reducer, snapshot_frequency=3)]


def test_one_notice_per_delta_thread_and_none_for_a_windowed_one(caplog) -> None:
    app = create_app(
        Settings(database="memory://", max_messages=4, min_messages=2, extract=False, sweep=False)
    )
    with TestClient(app) as client, caplog.at_level(logging.INFO, logger="reducing_saver.client"):
        saver = RemoteReducingSaver("http://testserver", transport=client._transport)
        delta = build_chat_graph(saver, prefix="d", state_schema=_Delta)
        windowed = build_chat_graph(saver, prefix="w")
        for turn in range(4):
            for thread in ("delta-a", "delta-b"):
                delta.invoke({"messages": [human(turn, thread)]}, {"configurable": {"thread_id": thread}})
            windowed.invoke({"messages": [human(turn, "w")]}, {"configurable": {"thread_id": "windowed"}})
        saver.close()
    notices = [r.getMessage() for r in caplog.records if r.name.startswith("reducing_saver.client")]
    assert len(notices) == 2, notices
    for thread, notice in zip(("delta-a", "delta-b"), notices, strict=True):
        assert f"thread {thread!r}" in notice and "DeltaChannel" in notice and "max_messages=4" in notice
