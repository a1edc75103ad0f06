"""An example agent worker: a LangGraph chat graph that checkpoints through a reducing-saver service.

    REDUCING_SAVER_URL=http://127.0.0.1:8080 python -m examples.agent_worker

It chats forever on one thread of its own (named after the host, so each replica of
docker-compose.yml has its own), pausing between turns, and prints after every turn how many
messages the service stored for the thread: the count stops growing once the reducer's window is
reached, however long the conversation gets. The chat model is langchain_core's
``GenericFakeChatModel`` answering ~400-character messages, so no model provider is needed.

Environment:
    REDUCING_SAVER_URL: the service's base URL (required). Read by this example, not by the service.
    REDUCING_SAVER_API_KEY: sent as a bearer token when set (read by ``RemoteReducingSaver``).
    AGENT_PAUSE_SECONDS: pause between turns (default 3).
    AGENT_MAX_TURNS: stop after this many turns (default 0: never).
    AGENT_THREAD_ID: the thread to chat on (default ``agent-<hostname>``).

Needs ``langgraph`` (the ``examples`` extra: ``pip install 'reducing-saver[examples]'``).
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.graph import END, START, MessagesState, StateGraph

from reducing_saver.client import ReducingSaverError, RemoteReducingSaver

ANSWER_CHARS = 400


def answers() -> Iterator[AIMessage]:
    """An endless supply of ~400-character answers for the fake chat model."""
    for turn in itertools.count(1):
        text = f"Answer {turn}: " + "the quick brown fox jumps over the lazy dog; " * 10
        yield AIMessage(text[:ANSWER_CHARS])


def build_graph(checkpointer: RemoteReducingSaver):
    """A one-node chat graph: every turn appends the model's answer to ``messages``."""
    model = GenericFakeChatModel(messages=answers())

    def chat(state: MessagesState) -> dict:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("chat", chat)
    builder.add_edge(START, "chat")
    builder.add_edge("chat", END)
    return builder.compile(checkpointer=checkpointer)


def connect(url: str, stop: threading.Event, pause: float) -> RemoteReducingSaver | None:
    """The saver, once the service answers; ``None`` if asked to stop first."""
    while not stop.is_set():
        try:
            return RemoteReducingSaver(url)
        except ReducingSaverError as exc:
            print(f"waiting for the service at {url}: {exc}", flush=True)
            stop.wait(pause)
    return None


def describe(saver: RemoteReducingSaver) -> str:
    reducer = saver.reducer
    if reducer.max_tokens is not None:
        return f"service reduces above {reducer.max_tokens} tokens, down to {reducer.target_tokens}"
    return f"service reduces above {reducer.max_messages} messages, down to {reducer.min_messages}"


def main() -> int:
    url = os.environ.get("REDUCING_SAVER_URL")
    if not url:
        print("set REDUCING_SAVER_URL to the service's URL, e.g. http://127.0.0.1:8080", file=sys.stderr)
        return 2
    pause = float(os.environ.get("AGENT_PAUSE_SECONDS", "3"))
    max_turns = int(os.environ.get("AGENT_MAX_TURNS", "0"))
    thread_id = os.environ.get("AGENT_THREAD_ID") or f"agent-{socket.gethostname()}"

    # As PID 1 in a container a process ignores SIGTERM unless it handles it: stop between turns.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    saver = connect(url, stop, pause)
    if saver is None:
        return 0
    with saver:
        graph = build_graph(saver)
        config = {"configurable": {"thread_id": thread_id}}
        print(f"agent on thread {thread_id!r} via {saver!r}; {describe(saver)}", flush=True)
        written = len(graph.get_state(config).values.get("messages", []))
        for turn in itertools.count(1):
            try:
                graph.invoke({"messages": [HumanMessage(f"Question {turn}: tell me more.")]}, config)
                stored = len(graph.get_state(config).values["messages"])
            except ReducingSaverError as exc:
                # The service restarting or the database failing over: the next turn retries.
                print(f"turn {turn}: {type(exc).__name__}: {exc}", flush=True)
            else:
                written += 2
                print(f"turn {turn}: stored window {stored} messages, {written} written so far", flush=True)
            if max_turns and turn >= max_turns:
                break
            if stop.wait(pause):
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
