"""Storage on a real PostgresSaver with a real LangGraph chat graph: the messages blob stays bounded.

Run with ``pytest -s`` to see the figures (they are also attached to the report as user properties).
"""

from __future__ import annotations

import psycopg
import pytest
from langchain_core.messages import SystemMessage
from langgraph.checkpoint.postgres import PostgresSaver

from reducing_saver.reducer import MessageReducer, ReducingSaver
from tests.support.chat import build_chat_graph, human
from tests.support.windows import msg_kind

MAX_MESSAGES, MIN_MESSAGES = 6, 4


def messages_blobs(conn: psycopg.Connection, serde, thread_id: str) -> list[tuple[str, int, int]]:
    """``(version, blob bytes, message count)`` of every stored version of the thread's messages channel."""
    rows = conn.execute(
        "SELECT version, type, blob FROM checkpoint_blobs "
        "WHERE thread_id = %s AND checkpoint_ns = '' AND channel = 'messages' ORDER BY version",
        (thread_id,),
    ).fetchall()
    return [(version, len(blob), len(serde.loads_typed((kind, bytes(blob))))) for version, kind, blob in rows]


def newest_blob_size(conn: psycopg.Connection, thread_id: str) -> int:
    row = conn.execute(
        "SELECT octet_length(blob) FROM checkpoint_blobs "
        "WHERE thread_id = %s AND checkpoint_ns = '' AND channel = 'messages' ORDER BY version DESC LIMIT 1",
        (thread_id,),
    ).fetchone()
    return row[0]


def run_thread(saver, conn, thread_id: str, turns: int, snapshot_at: tuple[int, ...]) -> dict[int, int]:
    """Run ``turns`` chat turns of ~400-character messages; the newest messages blob size after some turns."""
    graph = build_chat_graph(saver, prefix=thread_id, length=400)
    config = {"configurable": {"thread_id": thread_id}}
    sizes = {}
    for turn in range(1, turns + 1):
        graph.invoke({"messages": [human(turn, thread_id, 400)]}, config)
        if turn in snapshot_at:
            sizes[turn] = newest_blob_size(conn, thread_id)
    return sizes


def test_messages_blob_stays_bounded(fresh_pg: str, record_property) -> None:
    with (
        PostgresSaver.from_conn_string(fresh_pg) as postgres,
        psycopg.connect(fresh_pg, autocommit=True) as conn,
    ):
        postgres.setup()
        reduced = ReducingSaver(
            postgres, MessageReducer(max_messages=MAX_MESSAGES, min_messages=MIN_MESSAGES)
        )
        reduced_sizes = run_thread(reduced, conn, "reduced", 100, (10, 100))
        plain_sizes = run_thread(postgres, conn, "plain", 100, (10, 100))
        reduced_blobs = messages_blobs(conn, postgres.serde, "reduced")
        plain_blobs = messages_blobs(conn, postgres.serde, "plain")
        stored = PostgresSaver(postgres.conn).get_tuple({"configurable": {"thread_id": "reduced"}})

    # "The window first filled": the first stored version holding max_messages messages.
    fill_index = next(i for i, (_, _, count) in enumerate(reduced_blobs) if count == MAX_MESSAGES)
    fill_size = reduced_blobs[fill_index][1]
    plain_fill_size = next(size for _, size, count in plain_blobs if count == MAX_MESSAGES)

    figures = {
        "reduced: messages blob at window fill (bytes)": fill_size,
        "reduced: newest messages blob at turn 10 (bytes)": reduced_sizes[10],
        "reduced: newest messages blob at turn 100 (bytes)": reduced_sizes[100],
        "reduced: largest messages blob after fill (bytes)": max(
            size for _, size, _ in reduced_blobs[fill_index:]
        ),
        "reduced: all messages blobs of the thread (bytes)": sum(size for _, size, _ in reduced_blobs),
        "plain: messages blob at the same point, 6 messages (bytes)": plain_fill_size,
        "plain: newest messages blob at turn 10 (bytes)": plain_sizes[10],
        "plain: newest messages blob at turn 100 (bytes)": plain_sizes[100],
        "plain: all messages blobs of the thread (bytes)": sum(size for _, size, _ in plain_blobs),
    }
    print("\nmessages channel storage, 100 turns of ~400-character messages, window 4-6 messages:")
    for name, value in figures.items():
        print(f"  {name:<62} {value:>10,}")
        record_property(name, value)

    assert reduced_sizes[10] <= fill_size
    assert reduced_sizes[100] <= fill_size
    # Not just the two sample points: no version written after the fill is larger.
    assert all(size <= fill_size for _, size, _ in reduced_blobs[fill_index:])
    assert all(count <= MAX_MESSAGES for _, _, count in reduced_blobs)
    # The measurement sees growth where there is some.
    assert plain_sizes[10] < plain_sizes[100]
    assert plain_sizes[100] > 10 * reduced_sizes[100]
    # What a plain PostgresSaver reads back is the window, newest turn last.
    window = stored.checkpoint["channel_values"]["messages"]
    assert MIN_MESSAGES <= len(window) <= MAX_MESSAGES
    assert window[-1].id == "reduced-ai-0099" and msg_kind(window[0]) == "human"


def test_windows_stay_valid_on_a_graph_with_tool_calls(fresh_pg: str, window_problems) -> None:
    thread = {"configurable": {"thread_id": "tools"}}
    with (
        PostgresSaver.from_conn_string(fresh_pg) as postgres,
        PostgresSaver.from_conn_string(fresh_pg) as reader,
    ):
        postgres.setup()
        saver = ReducingSaver(postgres, MessageReducer(max_messages=MAX_MESSAGES, min_messages=MIN_MESSAGES))
        graph = build_chat_graph(saver, prefix="tools", length=400, with_tools=True)
        system = SystemMessage("You answer questions, looking things up when needed.", id="sys")
        seen_tool_windows = 0
        for turn in range(30):
            new = [system, human(turn, "tools")] if turn == 0 else [human(turn, "tools")]
            graph.invoke({"messages": new}, thread)
            window = reader.get_tuple(thread).checkpoint["channel_values"]["messages"]
            assert window_problems(window) == [], (turn, [(msg_kind(m), m.id) for m in window])
            assert window[0].id == "sys" and len(window) <= MAX_MESSAGES
            seen_tool_windows += any(msg_kind(m) == "tool" for m in window)

        # Every stored checkpoint, mid-turn ones included (a call waiting for its tools at the tail).
        history = list(reader.list(thread))
        windows = [
            t.checkpoint["channel_values"]["messages"]
            for t in history
            if "messages" in t.checkpoint["channel_values"]
        ]
    assert len(windows) > 100
    for window in windows:
        assert window_problems(window) == [], [(msg_kind(m), m.id) for m in window]
        assert window[0].id == "sys" and len(window) <= MAX_MESSAGES
    # The check had something to check: pruned history, and windows holding tool calls and results.
    assert seen_tool_windows >= 10
    assert any(msg_kind(w[-1]) == "ai" and w[-1].tool_calls for w in windows)
    assert "tools-h-0000" not in {m.id for m in windows[0]}


@pytest.mark.parametrize("turns", [10])
def test_reduced_thread_reads_back_with_a_plain_saver(fresh_pg: str, turns: int) -> None:
    """The rows a ReducingSaver writes are ordinary PostgresSaver rows: a plain saver resumes the thread."""
    with PostgresSaver.from_conn_string(fresh_pg) as postgres:
        postgres.setup()
        saver = ReducingSaver(postgres, MessageReducer(max_messages=MAX_MESSAGES, min_messages=MIN_MESSAGES))
        run_thread(saver, postgres.conn, "resume", turns, ())
        graph = build_chat_graph(postgres, prefix="resume-plain", length=400)
        result = graph.invoke(
            {"messages": [human(turns + 1, "resume", 400)]}, {"configurable": {"thread_id": "resume"}}
        )
    kept = [m.id for m in result["messages"]]
    assert len(kept) <= MAX_MESSAGES + 2
    assert kept[-2:] == [f"resume-h-{turns + 1:04d}", "resume-plain-ai-0000"]
