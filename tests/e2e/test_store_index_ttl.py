"""The store's semantic search (--store-index) and TTL (--store-ttl), through a running service.

Embeddings are a deterministic fake (``tests/support/embeddings.py``): no network, no model; a query
equal to an item's indexed text finds that item first with a score of 1, and every ranking is compared with
langgraph's InMemoryStore's. Vector search runs on every backend, none skipped: memory; SQLite with
sqlite-vec, under this Python when its sqlite3 loads extensions, else in the project's Docker image (whose
Python does; the service refuses to start on a Python that cannot, with one line saying so: tested here);
PostgreSQL on the test run's PostgreSQL with pgvector (``pgvector_server``, from ``pgserver``). The
server on 127.0.0.1:5432 may have no pgvector: then the refusal is tested on it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from langgraph.store.base import PutOp
from langgraph.store.memory import InMemoryStore
from langgraph.store.postgres import PostgresStore
from langgraph.store.sqlite import SqliteStore

from reducing_saver.client import RemoteStore
from reducing_saver.service.configuration.settings import Settings
from tests.service.security.test_security import KEYS, NAMESPACE, Api, key_pairs
from tests.support.embeddings import DIMS, embed
from tests.support.server import CLI, ROOT, run_in_image, run_service

INDEX = json.dumps(
    {"dims": DIMS, "embed": "tests.support.embeddings:embed", "fields": ["text", "data.content"]}
)
ENV = {"REDUCING_SAVER_API_KEYS": key_pairs()}


def _has_pgvector() -> bool:
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres") as conn:
        return (
            conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'").fetchone() is not None
        )


SQLITE_VEC = hasattr(sqlite3.connect(":memory:"), "enable_load_extension")


def _refused(tmp_path: Path, *args: str) -> str:
    """Run ``reducing-saver serve ARGS``; it must exit at once, non-zero; returns its last line."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")},
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [str(CLI), "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0, done.stdout + done.stderr
    return done.stderr.strip().splitlines()[-1]


# -- semantic search ---------------------------------------------------------------------------------


def _database(backend: str, tmp_path: Path, fresh_pg: str | None) -> str:
    return {"memory": "memory://", "sqlite": f"sqlite:///{tmp_path}/db.sqlite"}.get(backend) or str(fresh_pg)


@contextmanager
def _vector_service(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest, *args: str
) -> Iterator[Any]:
    """The service with ``--store-index`` on ``backend``, wherever that backend can do vector search.

    PostgreSQL: the pgvector server of the test run (``pgvector_server``). SQLite: this Python when its
    sqlite3 loads extensions, else the project's Docker image, whose Python does (the service refuses on
    this one: test_refusals).
    """
    args = ("--store-index", INDEX, "--max-messages", "4", "--min-messages", "2", *args)
    if backend == "sqlite" and not SQLITE_VEC:
        stack, _ = request.getfixturevalue("service_image")
        files = ("tests/__init__.py", "tests/support/__init__.py", "tests/support/embeddings.py")
        with run_in_image(
            stack.image, "--database", "sqlite:////data/db.sqlite", *args, env=ENV, files=files
        ) as svc:
            yield svc
        return
    database = (
        request.getfixturevalue("pgvector_db")
        if backend == "postgres"
        else _database(backend, tmp_path, None)
    )
    with run_service(tmp_path, "--database", database, *args, env=ENV) as svc:
        yield svc


def _reference(
    texts: dict[str, str], kinds: dict[str, str], query: str, **search: Any
) -> list[tuple[str, float]]:
    """``(key, score)`` of a search on langgraph's InMemoryStore holding the same items, same embedding."""
    store = InMemoryStore(index={"dims": DIMS, "embed": embed, "fields": ["text", "data.content"]})
    for key, text in texts.items():
        store.put(("profile",), key, {"text": text, "kind": kinds[key]})
    return [(item.key, item.score) for item in store.search(("profile",), query=query, **search)]


#: Where SQLite's vector search runs in the project's image, the test needs a Docker engine (compose lane).
_SQLITE = "sqlite" if SQLITE_VEC else pytest.param("sqlite", marks=pytest.mark.compose)


@pytest.mark.parametrize("backend", ["memory", _SQLITE, "postgres"])
def test_semantic_search(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    with (
        _vector_service(backend, tmp_path, request) as svc,
        RemoteStore(svc.url, api_key=KEYS["acme"]) as acme,
        RemoteStore(svc.url, api_key=KEYS["rival"]) as rival,
    ):
        texts = {"tea": "likes green tea", "chess": "plays chess on sundays", "city": "lives in lisbon"}
        kinds = {key: "hobby" if key != "city" else "place" for key in texts}
        for key, text in texts.items():
            acme.put(("profile",), key, {"text": text, "kind": kinds[key]})
        rival.put(("profile",), "rival", {"text": "plays chess on sundays"})
        found = acme.search(("profile",), query="plays chess on sundays")
        assert found[0].key == "chess" and found[0].score == pytest.approx(1.0)
        assert [i.score for i in found] == sorted((i.score for i in found), reverse=True)
        assert {i.key for i in found} == set(texts), "rival's item, the same text, is not acme's to find"
        hobbies = acme.search(("profile",), query="lives in lisbon", filter={"kind": "hobby"})
        assert {i.key for i in hobbies} == {"tea", "chess"}
        assert [i.key for i in rival.search((), query="likes green tea")] == ["rival"]
        assert all(i.score is None for i in acme.search(("profile",))), "no query, no score"

        # The ranking and the scores are InMemoryStore's with the same embedding, a query equal to no
        # item's text included (pgvector and sqlite-vec keep single-precision vectors).
        for query, search in (
            ("plays chess on sundays", {}),
            ("green tea on sundays in lisbon", {}),
            ("lives in lisbon", {"filter": {"kind": "hobby"}}),
        ):
            ranked = [(i.key, i.score) for i in acme.search(("profile",), query=query, **search)]
            expected = _reference(texts, kinds, query, **search)
            assert [key for key, _ in ranked] == [key for key, _ in expected], (query, ranked, expected)
            scores = [score for _, score in expected]
            assert [score for _, score in ranked] == pytest.approx(scores, abs=1e-5), (query, ranked)

        # A query search pages: every item once, equal scores (equal texts) in key order, and pages past
        # twice the limit are not empty (LangGraph's SQL stores bounded the candidates by the limit alone).
        acme.batch(
            [
                PutOp(("paged",), f"p{i:02}", {"text": "same text" if i % 3 else f"text {i}"})
                for i in range(30)
            ]
        )
        paged: list[Any] = []
        while page := acme.search(("paged",), query="same text", limit=4, offset=len(paged)):
            paged += page
        assert sorted(i.key for i in paged) == [f"p{i:02}" for i in range(30)]
        best = [i.key for i in paged if i.score == pytest.approx(1.0)]
        assert best == [f"p{i:02}" for i in range(30) if i % 3] and [i.key for i in paged[:20]] == best
        assert [i.score for i in paged] == sorted((i.score for i in paged), reverse=True)

        # langgraph_sdk's search_items with a query answers scores too.
        from langgraph_sdk import get_sync_client

        with get_sync_client(url=svc.url, api_key=KEYS["acme"]) as client:
            items = client.store.search_items(["profile"], query="likes green tea", limit=2)["items"]
        assert items[0]["key"] == "tea" and items[0]["score"] == pytest.approx(1.0) and len(items) == 2

        # Extracted messages are indexed like any item: a pruned message's content finds it.
        import httpx

        with httpx.Client(base_url=svc.url, timeout=30) as http:
            Api(http, "acme").put("shared", turns=4)
        deadline = time.monotonic() + 60
        while not (memories := acme.search(tuple(NAMESPACE), limit=100)):
            assert time.monotonic() < deadline, "the pruned messages never reached the store"
            time.sleep(0.1)
        target = memories[0]
        ranked = acme.search(tuple(NAMESPACE), query=target.value["data"]["content"], limit=100)
        assert ranked[0].key == target.key and ranked[0].score == pytest.approx(1.0)


def test_refusals(tmp_path: Path) -> None:
    """One line, naming the reason, instead of a service that cannot do what it was told."""
    line = _refused(tmp_path, "--database", "memory://", "--store-ttl", '{"default_ttl": 5}')
    assert line == "reducing-saver: --store-ttl needs PostgreSQL or SQLite: InMemoryStore has no TTL"
    line = _refused(
        tmp_path, "--database", "memory://", "--store-index", '{"dims": 4, "embed": "nope.mod:embed"}'
    )
    assert "--store-index embed 'nope.mod:embed': module not found" in line
    line = _refused(
        tmp_path, "--database", "memory://", "--store-index", '{"dims": 4, "embed": "x:y", "bogus": 1}'
    )
    assert "--store-index" in line or "store_index" in line
    if not SQLITE_VEC:
        line = _refused(tmp_path, "--database", f"sqlite:///{tmp_path}/db.sqlite", "--store-index", INDEX)
        assert line.startswith("reducing-saver: --store-index on SQLite needs the sqlite-vec extension")
    if not _has_pgvector():
        line = _refused(
            tmp_path, "--database", "postgresql://postgres@127.0.0.1:5432/postgres", "--store-index", INDEX
        )
        assert line == (
            "reducing-saver: --store-index needs the pgvector extension on PostgreSQL, and this server has "
            "none "
            "(pg_available_extensions lists no 'vector'): install pgvector, or start without --store-index"
        )


def test_store_settings_are_checked() -> None:
    settings = Settings(database="memory://", store_index=INDEX, store_ttl='{"default_ttl": 1.5}')
    assert settings.store_index == {
        "dims": DIMS,
        "embed": "tests.support.embeddings:embed",
        "fields": ["text", "data.content"],
    }
    assert settings.store_ttl == {"default_ttl": 1.5, "refresh_on_read": True}
    for bad in (
        '{"dims": 0, "embed": "a:b"}',
        '{"dims": 4}',
        '{"dims": 4, "embed": "a:b", "fields": []}',
        "[1]",
        "{",
    ):
        with pytest.raises(ValueError, match="store_index"):
            Settings(database="memory://", store_index=bad)
    for bad in (
        '{"default_ttl": -1}',
        '{"sweep_interval_minutes": 0.5}',
        '{"refresh_on_read": "yes"}',
        '{"ttl": 1}',
    ):
        with pytest.raises(ValueError, match="store_ttl"):
            Settings(database="memory://", store_ttl=bad)


# -- TTL ---------------------------------------------------------------------------------------------


def _expiries(backend: str, database: str) -> dict[tuple[str, str], object]:
    if backend == "sqlite":
        with sqlite3.connect(database.removeprefix("sqlite:///")) as conn:
            rows = conn.execute("SELECT prefix, key, expires_at FROM store").fetchall()
    else:
        with psycopg.connect(database) as conn:
            rows = conn.execute("SELECT prefix, key, expires_at FROM store").fetchall()
    return {(prefix, key): expires for prefix, key, expires in rows}


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_store_ttl(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    database = _database(
        backend, tmp_path, request.getfixturevalue("fresh_pg") if backend == "postgres" else None
    )
    # SqliteStore keeps fractions of minutes (1.2 s here); PostgresStore whole minutes, so on PostgreSQL
    # the items are aged below instead of waited for.
    default_ttl = 0.02 if backend == "sqlite" else 1
    ttl = json.dumps({"default_ttl": default_ttl, "refresh_on_read": False})
    args = ["--database", database, "--store-ttl", ttl, "--max-messages", "4", "--min-messages", "2"]
    with run_service(tmp_path, *args, env=ENV) as svc, RemoteStore(svc.url, api_key=KEYS["acme"]) as acme:
        acme.put(("notes",), "default", {"text": "expires with the default"})
        acme.put(("notes",), "own", {"text": "expires later"}, ttl=60)
        import httpx

        with httpx.Client(base_url=svc.url, timeout=30) as http:
            Api(http, "acme").put("shared", turns=4)
        deadline = time.monotonic() + 60
        while not acme.search(tuple(NAMESPACE)):
            assert time.monotonic() < deadline, "the pruned messages never reached the store"
            time.sleep(0.1)
        expiries = _expiries(backend, database)
        assert all(expires is not None for expires in expiries.values()), (
            "every item, extracted ones too, expires"
        )
        assert expiries[("tenants.acme.notes", "own")] != expiries[("tenants.acme.notes", "default")]
        # refresh_on_read is false: reads through RemoteStore (refresh_ttl left open) leave the expiry alone.
        acme.get(("notes",), "default")
        assert (
            _expiries(backend, database)[("tenants.acme.notes", "default")]
            == expiries[("tenants.acme.notes", "default")]
        )
        if backend == "sqlite":
            time.sleep(2.5)  # past every expiry; SQLite compares with CURRENT_TIMESTAMP, to the second
        else:
            with psycopg.connect(database) as conn:  # a minute later, for every item with the default TTL
                conn.execute(
                    "UPDATE store SET expires_at = NOW() - interval '1 second' WHERE ttl_minutes = 1"
                )
        local = (
            SqliteStore.from_conn_string(database.removeprefix("sqlite:///"))
            if backend == "sqlite"
            else PostgresStore.from_conn_string(database)
        )
        with local as store:
            swept = store.sweep_ttl()
        assert swept >= 2, "the default-TTL note and the extracted messages expired"
        assert acme.get(("notes",), "default") is None and acme.search(tuple(NAMESPACE)) == []
        assert acme.get(("notes",), "own") is not None
