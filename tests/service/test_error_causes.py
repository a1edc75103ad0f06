"""Errors that name their real cause, the same on the three backends (in-process, real PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from reducing_saver.service.app import create_app
from reducing_saver.service.config import Settings

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
    from reducing_saver.service import store_config

    settings = Settings(database=fresh_pg, store_ttl='{"default_ttl": 0.4}')
    refusal = store_config.refusal(settings)
    assert refusal is not None and "whole number of minutes" in refusal, refusal
    sqlite = Settings(database=f"sqlite:///{tmp_path / 'x.sqlite'}", store_ttl='{"default_ttl": 0.4}')
    assert store_config.refusal(sqlite) is None
    assert store_config.refusal(Settings(database=fresh_pg, store_ttl='{"default_ttl": 2}')) is None
