"""A custom, LLM-shaped extractor (a langchain_core fake chat model) plugged in with --extractor."""

from __future__ import annotations

import time

import httpx
from langgraph.store.postgres import PostgresStore

from reducing_saver.client import RemoteReducingSaver
from tests.support.agents import build_agent, user_line
from tests.support.server import run_service


def test_a_chat_model_extractor_writes_facts_into_the_store(tmp_path, fresh_pg):
    config = {"configurable": {"thread_id": "llm", "memory_namespace": ["facts", "llm"]}}
    with run_service(
        tmp_path,
        "--database",
        fresh_pg,
        "--max-messages",
        "4",
        "--extractor",
        "tests.support.extractors:facts",
    ) as service:
        with RemoteReducingSaver(service.url) as saver:
            graph = build_agent(saver)
            for turn in range(5):
                graph.invoke(
                    {"messages": [("user", f"{user_line(3 * turn)[:10]} I like tea {turn}")]}, config
                )
        for _ in range(100):
            status = httpx.get(f"{service.url}/v1/extraction/status").json()
            if status["pending"] == status["in_flight"] == 0:
                break
            time.sleep(0.1)
    assert status["delivered"] > 0 and status["dead"] == 0
    with PostgresStore.from_conn_string(fresh_pg) as store:
        facts = [item.value["fact"] for item in store.search(("facts", "llm"), limit=100)]
    assert facts and all(fact.startswith("user said: turn") for fact in facts)
    assert any("I like tea 0" in fact for fact in facts)
