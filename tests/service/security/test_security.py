"""Authentication, tenant isolation and safe defaults (service/security.py).

The isolation matrix runs every call of the API as tenant "rival" against threads, runs and memory of
tenant "acme", on PostgreSQL (a running service), SQLite and memory (the app in-process), and checks that
what rival sees is exactly what it sees for an id nobody ever used, and that acme's data is unchanged.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from pydantic import ValidationError

from reducing_saver.client import AuthenticationError, RemoteReducingSaver
from reducing_saver.service import security
from reducing_saver.service.cli import main as cli_main
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from reducing_saver.wire import blob_to_wire
from tests.support.server import CLI, ROOT, free_port, run_service

SERDE = JsonPlusSerializer()
KEYS = {"acme": "acme-key-0123456789abcdef", "rival": "rival-key-0123456789abcdef"}
NAMESPACE = ["memories", "user-42"]
NEVER_USED = "nobody-ever-used-this-id"


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def key_pairs(**extra: str) -> str:
    return ",".join(f"{tenant}={key}" for tenant, key in {**KEYS, **extra}.items())


# -- API keys ------------------------------------------------------------------------------------------


def test_keys_from_pairs_and_from_a_hash_file(tmp_path):
    hashes = tmp_path / "keys"
    hashes.write_text(
        f"# agents\nfiles {security.hash_key('file-key')}\n\nfiles {security.hash_key('rotated')}  # new\n"
    )
    settings = Settings(database="memory://", api_keys="dev=plain-key", api_keys_file=str(hashes))
    keys = security.load_api_keys(settings)
    assert keys.tenant_for("plain-key") == "dev"
    assert keys.tenant_for("file-key") == keys.tenant_for(b"rotated") == "files"
    assert keys.tenant_for("wrong") is None and keys.tenant_for("") is None
    assert (
        "plain-key" not in repr(keys)
        and "plain-key" not in repr(settings)
        and "plain-key" not in str(settings)
    )
    assert security.load_api_keys(Settings(database="memory://")) is None


@pytest.mark.parametrize(
    "pairs, message",
    [
        ("no-equals-sign-secret", "entry 1 is not tenant=key"),
        ("a=", "entry 1 is not tenant=key"),
        ("a:b=secret-value", "tenant name"),
        ("ok=k1,other=k1", "two tenants"),
        (" , ", "hold no key"),
    ],
)
def test_bad_key_settings_refuse_to_load_without_quoting_the_key(pairs, message):
    with pytest.raises(ValidationError) as error:
        Settings(database="memory://", api_keys=pairs)
    text = str(error.value)
    assert message in text
    for secret in ("secret", "k1"):
        assert f"={secret}" not in text and secret not in text.replace("tenants", "")


def test_a_bad_key_file_line_is_named(tmp_path):
    bad = tmp_path / "keys"
    bad.write_text(f"ok {security.hash_key('x')}\nbroken not-a-hash\n")
    with pytest.raises(ValidationError, match="line 2"):
        Settings(database="memory://", api_keys_file=str(bad))
    with pytest.raises(ValidationError, match="cannot read"):
        Settings(database="memory://", api_keys_file=str(tmp_path / "missing"))


def test_no_summary_on_a_key_file_line_opts_its_tenant_out_of_summaries(tmp_path):
    hashes = tmp_path / "keys"
    hashes.write_text(
        f"acme {security.hash_key('a')}\n"
        f"globex {security.hash_key('g1')} no-summary\n"
        f"globex {security.hash_key('g2')}   no-summary   # rotated\n"
    )
    keys = Settings(database="memory://", api_keys_file=str(hashes)).api_key_set
    assert keys.tenant_for("g2") == "globex" and keys.tenant_for("a") == "acme"
    assert keys.no_summary == {"globex"}
    assert security.load_api_keys(Settings(database="memory://", api_keys="x=y")).no_summary == frozenset()
    # --summarize-tenants may name the others, not an opted-out tenant.
    assert Settings(database="memory://", api_keys_file=str(hashes), summarize_tenants="acme")
    with pytest.raises(ValidationError, match="globex, whose keys carry no-summary"):
        Settings(database="memory://", api_keys_file=str(hashes), summarize_tenants="acme,globex")


@pytest.mark.parametrize(
    "lines, message",
    [
        (["acme {a} no-sumary"], "line 1: unknown attribute 'no-sumary'"),
        (["acme {a} NO-SUMMARY"], "line 1: unknown attribute"),
        (["acme {a} no-summary no-summary"], "line 1: an attribute is given twice"),
        (["acme no-summary {a}"], "line 1: expected `tenant sha256-hex-of-key [no-summary]`"),
        (["acme {a} no-summary", "acme {b}"], "tenant 'acme' has keys with and without no-summary"),
    ],
)
def test_a_key_attribute_is_parsed_strictly(tmp_path, lines, message):
    hashes = tmp_path / "keys"
    a, b = security.hash_key("a"), security.hash_key("b")
    hashes.write_text("\n".join(line.format(a=a, b=b) for line in lines) + "\n")
    with pytest.raises(ValidationError, match=re.escape(message)):
        Settings(database="memory://", api_keys_file=str(hashes))


def test_a_tenant_with_plain_keys_too_cannot_opt_out_on_its_file_lines_only(tmp_path):
    hashes = tmp_path / "keys"
    hashes.write_text(f"acme {security.hash_key('a')} no-summary\n")
    with pytest.raises(ValidationError, match="tenant 'acme' has keys with and without no-summary"):
        Settings(database="memory://", api_keys="acme=plain-key", api_keys_file=str(hashes))


def test_the_cli_reports_a_bad_key_without_echoing_it(capsys):
    os.environ["REDUCING_SAVER_API_KEYS"] = "tenant:bad=very-secret-value"
    try:
        assert cli_main(["extraction", "status", "--database", "memory://"]) == 2
    finally:
        del os.environ["REDUCING_SAVER_API_KEYS"]
    err = capsys.readouterr().err
    assert "tenant name" in err and "very-secret-value" not in err


@given(
    st.from_regex(security.TENANT_PATTERN, fullmatch=True),
    st.from_regex(security.TENANT_PATTERN, fullmatch=True),
    st.text(min_size=1, max_size=20),
    st.text(min_size=1, max_size=20),
)
def test_stored_thread_ids_of_two_tenants_never_collide(t1, t2, a, b):
    """``a`` + ``b:c`` and ``a:b`` + ``c`` stay apart: a tenant name never holds ':'."""
    if (t1, a) != (t2, b):
        assert security.TenantScope(t1).thread(a) != security.TenantScope(t2).thread(b)
    assert security.TenantScope(t1).unthread(security.TenantScope(t1).thread(a)) == a
    assert security.TenantScope(t1).namespace(["x"]) != security.TenantScope(t2).namespace(["x"]) or t1 == t2


def test_exposure_rules():
    def check(**kw: Any) -> str | None:
        return security.check_exposure(Settings(database="memory://", **kw))

    assert check() is None  # 127.0.0.1
    assert check(host="localhost") is None and check(host="::1") is None
    assert "refusing to listen on 0.0.0.0" in check(host="0.0.0.0")
    assert check(host="0.0.0.0", insecure=True) is None
    assert check(host="0.0.0.0", api_keys="a=b-long-key") is None
    assert check(host="10.1.2.3") and check(host="example.internal")


@pytest.mark.e2e  # starts processes
def test_serve_refuses_a_public_address_without_keys_and_says_why(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")}
    result = subprocess.run(
        [str(CLI), "serve", "--database", "memory://", "--host", "0.0.0.0", "--port", str(free_port())],
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "refusing to listen on 0.0.0.0 without API keys" in result.stderr
    assert "--insecure" in result.stderr


@pytest.mark.e2e
def test_serve_on_a_public_address_with_insecure_or_keys(tmp_path):
    with run_service(tmp_path, "--database", "memory://", "--host", "0.0.0.0", "--insecure") as svc:
        assert httpx.get(f"{svc.url}/v1/capabilities").status_code == 200
    env = {"REDUCING_SAVER_HOST": "0.0.0.0", "REDUCING_SAVER_API_KEYS": key_pairs()}
    with run_service(tmp_path, "--database", "memory://", env=env) as svc:
        assert httpx.get(f"{svc.url}/v1/capabilities").status_code == 401


# -- authentication on a running service ----------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_service(tmp_path_factory) -> Iterator[Any]:
    logs = tmp_path_factory.mktemp("keyed")
    env = {"REDUCING_SAVER_API_KEYS": key_pairs(), "REDUCING_SAVER_LOG_LEVEL": "debug"}
    with run_service(logs, "--database", "memory://", env=env) as svc:
        yield svc


def _routes(url: str) -> list[tuple[str, str]]:
    document = httpx.get(f"{url}/openapi.json", headers=auth("acme")).json()
    return [(method.upper(), path) for path, ops in document["paths"].items() for method in ops]


@pytest.mark.e2e
def test_every_route_but_the_probes_needs_a_key(keyed_service):
    url = keyed_service.url
    routes = _routes(url) + [("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/nonexistent")]
    assert ("GET", "/metrics") in routes and len(routes) >= 16
    bad = [
        {},
        {"Authorization": "Bearer wrong-key"},
        {"Authorization": f"Basic {KEYS['acme']}"},
        {"Authorization": KEYS["acme"]},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {KEYS['acme']}x"},
    ]
    for method, path in routes:
        for headers in bad:
            response = httpx.request(
                method, url + path, headers=headers, json={} if method == "POST" else None
            )
            # The probes, and the API description (docs_public, the default), need no key.
            expected = 200 if path in ("/healthz", "/readyz", "/docs", "/openapi.json") else 401
            assert response.status_code == expected, (method, path, headers, response.text)
            if expected == 401:
                assert response.headers["www-authenticate"].startswith("Bearer")
                wanted = "the metrics scraper's key" if path == "/metrics" else "a valid API key"
                assert response.json()["detail"].startswith(f"{wanted} is required")
        assert httpx.request(method, url + path, headers=auth("rival"), json={}).status_code != 401
    # The document declares the scheme, and 401 on every secured operation.
    document = httpx.get(f"{url}/openapi.json", headers=auth("acme")).json()
    assert document["components"]["securitySchemes"]["apiKey"] == {
        **document["components"]["securitySchemes"]["apiKey"],
        "type": "http",
        "scheme": "bearer",
    }
    header = document["components"]["securitySchemes"]["apiKeyHeader"]
    assert {k: header[k] for k in ("type", "in", "name")} == {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
    }
    for path, ops in document["paths"].items():
        for op in ops.values():
            public = path in ("/healthz", "/readyz")
            assert ("401" in op["responses"]) != public and ("security" in op) != public


AMBIGUOUS = [
    [("authorization", f"Bearer {KEYS['acme']}"), ("authorization", "Bearer wrong-key")],
    [("authorization", "Bearer wrong-key"), ("authorization", f"Bearer {KEYS['acme']}")],
    [("authorization", f"Bearer {KEYS['acme']}"), ("authorization", f"Bearer {KEYS['acme']}")],
    [("authorization", f"Bearer {KEYS['acme']}"), ("x-api-key", KEYS["rival"])],
    [("x-api-key", KEYS["acme"]), ("x-api-key", "wrong-key")],
]


@pytest.mark.parametrize(
    "headers",
    AMBIGUOUS,
    ids=["right-then-wrong", "wrong-then-right", "twice", "bearer-and-other-header", "two-x-api-keys"],
)
def test_ambiguous_credentials_are_refused_with_400(headers):
    """Two Authorization headers, or a key in both headers that disagree: which one a proxy in front checked
    is anyone's guess, so neither is taken (as servers guarding against request smuggling answer)."""
    with TestClient(create_app(Settings(database="memory://", api_keys=key_pairs()))) as client:
        answer = client.get("/v1/capabilities", headers=headers)
        assert answer.status_code == 400, answer.text
        assert answer.json()["detail"].startswith("ambiguous credentials")
        assert KEYS["acme"] not in answer.text and "wrong-key" not in answer.text
        # One key in both headers agrees: that is one credential.
        same = [("authorization", f"Bearer {KEYS['acme']}"), ("x-api-key", KEYS["acme"])]
        assert client.get("/v1/capabilities", headers=same).status_code == 200


def test_ambiguous_credentials_on_what_no_route_serves_get_the_routers_answer():
    """An undeclared method or an unknown path has no endpoint to protect: the router's 405 or 404 says
    more than a 400 would. Every operation that has one documents the 400."""
    headers = AMBIGUOUS[0]
    with TestClient(create_app(Settings(database="memory://", api_keys=key_pairs()))) as client:
        assert client.request("TRACE", "/v1/checkpoints/get", headers=headers).status_code == 405
        assert client.request("TRACE", "/v1/threads/t/storage", headers=headers).status_code == 405
        assert client.request("TRACE", "/store/items", headers=headers).status_code == 405
        assert client.request("TRACE", "/metrics", headers=headers).status_code == 405
        assert client.get("/v1/no-such-route", headers=headers).status_code == 404
        assert client.post("/v1/checkpoints/get", headers=headers, json={}).status_code == 400
        document = client.get("/openapi.json").json()
    for path, ops in document["paths"].items():
        for op in ops.values():
            assert ("400" in op["responses"]) == (path not in ("/healthz", "/readyz")), (
                path,
                op["responses"],
            )


@pytest.mark.e2e
def test_ambiguous_credentials_are_refused_by_the_running_service(keyed_service):
    for headers in AMBIGUOUS:
        answer = httpx.get(f"{keyed_service.url}/v1/capabilities", headers=headers)
        assert answer.status_code == 400, (headers, answer.text)


SCRAPER_KEY = "scraper-key-0123456789abcdef"


def test_metrics_answer_the_operators_key_only_never_a_tenants(tmp_path):
    """/metrics holds every tenant's figures (storage per tenant): a tenant's key gets 403 there, with or
    without a metrics key configured; the metrics key (plain, or its hash in a file) reads it and nothing
    else; the API description names the scheme."""

    def put_thread(client: TestClient, tenant: str) -> None:
        body = {
            "config": {"configurable": {"thread_id": "t", "checkpoint_ns": ""}},
            "checkpoint": empty_checkpoint(),
            "values": {},
            "metadata": {},
            "new_versions": {},
        }
        assert client.post("/v1/checkpoints/put", json=body, headers=auth(tenant)).status_code == 200

    with TestClient(create_app(Settings(database="memory://", api_keys=key_pairs()))) as client:
        put_thread(client, "acme")
        refused = client.get("/metrics", headers=auth("acme"))
        assert refused.status_code == 403, refused.text
        assert "REDUCING_SAVER_METRICS_KEY" in refused.json()["detail"]
        assert client.get("/metrics").status_code == 401
    hashed = tmp_path / "metrics-key"
    hashed.write_text(security.hash_key(SCRAPER_KEY) + "\n")
    for source in ({"metrics_key": SCRAPER_KEY}, {"metrics_key_file": str(hashed)}):
        settings = Settings(database="memory://", api_keys=key_pairs(), **source)
        with TestClient(create_app(settings)) as client:
            put_thread(client, "acme")
            put_thread(client, "rival")
            for headers in (auth("acme"), {"x-api-key": KEYS["rival"]}):
                assert client.get("/metrics", headers=headers).status_code == 403
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                assert client.get("/metrics", headers=headers).status_code == 401
            for headers in ({"Authorization": f"Bearer {SCRAPER_KEY}"}, {"x-api-key": SCRAPER_KEY}):
                scraped = client.get("/metrics", headers=headers)
                assert scraped.status_code == 200 and "reducing_saver_http_requests_total" in scraped.text
            assert (
                client.get("/v1/capabilities", headers={"Authorization": f"Bearer {SCRAPER_KEY}"}).status_code
                == 401
            )
            operation = client.get("/openapi.json").json()["paths"]["/metrics"]["get"]
            assert operation["security"] == [{"metricsKey": []}, {"metricsKeyHeader": []}]
            assert {"401", "403"} <= set(operation["responses"])


def test_a_metrics_key_that_is_also_a_tenants_key_is_refused():
    with pytest.raises(ValidationError, match="metrics key is also tenant 'acme'"):
        Settings(database="memory://", api_keys=key_pairs(), metrics_key=KEYS["acme"])


@pytest.mark.e2e
def test_metrics_public_setting(tmp_path):
    env = {"REDUCING_SAVER_API_KEYS": key_pairs(), "REDUCING_SAVER_METRICS_PUBLIC": "true"}
    with run_service(tmp_path, "--database", "memory://", env=env) as svc:
        assert httpx.get(f"{svc.url}/metrics").status_code == 200
        assert httpx.get(f"{svc.url}/v1/capabilities").status_code == 401


@pytest.mark.e2e
def test_the_key_appears_in_no_log_line_error_or_repr(keyed_service, caplog, monkeypatch):
    url = keyed_service.url
    with pytest.raises(AuthenticationError) as error:
        RemoteReducingSaver(url, api_key="not-the-key-" + KEYS["acme"][::-1])
    assert KEYS["acme"][::-1] not in str(error.value) and error.value.status_code == 401
    monkeypatch.setenv("REDUCING_SAVER_API_KEY", KEYS["acme"])
    caplog.set_level(logging.DEBUG)
    with RemoteReducingSaver(url) as saver:  # the key from REDUCING_SAVER_API_KEY
        assert KEYS["acme"] not in repr(saver)
        config = {"configurable": {"thread_id": "logged", "checkpoint_ns": ""}}
        saver.put(config, empty_checkpoint(), {}, {})
        assert saver.get_tuple(config) is not None
        with pytest.raises(Exception) as failure:
            saver.copy_thread("logged", "logged")
        assert KEYS["acme"] not in str(failure.value)
    # The service's own lines (JSON access log at DEBUG, errors) and the client's.
    service_log = keyed_service.output()
    assert "/v1/checkpoints/put" in service_log
    for key in KEYS.values():
        assert key not in service_log and key[::-1] not in service_log
        assert key not in caplog.text
    assert "authorization" not in service_log.lower()


# -- the isolation matrix ------------------------------------------------------------------------------


def _messages(n: int) -> dict:
    msgs = []
    for i in range(n):
        msgs += [HumanMessage(f"q{i}", id=f"h{i}"), AIMessage(f"a{i}", id=f"a{i}")]
    return blob_to_wire(*SERDE.dumps_typed(msgs))


class Api:
    """One tenant's calls, over any client with ``post``/``get`` (httpx or TestClient)."""

    def __init__(self, client: Any, tenant: str) -> None:
        self.client, self.headers = client, auth(tenant)

    def post(self, path: str, body: dict, status: int | None = None) -> Any:
        response = self.client.post(path, json=body, headers=self.headers)
        if status is not None:
            assert response.status_code == status, (path, response.text)
        return response

    def put(
        self,
        thread: str,
        *,
        turns: int = 3,
        namespace: bool = True,
        run_id: str = "run-a",
        parent: str | None = None,
    ) -> str:
        configurable: dict[str, Any] = {"thread_id": thread, "checkpoint_ns": ""}
        if namespace:
            configurable["memory_namespace"] = NAMESPACE
        if parent:
            configurable["checkpoint_id"] = parent
        checkpoint = dict(empty_checkpoint())
        checkpoint.pop("channel_values")
        checkpoint["channel_versions"] = {"messages": f"{turns}"}
        body = {
            "config": {"configurable": configurable, "metadata": {"run_id": run_id}},
            "checkpoint": checkpoint,
            "values": {"messages": _messages(turns)},
            "metadata": {"source": "loop", "step": turns},
            "new_versions": {"messages": f"{turns}"},
        }
        out = self.post("/v1/checkpoints/put", body, 200).json()["config"]
        assert out["configurable"]["thread_id"] == thread
        return out["configurable"]["checkpoint_id"]

    def get(self, thread: str, checkpoint_id: str | None = None) -> Any:
        configurable = {"thread_id": thread, "checkpoint_ns": ""}
        if checkpoint_id:
            configurable["checkpoint_id"] = checkpoint_id
        return self.post("/v1/checkpoints/get", {"config": {"configurable": configurable}}, 200).json()[
            "checkpoint"
        ]

    def list(self, thread: str | None = None, **kw: Any) -> list[dict]:
        config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}} if thread else None
        return self.post("/v1/checkpoints/list", {"config": config, **kw}, 200).json()["checkpoints"]

    def ids(self, thread: str | None = None, **kw: Any) -> list[tuple[str, str]]:
        return [
            (c["config"]["configurable"]["thread_id"], c["config"]["configurable"]["checkpoint_id"])
            for c in self.list(thread, **kw)
        ]

    def status(self) -> dict:
        response = self.client.get("/v1/extraction/status", headers=self.headers)
        assert response.status_code == 200
        return response.json()

    def dead(self) -> list[dict]:
        return self.client.get("/v1/extraction/dead-letters", headers=self.headers).json()["dead_letters"]


def _same_as_missing(do, their_id: str) -> None:
    """Acting on another tenant's id answers exactly as acting on an id nobody used."""
    theirs, missing = do(their_id), do(NEVER_USED)
    assert theirs.status_code == missing.status_code
    assert theirs.content.replace(their_id.encode(), b"ID") == missing.content.replace(
        NEVER_USED.encode(), b"ID"
    )


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def run_matrix(client: Any, backend: str, outbox_namespaces) -> None:
    acme, rival = Api(client, "acme"), Api(client, "rival")

    # acme: thread "shared" (3 checkpoints, explicit namespace), "solo" (fallback namespace), writes.
    shared = [acme.put("shared", turns=3 + i, run_id="run-a") for i in range(3)]
    solo = acme.put("solo", turns=4, namespace=False, run_id="run-b")
    acme.post(
        "/v1/writes/put",
        {
            "config": {"configurable": {"thread_id": "solo", "checkpoint_ns": "", "checkpoint_id": solo}},
            "writes": [["messages", 1]],
            "task_id": "t1",
        },
        204,
    )
    # rival: the same thread id and run id, and one thread of its own, written after acme's (newer).
    rival_shared = rival.put("shared", turns=5, run_id="run-a")
    rival_own = rival.put("rivals-own", turns=1, run_id="run-r")

    def acme_state() -> Any:
        return (acme.ids(), acme.get("solo"), acme.get("shared"), acme.get("shared", shared[0]))

    before = acme_state()
    assert sorted(t for t, _ in before[0]) == ["shared", "shared", "shared", "solo"]
    assert before[1]["pending_writes"] == [["t1", "messages", 1]]

    # get: latest, by checkpoint id (acme's id under its own thread id and under rival's)
    _same_as_missing(
        lambda t: rival.post(
            "/v1/checkpoints/get", {"config": {"configurable": {"thread_id": t, "checkpoint_ns": ""}}}
        ),
        "solo",
    )
    assert rival.get("shared", shared[0]) is None and rival.get("solo", solo) is None
    assert rival.get("shared")["config"]["configurable"]["checkpoint_id"] == rival_shared
    # list: by thread, across threads (with filter, limit, before)
    _same_as_missing(
        lambda t: rival.post(
            "/v1/checkpoints/list", {"config": {"configurable": {"thread_id": t, "checkpoint_ns": ""}}}
        ),
        "solo",
    )
    assert sorted(rival.ids()) == sorted([("rivals-own", rival_own), ("shared", rival_shared)])
    assert rival.ids(filter={"run_id": "run-a"}) == [("shared", rival_shared)]
    # limit and before keep the saver's meaning, applied to the tenant's own checkpoints: limit is a prefix
    # of the tenant's full list (the filter comes before the limit; rival's are the newest overall).
    everything = acme.ids()
    if backend != "memory":  # InMemorySaver lists thread by thread; the others newest first overall
        assert everything == sorted(everything, key=lambda x: x[1], reverse=True)
    assert acme.ids(limit=2) == everything[:2] and rival.ids(limit=1) == rival.ids()[:1]
    newest = max(cid for _, cid in everything)
    assert acme.ids(before={"configurable": {"checkpoint_id": newest}}) == [
        i for i in everything if i[1] < newest
    ]
    assert acme.ids(filter={"run_id": "run-b"}) == [("solo", solo)]
    assert [c["parent_config"] for c in acme.list("shared")][-1] is None
    # delta history
    _same_as_missing(
        lambda t: rival.post(
            "/v1/checkpoints/delta-history",
            {
                "config": {"configurable": {"thread_id": t, "checkpoint_ns": "", "checkpoint_id": solo}},
                "channels": ["messages"],
            },
        ),
        "solo",
    )
    # copy: from acme's thread (copies nothing), into acme's thread id (no 409: rival's own id)
    _same_as_missing(
        lambda t: rival.post("/v1/threads/copy", {"source_thread_id": t, "target_thread_id": f"copy-of-{t}"}),
        "solo",
    )
    assert rival.ids("copy-of-solo") == []
    rival.post("/v1/threads/copy", {"source_thread_id": "rivals-own", "target_thread_id": "solo"}, 204)
    assert rival.ids("solo") == [("solo", rival_own)]
    conflict = rival.post(
        "/v1/threads/copy", {"source_thread_id": "rivals-own", "target_thread_id": "solo"}, 409
    )
    assert "rival:" not in conflict.text and "'solo'" in conflict.text
    # put_writes: rival writes under acme's thread and checkpoint ids: lands in rival's own thread
    rival.post(
        "/v1/writes/put",
        {
            "config": {"configurable": {"thread_id": "solo", "checkpoint_ns": "", "checkpoint_id": solo}},
            "writes": [["messages", 2]],
            "task_id": "t9",
        },
        204,
    )
    # delete_for_runs: rival deletes run-a: its own only
    rival.post("/v1/runs/delete", {"run_ids": ["run-a", "run-b"]}, 204)
    assert rival.ids("shared") == []
    # prune (both strategies) and delete_thread on acme's ids
    rival.post("/v1/threads/prune", {"thread_ids": ["shared", "solo"], "strategy": "keep_latest"}, 204)
    rival.post("/v1/threads/prune", {"thread_ids": ["shared", "solo"], "strategy": "delete"}, 204)
    _same_as_missing(lambda t: rival.post("/v1/threads/delete", {"thread_id": t}), "shared")
    assert rival.ids() == [("rivals-own", rival_own)]

    # acme saw none of it
    assert acme_state() == before

    # extraction: every pruned message dead-letters (the extractor always fails): counts are per tenant
    wait_for(
        lambda: (
            acme.status()["dead"] > 0
            and rival.status()["dead"] > 0
            and acme.status()["pending"] == 0
            and rival.status()["pending"] == 0
            and acme.status()["in_flight"] == 0
            and rival.status()["in_flight"] == 0
        )
    )
    # memory: the same explicit namespace and thread id under each tenant's prefix; fallback unscoped id.
    # Read once every row is a dead letter: a row the deliverer holds is neither dead nor claimable.
    namespaces = outbox_namespaces()
    assert ("tenants", "acme", *NAMESPACE) in namespaces and ("tenants", "rival", *NAMESPACE) in namespaces
    assert ("tenants", "acme", "memories", "solo") in namespaces
    assert all(ns[:2] in {("tenants", "acme"), ("tenants", "rival")} for ns in namespaces)
    acme_dead, rival_dead = acme.dead(), rival.dead()
    assert len(acme_dead) == acme.status()["dead"] and len(rival_dead) == rival.status()["dead"]
    assert len(acme_dead) != len(rival_dead), "the two tenants pruned different numbers of messages"
    assert {tuple(d["namespace"]) for d in acme_dead} == {tuple(NAMESPACE), ("memories", "solo")}
    assert {d["thread_id"] for d in acme_dead} == {"shared", "solo"}
    assert {tuple(d["namespace"]) for d in rival_dead} == {tuple(NAMESPACE)}
    requeued = rival.client.post("/v1/extraction/retry-dead", headers=rival.headers).json()["requeued"]
    assert requeued == len(rival_dead)
    assert acme.dead() == acme_dead, "rival's retry left acme's dead letters alone"


FAILING = {
    "extractor": "tests.support.extractors:counting",
    "extraction_max_attempts": 1,
    "extraction_idle_seconds": 0.05,
}


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_isolation_matrix_in_process(backend, tmp_path, monkeypatch):
    monkeypatch.setenv("RS_TEST_FAIL_RATE", "1")
    database = "memory://" if backend == "memory" else f"sqlite:///{tmp_path}/db.sqlite"
    settings = Settings(database=database, api_keys=key_pairs(), max_messages=4, min_messages=2, **FAILING)
    app = create_app(settings)
    with TestClient(app) as client:
        outbox = app.state.service.memory.outbox

        def namespaces() -> set[tuple[str, ...]]:
            return {e.namespace for e in outbox.dead_letters(10_000)} | {
                e.namespace for e in outbox.claim("peek", 10_000, 0.001)
            }

        run_matrix(client, backend, namespaces)


@pytest.mark.e2e
def test_isolation_matrix_on_postgres(tmp_path, fresh_pg):
    env = {"REDUCING_SAVER_API_KEYS": key_pairs(), "RS_TEST_FAIL_RATE": "1", "RS_TEST_CALLS_DB": fresh_pg}
    args = [
        "--database",
        fresh_pg,
        "--max-messages",
        "4",
        "--min-messages",
        "2",
        "--extractor",
        FAILING["extractor"],
        "--extraction-max-attempts",
        "1",
    ]
    with run_service(tmp_path, *args, env=env) as svc, httpx.Client(base_url=svc.url, timeout=30) as client:

        def namespaces() -> set[tuple[str, ...]]:
            with psycopg.connect(fresh_pg) as conn:
                return {tuple(r[0]) for r in conn.execute("SELECT namespace FROM reducing_saver_outbox")}

        run_matrix(client, "postgres", namespaces)

        # How tenant mode stores (docs/security.md): thread ids "tenant:thread" in PostgresSaver's own tables.
        with psycopg.connect(fresh_pg) as conn:
            stored = {r[0] for r in conn.execute("SELECT DISTINCT thread_id FROM checkpoints")}
        assert stored == {"acme:shared", "acme:solo", "rival:rivals-own"}
        with PostgresSaver.from_conn_string(fresh_pg) as stock:
            assert (
                stock.get_tuple({"configurable": {"thread_id": "acme:shared", "checkpoint_ns": ""}})
                is not None
            )


@pytest.mark.e2e
def test_like_wildcards_in_tenant_names_do_not_widen_a_list(tmp_path, fresh_pg):
    """Tenant "a_c" must not see "abc"'s threads: '_' is a LIKE wildcard, escaped in the query."""
    keys = {"a_c": "underscore-tenant-key-1234", "abc": "plain-tenant-key-12345678"}
    env = {"REDUCING_SAVER_API_KEYS": ",".join(f"{t}={k}" for t, k in keys.items())}
    with (
        run_service(tmp_path, "--database", fresh_pg, env=env) as svc,
        httpx.Client(base_url=svc.url) as client,
    ):
        KEYS.update(keys)
        try:
            Api(client, "abc").put("t", turns=1, namespace=False)
            underscore = Api(client, "a_c")
            assert underscore.ids() == [] and underscore.list(limit=10) == []
            underscore.post("/v1/runs/delete", {"run_ids": ["run-a"]}, 204)
            assert len(Api(client, "abc").ids()) == 1
        finally:
            for tenant in keys:
                KEYS.pop(tenant)


def test_single_tenant_mode_stores_the_agents_own_ids(tmp_path):
    app = create_app(Settings(database=f"sqlite:///{tmp_path}/db.sqlite"))
    with TestClient(app) as client:
        api = Api(client, "acme")  # the header is ignored without keys
        api.put("plain", turns=1)
        assert api.ids() == [(api.ids()[0][0], api.ids()[0][1])] and api.ids()[0][0] == "plain"
    import sqlite3

    rows = (
        sqlite3.connect(tmp_path / "db.sqlite")
        .execute("SELECT DISTINCT thread_id FROM checkpoints")
        .fetchall()
    )
    assert rows == [("plain",)]


def test_deploy_files_run_with_keys():
    """k8s serves with API keys from a Secret file; the compose stack with a development key on loopback."""
    import yaml

    from tests.test_deploy import AGENT, SERVICE, compose, dockerfile_env, environment, published_ports

    deployment = yaml.safe_load((ROOT / "deploy" / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert set(env) <= {f"REDUCING_SAVER_{f.upper()}" for f in Settings.model_fields}
    path = Path(env["REDUCING_SAVER_API_KEYS_FILE"])
    mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == path.parent)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["items"] == [{"key": path.name, "path": path.name}]
    assert "optional" not in volume["secret"], "a missing key Secret must keep the pod from starting"
    config = yaml.safe_load((ROOT / "deploy" / "configmap.yaml").read_text())["data"]
    assert config["REDUCING_SAVER_HOST"] == "0.0.0.0" and "REDUCING_SAVER_INSECURE" not in config
    services = compose({})["services"]
    service_env = environment(services[SERVICE])
    settings = Settings(
        _env_file=None,
        **{  # the container's view: the image's ENV under compose's
            name.removeprefix("REDUCING_SAVER_").lower(): value
            for name, value in {**dockerfile_env(), **service_env}.items()
        },
    )
    assert settings.host == "0.0.0.0" and not settings.insecure
    assert security.check_exposure(settings) is None, "compose's service would refuse to start"
    (tenant_key,) = service_env["REDUCING_SAVER_API_KEYS"].split(",")
    assert tenant_key.split("=", 1)[1] == environment(services[AGENT])["REDUCING_SAVER_API_KEY"]
    assert {address for address, _, _ in published_ports(services[SERVICE])} == {"127.0.0.1"}


def test_a_key_file_works_end_to_end_in_process(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"acme {hashlib.sha256(KEYS['acme'].encode()).hexdigest()}\n")
    app = create_app(Settings(database="memory://", api_keys_file=str(keys)))
    with TestClient(app) as client:
        assert client.get("/v1/capabilities").status_code == 401
        assert client.get("/v1/capabilities", headers=auth("acme")).status_code == 200
        assert client.get("/v1/capabilities", headers=auth("rival")).status_code == 401
        assert client.get("/healthz").status_code == 200


def test_reserved_configurable_keys_are_refused_naming_the_first_in_order():
    from reducing_saver.service.security.limits import check_configurable

    with pytest.raises(ValueError, match=r"^configurable\.__a: keys starting with '__' are reserved$"):
        check_configurable({"thread_id": "t", "__b": 1, "__a": 2})
    assert check_configurable({"thread_id": "t", "a__": 1}) == {"thread_id": "t", "a__": 1}


def test_count_caps_are_the_settings_of_the_app_serving_the_request():
    """The models' count caps read the settings of the app serving the request: a body over one is refused
    naming the cap, one at it is stored, and another app's higher cap lets the same body through."""
    checkpoint = empty_checkpoint()
    checkpoint.pop("channel_values")

    def put(channels: int) -> dict[str, Any]:
        versions = {f"c{index}": "1" for index in range(channels)}
        return {
            "config": {"configurable": {"thread_id": f"t{channels}", "checkpoint_ns": ""}},
            "checkpoint": {**checkpoint, "channel_versions": versions},
            "values": {name: 1 for name in versions},
            "metadata": {},
            "new_versions": versions,
        }

    with TestClient(create_app(Settings(database="memory://", max_channels=3))) as client:
        assert client.post("/v1/checkpoints/put", json=put(3)).status_code == 200
        refused = client.post("/v1/checkpoints/put", json=put(4))
        assert refused.status_code == 422
        assert "4 channels is more than the limit of 3 (setting max_channels)" in refused.text
    with TestClient(create_app(Settings(database="memory://", max_channels=5))) as client:
        assert client.post("/v1/checkpoints/put", json=put(4)).status_code == 200


@pytest.mark.parametrize(
    ("versions_seen", "field"),
    [
        ({f"node{index}": {} for index in range(4)}, "checkpoint.versions_seen"),
        ({"node": {f"c{index}": "1" for index in range(4)}}, "checkpoint.versions_seen[node]"),
    ],
)
def test_versions_seen_is_capped_at_both_levels_naming_which(versions_seen, field):
    """``versions_seen`` maps nodes to channel versions: the node count and each node's channels are capped
    by max_channels, checked before the versions are read, and the refusal names which of the two."""
    checkpoint = empty_checkpoint()
    checkpoint.pop("channel_values")
    body = {
        "config": {"configurable": {"thread_id": "t", "checkpoint_ns": ""}},
        "checkpoint": {**checkpoint, "versions_seen": versions_seen},
        "values": {},
        "new_versions": {},
    }
    with TestClient(create_app(Settings(database="memory://", max_channels=3))) as client:
        refused = client.post("/v1/checkpoints/put", json=body)
        assert refused.status_code == 422, refused.text
        assert f"{field}: 4 channels is more than the limit of 3 (setting max_channels)" in refused.text
        schema = client.get("/openapi.json").json()["components"]["schemas"]["CheckpointFieldsBody"]
        assert schema["properties"]["versions_seen"]["maxProperties"] == 3
        assert schema["properties"]["versions_seen"]["additionalProperties"]["maxProperties"] == 3
        body["checkpoint"]["versions_seen"] = {"node": {"c0": "1", "c1": "1", "c2": "1"}}
        assert client.post("/v1/checkpoints/put", json=body).status_code == 200
