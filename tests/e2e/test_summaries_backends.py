"""Running summaries on the three backends, through a real service process: the summary reaches the
window, a copied thread carries its summary on, a deleted thread starts over."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from langchain_core.messages import HumanMessage

from reducing_saver.client import RemoteReducingSaver, RemoteStore
from reducing_saver.reducer import MARK_KEY, summary_message_id
from tests.support.chat import build_chat_graph
from tests.support.server import run_service
from tests.support.windows import api_window_problems

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
    graph.invoke(
        {"messages": [HumanMessage(f"FACT: {thread} {n}\nquestion", id=f"{thread}-h-{n}")]},
        {"configurable": {"thread_id": thread}},
    )


def window(graph, thread: str) -> list:
    return graph.get_state({"configurable": {"thread_id": thread}}).values["messages"]


def test_summaries_on_every_backend_follow_copies_and_deletes(tmp_path: Path, database: str):
    args = [
        "--database",
        database,
        "--max-messages",
        "6",
        "--min-messages",
        "4",
        "--summarizer",
        "tests.support.summarizers:async_facts",
        "--summary-concurrency",
        "3",
    ]
    with run_service(tmp_path, *args) as service, RemoteReducingSaver(service.url) as saver:
        graph = build_chat_graph(saver, prefix="b", length=40, with_tools=True)
        for n in range(15):
            ask(graph, "t", n)
            wait_summarized(service.url)
        ask(graph, "t", 15)
        messages = window(graph, "t")
        assert not api_window_problems(messages)
        summary = messages[0]
        assert (
            summary.id == summary_message_id("t", "") and summary.additional_kwargs[MARK_KEY]["version"] >= 3
        )
        seen = "\n".join(str(m.content) for m in messages)
        assert all(f"FACT: t {n}" in seen for n in range(16))
        assert metric(service.url, 'reducing_saver_summary_calls_total{tenant=""}') >= 3
        status = httpx.get(f"{service.url}/v1/extraction/status", timeout=5).json()["summaries"]
        assert status["done_steps"] >= 3 and status["dead_steps"] == 0

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


def test_only_the_tenants_named_are_summarized_and_each_reads_its_own_summary(tmp_path: Path):
    from reducing_saver.client import RemoteStore

    keys = {
        "REDUCING_SAVER_API_KEYS": "acme=acme-key,globex=globex-key",
        "REDUCING_SAVER_METRICS_KEY": SCRAPER_KEY,
    }
    args = [
        "--database",
        f"sqlite:///{tmp_path}/service.sqlite",
        "--max-messages",
        "6",
        "--min-messages",
        "4",
        "--summarizer",
        "tests.support.summarizers:facts",
        "--summarize-tenants",
        "acme",
    ]
    with (
        run_service(tmp_path, *args, env=keys) as service,
        RemoteReducingSaver(service.url, api_key="acme-key") as acme,
        RemoteReducingSaver(service.url, api_key="globex-key") as globex,
    ):
        graphs = {
            "acme": build_chat_graph(acme, prefix="a", length=40),
            "globex": build_chat_graph(globex, prefix="g", length=40),
        }
        for n in range(10):
            for graph in graphs.values():
                ask(graph, "t", n)
            deadline = time.monotonic() + 30
            while metric_with_key(service.url, SCRAPER_KEY, "reducing_saver_summary_pending_steps"):
                assert time.monotonic() < deadline
                time.sleep(0.05)
        ask(graphs["acme"], "t", 10)
        ask(graphs["globex"], "t", 10)
        acme_window, globex_window = window(graphs["acme"], "t"), window(graphs["globex"], "t")
        assert acme_window[0].additional_kwargs.get("lc_source") == "summarization"
        assert "FACT: t 0" in acme_window[0].content
        assert not any(m.additional_kwargs.get("lc_source") for m in globex_window)
        assert len(globex_window) <= 6  # reduced as without summaries
        headers = {"Authorization": "Bearer globex-key"}
        status = httpx.get(f"{service.url}/v1/extraction/status", headers=headers, timeout=5).json()
        assert status["summaries"]["done_steps"] == 0  # globex sees its own threads only: none summarized
        text = metrics_text(service.url, SCRAPER_KEY)
        assert 'reducing_saver_summary_calls_total{tenant="acme"}' in text and 'tenant="globex"' not in text
        # The summary is in the tenant's store too, and only there.
        with RemoteStore(service.url, api_key="acme-key") as store:
            item = store.get(("threads", "t", "summary"), "running")
            assert "FACT: t 0" in item.value["text"]
        with RemoteStore(service.url, api_key="globex-key") as store:
            assert store.get(("threads", "t", "summary"), "running") is None


#: The metrics scraper's key of the services with tenant keys: /metrics answers no tenant's.
SCRAPER_KEY = "scraper-key"


def metrics_text(url: str, key: str) -> str:
    return httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=5).text


def metric_with_key(url: str, key: str, name: str) -> float:
    for line in metrics_text(url, key).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_tenant_whose_keys_carry_no_summary_is_never_summarized(tmp_path: Path):
    """``no-summary`` on a tenant's lines of the keys file: its cuts are those of a service without
    ``--summarizer`` (the same windows, turn by turn), and nothing of it reaches the summarizer."""
    from reducing_saver.service.security.keys import hash_key

    keys = tmp_path / "api-keys"
    keys.write_text(
        f"acme {hash_key('acme-key')}\n"
        f"globex {hash_key('globex-key')} no-summary  # conversations stay out of the summarizer\n"
        f"globex {hash_key('globex-rotated')} no-summary\n"
    )
    window_args = ["--max-messages", "6", "--min-messages", "4", "--api-keys-file", str(keys)]
    summarized = [f"--database=sqlite:///{tmp_path}/summarized.sqlite", *window_args]
    plain = [f"--database=sqlite:///{tmp_path}/plain.sqlite", *window_args]
    with (
        run_service(
            tmp_path,
            *summarized,
            "--summarizer",
            "tests.support.summarizers:facts",
            env={"REDUCING_SAVER_METRICS_KEY": SCRAPER_KEY},
        ) as service,
        run_service(tmp_path, *plain) as without,
        RemoteReducingSaver(service.url, api_key="acme-key") as acme,
        RemoteReducingSaver(service.url, api_key="globex-key") as globex,
        RemoteReducingSaver(without.url, api_key="globex-rotated") as globex_without,
    ):
        graphs = {
            "acme": build_chat_graph(acme, prefix="a", length=40),
            "globex": build_chat_graph(globex, prefix="g", length=40),
            "without": build_chat_graph(globex_without, prefix="g", length=40),
        }
        for n in range(11):
            for graph in graphs.values():
                ask(graph, "t", n)
            deadline = time.monotonic() + 30
            while metric_with_key(service.url, SCRAPER_KEY, "reducing_saver_summary_pending_steps"):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert [m.id for m in window(graphs["globex"], "t")] == [
                m.id for m in window(graphs["without"], "t")
            ], n
        acme_window, globex_window = window(graphs["acme"], "t"), window(graphs["globex"], "t")
        assert acme_window[0].additional_kwargs.get("lc_source") == "summarization"
        assert "FACT: t 0" in acme_window[0].content
        assert not any(m.additional_kwargs.get("lc_source") for m in globex_window)
        assert len(globex_window) <= 6
        assert "FACT: t 0" not in "\n".join(str(m.content) for m in globex_window)
        for key in ("globex-key", "globex-rotated"):
            headers = {"Authorization": f"Bearer {key}"}
            status = httpx.get(f"{service.url}/v1/extraction/status", headers=headers, timeout=5).json()
            summaries = status["summaries"]
            assert summaries["done_steps"] == summaries["pending_steps"] == summaries["dead_steps"] == 0
            assert status["delivered"] + status["pending"] + status["in_flight"] > 0  # its cuts: to memory
        text = metrics_text(service.url, SCRAPER_KEY)
        assert 'reducing_saver_summary_calls_total{tenant="acme"}' in text and 'tenant="globex"' not in text
        with RemoteStore(service.url, api_key="globex-key") as store:
            assert store.get(("threads", "t", "summary"), "running") is None
