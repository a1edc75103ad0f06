"""Dead summary batches over HTTP: listed per tenant, sent back per tenant, 404 without --summarizer."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from reducing_saver.wire import SUMMARY_DEAD_PATH, SUMMARY_RETRY_DEAD_PATH, blob_to_wire
from tests.support.bodies import messages_put_body

SERDE = JsonPlusSerializer()
KEYS = {"acme": "acme-key-0123456789", "rival": "rival-key-0123456789"}


def _put(client: TestClient, key: str, thread: str, turns: int) -> None:
    messages = []
    for i in range(turns):
        messages += [HumanMessage(f"FACT: {thread} {i}", id=f"h{i}"), AIMessage(f"a{i}", id=f"a{i}")]
    body = messages_put_body(blob_to_wire(*SERDE.dumps_typed(messages)), thread_id=thread)
    response = client.post("/v1/checkpoints/put", json=body, headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text


def _dead(client: TestClient, key: str, **params) -> list[dict]:
    response = client.get(SUMMARY_DEAD_PATH, params=params, headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()["dead_steps"]


def test_dead_summary_batches_are_listed_and_sent_back_per_tenant():
    settings = Settings(
        database="memory://",
        api_keys=",".join(f"{tenant}={key}" for tenant, key in KEYS.items()),
        metrics_key="scraper-key",
        max_messages=4,
        min_messages=2,
        summarizer="tests.support.summarizers:failing",
        extraction_max_attempts=1,
        extraction_idle_seconds=0.05,
    )
    with TestClient(create_app(settings)) as client:
        _put(client, KEYS["acme"], "chat", 4)  # 8 messages over a window of 4: a batch to summarize
        _put(client, KEYS["acme"], "other", 4)
        _put(client, KEYS["rival"], "chat", 4)
        deadline = time.monotonic() + 20
        while len(_dead(client, KEYS["acme"])) < 2 or len(_dead(client, KEYS["rival"])) < 1:
            assert time.monotonic() < deadline, "the failing summarizer's batches never became dead letters"
            time.sleep(0.05)
        acme = _dead(client, KEYS["acme"])
        assert sorted(step["thread_id"] for step in acme) == ["chat", "other"]  # the agent's ids, no tenant
        for step in acme:
            assert step["checkpoint_ns"] == "" and step["messages"] > 0 and step["attempts"] == 1
            assert "FlakySummarizerError: no model for" in step["last_error"]
        assert [step["thread_id"] for step in _dead(client, KEYS["rival"])] == ["chat"]
        assert len(_dead(client, KEYS["acme"], limit=1)) == 1
        bad = client.get(
            SUMMARY_DEAD_PATH, params={"limit": 0}, headers={"authorization": f"Bearer {KEYS['acme']}"}
        )
        assert bad.status_code == 422 and "limit" in bad.text
        assert client.get(SUMMARY_DEAD_PATH).status_code == 401
        assert client.post(SUMMARY_RETRY_DEAD_PATH).status_code == 401
        status = client.get("/v1/extraction/status", headers={"authorization": f"Bearer {KEYS['rival']}"})
        assert status.json()["summaries"]["dead_steps"] == 1

        # rival's retry sends back rival's batch only; it fails again and is dead again.
        retried = client.post(SUMMARY_RETRY_DEAD_PATH, headers={"authorization": f"Bearer {KEYS['rival']}"})
        assert retried.status_code == 200 and retried.json() == {"requeued": 1}
        assert _dead(client, KEYS["acme"]) == acme
        deadline = time.monotonic() + 20
        while _dead(client, KEYS["rival"]) == []:
            assert time.monotonic() < deadline, "the retried batch never failed again"
            time.sleep(0.05)
        metrics = client.get("/metrics", headers={"authorization": "Bearer scraper-key"}).text
        assert "reducing_saver_summary_dead_steps 3.0" in metrics
        assert 'reducing_saver_summary_failures_total{tenant="rival"} 2.0' in metrics


def test_without_a_summarizer_the_routes_answer_404_naming_the_flag():
    with TestClient(create_app(Settings(database="memory://"))) as client:
        for response in (client.get(SUMMARY_DEAD_PATH), client.post(SUMMARY_RETRY_DEAD_PATH)):
            assert response.status_code == 404 and "--summarizer" in response.json()["detail"]
        paths = client.get("/openapi.json").json()["paths"]
        assert "get" in paths[SUMMARY_DEAD_PATH] and "post" in paths[SUMMARY_RETRY_DEAD_PATH]
