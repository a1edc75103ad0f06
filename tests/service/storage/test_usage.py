"""Storage you can see, on every backend: the service app in-process (FastAPI TestClient), the real client,
a real LangGraph chat graph; figures compared with the database measured directly, and the plain estimate
with a plain saver that stored the same conversation."""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import psycopg
import pytest
from fastapi.testclient import TestClient
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, MessagesState, StateGraph

from reducing_saver.client import NotFoundError, RemoteReducingSaver
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import Service, create_app
from reducing_saver.service.storage.usage import Head, plain_messages

KEYS = {"a": "key-of-tenant-a", "b": "key-of-tenant-b"}
_LETTERS = random.Random(0)
#: A vocabulary of 2,000 word-like strings.
WORDS = ["".join(_LETTERS.choices("etaoinshrdlucmfwypvbgk", k=_LETTERS.randint(2, 9))) for _ in range(2000)]


def words(rng: random.Random, length: int = 400) -> str:
    """Word-like text (compresses about as little as prose does under PostgreSQL's pglz, unlike padding)."""
    text = ""
    while len(text) < length:
        text += rng.choice(WORDS) + " "
    return text[:length]


def chat_graph(checkpointer: Any, seed: int) -> Any:
    """One AI answer of ~400 word-like characters a turn, the same answers for the same seed."""
    rng = random.Random(seed)
    model = GenericFakeChatModel(
        messages=iter([AIMessage(words(rng), id=f"ai-{seed}-{n}") for n in range(10_000)])
    )

    def chat(state: MessagesState) -> dict:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("chat", chat)
    builder.add_edge(START, "chat")
    builder.add_edge("chat", END)
    return builder.compile(checkpointer=checkpointer)


def converse(checkpointer: Any, thread_id: str, turns: int, seed: int = 1) -> None:
    graph = chat_graph(checkpointer, seed)
    rng = random.Random(seed + 1000)
    config = {"configurable": {"thread_id": thread_id}}
    for turn in range(turns):
        graph.invoke({"messages": [HumanMessage(words(rng), id=f"h-{seed}-{turn}")]}, config)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def database(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "memory":
        return "memory://"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/rs.sqlite"
    return request.getfixturevalue("fresh_pg")


@dataclass
class Running:
    service: Service
    http: TestClient
    app: Any

    def saver(self, api_key: str | None = None) -> RemoteReducingSaver:
        return RemoteReducingSaver(
            "http://testserver", transport=self.http._transport, max_retries=0, api_key=api_key
        )

    def delivered(self, rows: int, timeout: float = 30.0) -> None:
        """Wait until ``rows`` outbox rows are delivered to the store."""
        deadline = time.monotonic() + timeout
        while (status := self.service.open_memory().outbox.status())["delivered"] < rows:
            assert time.monotonic() < deadline, status
            time.sleep(0.05)


@contextmanager
def running(database: str, **settings: Any) -> Iterator[Running]:
    settings = {
        "max_messages": 6,
        "min_messages": 4,
        "sweep": False,
        "extract": True,
        "extraction_idle_seconds": 0.05,
        "storage_refresh_seconds": 0,
        **settings,
    }
    app = create_app(Settings(database=database, **settings))
    with TestClient(app) as http:
        yield Running(app.state.service, http, app)


# -- the figures against the database measured directly ------------------------------------------


def direct_figures(service: Service, thread_id: str) -> dict[str, int]:
    """The thread's bytes per kind, measured here, not by the service's code."""
    kind, url = service.backend_kind, service.settings.database
    if kind == "postgres":
        with psycopg.connect(url) as conn:
            one = lambda sql: conn.execute(sql, (thread_id,)).fetchone()[0] or 0  # noqa: E731
            return {
                "checkpoints": one("SELECT count(*) FROM checkpoints WHERE thread_id = %s"),
                "checkpoint_bytes": one(
                    "SELECT sum(pg_column_size(t.*)) FROM checkpoints t WHERE thread_id = %s"
                ),
                "blob_bytes": one(
                    "SELECT sum(pg_column_size(t.*)) FROM checkpoint_blobs t WHERE thread_id = %s"
                ),
                "write_bytes": one(
                    "SELECT sum(pg_column_size(t.*)) FROM checkpoint_writes t WHERE thread_id = %s"
                ),
                "outbox_bytes": one(
                    "SELECT sum(pg_column_size(t.*)) FROM reducing_saver_outbox t WHERE thread_id = %s"
                ),
                "store_bytes": one(
                    "SELECT sum(pg_column_size(t.*)) FROM store t WHERE value->>'thread_id' = %s"
                ),
            }
    if kind == "sqlite":
        path = url.split("sqlite:///", 1)[1]
        with closing(sqlite3.connect(path)) as conn:

            def size(table: str, where: str) -> int:
                columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
                total = 0
                for row in conn.execute(f"SELECT * FROM {table} WHERE {where}", (thread_id,)):
                    for column, value in zip(columns, row, strict=True):
                        if column in (
                            "pruned_at",
                            "attempts",
                            "available_at",
                            "lease_until",
                            "failed_at",
                            "delivered_at",
                            "created_at",
                            "updated_at",
                            "expires_at",
                            "ttl_minutes",
                        ):
                            continue  # numbers and times: not counted
                        if value is not None:
                            total += len(value if isinstance(value, bytes) else str(value).encode())
                return total

            return {
                "checkpoints": conn.execute(
                    "SELECT count(*) FROM checkpoints WHERE thread_id = ?", (thread_id,)
                ).fetchone()[0],
                "checkpoint_bytes": size("checkpoints", "thread_id = ?"),
                "blob_bytes": 0,
                "write_bytes": size("writes", "thread_id = ?"),
                "outbox_bytes": size("reducing_saver_outbox", "thread_id = ?"),
                "store_bytes": size("store", "json_extract(value, '$.thread_id') = ?"),
            }
    backend = service.open_backend()
    saver = backend.saver
    checkpoints = [c for ns in saver.storage[thread_id].values() for c in ns.values()]
    store = backend.store()
    items = [item for ns in store.list_namespaces() for item in store.search(ns, limit=1000)]
    return {
        "checkpoints": len(checkpoints),
        "checkpoint_bytes": sum(len(c[1]) + len(m[1]) for c, m, _ in checkpoints),
        "blob_bytes": sum(len(v[1]) for k, v in saver.blobs.items() if k[0] == thread_id),
        "write_bytes": sum(
            len(w[2][1]) for k, ws in saver.writes.items() if k[0] == thread_id for w in ws.values()
        ),
        "outbox_bytes": sum(
            len(json.dumps(e.message, separators=(",", ":"), ensure_ascii=False).encode())
            for e in _outbox_entries(backend.outbox())
            if e.thread_id == thread_id
        ),
        "store_bytes": sum(
            len(json.dumps(i.value, separators=(",", ":"), ensure_ascii=False).encode())
            for i in items
            if i.value.get("thread_id") == thread_id
        ),
    }


def _outbox_entries(outbox: Any) -> list[Any]:
    return [row.entry for row in outbox._rows.values()]


def test_thread_figures_match_the_database_measured_directly(database: str) -> None:
    with running(database) as run, run.saver() as saver:
        converse(saver, "t1", 12, seed=1)
        converse(saver, "t2", 3, seed=2)
        cut = 12 * 2 - 6  # 12 turns of two messages, a window of at most 6 (4 to 6 kept)
        window = len(
            saver.get_tuple({"configurable": {"thread_id": "t1"}}).checkpoint["channel_values"]["messages"]
        )
        run.delivered(12 * 2 - window)
        figures = run.http.get("/v1/threads/t1/storage").json()
        direct = direct_figures(run.service, "t1")
        assert {k: figures[k] for k in direct} == direct
        assert figures["checkpoints"] == len(list(saver.list({"configurable": {"thread_id": "t1"}})))
        assert figures["cut_messages"] == 12 * 2 - window >= cut
        assert (
            figures["saver_bytes"]
            == figures["checkpoint_bytes"] + figures["blob_bytes"] + figures["write_bytes"]
        )
        assert (
            figures["total_bytes"]
            == figures["saver_bytes"] + figures["outbox_bytes"] + figures["store_bytes"]
        )
        assert figures["plain_estimate"] > figures["saver_bytes"]
        assert figures["saved_ratio"] == pytest.approx(figures["plain_estimate"] / figures["total_bytes"])
        # The summary adds up the threads it measures in the same pass, largest first. (Against the
        # per-thread route it may differ by a few bytes: pg_column_size of a whole outbox row depends on
        # the plan that read it.)
        both = run.http.get("/v1/storage", params={"top": 2}).json()
        assert both["threads"] == 2
        assert [t["thread_id"] for t in both["largest"]] == ["t1", "t2"]
        for key in ("checkpoints", "total_bytes", "outbox_bytes", "store_bytes", "plain_estimate"):
            assert both[key] == sum(t[key] for t in both["largest"]), key
        summary = run.http.get("/v1/storage", params={"top": 1}).json()
        assert [t["thread_id"] for t in summary["largest"]] == ["t1"]
        second = run.http.get("/v1/threads/t2/storage").json()
        assert summary["checkpoints"] == figures["checkpoints"] + second["checkpoints"]
        # The client reads the same figures, sync and async.
        assert saver.storage("t1") == figures
        assert saver.storage_summary(top=1) == summary
        with pytest.raises(NotFoundError):
            saver.storage("nope")
        aclient = RemoteReducingSaver(
            "http://testserver",
            transport=run.http._transport,
            async_transport=httpx.ASGITransport(run.app),
            max_retries=0,
        )
        with aclient:
            assert asyncio.run(aclient.astorage("t1")) == figures
            assert asyncio.run(aclient.astorage_summary(top=1)) == summary


# -- the plain estimate against a plain saver that stored the same conversation -------------------


def plain_bytes(kind: str, url: str, turns: int) -> tuple[int, int]:
    """Bytes a stock saver of ``kind`` holds after ``turns`` turns of the conversation, measured as the
    service measures its own; and the same with the messages uncompressed (PostgreSQL compresses long
    values; elsewhere the two are equal)."""
    if kind == "postgres":
        with PostgresSaver.from_conn_string(url) as saver:
            saver.setup()
            converse(saver, "t1", turns, seed=1)
        with psycopg.connect(url) as conn:
            return conn.execute(
                "WITH o AS (SELECT (SELECT sum(pg_column_size(t.*)) FROM checkpoints t) "
                "+ (SELECT sum(pg_column_size(t.*)) FROM checkpoint_writes t) AS rows), "
                "b AS (SELECT sum(pg_column_size(t.*)) AS stored, "
                "sum(pg_column_size(t.*) - pg_column_size(t.blob) + length(t.blob)) AS uncompressed "
                "FROM checkpoint_blobs t) "
                "SELECT o.rows + b.stored, o.rows + b.uncompressed FROM o, b"
            ).fetchone()
    if kind == "sqlite":
        with SqliteSaver.from_conn_string(url) as saver:
            converse(saver, "t1", turns, seed=1)
            conn = saver.conn
            row = "+".join(
                f"coalesce(length(CAST({c} AS BLOB)),0)"
                for c in (
                    "thread_id",
                    "checkpoint_ns",
                    "checkpoint_id",
                    "parent_checkpoint_id",
                    "type",
                    "checkpoint",
                    "metadata",
                )
            )
            writes = "+".join(
                f"coalesce(length(CAST({c} AS BLOB)),0)"
                for c in (
                    "thread_id",
                    "checkpoint_ns",
                    "checkpoint_id",
                    "task_id",
                    "task_path",
                    "CAST(idx AS TEXT)",
                    "channel",
                    "type",
                    "value",
                )
            )
            size = conn.execute(
                f"SELECT (SELECT sum({row}) FROM checkpoints) + (SELECT sum({writes}) FROM writes)"
            ).fetchone()[0]
            return size, size
    saver = InMemorySaver()
    converse(saver, "t1", turns, seed=1)
    size = (
        sum(len(c[1]) + len(m[1]) for ns in saver.storage["t1"].values() for c, m, _ in ns.values())
        + sum(len(v[1]) for v in saver.blobs.values())
        + sum(len(w[2][1]) for ws in saver.writes.values() for w in ws.values())
    )
    return size, size


def test_the_plain_estimate_is_close_to_what_a_plain_saver_holds(
    database: str, make_database, tmp_path, record_property
) -> None:
    turns = 40
    with running(database, extract=False) as run, run.saver() as saver:
        converse(saver, "t1", turns, seed=1)
        figures = run.http.get("/v1/threads/t1/storage").json()
    kind = run.service.backend_kind
    plain_url = {
        "postgres": make_database,
        "sqlite": lambda: str(tmp_path / "plain.sqlite"),
        "memory": lambda: "",
    }[kind]()
    plain, uncompressed = plain_bytes(kind, plain_url, turns)
    record_property(
        "storage figures",
        f"{kind}: {turns} turns, plain saver {plain} B ({uncompressed} B with its messages uncompressed), "
        f"estimate {figures['plain_estimate']} B, held {figures['saver_bytes']} B",
    )
    # The estimate counts messages uncompressed: on PostgreSQL an upper bound of what pglz leaves.
    assert figures["plain_estimate"] == pytest.approx(uncompressed, rel=0.1)
    assert plain <= figures["plain_estimate"]
    assert figures["saver_bytes"] < plain / 2


# -- tenancy -------------------------------------------------------------------------------------


def test_a_tenant_reads_only_its_own_threads_storage(database: str) -> None:
    api_keys = ",".join(f"{tenant}={key}" for tenant, key in KEYS.items())
    with running(database, api_keys=api_keys) as run, run.saver(KEYS["a"]) as a, run.saver(KEYS["b"]) as b:
        converse(a, "shared-name", 8, seed=3)
        converse(b, "own", 2, seed=4)
        run.delivered(8 * 2 - 6 + 0)
        mine = a.storage("shared-name")
        assert mine["thread_id"] == "shared-name" and mine["tenant"] == "a"
        assert mine["cut_messages"] > 0 and mine["store_bytes"] > 0 and mine["outbox_bytes"] > 0
        with pytest.raises(NotFoundError):
            b.storage("shared-name")
        answer = run.http.get("/v1/threads/shared-name/storage", headers={"x-api-key": KEYS["b"]})
        assert answer.status_code == 404 and "shared-name" in answer.json()["detail"]
        assert [t["thread_id"] for t in a.storage_summary()["largest"]] == ["shared-name"]
        theirs = b.storage_summary()
        assert theirs["threads"] == 1 and [t["thread_id"] for t in theirs["largest"]] == ["own"]
        assert theirs["outbox_bytes"] == 0 and theirs["store_bytes"] == 0
        assert run.http.get("/v1/storage").status_code == 401


def test_bad_input_gets_a_4xx_naming_it() -> None:
    with running("memory://") as run:
        for top in ("0", "101", "many"):
            answer = run.http.get("/v1/storage", params={"top": top})
            assert answer.status_code == 422 and "top" in answer.text


@pytest.mark.parametrize(
    ("path_id", "why"),
    [
        ("a%00b", "'\\x00' at index 1"),
        ("a%01b", "'\\x01' at index 1"),
        ("a%2Fb", "'/' at index 1"),
        ("%2E%2E", "'..' is not a thread id"),
        ("x" * 300, "300 characters is more than the limit of 256 (setting max_thread_id_length)"),
    ],
    ids=["nul", "control", "slash", "dot-dot", "too-long"],
)
def test_the_thread_route_checks_the_thread_id_as_every_route_does(
    database: str, path_id: str, why: str
) -> None:
    """The same refusal a put of that thread id gets (422 naming thread_id), before any database work:
    never the database's own error text."""
    with running(database) as run:
        answer = run.http.get(f"/v1/threads/{path_id}/storage")
        assert answer.status_code == 422, answer.text
        detail = str(answer.json()["detail"])
        assert "thread_id" in detail and why in detail, detail
        assert "PostgreSQL" not in detail
        assert run.http.get("/v1/threads/fine/storage").status_code == 404  # still serving


# -- the estimate's parts ----------------------------------------------------------------------------


def test_plain_messages_is_the_triangle_of_the_history() -> None:
    # 10 copies of a history growing to 10 messages of 100 bytes: 100 + 200 + ... + 1000.
    assert plain_messages(Head(copies=10, window_bytes=1000, window_messages=10), 0) == 5500
    # The same history with 6 of its messages cut and 4 kept; one copy per message unless told.
    assert plain_messages(Head(copies=10, window_bytes=400, window_messages=4), 6) == 5500
    assert plain_messages(Head(window_bytes=400, window_messages=4), 6) == 5500
    assert plain_messages(Head(copies=10, window_bytes=400, window_messages=None), 6) == 2200


def test_the_estimate_survives_deleted_checkpoints(database: str) -> None:
    with running(database, extract=False) as run, run.saver() as saver:
        converse(saver, "t1", 20, seed=5)
        before = saver.storage("t1")
        saver.prune(["t1"], strategy="keep_latest")
        after = saver.storage("t1")
    assert after["checkpoints"] == 1 < before["checkpoints"]
    assert after["saver_bytes"] < before["saver_bytes"] / 5
    # Every input comes from the head, the outbox and the step count: deleted checkpoints still count.
    assert after["plain_estimate"] == pytest.approx(before["plain_estimate"], rel=0.1)


def test_the_openapi_document_describes_both_routes() -> None:
    with running("memory://") as run:
        paths = run.http.get("/openapi.json").json()["paths"]
    thread = paths["/v1/threads/{thread_id}/storage"]["get"]["responses"]
    assert thread["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ThreadStorageResponse")
    assert "404" in thread
    summary = paths["/v1/storage"]["get"]
    assert summary["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/StorageSummaryResponse"
    )
    assert [p["name"] for p in summary["parameters"]] == ["top"]
