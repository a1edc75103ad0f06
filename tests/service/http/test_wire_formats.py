"""The per-step calls' two body formats: what travels, and that both store the same thing.

The service runs in-process (FastAPI's TestClient on the memory backend); a recording httpx transport
in front of it shows the client's requests and the service's answers as they are on the wire.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator

import httpx
import msgpack
import orjson
import ormsgpack
import pytest
from fastapi.testclient import TestClient

from reducing_saver.client import RemoteReducingSaver
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http import msgpack_body
from reducing_saver.service.http.app import create_app
from tests.support.chat import build_chat_graph, human

PER_STEP = {"/v1/checkpoints/get", "/v1/checkpoints/put", "/v1/writes/put"}


class Recorder(httpx.BaseTransport):
    """Passes requests to the in-process service and keeps (path, request content type, answer content type)."""

    def __init__(self, client: TestClient, *, advertise_msgpack: bool = True) -> None:
        self.client = client
        self.advertise_msgpack = advertise_msgpack
        self.seen: list[tuple[str, str, str]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        answer = self.client.request(
            request.method, str(request.url), content=request.read(), headers=dict(request.headers)
        )
        content = answer.content
        if request.url.path == "/v1/capabilities" and not self.advertise_msgpack:
            body = orjson.loads(content)
            del body["body_formats"]  # what a service older than msgpack bodies answers
            content = orjson.dumps(body)
        self.seen.append(
            (
                request.url.path,
                request.headers.get("content-type", ""),
                answer.headers.get("content-type", ""),
            )
        )
        headers = {k: v for k, v in answer.headers.items() if k.lower() != "content-length"}
        return httpx.Response(answer.status_code, content=content, headers=headers)


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = create_app(
        Settings(database="memory://", max_messages=4, min_messages=2, extract=False, sweep=False)
    )
    with TestClient(app) as test_client:
        yield test_client


def _chat(saver: RemoteReducingSaver, thread_id: str, turns: int = 5) -> list:
    graph = build_chat_graph(saver, prefix=thread_id)
    config = {"configurable": {"thread_id": thread_id}}
    for turn in range(turns):
        graph.invoke({"messages": [human(turn, thread_id)]}, config)
    list(saver.list(config, limit=2))
    return graph.get_state(config).values["messages"]


def test_per_step_calls_travel_as_msgpack_and_the_rest_as_json(client: TestClient) -> None:
    recorder = Recorder(client)
    saver = RemoteReducingSaver("http://testserver", transport=recorder)
    assert saver.body_format == "application/msgpack"
    _chat(saver, "mp")
    per_step = [(req, ans) for path, req, ans in recorder.seen if path in PER_STEP]
    others = [(req, ans) for path, req, ans in recorder.seen if path not in PER_STEP]
    assert per_step and {req for req, _ in per_step} == {"application/msgpack"}
    # put and get answer in msgpack; put_writes answers 204 with no body.
    assert {ans for req, ans in per_step} >= {"application/msgpack"}
    assert any(path == "/v1/checkpoints/list" for path, _, _ in recorder.seen)
    assert {ans for _, ans in others} == {"application/json"}


@pytest.mark.parametrize("advertise", [True, False], ids=["asked-for-json", "service-without-msgpack"])
def test_json_when_asked_or_when_the_service_has_no_msgpack(client: TestClient, advertise: bool) -> None:
    recorder = Recorder(client, advertise_msgpack=advertise)
    saver = RemoteReducingSaver(
        "http://testserver", transport=recorder, body_format="json" if advertise else "msgpack"
    )
    assert saver.body_format == "application/json"
    _chat(saver, "js")
    assert {req for path, req, _ in recorder.seen if path in PER_STEP} == {"application/json"}


def test_both_formats_store_the_same_window(client: TestClient) -> None:
    windows = {}
    for body_format in ("msgpack", "json"):
        saver = RemoteReducingSaver("http://testserver", transport=Recorder(client), body_format=body_format)
        windows[body_format] = [(type(m).__name__, m.content) for m in _chat(saver, f"same-{body_format}")]
    strip = [(kind, content.replace("same-msgpack", "X")) for kind, content in windows["msgpack"]]
    assert strip == [(kind, content.replace("same-json", "X")) for kind, content in windows["json"]]
    assert 2 <= len(strip) <= 4


def test_an_unknown_body_format_is_refused(client: TestClient) -> None:
    with pytest.raises(ValueError, match="body_format"):
        RemoteReducingSaver("http://testserver", transport=Recorder(client), body_format="xml")


def test_the_answer_carries_bytes_not_base64(client: TestClient) -> None:
    saver = RemoteReducingSaver("http://testserver", transport=Recorder(client))
    _chat(saver, "raw", turns=1)
    config = {"configurable": {"thread_id": "raw", "checkpoint_ns": ""}}
    answer = client.post(
        "/v1/checkpoints/get",
        content=ormsgpack.packb({"config": config}),
        headers={"content-type": "application/msgpack"},
    )
    assert answer.headers["content-type"] == "application/msgpack"
    blob = ormsgpack.unpackb(answer.content)["checkpoint"]["values"]["messages"]
    assert blob["type"] == "msgpack" and isinstance(blob["data"], bytes)
    as_json = client.post("/v1/checkpoints/get", json={"config": config}).json()["checkpoint"]["values"][
        "messages"
    ]
    assert isinstance(as_json["data"], str) and as_json["data"] != blob["data"]


# -- the decoder ------------------------------------------------------------------------------------

LIMITS = Settings(database="memory://").limits


def test_a_well_formed_body_decodes_to_plain_values() -> None:
    body = {
        "config": {"configurable": {"thread_id": "t", "memory_namespace": ["a", "b"]}},
        "values": {"messages": {"type": "msgpack", "data": b"\x90"}, "count": 3, "ratio": 0.5},
        "metadata": {"step": -1, "parents": {}, "ok": True, "none": None},
    }
    assert msgpack_body.decode(ormsgpack.packb(body), LIMITS) == body


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (msgpack.packb({"a": msgpack.ExtType(0, b"x")}), "extension (code 0)"),
        (msgpack.packb([msgpack.ExtType(5, b"x")]), "extension (code 5)"),
        (b"\x82\xa1a\x01\xa1a\x02", "repeats the key 'a'"),
        (b"\x81\x01\x02", "map key"),
        (msgpack.packb({"metadata": {"x": b"raw"}}), "bytes under 'x'"),
        (msgpack.packb({"writes": [b"raw"]}), "bytes in an array"),
        (msgpack.packb({"data": b"raw", "type": "t", "extra": 1}), "exactly 'type' and 'data'"),
        (msgpack.packb({"x": math.nan}), "floats must be finite"),
        (msgpack.packb([math.inf]), "floats must be finite"),
        (msgpack.packb({"a": 1})[:-1], "not valid msgpack"),
        (msgpack.packb({"a": 1}) + b"\x00", "after its msgpack value"),
        (b"\xa2\xff\xfe", "not UTF-8"),
        (b"\x91" * 40 + b"\x01", "nests 40 levels"),
        (b"\x91" * 2000 + b"\x01", "nests >1024 levels"),
    ],
)
def test_the_decoder_refuses_with_the_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(msgpack_body.MsgpackBodyError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        msgpack_body.decode(raw, LIMITS)


def test_a_refused_msgpack_body_stores_nothing_and_is_answered_in_json(client: TestClient) -> None:
    thread = f"refused-{uuid.uuid4().hex[:8]}"
    body = {
        "config": {"configurable": {"thread_id": thread, "checkpoint_ns": ""}},
        "checkpoint": {
            "v": 4,
            "id": str(uuid.uuid4()),
            "ts": "2026-12-01T00:00:00+00:00",
            "channel_versions": {"messages": "1"},
            "versions_seen": {},
        },
        "values": {"messages": {"type": "msgpack", "data": b"\x90"}},
        "metadata": {"x": msgpack.ExtType(0, msgpack.packb(("os", "system", "true")))},
        "new_versions": {"messages": "1"},
    }
    answer = client.post(
        "/v1/checkpoints/put", content=msgpack.packb(body), headers={"content-type": "application/msgpack"}
    )
    assert answer.status_code == 422 and answer.headers["content-type"] == "application/json"
    assert "extension (code 0)" in answer.json()["detail"][0]["msg"]
    got = client.post("/v1/checkpoints/get", json={"config": body["config"]}).json()
    assert got == {"checkpoint": None}


# -- metadata: the wire's own typed values, and user objects shaped like them -------------------------

_SHAPES = [
    {"type": "reducing-saver/int", "data": "MTIz"},
    {"type": "reducing-saver/literal", "data": {"type": "reducing-saver/int", "data": "MTIz"}},
    {"type": "reducing-saver/literal", "data": 5},
    {"type": "reducing-saver/whatever", "data": [1, {"type": "reducing-saver/int", "data": "12"}]},
    {"type": "msgpack", "data": "MTIz"},
    {"type": "reducing-saver/int", "data": "MTIz", "more": 1},
]


@pytest.mark.parametrize("shape", _SHAPES, ids=range(len(_SHAPES)))
@pytest.mark.parametrize("body", ["json", "msgpack"])
def test_metadata_of_any_shape_travels_unchanged(shape, body):
    from reducing_saver.wire import ints_from_wire, ints_to_wire, json_default, msgpack_default

    value = {"user": shape, "list": [shape, 10**20, -(2**70), 3], "big": 10**25}
    wire = ints_to_wire(value)
    if body == "json":
        arrived = orjson.loads(orjson.dumps(wire, default=json_default))
    else:
        arrived = ormsgpack.unpackb(ormsgpack.packb(wire, default=msgpack_default))
    assert ints_from_wire(arrived, "metadata") == value
    assert ints_to_wire({"plain": [1, "x"]}) == {"plain": [1, "x"]}


def test_metadata_without_typed_values_is_read_as_it_is_and_typed_ones_anywhere_are_found():
    from reducing_saver.wire import INT_TYPE, WireError, ints_from_wire, ints_to_wire, json_default

    plain = {"parents": {}, "source": "loop", "step": 4, "nested": [{"a": [1, {"type": "x", "data": 2}]}]}
    assert ints_from_wire(plain, "metadata") is plain
    deep = {"a": [{"b": [10**20]}], "c": 1, "d": {"type": INT_TYPE, "data": "a look-alike"}}
    wire = ints_to_wire(deep)
    assert wire != deep
    assert ints_from_wire(orjson.loads(orjson.dumps(wire, default=json_default)), "metadata") == deep
    with pytest.raises(WireError) as error:
        ints_from_wire({"a": [{"b": {"type": INT_TYPE, "data": "MXg="}}]}, "metadata")
    assert "metadata.a[0].b" in str(error.value)
