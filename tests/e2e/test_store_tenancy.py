"""The isolation matrix of the store routes: tenant "rival" against the items and extracted memories of
tenant "acme", through every store route, on memory and SQLite (in-process) and PostgreSQL (a running
service).

acme holds items it put itself and the messages the service extracted from its pruned checkpoints (stored
under ``("tenants", "acme", ...)``). rival then reads, searches, lists, overwrites and deletes with acme's
namespaces and keys, with the stored prefix spelt out, with wildcards and suffixes: every answer is what
it gets for a namespace nobody used, and acme's items are unchanged afterwards.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import psycopg
from fastapi.testclient import TestClient

from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from tests.service.security.test_security import KEYS, NAMESPACE, Api, key_pairs
from tests.support.server import run_service

MINE = ["notes", "projects"]


class Store:
    """One tenant's store calls (Agent Server's routes and the batch route)."""

    def __init__(self, client: Any, tenant: str) -> None:
        self.client, self.headers = client, {"x-api-key": KEYS[tenant]}

    def _ok(self, response: Any, status: int = 200) -> Any:
        assert response.status_code == status, response.text
        return response.json() if response.content else None

    def put(self, ns: list[str], key: str, value: dict) -> None:
        self._ok(
            self.client.put(
                "/store/items", json={"namespace": ns, "key": key, "value": value}, headers=self.headers
            ),
            204,
        )

    def get(self, ns: list[str], key: str) -> Any:
        return self._ok(
            self.client.get(
                "/store/items", params={"namespace": ".".join(ns), "key": key}, headers=self.headers
            )
        )

    def delete(self, ns: list[str], key: str) -> None:
        self._ok(
            self.client.request(
                "DELETE", "/store/items", json={"namespace": ns, "key": key}, headers=self.headers
            ),
            204,
        )

    def search(self, prefix: list[str], **kw: Any) -> list[dict]:
        body = {"namespace_prefix": prefix, "limit": 1000, **kw}
        return self._ok(self.client.post("/store/items/search", json=body, headers=self.headers))["items"]

    def namespaces(self, **kw: Any) -> list[list[str]]:
        body = {"limit": 1000, **kw}
        return sorted(
            self._ok(self.client.post("/store/namespaces", json=body, headers=self.headers))["namespaces"]
        )

    def batch(self, ops: list[dict]) -> list[Any]:
        return self._ok(self.client.post("/store/batch", json={"ops": ops}, headers=self.headers))["results"]


def _everything(store: Store) -> list[tuple]:
    return sorted((tuple(i["namespace"]), i["key"], repr(i["value"])) for i in store.search([]))


def run_store_matrix(client: Any) -> dict[str, str]:
    """Run the matrix; returns ``{attack: outcome}`` for the report."""
    outcome: dict[str, str] = {}
    acme_api = Api(client, "acme")
    acme, rival = Store(client, "acme"), Store(client, "rival")

    # acme: a pruning checkpoint (extracted under its NAMESPACE) and items of its own.
    acme_api.put("shared", turns=4)
    acme.put(MINE, "k", {"secret": "acme", "n": 1})
    acme.put([*NAMESPACE, "deep"], "k", {"secret": "acme", "n": 2})
    deadline = time.monotonic() + 60
    while not any(i["namespace"] == NAMESPACE for i in acme.search(NAMESPACE)):
        assert time.monotonic() < deadline, "the pruned messages never reached acme's store"
        time.sleep(0.1)
    extracted = [i for i in acme.search(NAMESPACE) if i["namespace"] == NAMESPACE]
    assert extracted and all(i["value"]["thread_id"] == "shared" for i in extracted), (
        "extracted memories, unprefixed"
    )
    assert ["memories", "user-42"] in acme.namespaces()
    message_key = extracted[0]["key"]
    # rival: one item of its own under the same namespace.
    rival.put(NAMESPACE, "own", {"secret": "rival"})
    before = _everything(acme)
    assert all(ns[:1] != ("tenants",) for ns, _, _ in before), "acme sees its namespaces unprefixed"

    stored = ["tenants", "acme"]
    # list_namespaces first (InMemoryStore lists a namespace a get or delete touched, even empty): prefixes,
    # suffixes (also spelling out the stored labels), wildcards, depth.
    for name, kw in [
        ("list everything", {}),
        ("list prefix tenants", {"prefix": ["tenants"]}),
        ("list prefix tenants.acme", {"prefix": stored}),
        ("list prefix wildcard", {"prefix": ["*"]}),
        ("list suffix acme's namespace", {"suffix": MINE}),
        ("list suffix stored acme namespace", {"suffix": [*stored, *MINE]}),
        ("list suffix tenant label", {"suffix": ["acme", "notes", "projects"]}),
        ("list suffix wildcards", {"suffix": ["*", "*", "*", "*"]}),
        ("list max_depth 1", {"max_depth": 1}),
    ]:
        listed = rival.namespaces(**kw)
        assert all(ns in ([*NAMESPACE], NAMESPACE[:1]) for ns in listed), (name, listed)
        outcome[name] = f"only rival's own ({listed})" if listed else "no namespaces"
    assert rival.namespaces() == [NAMESPACE] and rival.namespaces(max_depth=1) == [["memories"]]
    # GET: acme's namespace and key, plain and with the stored prefix spelt out.
    for name, ns, key in [
        ("get acme's item", MINE, "k"),
        ("get an extracted memory", NAMESPACE, message_key),
        ("get with the stored prefix", [*stored, *MINE], "k"),
        ("get with the stored prefix (extracted)", [*stored, *NAMESPACE], message_key),
    ]:
        assert rival.get(ns, key) is None, name
        outcome[name] = "null, as for a missing item"
    # search: every prefix, and filters matching acme's values.
    for name, prefix, kw in [
        ("search the whole store", [], {}),
        ("search acme's namespace", MINE, {}),
        ("search the shared namespace", NAMESPACE, {}),
        ("search prefix tenants", ["tenants"], {}),
        ("search prefix tenants.acme", stored, {}),
        ("search filter on acme's value", [], {"filter": {"secret": "acme"}}),
        ("search filter on extracted thread", [], {"filter": {"thread_id": "shared"}}),
    ]:
        found = rival.search(prefix, **kw)
        assert all(i["value"] == {"secret": "rival"} for i in found), (name, found)
        outcome[name] = "only rival's own item" if found else "no items"
    # writes: overwrite and delete acme's items by their namespaces and keys.
    rival.put(MINE, "k", {"secret": "overwritten?"})
    rival.delete(MINE, "k")
    rival.delete(NAMESPACE, message_key)
    rival.delete([*NAMESPACE, "deep"], "k")
    outcome["put over acme's item"] = "lands in rival's subtree"
    outcome["delete acme's items"] = "204, acme's untouched"
    # batch: the same through one request.
    results = rival.batch(
        [
            {"op": "get", "namespace": MINE, "key": "k"},
            {"op": "put", "namespace": [*NAMESPACE, "deep"], "key": "k", "value": None},
            {"op": "search", "namespace_prefix": stored},
            {"op": "list_namespaces", "match_conditions": [{"match_type": "prefix", "path": stored}]},
            {
                "op": "list_namespaces",
                "match_conditions": [{"match_type": "suffix", "path": [*stored, *MINE]}],
            },
        ]
    )
    assert results[:3] == [None, None, []]
    # InMemoryStore lists the (empty) namespaces rival's own gets above touched in its subtree: no items.
    assert all(rival.search(ns) == [] for ns in results[3] + results[4]), results
    outcome["batch (get, delete, search, list)"] = "null, null, no items, no items, no items"
    # acme's store is unchanged.
    assert _everything(acme) == before
    assert acme.get(MINE, "k")["value"] == {"secret": "acme", "n": 1}
    return outcome


def test_store_isolation_matrix_in_process(tmp_path) -> None:
    for database in ("memory://", f"sqlite:///{tmp_path}/db.sqlite"):
        settings = Settings(database=database, api_keys=key_pairs(), max_messages=4, min_messages=2)
        with TestClient(create_app(settings)) as client:
            outcome = run_store_matrix(client)
        assert len(outcome) == 23


def test_store_isolation_matrix_on_postgres(tmp_path, fresh_pg) -> None:
    env = {"REDUCING_SAVER_API_KEYS": key_pairs()}
    args = ["--database", fresh_pg, "--max-messages", "4", "--min-messages", "2"]
    with run_service(tmp_path, *args, env=env) as svc, httpx.Client(base_url=svc.url, timeout=30) as client:
        outcome = run_store_matrix(client)
        with psycopg.connect(fresh_pg) as conn:
            prefixes = {r[0] for r in conn.execute("SELECT DISTINCT prefix FROM store")}
    assert prefixes == {
        "tenants.acme.notes.projects",
        "tenants.acme.memories.user-42",
        "tenants.acme.memories.user-42.deep",
        "tenants.rival.memories.user-42",
    }, "every item lies under its tenant's labels"
    for attack, result in outcome.items():
        print(f"{attack:45} {result}")


def test_single_tenant_mode_maps_nothing(tmp_path) -> None:
    with TestClient(create_app(Settings(database="memory://"))) as client:
        client.put("/store/items", json={"namespace": ["a"], "key": "k", "value": {"v": 1}})
        assert client.get("/store/items", params={"namespace": "a", "key": "k"}).json()["namespace"] == ["a"]
        assert client.post("/store/namespaces", json={}).json() == {"namespaces": [["a"]]}
