"""Agents running chat turns against real services while something happens to their database, and the
count afterwards: turns acknowledged, failed and lost, and how soon turns went through again.

Each agent is a thread running a real LangGraph graph on ``RemoteReducingSaver`` (the client's default
retries), its turns spread over one or more service URLs (turn *n* to URL *n* mod *k*, so every replica
takes puts of every thread). A turn is acknowledged when ``invoke`` returned: LangGraph waits for its
checkpoints then. A turn is lost when it was acknowledged and one of its two messages is neither in the
thread's stored window nor delivered to long-term memory (the store, read directly with PostgresStore).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.graph import END, START, MessagesState, StateGraph

from reducing_saver.client import RemoteReducingSaver
from tests.support.chat import padded

#: Characters of each message: a window of 6 is a few KB.
LENGTH = 120


def turn_graph(checkpointer: Any) -> Any:
    """A chat graph whose node answers the newest human message with an AI message named after it."""

    def chat(state: MessagesState) -> dict[str, list[AIMessage]]:
        question = state["messages"][-1]
        return {"messages": [AIMessage(padded(f"answer to {question.id}", LENGTH), id=f"{question.id}-ai")]}

    builder = StateGraph(MessagesState)
    builder.add_node("chat", chat)
    builder.add_edge(START, "chat")
    builder.add_edge("chat", END)
    return builder.compile(checkpointer=checkpointer)


@dataclass
class Agent:
    """One thread's turns: those acknowledged (turn, when) and the failures (when, error)."""

    thread_id: str
    urls: Sequence[str]
    acknowledged: list[tuple[int, float]] = field(default_factory=list)
    failures: list[tuple[float, str]] = field(default_factory=list)
    #: The next turn's number: a later run carries on the thread where the last one stopped.
    next_turn: int = 0

    def config(self) -> dict[str, Any]:
        return {"configurable": {"thread_id": self.thread_id}}

    def human(self, turn: int) -> HumanMessage:
        return HumanMessage(padded(f"question {turn}", LENGTH), id=f"{self.thread_id}-h-{turn:04d}")

    def expected_ids(self) -> set[str]:
        """The ids of the messages of every acknowledged turn."""
        ids: set[str] = set()
        for turn, _ in self.acknowledged:
            human = f"{self.thread_id}-h-{turn:04d}"
            ids |= {human, f"{human}-ai"}
        return ids

    def run(self, stop: threading.Event, pause: float, options: dict[str, Any]) -> None:
        with ExitStack() as stack:
            graphs = [
                turn_graph(stack.enter_context(RemoteReducingSaver(url, **options))) for url in self.urls
            ]
            while not stop.is_set():
                turn = self.next_turn
                try:
                    graphs[turn % len(graphs)].invoke({"messages": [self.human(turn)]}, self.config())
                except Exception as exc:  # noqa: BLE001 - counted: a failed turn is a figure of the test
                    self.failures.append((time.monotonic(), f"{type(exc).__name__}: {exc}"))
                else:
                    self.acknowledged.append((turn, time.monotonic()))
                self.next_turn += 1
                stop.wait(pause)


class Fleet:
    """Agents running in threads until :meth:`stop`."""

    def __init__(
        self, agents: list[Agent], *, pause: float = 0.05, client: dict[str, Any] | None = None
    ) -> None:
        self.agents = agents
        self.pause = pause
        self.client = {"startup_timeout": 60.0, **(client or {})}
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=agent.run, args=(self._stop, pause, self.client), daemon=True)
            for agent in agents
        ]

    def start(self) -> Fleet:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in self._threads), "an agent is still running"

    def acknowledged(self) -> int:
        return sum(len(agent.acknowledged) for agent in self.agents)

    def failed(self) -> int:
        return sum(len(agent.failures) for agent in self.agents)

    def wait_for(self, turns: int, timeout: float = 60.0) -> None:
        """Wait until at least ``turns`` more turns than now have been acknowledged."""
        target = self.acknowledged() + turns
        deadline = time.monotonic() + timeout
        while self.acknowledged() < target:
            assert time.monotonic() < deadline, f"only {self.acknowledged()} of {target} turns acknowledged"
            assert all(thread.is_alive() for thread in self._threads), "an agent stopped"
            time.sleep(0.05)

    def back_after(self, moment: float) -> float | None:
        """Seconds from ``moment`` until every agent had a turn acknowledged after it (``None``: not all)."""
        firsts = []
        for agent in self.agents:
            after = [at for _, at in agent.acknowledged if at > moment]
            if not after:
                return None
            firsts.append(min(after))
        return max(firsts) - moment

    def figures(self) -> str:
        return f"{self.acknowledged()} turns acknowledged, {self.failed()} failed"


@contextmanager
def running(agents: list[Agent], **options: Any) -> Iterator[Fleet]:
    """A :class:`Fleet` of ``agents``, started, stopped when the block ends."""
    fleet = Fleet(agents, **options).start()
    try:
        yield fleet
    finally:
        fleet.stop()


def wait_delivered(url: str, timeout: float = 60.0) -> None:
    """Wait until the service at ``url`` reports nothing pending or in flight in the outbox."""
    deadline = time.monotonic() + timeout
    while True:
        status = httpx.get(f"{url}/v1/extraction/status", timeout=10).json()
        if status["pending"] == 0 and status["in_flight"] == 0:
            return
        assert time.monotonic() < deadline, f"outbox not drained: {status}"
        time.sleep(0.2)


def lost_turns(agents: list[Agent], url: str, database: str) -> dict[str, list[str]]:
    """Per thread, the ids of acknowledged messages found neither in its window (read through the
    service at ``url``) nor in long-term memory (the store of ``database``, read with PostgresStore)."""
    from langgraph.store.postgres import PostgresStore

    lost: dict[str, list[str]] = {}
    with RemoteReducingSaver(url) as saver, PostgresStore.from_conn_string(database) as store:
        for agent in agents:
            stored = saver.get_tuple(agent.config())
            window = {m.id for m in stored.checkpoint["channel_values"]["messages"]} if stored else set()
            memory = {item.key for item in store.search(("memories", agent.thread_id), limit=100_000)}
            missing = sorted(agent.expected_ids() - window - memory)
            if missing:
                lost[agent.thread_id] = missing
    return lost
