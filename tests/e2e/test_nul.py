"""A tool output holding NUL (U+0000), through a real service on PostgreSQL, into long-term memory.

PostgreSQL's jsonb and text cannot hold U+0000; the outbox column is ``json``, which keeps the ``\\u0000``
escape as text. The default extractor stores such a message escaped and marked (``wire.nul``), and
``decode_memory_value`` gives the original back.
"""

from __future__ import annotations

import itertools
import time

import httpx
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage, messages_from_dict
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.store.postgres import PostgresStore

from reducing_saver.client import RemoteReducingSaver, decode_memory_value
from tests.support.server import run_service

BINARY = "PK\x03\x04\x00\x00 header \\0 and a backslash, then \x00\x00 again"


def graph_with_a_binary_tool(checkpointer):
    def answers():
        for turn in itertools.count():
            call = {"id": f"call-{turn}", "name": "read_file", "args": {"path": f"f{turn}.zip"}}
            yield AIMessage("", id=f"ai-{turn}-call", tool_calls=[call])
            yield AIMessage(f"answer {turn}", id=f"ai-{turn}")

    model = GenericFakeChatModel(messages=answers())

    @tool
    def read_file(path: str) -> str:
        """Read a file."""
        return f"{path}: {BINARY}"

    builder = StateGraph(MessagesState)
    builder.add_node("chat", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_node("tools", ToolNode([read_file]))
    builder.add_edge(START, "chat")
    builder.add_conditional_edges("chat", tools_condition)
    builder.add_edge("tools", "chat")
    return builder.compile(checkpointer=checkpointer)


def test_a_tool_output_with_nul_reaches_the_store_and_reads_back_unchanged(fresh_pg, tmp_path):
    args = (
        "--database",
        fresh_pg,
        "--max-messages",
        "4",
        "--min-messages",
        "2",
        "--extraction-linger-seconds",
        "0",
    )
    with run_service(tmp_path, *args) as service:
        config = {"configurable": {"thread_id": "nul-thread"}}
        with RemoteReducingSaver(service.url) as saver:
            graph = graph_with_a_binary_tool(saver)
            for turn in range(3):
                graph.invoke({"messages": [HumanMessage(f"read f{turn}", id=f"h-{turn}")]}, config)
        deadline = time.monotonic() + 30
        while True:
            status = httpx.get(f"{service.url}/v1/extraction/status").json()
            if status["pending"] == status["in_flight"] == 0 and status["delivered"] >= 4:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        assert status["dead"] == 0, httpx.get(f"{service.url}/v1/extraction/dead-letters").json()

    with PostgresStore.from_conn_string(fresh_pg) as store:
        items = {item.key: item.value for item in store.search(("memories", "nul-thread"), limit=100)}
    tools = {key: value for key, value in items.items() if value["type"] == "tool"}
    assert tools, sorted(items)
    for value in tools.values():
        assert value["nul_escaped"] is True
        (message,) = messages_from_dict([decode_memory_value(value)])
        assert isinstance(message, ToolMessage)
        assert message.content in {f"f{turn}.zip: {BINARY}" for turn in range(3)}
    # Messages without NUL are stored as they are.
    assert all("nul_escaped" not in value for key, value in items.items() if value["type"] != "tool")


def test_a_message_id_with_nul_leaves_the_window_and_reaches_memory(fresh_pg, tmp_path):
    """Cut from the window, the message used to make every later put of the thread a 422 (its id was the
    outbox's text key); a stock saver stores such ids, and so must the thread."""
    args = ("--database", fresh_pg, "--max-messages", "4", "--min-messages", "2")
    args += ("--extraction-linger-seconds", "0")
    odd_id = "h\x00nul-0"
    builder = StateGraph(MessagesState)
    builder.add_node("chat", lambda state: {"messages": [AIMessage(f"answer {len(state['messages'])}")]})
    builder.add_edge(START, "chat")
    with run_service(tmp_path, *args) as service:
        config = {"configurable": {"thread_id": "nul-ids"}}
        with RemoteReducingSaver(service.url) as saver:
            graph = builder.compile(checkpointer=saver)
            for turn in range(4):
                message_id = odd_id if turn == 0 else f"h-{turn}"
                graph.invoke({"messages": [HumanMessage(f"turn {turn}", id=message_id)]}, config)
            window = graph.get_state(config).values["messages"]
            assert odd_id not in {message.id for message in window}
            assert window[-1].content.startswith("answer")
        deadline = time.monotonic() + 30
        while True:
            status = httpx.get(f"{service.url}/v1/extraction/status").json()
            if status["pending"] == status["in_flight"] == 0 and status["delivered"] >= 4:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        assert status["dead"] == 0, httpx.get(f"{service.url}/v1/extraction/dead-letters").json()

    with PostgresStore.from_conn_string(fresh_pg) as store:
        items = [decode_memory_value(item.value) for item in store.search(("memories", "nul-ids"), limit=100)]
    (odd,) = [value for value in items if value["data"]["id"] == odd_id]
    assert messages_from_dict([odd])[0] == HumanMessage("turn 0", id=odd_id)
