"""Paging through the long-term memory store: every item once, on PostgreSQL, SQLite and in memory.

Memories arrive in batches (the deliverer writes a batch in one ``store.batch``), so many items share one
``updated_at``: PostgreSQL's ``NOW()`` of one statement, SQLite's whole second. Search orders newest first,
ties broken by namespace and key, so ``limit``/``offset`` pages neither overlap nor skip; the order is the
same on the three backends. Through the service (``RemoteStore`` against the app in process), as an agent
pages.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from langgraph.store.base import PutOp

from reducing_saver.client import RemoteStore
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app

KINDS = ("postgres", "sqlite", "memory")
#: One delivery's worth: the figure the skipped pages were seen with.
ITEMS = 296


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path) -> Iterator[RemoteStore]:
    kind = request.param
    database = {
        "postgres": request.getfixturevalue("fresh_pg") if kind == "postgres" else None,
        "sqlite": f"sqlite:///{tmp_path}/store.sqlite",
        "memory": "memory://",
    }[kind]
    app = create_app(Settings(database=database, extract=False, sweep=False))
    with TestClient(app) as client, RemoteStore("http://testserver", transport=client._transport) as remote:
        yield remote


def _page_through(search: Any, limit: int) -> list[Any]:
    found, offset = [], 0
    while page := search(limit=limit, offset=offset):
        found += page
        offset += limit
    return found


def _ids(items: list[Any]) -> list[tuple[tuple[str, ...], str]]:
    return [(tuple(item.namespace), item.key) for item in items]


def _assert_page_order(items: list[Any]) -> None:
    """Newest first; equal times in namespace (labels joined by ".") then key order, as bytes."""
    order = sorted(items, key=lambda item: (".".join(item.namespace), item.key))
    order.sort(key=lambda item: item.updated_at, reverse=True)
    assert _ids(items) == _ids(order)


def test_paging_through_one_delivered_batch_finds_every_item_once(store: RemoteStore) -> None:
    # One batch, keys interleaved across three namespaces and not in key order: on PostgreSQL and SQLite
    # every updated_at ties (InMemoryStore stamps each item on its own).
    ops = [PutOp(("memories", f"u{i % 3}"), f"m-{(i * 7919) % ITEMS:04}", {"n": i}) for i in range(ITEMS)]
    store.batch(ops)
    expected = {(op.namespace, op.key) for op in ops}
    for limit in (100, 7):
        found = _page_through(lambda **page: store.search(("memories",), **page), limit)
        ids = _ids(found)
        assert len(ids) == ITEMS and set(ids) == expected, f"limit {limit}: {ITEMS - len(set(ids))} missed"
        _assert_page_order(found)


def test_pages_stay_stable_over_batches_of_different_times(store: RemoteStore) -> None:
    for batch in range(3):
        store.batch([PutOp(("memories", "u"), f"b{batch}-{i:03}", {"n": i}) for i in range(40)])
        time.sleep(0.01)
    store.put(("memories", "u"), "b0-005", {"n": "edited"})
    found = _page_through(lambda **page: store.search(("memories",), **page), 9)
    assert len(_ids(found)) == len(set(_ids(found))) == 120
    _assert_page_order(found)


def test_paging_through_namespaces_finds_each_once(store: RemoteStore) -> None:
    store.batch([PutOp(("users", f"u{i:02}", "facts"), "k", {"n": i}) for i in range(50)])
    listed: list[tuple[str, ...]] = []
    while page := store.list_namespaces(prefix=("users",), limit=6, offset=len(listed)):
        listed += page
    assert listed == sorted(("users", f"u{i:02}", "facts") for i in range(50))


def test_a_query_search_pages_in_memory(tmp_path) -> None:
    """Equal texts score alike: they page in key order, and pages past twice the limit are not empty
    (PostgreSQL and SQLite: tests/e2e/test_store_index_ttl.py, where vector search runs)."""
    index = '{"dims": 64, "embed": "tests.support.embeddings:embed", "fields": ["text"]}'
    app = create_app(Settings(database="memory://", extract=False, sweep=False, store_index=index))
    with TestClient(app) as client, RemoteStore("http://testserver", transport=client._transport) as store:
        store.batch(
            [PutOp(("paged",), f"p{i:02}", {"text": "same" if i % 3 else f"t{i}"}) for i in range(30)]
        )
        found = _page_through(lambda **page: store.search(("paged",), query="same", **page), 4)
        assert sorted(_ids(found)) == [(("paged",), f"p{i:02}") for i in range(30)]
        assert [item.key for item in found[:20]] == [f"p{i:02}" for i in range(30) if i % 3]
        scores = [round(item.score, 12) for item in found]  # equal vectors score a rounding error apart
        assert scores == sorted(scores, reverse=True)


def test_the_sql_stores_extend_langgraphs_own_search_queries(caplog: pytest.LogCaptureFixture) -> None:
    """The tie-breakers and the candidates' bound land in the SQL LangGraph writes, with and without a
    query (the SQLite vector search runs only where sqlite3 loads extensions: the project's image): a
    LangGraph that writes its queries differently fails here, not silently in production."""
    import sqlite3

    from langgraph.store.base import SearchOp

    from reducing_saver.service.storage.postgres.store import PagingPostgresStore
    from reducing_saver.service.storage.sqlite.store import PagingSqliteStore
    from tests.support.embeddings import DIMS, embed

    index = {"dims": DIMS, "embed": embed, "fields": ["text"]}
    plain, query = SearchOp(("a",), {"k": 1}, 4, 8), SearchOp(("a",), None, 4, 8, "q")
    postgres = PagingPostgresStore(None, index=index)  # builds queries only: no connection needed
    (newest, _), (best, params) = postgres._prepare_batch_search_queries([(0, plain), (1, query)])[0]
    assert 'ORDER BY store.updated_at DESC, store.prefix COLLATE "C", store.key COLLATE "C"' in newest
    assert 'ORDER BY score DESC, uniq.prefix COLLATE "C", uniq.key COLLATE "C"' in best
    assert params[-3:] == [(8 + 4) * 2 + 1, 4, 8]  # one vector per item: twice the page's end, plus one
    sqlite = PagingSqliteStore(sqlite3.connect(":memory:"), index={**index, "text_fields": ["text"]})
    (newest, _, _), (best, params, _) = sqlite._prepare_batch_search_queries([(0, plain), (1, query)])[0]
    assert "ORDER BY updated_at DESC, prefix, key" in newest
    assert (
        best.count("ORDER BY score DESC, s.prefix, s.key") == 1
        and best.rstrip().count("ORDER BY score DESC, prefix, key") == 1
    )
    assert params[-3:] == [(8 + 4) * 2, 4, 8]
    assert "store search" not in caplog.text
