"""Routes of the service app in-process (FastAPI TestClient): bad input, refusals, reduction on the wire."""

from __future__ import annotations

import base64
from pathlib import Path

import ormsgpack
import pytest
from fastapi.testclient import TestClient
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from reducing_saver.wire import blob_to_wire
from tests.support.bodies import messages_put_body as _put_body

SERDE = JsonPlusSerializer()


@pytest.fixture
def pruned() -> list:
    return []


@pytest.fixture
def client(pruned):
    app = create_app(
        Settings(database="memory://", max_messages=4, min_messages=2, max_body_bytes=64 * 1024),
        on_prune=[lambda messages, namespace: pruned.append((list(messages), namespace))],
    )
    with TestClient(app) as test_client:
        yield test_client


def _config(thread_id: str = "t1", **extra) -> dict:
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": "", **extra}}


def _messages(n: int) -> list:
    out = [SystemMessage("sys", id="s")]
    for i in range(n):
        out.append(HumanMessage(f"q{i}", id=f"h{i}"))
        out.append(AIMessage(f"a{i}", id=f"a{i}"))
    return out


def _get(client: TestClient, thread_id: str = "t1"):
    response = client.post("/v1/checkpoints/get", json={"config": _config(thread_id)})
    assert response.status_code == 200, response.text
    return response.json()["checkpoint"]


def test_put_reduces_the_messages_channel_byte_identically(client, pruned):
    messages = _messages(4)  # system + 8 messages, window 2..4
    response = client.post("/v1/checkpoints/put", json=_put_body(blob_to_wire(*SERDE.dumps_typed(messages))))
    assert response.status_code == 200, response.text
    stored = _get(client)["values"]["messages"]
    kept = SERDE.loads_typed((stored["type"], base64.b64decode(stored["data"])))
    assert [m.id for m in kept] == ["s", "h3", "a3"]
    assert base64.b64decode(stored["data"]) == SERDE.dumps_typed([messages[0], *messages[-2:]])[1]
    assert [[m["id"] for m in batch] for batch, _ in pruned] == [["h0", "a0", "h1", "a1", "h2", "a2"]]
    assert pruned[0][1] == ("memories", "t1")


def test_memory_namespace_comes_from_the_config(client, pruned):
    body = _put_body(blob_to_wire(*SERDE.dumps_typed(_messages(4))), memory_namespace=["team", "x"])
    assert client.post("/v1/checkpoints/put", json=body).status_code == 200
    assert pruned[0][1] == ("team", "x")


@pytest.mark.parametrize(
    ("code", "args", "allowable"),
    [(0, "touch {marker}", False), (5, {"content": "touch {marker}"}, True)],
)
def test_hostile_extension_is_refused_and_not_executed(client, tmp_path: Path, code, args, allowable):
    marker = tmp_path / "executed"
    args = args.format(marker=marker) if isinstance(args, str) else {"content": f"touch {marker}"}
    payload = ormsgpack.packb([ormsgpack.Ext(code, ormsgpack.packb(("os", "system", args, "x")))])
    response = client.post("/v1/checkpoints/put", json=_put_body(blob_to_wire("msgpack", payload)))
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert "os.system" in detail and f"code {code}" in detail
    # Only a message class (code 5) can be allowed by the operator; the detail says how.
    assert ("REDUCING_SAVER_ALLOWED_MESSAGE_CLASSES" in detail) is allowable
    assert not marker.exists()
    assert _get(client) is None  # nothing stored
    assert client.get("/healthz").status_code == 200


def test_unreadable_messages_are_stored_unreduced(client):
    opaque = blob_to_wire("msgpack+aes", b"\x00secret bytes")
    assert client.post("/v1/checkpoints/put", json=_put_body(opaque)).status_code == 200
    assert _get(client)["values"]["messages"] == opaque
    assert client.app.state.service.codec.unreadable == 1


@pytest.mark.parametrize(
    ("mutate", "expected_status", "needle"),
    [
        (lambda b: b.update(extra_field=1), 422, "extra_field"),
        (
            lambda b: b["values"].update(messages={"type": "msgpack", "data": "***not base64***"}),
            422,
            "base64",
        ),
        (lambda b: b["values"].update(messages={"type": "msgpack"}), 422, "data"),
        (lambda b: b["checkpoint"].update(id=5), 422, "id"),
        (lambda b: b["config"]["configurable"].pop("thread_id"), 422, "thread_id"),
        (lambda b: b.update(new_versions="x"), 422, "new_versions"),
    ],
)
def test_bad_put_bodies_name_the_field(client, mutate, expected_status, needle):
    body = _put_body(blob_to_wire(*SERDE.dumps_typed(_messages(1))))
    mutate(body)
    response = client.post("/v1/checkpoints/put", json=body)
    assert response.status_code == expected_status, response.text
    assert needle in response.text
    assert _get(client) is None
    assert client.get("/healthz").status_code == 200


def test_malformed_json_is_refused(client):
    response = client.post(
        "/v1/checkpoints/put", content=b'{"config": ', headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert "json" in response.text.lower()


def test_body_over_the_limit_gets_413_before_parsing(client):
    big = blob_to_wire("msgpack", b"x" * (80 * 1024))
    response = client.post("/v1/checkpoints/put", json=_put_body(big))
    assert response.status_code == 413
    assert "max_body_bytes" in response.json()["detail"]
    assert _get(client) is None


def test_thread_lifecycle_routes(client):
    body = _put_body(blob_to_wire(*SERDE.dumps_typed(_messages(1))))
    assert client.post("/v1/checkpoints/put", json=body).status_code == 200
    assert (
        client.post("/v1/threads/copy", json={"source_thread_id": "t1", "target_thread_id": "t2"}).status_code
        == 204
    )
    assert _get(client, "t2")["values"] == _get(client, "t1")["values"]
    again = client.post("/v1/threads/copy", json={"source_thread_id": "t1", "target_thread_id": "t2"})
    assert again.status_code == 409 and "t2" in again.json()["detail"]
    assert (
        client.post("/v1/threads/prune", json={"thread_ids": ["t2"], "strategy": "delete"}).status_code == 204
    )
    assert _get(client, "t2") is None
    bad = client.post("/v1/threads/prune", json={"thread_ids": ["t1"], "strategy": "everything"})
    assert bad.status_code == 422 and "strategy" in bad.text


def test_openapi_documents_every_route(client):
    spec = client.get("/openapi.json").json()
    paths = set(spec["paths"])
    assert {
        "/healthz",
        "/readyz",
        "/v1/capabilities",
        "/v1/checkpoints/get",
        "/v1/checkpoints/list",
        "/v1/checkpoints/put",
        "/v1/writes/put",
        "/v1/threads/delete",
        "/v1/threads/copy",
        "/v1/threads/prune",
        "/v1/runs/delete",
        "/v1/checkpoints/delta-history",
    } <= paths
    put = spec["paths"]["/v1/checkpoints/put"]["post"]
    assert {"200", "413", "422"} <= set(put["responses"])


def test_repeat_puts_of_a_turn_record_the_pruned_messages_once(client, monkeypatch):
    outbox = client.app.state.service.memory.outbox
    recorded = []
    original = outbox.record
    monkeypatch.setattr(outbox, "record", lambda entries: recorded.append(len(entries)) or original(entries))
    body = _put_body(blob_to_wire(*SERDE.dumps_typed(_messages(4))))
    for _ in range(3):  # LangGraph hands every put of a turn the same unreduced list
        assert client.post("/v1/checkpoints/put", json=body).status_code == 200
    assert recorded == [6]  # one round trip; the repeats are known to be committed
    status = client.get("/v1/extraction/status").json()
    assert status["pending"] + status["in_flight"] + status["delivered"] == 6


# -- the documentation pages work offline -------------------------------------------------------------


def _referenced_urls(html: str) -> list[str]:
    import re

    return re.findall(r"""(?:src|href|url)\s*[=:]\s*['"]([^'"]+)['"]""", html)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_documentation_pages_load_nothing_from_elsewhere(page):
    with TestClient(create_app(Settings(database="memory://", sweep=False, extract=False))) as http:
        answer = http.get(page)
        assert answer.status_code == 200
        html = answer.text
        urls = _referenced_urls(html)
        assert "/openapi.json" in urls and any(url.startswith("/docs/assets/") for url in urls), urls
        for url in urls:
            assert url.startswith("/"), f"{page} loads {url} from elsewhere"
            fetched = http.get(url)
            assert fetched.status_code == 200, url
            assert fetched.content, url
        # Nothing else names another host either (Google fonts, the swagger.io validator badge).
        assert "http://" not in html and "https://" not in html, html


DOCS_PAGES = (
    "/docs",
    "/redoc",
    "/openapi.json",
    "/docs/assets/swagger-ui-bundle.js",
    "/docs/assets/swagger-ui.css",
)


def test_the_api_description_opens_without_a_key_by_default():
    """The API description is not a secret: a browser opens /docs on a keyed service; data needs a key."""
    key = "docs-key-0123456789abcdef"
    settings = Settings(database="memory://", sweep=False, extract=False, api_keys=f"acme={key}")
    with TestClient(create_app(settings)) as http:
        for path in DOCS_PAGES:
            assert http.get(path).status_code == 200, path
        assert http.get("/v1/capabilities").status_code == 401
        assert http.get("/v1/capabilities", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        # The document still declares the key on every route that needs one.
        assert "security" in http.get("/openapi.json").json()["paths"]["/v1/capabilities"]["get"]


def test_the_api_description_needs_a_key_without_docs_public():
    key = "docs-key-0123456789abcdef"
    settings = Settings(
        database="memory://", sweep=False, extract=False, api_keys=f"acme={key}", docs_public=False
    )
    with TestClient(create_app(settings)) as http:
        for path in DOCS_PAGES:
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers={"Authorization": f"Bearer {key}"}).status_code == 200, path


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgres"])
def test_stored_values_says_which_values_a_put_stores(kind, request, tmp_path):
    """``/v1/capabilities`` → ``stored_values`` is what the backend keeps of a put's channels outside
    ``new_versions``: a client that sends only those loses nothing."""
    database = {
        "memory": "memory://",
        "sqlite": f"sqlite:///{tmp_path / 'stored.sqlite'}",
        "postgres": request.getfixturevalue("fresh_pg") if kind == "postgres" else "",
    }[kind]
    with TestClient(create_app(Settings(database=database, sweep=False, extract=False))) as http:
        advertised = http.get("/v1/capabilities").json()["stored_values"]
        checkpoint = empty_checkpoint()
        checkpoint.pop("channel_values")
        checkpoint["channel_versions"] = {"changed": "2", "blob": "1", "primitive": "1"}
        body = {
            "config": _config("t-stored"),
            "checkpoint": checkpoint,
            "values": {
                "changed": blob_to_wire(*SERDE.dumps_typed(["new"])),
                "blob": blob_to_wire(*SERDE.dumps_typed({"written": "before"})),
                "primitive": 7,
            },
            "metadata": {},
            "new_versions": {"changed": "2"},
        }
        assert http.post("/v1/checkpoints/put", json=body).status_code == 200
        kept = set(_get(http, "t-stored")["values"])
    assert {
        "all": {"changed", "blob", "primitive"},
        "changed": {"changed"},
        "changed_and_inline": {"changed", "primitive"},
    }[advertised] == kept
    assert advertised == {"memory": "changed", "sqlite": "all", "postgres": "changed_and_inline"}[kind]
