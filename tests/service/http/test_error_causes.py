"""Errors that name their real cause, the same on the three backends (in-process, real PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app

BACKENDS = ("memory", "sqlite", "postgres")


def _database(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if backend == "postgres":
        return request.getfixturevalue("fresh_pg")
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'errors.sqlite'}"
    return "memory://"


@pytest.fixture(params=BACKENDS)
def client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(database=_database(request.param, tmp_path, request), sweep=False, extract=False)
    with TestClient(create_app(settings), raise_server_exceptions=False) as test_client:
        test_client.backend = request.param  # type: ignore[attr-defined]
        yield test_client


# -- checkpoints/list metadata filter keys -----------------------------------------------------------


@pytest.mark.parametrize("key", ["owner') OR 1=1 --", "a b", "k\u00e9", "", "x" * 257])
def test_a_list_filter_key_outside_the_rule_is_a_422_naming_it_on_every_backend(client, key: str) -> None:
    response = client.post("/v1/checkpoints/list", json={"filter": {key: "x"}})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert "filter" in str(detail) and repr(key)[:60] in str(detail), detail
    assert "letters, digits" in str(detail)
    assert client.get("/healthz").status_code == 200


def test_a_list_filter_key_inside_the_rule_is_served_on_every_backend(client) -> None:
    response = client.post("/v1/checkpoints/list", json={"filter": {"owner.name_1-x": "x", "source": "loop"}})
    assert response.status_code == 200, response.text
    assert response.json() == {"checkpoints": []}


# -- store search filters with nested objects ---------------------------------------------------------


def _search(client: TestClient, filter: dict) -> tuple[int, object]:
    response = client.post(
        "/store/batch", json={"ops": [{"op": "search", "namespace_prefix": ["n"], "filter": filter}]}
    )
    return response.status_code, response.json()


def test_a_nested_object_filter_works_where_the_stock_store_supports_it_else_says_so(client) -> None:
    put = {"op": "put", "namespace": ["n"], "key": "k", "value": {"a": {"k": 1, "j": 2}}}
    assert client.post("/store/batch", json={"ops": [put]}).status_code == 200
    status, body = _search(client, {"a": {"k": 1}})
    if client.backend == "memory":  # InMemoryStore matches nested objects by containment
        assert status == 200, body
        assert [item["key"] for item in body["results"][0]] == ["k"]
        assert _search(client, {"a": {"k": 2}}) == (200, {"results": [[]]})
    else:  # PostgresStore and SqliteStore read every key of an object as an operator
        assert status == 422, body
        detail = body["detail"]
        assert "ops[0].filter.a" in detail and "nested objects" in detail, detail
        assert "different types" not in detail and "Unsupported operator" not in detail
    # Operators keep working on every backend.
    status, body = _search(client, {"a": {"$ne": None}})
    assert status == 200, body


# -- store TTLs ----------------------------------------------------------------------------------------


@pytest.fixture(params=("sqlite", "postgres"))
def ttl_client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        database=_database(request.param, tmp_path, request),
        sweep=False,
        extract=False,
        store_ttl='{"default_ttl": 60}',
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as test_client:
        test_client.backend = request.param  # type: ignore[attr-defined]
        yield test_client


def test_a_fractional_ttl_is_refused_where_the_store_keeps_whole_minutes(ttl_client) -> None:
    put = {"op": "put", "namespace": ["n"], "key": "k", "value": {"v": 1}, "ttl": 0.4}
    response = ttl_client.post("/store/batch", json={"ops": [put]})
    if ttl_client.backend == "postgres":
        assert response.status_code == 422, response.text
        detail = response.json()["detail"]
        assert "ops[0].ttl" in detail and "whole number of minutes" in detail, detail
        get = {"op": "get", "namespace": ["n"], "key": "k"}
        assert ttl_client.post("/store/batch", json={"ops": [get]}).json() == {"results": [None]}
    else:  # SqliteStore keeps minutes as REAL: 0.4 stays 24 s, refreshes included
        assert response.status_code == 200, response.text
    whole = {**put, "ttl": 2}
    assert ttl_client.post("/store/batch", json={"ops": [whole]}).status_code == 200


def test_a_fractional_default_ttl_is_refused_at_start_on_postgresql(fresh_pg: str, tmp_path: Path) -> None:
    from reducing_saver.service.configuration import store as store_config

    settings = Settings(database=fresh_pg, store_ttl='{"default_ttl": 0.4}')
    refusal = store_config.refusal(settings)
    assert refusal is not None and "whole number of minutes" in refusal, refusal
    sqlite = Settings(database=f"sqlite:///{tmp_path / 'x.sqlite'}", store_ttl='{"default_ttl": 0.4}')
    assert store_config.refusal(sqlite) is None
    assert store_config.refusal(Settings(database=fresh_pg, store_ttl='{"default_ttl": 2}')) is None


# -- paging across copied threads ----------------------------------------------------------------------


def _put_checkpoints(client: TestClient, thread_id: str, count: int) -> None:
    from langgraph.checkpoint.base import empty_checkpoint

    parent = None
    for step in range(count):
        checkpoint = empty_checkpoint()
        checkpoint.pop("channel_values")
        checkpoint["channel_versions"] = {"n": str(step + 1)}
        configurable = {"thread_id": thread_id, "checkpoint_ns": ""}
        if parent:
            configurable["checkpoint_id"] = parent
        body = {
            "config": {"configurable": configurable},
            "checkpoint": checkpoint,
            "values": {"n": step},
            "metadata": {"step": step},
            "new_versions": {"n": str(step + 1)},
        }
        response = client.post("/v1/checkpoints/put", json=body)
        assert response.status_code == 200, response.text
        parent = response.json()["config"]["configurable"]["checkpoint_id"]


def _key(item: dict) -> tuple[str, str, str]:
    configurable = item["config"]["configurable"]
    return configurable["thread_id"], configurable["checkpoint_ns"], configurable["checkpoint_id"]


@pytest.mark.parametrize("page_size", [1, 2, 3, 4])
def test_paging_across_copied_threads_is_complete_on_every_backend(client, page_size: int) -> None:
    _put_checkpoints(client, "original", 3)
    for copy in ("copy-a", "copy-b", "copy-c"):  # the copies share every checkpoint id with the original
        body = {"source_thread_id": "original", "target_thread_id": copy}
        response = client.post("/v1/threads/copy", json=body)
        assert response.status_code == 204, response.text
    _put_checkpoints(client, "other", 2)
    everything = client.post("/v1/checkpoints/list", json={"limit": 1000}).json()["checkpoints"]
    assert len(everything) == 14

    pages, before = [], None
    while True:
        body = {"limit": page_size, **({"before": before} if before else {})}
        page = client.post("/v1/checkpoints/list", json=body).json()["checkpoints"]
        assert len(page) <= page_size
        pages.append(page)
        if len(page) < page_size:
            break
        before = page[-1]["config"]
    paged = [_key(item) for page in pages for item in page]
    assert len(paged) == len(set(paged)), "a checkpoint came twice"
    assert sorted(paged) == sorted(_key(item) for item in everything), "a page skipped checkpoints"
    ids = [key[2] for key in paged]
    assert ids == sorted(ids, reverse=True), "newest first across pages"


def test_a_before_without_a_thread_keeps_its_meaning(client) -> None:
    """``before`` naming only a checkpoint id (as a stock saver's caller writes it): strictly older ids."""
    _put_checkpoints(client, "original", 3)
    client.post("/v1/threads/copy", json={"source_thread_id": "original", "target_thread_id": "copy"})
    everything = client.post("/v1/checkpoints/list", json={"limit": 1000}).json()["checkpoints"]
    middle = sorted({_key(item)[2] for item in everything})[1]
    body = {"before": {"configurable": {"checkpoint_id": middle}}}
    older = client.post("/v1/checkpoints/list", json=body).json()["checkpoints"]
    assert sorted(_key(item) for item in older) == sorted(
        _key(item) for item in everything if _key(item)[2] < middle
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_paging_across_copied_threads_is_complete_for_each_tenant(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    keys = {"acme": "acme-key-0123456789abcdef", "beta": "beta-key-0123456789abcdef"}
    settings = Settings(
        database=_database(backend, tmp_path, request),
        sweep=False,
        extract=False,
        api_keys=",".join(f"{tenant}={key}" for tenant, key in keys.items()),
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        for key in keys.values():
            client.headers["Authorization"] = f"Bearer {key}"
            _put_checkpoints(client, "original", 3)
            for copy in ("copy-a", "copy-b"):
                body = {"source_thread_id": "original", "target_thread_id": copy}
                assert client.post("/v1/threads/copy", json=body).status_code == 204
        client.headers["Authorization"] = f"Bearer {keys['acme']}"
        everything = client.post("/v1/checkpoints/list", json={"limit": 1000}).json()["checkpoints"]
        assert len(everything) == 9
        paged, before = [], None
        while True:
            body = {"limit": 2, **({"before": before} if before else {})}
            page = client.post("/v1/checkpoints/list", json=body).json()["checkpoints"]
            paged += [_key(item) for item in page]
            if len(page) < 2:
                break
            before = page[-1]["config"]
    assert sorted(paged) == sorted(_key(item) for item in everything) and len(paged) == len(set(paged))
