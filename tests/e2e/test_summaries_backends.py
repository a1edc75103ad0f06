"""Running summaries on the three backends, through a real service process: the summary reaches the
window, a copied thread carries its summary on, a deleted thread starts over."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from langchain_core.messages import HumanMessage

from reducing_saver.client import RemoteReducingSaver
from reducing_saver.reducer import MARK_KEY, summary_message_id
from tests.conftest import api_window_problems, build_chat_graph
from tests.support.server import run_service

pytestmark = pytest.mark.e2e


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def database(request, tmp_path):
    if request.param == "memory":
        return "memory://"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/service.sqlite"
    return request.getfixturevalue("fresh_pg")


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_summarized(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(url, "reducing_saver_summary_pending_steps"):
        assert time.monotonic() < deadline, "the summarizer did not catch up"
        time.sleep(0.05)


def ask(graph, thread: str, n: int) -> None:
    graph.invoke({"messages": [HumanMessage(f"FACT: {thread} {n}\nquestion", id=f"{thread}-h-{n}")]},
                 {"configurable": {"thread_id": thread}})


def window(graph, thread: str) -> list:
    return graph.get_state({"configurable": {"thread_id": thread}}).values["messages"]


def test_summaries_on_every_backend_follow_copies_and_deletes(tmp_path: Path, database: str):
    args = ["--database", database, "--max-messages", "6", "--min-messages", "4",
            "--summarizer", "tests.support.summarizers:async_facts"]
    with run_service(tmp_path, *args) as service, RemoteReducingSaver(service.url) as saver:
        graph = build_chat_graph(saver, prefix="b", length=40, with_tools=True)
        for n in range(15):
            ask(graph, "t", n)
            wait_summarized(service.url)
        ask(graph, "t", 15)
        messages = window(graph, "t")
        assert not api_window_problems(messages)
        summary = messages[0]
        assert summary.id == summary_message_id("t", "") and summary.additional_kwargs[MARK_KEY]["version"] >= 3
        seen = "\n".join(str(m.content) for m in messages)
        assert all(f"FACT: t {n}" in seen for n in range(16))
        assert metric(service.url, 'reducing_saver_summary_calls_total{tenant=""}') >= 3

        # A copy carries the summary on: its steps were copied, so the copied summary is accepted, and the
        # next rewrite gives it the copy's own id.
        saver.copy_thread("t", "copy")
        for n in range(16, 24):
            ask(graph, "copy", n)
            wait_summarized(service.url)
        ask(graph, "copy", 24)
        copied = window(graph, "copy")
        assert copied[0].id == summary_message_id("copy", "")
        seen = "\n".join(str(m.content) for m in copied)
        assert "FACT: t 0" in seen and "FACT: copy 23" in seen

        # A deleted thread starts over: no summary of its past comes back.
        saver.delete_thread("t")
        ask(graph, "t", 100)
        assert all(m.id != summary_message_id("t", "") for m in window(graph, "t"))
