"""Stored values the wire could not carry: they travel now, or fail their own call only.

* A state float >= 2**64 (``1e20``): PostgresSaver keeps it inline in its checkpoint JSONB, which reads
  it back as the int 100000000000000000000; neither orjson nor msgpack can write that int, so every get
  and list of the thread answered 500. It now travels in the wire's typed int form and reaches the
  client as the int a stock PostgresSaver returns.
* A client value typed with the service's own storage type (``reducing-saver/msgpack``) was stored and
  then decoded as the service's structure when read back (a 500 again). It is refused with a 422.
* A stored value that has no wire form fails its own call, and leaves no saver locked: PostgresSaver.list
  holds its saver's lock while its generator is open.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import httpx
import ormsgpack
import psycopg
import pytest
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.graph import START, StateGraph
from typing_extensions import TypedDict

from reducing_saver.client import RemoteReducingSaver
from reducing_saver.wire import GET_PATH, INT_TYPE, LIST_PATH, MSGPACK, PUT_PATH, WRITES_PATH
from tests.support.server import run_service

BIG = 100000000000000000000  # 1e20 as PostgreSQL's JSONB gives it back


class Scored(TypedDict, total=False):
    score: float
    note: str


def scoring_graph(checkpointer: Any) -> Any:
    builder = StateGraph(Scored)
    builder.add_node("score", lambda state: {"score": 1e19 * 10})
    builder.add_node("note", lambda state: {"note": "scored"})
    builder.add_edge(START, "score")
    builder.add_edge("score", "note")
    return builder.compile(checkpointer=checkpointer)


def noting_graph(checkpointer: Any) -> Any:
    """Writes only ``note``: the stored ``score`` must carry over to its checkpoints unchanged."""
    builder = StateGraph(Scored)
    builder.add_node("note", lambda state: {"note": "again"})
    builder.add_edge(START, "note")
    return builder.compile(checkpointer=checkpointer)


def turns(checkpointer: Any, thread_id: str) -> dict[str, Any]:
    config = {"configurable": {"thread_id": thread_id}}
    # Run metadata is merged into checkpoint metadata, which PostgresSaver keeps in JSONB too.
    scoring_graph(checkpointer).invoke({"note": "start"}, {**config, "metadata": {"rating": 1e19 * 10}})
    graph = noting_graph(checkpointer)
    graph.invoke({"note": "more"}, config)
    return graph.get_state(config).values


@pytest.mark.parametrize("body_format", ["msgpack", "json"])
def test_a_float_beyond_64_bits_reads_back_as_a_stock_postgres_saver_reads_it(
    body_format, tmp_path, make_database
):
    reference_db, service_db = make_database(), make_database()
    with PostgresSaver.from_conn_string(reference_db) as stock:
        stock.setup()
        expected = turns(stock, "t")
    assert expected == {"score": BIG, "note": "again"} and type(expected["score"]) is int

    with run_service(tmp_path, "--database", service_db, "--no-sweep", "--no-extract") as service:
        with RemoteReducingSaver(service.url, body_format=body_format, max_retries=0) as saver:
            assert turns(saver, "t") == expected
            config = {"configurable": {"thread_id": "t"}}
            latest = saver.get_tuple(config)
            assert latest is not None and type(latest.checkpoint["channel_values"]["score"]) is int
            listed = list(saver.list(config))
        with PostgresSaver.from_conn_string(service_db) as stock:
            stored = list(stock.list(config))
        # Every checkpoint reads the same through the service as through a stock saver on its database.
        assert [item.checkpoint["channel_values"] for item in listed] == [
            item.checkpoint["channel_values"] for item in stored
        ]
        assert [item.metadata for item in listed] == [item.metadata for item in stored]
        assert stored[0].checkpoint["channel_values"]["score"] == BIG
        assert any(item.metadata.get("rating") == BIG for item in stored)

        # Metadata the client itself puts with such an int (LangGraph hands put whatever it holds).
        with RemoteReducingSaver(service.url, body_format=body_format, max_retries=0) as saver:
            put = saver.put(
                {"configurable": {"thread_id": "m", "checkpoint_ns": ""}},
                empty_checkpoint(),
                {"big": [-(10**25)], "small": 1},
                {},
            )
            assert saver.get_tuple(put).metadata == {"big": [-(10**25)], "small": 1}
        with PostgresSaver.from_conn_string(service_db) as stock:
            assert stock.get_tuple(put).metadata == {"big": [-(10**25)], "small": 1}


def _typed(type_: str, data: bytes, msgpack: bool) -> dict[str, Any]:
    return {"type": type_, "data": data if msgpack else base64.b64encode(data).decode()}


def _post(url: str, body: dict[str, Any], msgpack: bool) -> httpx.Response:
    if msgpack:
        return httpx.post(url, content=ormsgpack.packb(body), headers={"content-type": MSGPACK})
    return httpx.post(url, json=body)


def _put_body(values: dict[str, Any]) -> dict[str, Any]:
    checkpoint = {
        "v": 4,
        "id": str(uuid.uuid4()),
        "ts": "2026-01-01T00:00:00+00:00",
        "channel_versions": {channel: "1" for channel in values},
        "versions_seen": {},
    }
    return {
        "config": {"configurable": {"thread_id": "reserved"}},
        "checkpoint": checkpoint,
        "values": values,
        "metadata": {},
        "new_versions": {channel: "1" for channel in values},
    }


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
def test_values_under_the_service_s_own_types_are_refused_naming_the_field(msgpack, tmp_path, fresh_pg):
    structure = ormsgpack.packb({"a": 1})
    with run_service(tmp_path, "--database", fresh_pg, "--no-sweep", "--no-extract") as service:
        put = _post(
            service.url + PUT_PATH,
            _put_body({"x": _typed("reducing-saver/msgpack", structure, msgpack)}),
            msgpack,
        )
        assert put.status_code == 422, put.text
        assert "values.x.type" in put.text and "reducing-saver/msgpack" in put.text

        bad_int = _post(service.url + PUT_PATH, _put_body({"x": _typed(INT_TYPE, b"12e4", msgpack)}), msgpack)
        assert bad_int.status_code == 422 and "values.x.data" in bad_int.text and "12e4" in bad_int.text

        good = _put_body({"x": _typed(INT_TYPE, str(-BIG).encode(), msgpack)})
        assert _post(service.url + PUT_PATH, good, msgpack).status_code == 200
        checkpoint_id = good["checkpoint"]["id"]
        config = {"configurable": {"thread_id": "reserved", "checkpoint_id": checkpoint_id}}
        writes = {
            "config": config,
            "writes": [["y", _typed("reducing-saver/msgpack", structure, msgpack)]],
            "task_id": "task",
        }
        refused = _post(service.url + WRITES_PATH, writes, msgpack)
        assert refused.status_code == 422 and "writes[0].type" in refused.text

        # Nothing refused was stored, and what was stored still reads.
        answer = httpx.post(service.url + GET_PATH, json={"config": config})
        assert answer.status_code == 200, answer.text
        stored = answer.json()["checkpoint"]
        assert stored["values"] == {"x": _typed(INT_TYPE, str(-BIG).encode(), False)}
        assert stored["pending_writes"] == []
        with RemoteReducingSaver(service.url) as saver:
            assert saver.get_tuple(config).checkpoint["channel_values"] == {"x": -BIG}


class Counter(TypedDict):
    value: int


def counter(checkpointer: Any) -> Any:
    builder = StateGraph(Counter)
    builder.add_node("inc", lambda state: {"value": state["value"] + 1})
    builder.add_edge(START, "inc")
    return builder.compile(checkpointer=checkpointer)


def test_a_list_failing_midway_leaves_every_saver_usable(tmp_path, fresh_pg):
    keys = {"acme": "acme-key-0123456789abcdef", "globex": "globex-key-0123456789abcdef"}
    env = {"REDUCING_SAVER_API_KEYS": ",".join(f"{tenant}={key}" for tenant, key in keys.items())}
    args = (
        "--database",
        fresh_pg,
        "--pool-size",
        "2",
        "--db-timeout-seconds",
        "2",
        "--no-sweep",
        "--no-extract",
    )
    with run_service(tmp_path, *args, env=env) as service:
        for tenant, threads in (("acme", ("bad", "good")), ("globex", ("other",))):
            with RemoteReducingSaver(service.url, api_key=keys[tenant]) as saver:
                for thread_id in threads:
                    for start in range(3):
                        counter(saver).invoke({"value": start}, {"configurable": {"thread_id": thread_id}})
        # A row no client could have written: an object where the service stored an int. The list of
        # this thread fails on it mid-way (newer checkpoints convert first).
        with psycopg.connect(fresh_pg, autocommit=True) as conn:
            ids = [
                row[0]
                for row in conn.execute(
                    "SELECT checkpoint_id FROM checkpoints WHERE thread_id = 'acme:bad' ORDER BY checkpoint_id DESC"
                )
            ]
            conn.execute(
                "UPDATE checkpoints SET checkpoint = jsonb_set(checkpoint, '{channel_values,value}', "
                "'{\"not\": \"an int\"}') WHERE thread_id = 'acme:bad' AND checkpoint_id = %s",
                (ids[len(ids) // 2],),
            )

        acme = {"Authorization": f"Bearer {keys['acme']}"}
        globex = {"Authorization": f"Bearer {keys['globex']}"}
        with httpx.Client(base_url=service.url, timeout=10) as http:
            for _ in range(6):  # three times the savers there are
                failed = http.post(
                    LIST_PATH, json={"config": {"configurable": {"thread_id": "bad"}}}, headers=acme
                )
                assert failed.status_code == 500
                assert "values.value" in failed.json()["detail"] and "dict" in failed.json()["detail"]
            calls = [
                ("GET", "/healthz", None, {}),
                ("POST", GET_PATH, {"config": {"configurable": {"thread_id": "good"}}}, acme),
                ("POST", GET_PATH, {"config": {"configurable": {"thread_id": "other"}}}, globex),
                ("POST", LIST_PATH, {"config": {"configurable": {"thread_id": "good"}}}, acme),
                ("POST", LIST_PATH, {"config": None}, globex),
                ("POST", GET_PATH, {"config": {"configurable": {"thread_id": "bad"}}}, acme),
            ]
            for _ in range(3):
                for method, path, body, headers in calls:
                    started = time.monotonic()
                    answer = http.request(method, path, json=body, headers=headers)
                    elapsed = time.monotonic() - started
                    assert answer.status_code == 200, (path, answer.status_code, answer.text)
                    assert elapsed < 1.0, (path, elapsed)  # a locked saver would wait out the 2 s timeout


def test_a_failing_list_releases_the_saver_even_while_its_error_is_kept(fresh_pg):
    # An error reporter or log handler may keep the exception (and with its traceback the operation's
    # frame) alive; the saver's lock must not depend on when that goes away.
    from fastapi.testclient import TestClient
    from pydantic import TypeAdapter

    from reducing_saver.service.configuration.settings import Settings
    from reducing_saver.service.errors import Untransportable
    from reducing_saver.service.http import schemas
    from reducing_saver.service.http.app import create_app
    from reducing_saver.service.operations import saver as ops

    app = create_app(Settings(database=fresh_pg, pool_size=1, sweep=False, extract=False))
    with TestClient(app) as http:
        with RemoteReducingSaver("http://testserver", transport=http._transport, max_retries=0) as saver:
            for start in range(3):
                counter(saver).invoke({"value": start}, {"configurable": {"thread_id": "bad"}})
        with psycopg.connect(fresh_pg, autocommit=True) as conn:
            conn.execute(
                "UPDATE checkpoints SET checkpoint = jsonb_set(checkpoint, '{channel_values,value}', '[1]') "
                "WHERE checkpoint_id = (SELECT min(checkpoint_id) FROM checkpoints)"
            )
        service = app.state.service
        body = TypeAdapter(schemas.ListCheckpointsBody).validate_python(
            {"config": {"configurable": {"thread_id": "bad"}}}
        )
        kept = []
        with service.savers.borrow() as pooled:
            try:
                ops.list_checkpoints(service, pooled, body)
            except Untransportable as exc:
                kept.append(exc)
            assert kept and "values.value" in str(kept[0])
            assert not pooled.inner.lock.locked()
            assert pooled.get_tuple({"configurable": {"thread_id": "bad", "checkpoint_ns": ""}}) is not None


@pytest.mark.parametrize("body_format", ["msgpack", "json"])
def test_an_answer_that_cannot_be_encoded_fails_that_call_only(body_format, monkeypatch):
    # Defence in depth: should an operation ever hand the encoder a value without a wire form, the call
    # gets a 500 saying so (the hot path and the FastAPI routes), and the next call is served.
    from fastapi.testclient import TestClient

    from reducing_saver.client import ReducingSaverError
    from reducing_saver.service.configuration.settings import Settings
    from reducing_saver.service.http.app import create_app
    from reducing_saver.service.operations import saver as ops

    app = create_app(Settings(database="memory://", sweep=False, extract=False))
    with (
        TestClient(app) as http,
        RemoteReducingSaver(
            "http://testserver", transport=http._transport, max_retries=0, body_format=body_format
        ) as saver,
    ):
        counter(saver).invoke({"value": 1}, {"configurable": {"thread_id": "t"}})
        monkeypatch.setattr(ops, "_wire_metadata", lambda metadata, *_: {**metadata, "raw": object()})
        for call in (
            lambda: saver.get_tuple({"configurable": {"thread_id": "t"}}),
            lambda: list(saver.list({"configurable": {"thread_id": "t"}})),
        ):
            with pytest.raises(ReducingSaverError) as caught:
                call()
            assert caught.value.status_code == 500 and "cannot travel" in str(caught.value)
        monkeypatch.undo()
        assert saver.get_tuple({"configurable": {"thread_id": "t"}}).checkpoint["channel_values"] == {
            "value": 2
        }


@pytest.mark.parametrize("backend", ["sqlite", "memory"])
@pytest.mark.parametrize("body_format", ["msgpack", "json"])
def test_big_ints_travel_on_the_other_backends(backend, body_format, tmp_path):
    # SqliteSaver writes metadata as JSON and the memory backend as msgpack: neither holds such an int,
    # so they keep its typed form, which reaches the client as the int.
    from fastapi.testclient import TestClient

    from reducing_saver.service.configuration.settings import Settings
    from reducing_saver.service.http.app import create_app

    database = f"sqlite:///{tmp_path / 'service.sqlite'}" if backend == "sqlite" else "memory://"
    app = create_app(Settings(database=database, sweep=False, extract=False))
    with (
        TestClient(app) as http,
        RemoteReducingSaver(
            "http://testserver", transport=http._transport, max_retries=0, body_format=body_format
        ) as saver,
    ):
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = {"score": BIG, "small": 1}
        checkpoint["channel_versions"] = {"score": "1", "small": "1"}
        config = saver.put(
            {"configurable": {"thread_id": "t", "checkpoint_ns": ""}},
            checkpoint,
            {"big": [-(10**25)], "n": 1},
            {"score": "1", "small": "1"},
        )
        saver.put_writes(config, [("score", -BIG)], "task")
        for item in (saver.get_tuple(config), next(saver.list(None, filter={"n": 1}))):
            assert item.checkpoint["channel_values"] == {"score": BIG, "small": 1}
            assert item.metadata == {"big": [-(10**25)], "n": 1}
            assert item.pending_writes == [("task", "score", -BIG)]


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
def test_a_serde_type_no_stock_reader_reads_is_refused_naming_the_channel(msgpack, tmp_path, fresh_pg):
    """Stored, such a value broke every later read of the thread and every list, a stock saver's too."""
    data = ormsgpack.packb({"a": 1})
    with run_service(tmp_path, "--database", fresh_pg, "--no-sweep", "--no-extract") as service:
        good = _put_body({"notes": _typed("msgpack", data, msgpack)})
        config = {"configurable": {"thread_id": "reserved", "checkpoint_id": good["checkpoint"]["id"]}}
        for type_ in ("foo", "", "pickle", "msgpack+", "pickle+aes"):
            put = _post(service.url + PUT_PATH, _put_body({"notes": _typed(type_, data, msgpack)}), msgpack)
            assert put.status_code == 422, put.text
            assert "values.notes.type" in put.text, put.text
            if type_:
                assert repr(type_) in put.text
                assert _post(service.url + PUT_PATH, good, msgpack).status_code == 200
                value = _typed(type_, data, msgpack)
                writes = {"config": config, "writes": [["notes", value]], "task_id": "t"}
                refused = _post(service.url + WRITES_PATH, writes, msgpack)
                assert refused.status_code == 422 and "writes[0].type" in refused.text, refused.text
        # What a stock reader reads is still stored as sent: null, bytes, json.
        for index, stock_type in enumerate(("null", "bytes", "bytearray", "json")):
            value = _typed(stock_type, b"{}" if stock_type == "json" else b"", msgpack)
            writes = {"config": config, "writes": [["notes", value]], "task_id": f"task-{index}"}
            assert _post(service.url + WRITES_PATH, writes, msgpack).status_code == 204
        # So is what EncryptedSerializer writes (its reader decrypts, then reads a stock type).
        encrypted = _put_body({"notes": _typed("msgpack+aes", b"ciphertext", msgpack)})
        encrypted["config"]["configurable"]["thread_id"] = "encrypted"
        assert _post(service.url + PUT_PATH, encrypted, msgpack).status_code == 200
        with RemoteReducingSaver(service.url) as saver:  # a stock reader without its key cannot read it
            saver.delete_thread("encrypted")

    with PostgresSaver.from_conn_string(fresh_pg) as stock:
        stored = list(stock.list(None))
    assert [item.checkpoint["channel_values"] for item in stored] == [{"notes": {"a": 1}}]
    assert [value for _, _, value in stored[0].pending_writes] == [None, b"", bytearray(), {}]


LOOKALIKES = {
    "payload": {"type": INT_TYPE, "data": "MTIz"},  # base64 of "123": the wire's own form of an int
    "as_bytes": [{"type": INT_TYPE, "data": "123"}, {"type": "reducing-saver/literal", "data": {"a": 1}}],
    "other": {"type": "reducing-saver/msgpack", "data": {"type": INT_TYPE, "data": "MTIz"}},
    "big": [10**20, {"type": "msgpack", "data": "x"}],
}


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
@pytest.mark.parametrize("body_format", ["msgpack", "json"])
def test_metadata_shaped_like_the_wire_s_typed_values_reads_back_unchanged(
    body_format, backend, tmp_path, fresh_pg
):
    """``{"type": "reducing-saver/int", "data": "MTIz"}`` in metadata read back as 123; a stock PostgresSaver
    returns the dict."""
    config = {"configurable": {"thread_id": "lookalike", "checkpoint_ns": ""}}
    with PostgresSaver.from_conn_string(fresh_pg) as stock:
        stock.setup()
        stock_config = stock.put(config, empty_checkpoint(), LOOKALIKES, {})
        assert stock.get_tuple(stock_config).metadata == LOOKALIKES
        stock.delete_thread("lookalike")
    database = fresh_pg if backend == "postgres" else f"sqlite:///{tmp_path}/db.sqlite"
    with run_service(tmp_path, "--database", database, "--no-sweep", "--no-extract") as service:
        with RemoteReducingSaver(service.url, body_format=body_format, max_retries=0) as saver:
            put = saver.put(config, empty_checkpoint(), LOOKALIKES, {})
            assert saver.get_tuple(put).metadata == LOOKALIKES
            assert [item.metadata for item in saver.list(None)] == [LOOKALIKES]
    if backend == "postgres":
        with PostgresSaver.from_conn_string(fresh_pg) as stock:
            assert stock.get_tuple(put).metadata == LOOKALIKES


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
def test_the_previous_release_s_typed_ints_still_read_as_ints(msgpack, tmp_path, fresh_pg):
    """A client of the previous release sends big ints in metadata typed, as it always did."""
    body = _put_body({})
    body["config"]["configurable"]["thread_id"] = "old-client"
    body["metadata"] = {
        "big": _typed(INT_TYPE, str(BIG).encode(), msgpack),
        "n": [_typed(INT_TYPE, b"-7", msgpack)],
    }
    with run_service(tmp_path, "--database", fresh_pg, "--no-sweep", "--no-extract") as service:
        assert _post(service.url + PUT_PATH, body, msgpack).status_code == 200
    with PostgresSaver.from_conn_string(fresh_pg) as stock:
        (stored,) = stock.list({"configurable": {"thread_id": "old-client"}})
    assert stored.metadata == {"big": BIG, "n": [-7]}
