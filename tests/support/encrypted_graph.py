"""A chat graph whose every kind of stored value carries a sentinel string, for the encryption tests.

``fill(url, api_key, thread_id, sentinel)`` runs turns until messages are pruned and extracted, and
puts the sentinel into a message, a custom channel, the run's metadata, a pending write, a store item;
the extracted memories then carry it too.
"""

from __future__ import annotations

import time
from typing import Annotated, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages

from reducing_saver.client import RemoteReducingSaver, RemoteStore


class State(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    notes: str


def _chat(state: State) -> State:
    last = state["messages"][-1].content
    return {"messages": [AIMessage(f"echo: {last}")], "notes": f"notes about {last}"}


def graph(saver: RemoteReducingSaver, store: RemoteStore | None = None):
    builder = StateGraph(State)
    builder.add_node("chat", _chat)
    builder.add_edge(START, "chat")
    return builder.compile(checkpointer=saver, store=store)


def fill(url: str, api_key: str | None, thread_id: str, sentinel: str, *, turns: int = 4) -> dict:
    """Store the sentinel in every kind of value; returns the head checkpoint's config."""
    with RemoteReducingSaver(url, api_key=api_key) as saver, RemoteStore(url, api_key=api_key) as store:
        app = graph(saver, store)
        config = {"configurable": {"thread_id": thread_id}, "metadata": {"tag": f"meta {sentinel}"}}
        for turn in range(turns):
            app.invoke({"messages": [HumanMessage(f"turn {turn} {sentinel}")]}, config)
        head = saver.get_tuple({"configurable": {"thread_id": thread_id}})
        saver.put_writes(head.config, [("notes", f"write {sentinel}")], "task-1")
        store.put(("prefs", thread_id), "item", {"text": f"item {sentinel}"})
        deadline = time.monotonic() + 20
        while not store.search(("memories", thread_id)):  # the extracted memories
            if time.monotonic() > deadline:
                raise AssertionError("no memory was extracted")
            time.sleep(0.2)
        return head.config
