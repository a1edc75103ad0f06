"""RemoteReducingSaver without a server: httpx.MockTransport plays the service."""

from __future__ import annotations

import base64
import inspect
import math
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.checkpoint.base import BaseCheckpointSaver, CheckpointTuple
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import (
    ALL_CAPABILITIES,
    BASE_CAPABILITIES,
    Capability,
    DetectedCapabilities,
)
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

import reducing_saver.client
from reducing_saver.client import (
    AuthenticationError,
    BadRequestError,
    CheckpointPrunedError,
    ConflictError,
    DatabaseTimeoutError,
    NotFoundError,
    PayloadTooLargeError,
    ReducingSaverError,
    RemoteReducer,
    RemoteReducingSaver,
    RemoteStore,
    RequestTimeoutError,
    ServerUnavailableError,
)
from reducing_saver.client import _transport as transport_errors
from reducing_saver.wire import DATABASE_TIMEOUT, Blob, channel_value_from_wire, is_inline
from reducing_saver.wire.capabilities import OPTIONAL_CAPABILITIES, saver_capabilities

URL = "http://reducing-saver.test"
ALL_FOUR = sorted(OPTIONAL_CAPABILITIES)
SERDE = JsonPlusSerializer()

Handler = Callable[[httpx.Request], httpx.Response]


class FakeService:
    """A tiny in-memory reducing-saver service: stores what the client sends, as the real backends do.

    ``postgres``/``memory``: a checkpoint row plus one blob per (channel, version) for the channels in
    ``new_versions``; ``sqlite``: the whole checkpoint. ``override`` answers (or raises) instead of
    the store for every request but the capabilities one.
    """

    def __init__(self, capabilities: Iterable[str] = (), backend: str = "postgres") -> None:
        self.info = {
            "capabilities": list(capabilities),
            "backend": backend,
            "messages_key": "messages",
            "reducer": {
                "max_messages": 6,
                "min_messages": 4,
                "max_tokens": None,
                "target_tokens": None,
                "preserve_first": True,
                "cascade_tool_messages": True,
                "start_on": "human",
                "namespace_key": "memory_namespace",
            },
            "version": "0.1.0",
        }
        self.requests: list[httpx.Request] = []
        self.override: Handler | None = None
        self.rows: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        self.blobs: dict[tuple[str, str, str, Any], Any] = {}
        self.writes: dict[tuple[str, str, str], list[list[Any]]] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path == "/v1/capabilities":
            return httpx.Response(200, json=self.info)
        if self.override is not None:
            return self.override(request)
        body = orjson.loads(request.content)
        route = getattr(self, "_" + request.url.path.removeprefix("/v1/").replace("/", "_").replace("-", "_"))
        result = route(body)
        return httpx.Response(204) if result is None else httpx.Response(200, content=orjson.dumps(result))

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [orjson.loads(r.content) for r in self.requests if r.url.path == "/v1" + path]

    def count(self, path: str) -> int:
        return sum(r.url.path == "/v1" + path for r in self.requests)

    @staticmethod
    def _key(config: dict[str, Any]) -> tuple[str, str]:
        configurable = config["configurable"]
        return configurable["thread_id"], configurable.get("checkpoint_ns", "")

    def _checkpoints_put(self, body: dict[str, Any]) -> dict[str, Any]:
        thread_id, ns = self._key(body["config"])
        checkpoint = body["checkpoint"]
        row = {
            "checkpoint": checkpoint,
            "metadata": body["metadata"],
            "parent": body["config"]["configurable"].get("checkpoint_id"),
        }
        if self.info["backend"] == "sqlite":
            row["values"] = body["values"]
        else:
            for channel, version in body["new_versions"].items():
                if channel in body["values"]:
                    self.blobs[(thread_id, ns, channel, version)] = body["values"][channel]
        self.rows.setdefault((thread_id, ns), {})[checkpoint["id"]] = row
        return {
            "config": {
                "configurable": {
                    "thread_id": thread_id,
                    "checkpoint_ns": ns,
                    "checkpoint_id": checkpoint["id"],
                }
            }
        }

    def _tuple(self, thread_id: str, ns: str, checkpoint_id: str) -> dict[str, Any]:
        row = self.rows[(thread_id, ns)][checkpoint_id]
        if "values" in row:
            values = row["values"]
        else:
            values = {
                channel: self.blobs[(thread_id, ns, channel, version)]
                for channel, version in row["checkpoint"]["channel_versions"].items()
                if (thread_id, ns, channel, version) in self.blobs
            }
        parent = row["parent"]
        return {
            "config": {
                "configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": checkpoint_id}
            },
            "checkpoint": row["checkpoint"],
            "values": values,
            "metadata": row["metadata"],
            "parent_config": None
            if parent is None
            else {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": parent}},
            "pending_writes": self.writes.get((thread_id, ns, checkpoint_id), []),
        }

    def _checkpoints_get(self, body: dict[str, Any]) -> dict[str, Any]:
        thread_id, ns = self._key(body["config"])
        rows = self.rows.get((thread_id, ns), {})
        checkpoint_id = body["config"]["configurable"].get("checkpoint_id") or max(rows, default=None)
        if checkpoint_id not in rows:
            return {"checkpoint": None}
        return {"checkpoint": self._tuple(thread_id, ns, checkpoint_id)}

    def _checkpoints_list(self, body: dict[str, Any]) -> dict[str, Any]:
        thread_id, ns = self._key(body["config"])
        ids = sorted(self.rows.get((thread_id, ns), {}), reverse=True)[: body["limit"]]
        return {"checkpoints": [self._tuple(thread_id, ns, i) for i in ids]}

    def _writes_put(self, body: dict[str, Any]) -> None:
        thread_id, ns = self._key(body["config"])
        stored = self.writes.setdefault((thread_id, ns, body["config"]["configurable"]["checkpoint_id"]), [])
        stored.extend([body["task_id"], channel, value] for channel, value in body["writes"])

    def _threads_delete(self, body: dict[str, Any]) -> None:
        for key in [k for k in self.rows if k[0] == body["thread_id"]]:
            del self.rows[key]

    def _threads_copy(self, body: dict[str, Any]) -> None:
        return None

    def _threads_prune(self, body: dict[str, Any]) -> None:
        return None

    def _runs_delete(self, body: dict[str, Any]) -> None:
        return None


def make_saver(service: Handler, **options: Any) -> RemoteReducingSaver:
    transport = httpx.MockTransport(service)
    options.setdefault("backoff", 0)
    return RemoteReducingSaver(URL, transport=transport, async_transport=transport, **options)


def typed(value: Any) -> dict[str, str]:
    type_, data = SERDE.dumps_typed(value)
    return {"type": type_, "data": base64.b64encode(data).decode()}


def make_checkpoint(checkpoint_id: str, values: dict[str, Any], versions: dict[str, str]) -> dict[str, Any]:
    return {
        "v": 4,
        "id": checkpoint_id,
        "ts": "2025-01-01T00:00:00+00:00",
        "channel_values": values,
        "channel_versions": versions,
        "versions_seen": {},
        "updated_channels": None,
    }


def config(thread_id: str = "t1", checkpoint_id: str | None = None) -> dict[str, Any]:
    configurable = {"thread_id": thread_id, "checkpoint_ns": ""}
    if checkpoint_id:
        configurable["checkpoint_id"] = checkpoint_id
    return {"configurable": configurable}


def failing_with(status: int, detail: Any = "it broke", request_id: str | None = "req-42") -> Handler:
    headers = {"X-Request-ID": request_id} if request_id else {}
    return lambda request: httpx.Response(status, json={"detail": detail}, headers=headers)


def raising(exc: Exception) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    return handler


def sequence(*handlers: Handler) -> Handler:
    """Answer the n-th request with the n-th handler (the last one repeats)."""
    queue = list(handlers)

    def handler(request: httpx.Request) -> httpx.Response:
        return (queue.pop(0) if len(queue) > 1 else queue[0])(request)

    return handler


# -- errors -----------------------------------------------------------------------------------------


STATUS_TABLE = [
    (400, BadRequestError),
    (401, AuthenticationError),
    (403, AuthenticationError),
    (404, NotFoundError),
    (409, ConflictError),
    (410, CheckpointPrunedError),
    (413, PayloadTooLargeError),
    (422, BadRequestError),
    (500, ServerUnavailableError),
    (502, ServerUnavailableError),
    (503, ServerUnavailableError),
    (504, ServerUnavailableError),
]


@pytest.mark.parametrize(("status", "error"), STATUS_TABLE)
def test_status_maps_to_exception_sync(status: int, error: type[ReducingSaverError]) -> None:
    service = FakeService()
    saver = make_saver(service, max_retries=0)
    service.override = failing_with(status, "thread 't1' is on fire")
    with pytest.raises(error) as info:
        saver.get_tuple(config())
    assert type(info.value) is error
    assert "thread 't1' is on fire" in str(info.value)
    assert info.value.status_code == status
    assert info.value.request_id == "req-42"
    assert "req-42" in str(info.value)


@pytest.mark.parametrize(("status", "error"), STATUS_TABLE)
async def test_status_maps_to_exception_async(status: int, error: type[ReducingSaverError]) -> None:
    service = FakeService()
    saver = make_saver(service, max_retries=0)
    service.override = failing_with(status, "thread 't1' is on fire")
    with pytest.raises(error) as info:
        await saver.aput_writes(config(checkpoint_id="c1"), [("x", 1)], "task")
    assert type(info.value) is error
    assert "thread 't1' is on fire" in str(info.value)
    assert (info.value.status_code, info.value.request_id) == (status, "req-42")
    await saver.aclose()


def test_validation_errors_render_loc_and_msg() -> None:
    service = FakeService()
    saver = make_saver(service)
    service.override = failing_with(
        422,
        [
            {"type": "missing", "loc": ["body", "config", "thread_id"], "msg": "Field required", "input": {}},
            {"type": "extra_forbidden", "loc": ["body", "colour"], "msg": "Extra inputs are not permitted"},
        ],
        request_id=None,
    )
    with pytest.raises(BadRequestError) as info:
        saver.delete_thread("t1")
    message = str(info.value)
    assert "body.config.thread_id: Field required" in message
    assert "body.colour: Extra inputs are not permitted" in message
    assert info.value.request_id is None


def test_non_json_error_body_is_quoted() -> None:
    service = FakeService()
    saver = make_saver(service, max_retries=0)
    service.override = lambda request: httpx.Response(502, text="<html>upstream gone</html>")
    with pytest.raises(ServerUnavailableError, match="upstream gone"):
        saver.get_tuple(config())


def test_other_statuses_raise_the_root_error() -> None:
    service = FakeService()
    saver = make_saver(service)
    service.override = failing_with(429, "slow down")
    with pytest.raises(ReducingSaverError, match="slow down") as info:
        saver.get_tuple(config())
    assert type(info.value) is ReducingSaverError


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(200, json={"hello": "world"}),
        httpx.Response(200),
        httpx.Response(200, content=b"\xc1", headers={"content-type": "application/msgpack"}),
        httpx.Response(200, content=b"\x81\xa1a\x01", headers={"content-type": "application/msgpack"}),
    ],
    ids=["other-json", "empty", "bad-msgpack", "other-msgpack"],
)
def test_answer_that_is_not_the_api_is_reported(answer: httpx.Response) -> None:
    service = FakeService()
    saver = make_saver(service)
    service.override = lambda request: answer
    with pytest.raises(ReducingSaverError, match="does not follow the reducing-saver API"):
        saver.get_tuple(config())


def test_a_value_the_client_cannot_read_is_reported_as_such() -> None:
    """The answer is the service's; one value in it has a malformed wire form: say that, not "wrong URL"."""
    service = FakeService()
    saver = make_saver(service)
    saver.put(config(), make_checkpoint("c1", {"big": 2**70}, {"big": "1"}), {}, {"big": "1"})
    (key,) = service.blobs
    service.blobs[key] = {"type": "reducing-saver/int", "data": base64.b64encode(b"12x").decode()}
    with pytest.raises(ReducingSaverError) as caught:
        saver.get_tuple(config())
    message = str(caught.value)
    assert "cannot read" in message and "values.big" in message, message
    assert "is the URL" not in message


def test_constructor_raises_when_capabilities_fail() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"detail": "missing API key"})

    with pytest.raises(AuthenticationError, match="missing API key"):
        make_saver(refuse)


class _MySaver(RemoteReducingSaver):
    pass


class _MyStore(RemoteStore):
    pass


@pytest.mark.parametrize("cls", [RemoteReducingSaver, RemoteStore, _MySaver, _MyStore])
def test_non_http_url_is_refused_naming_the_class_constructed(cls: type) -> None:
    with pytest.raises(ValueError, match="http:// or https://") as info:
        cls("postgresql://user:hunter2@db/app")
    assert str(info.value).startswith(f"{cls.__name__} needs the service's http:// or https:// URL")
    assert "hunter2" not in str(info.value)


# -- retries and timeouts ---------------------------------------------------------------------------


def test_503_twice_then_success_is_retried() -> None:
    service = FakeService()
    saver = make_saver(service, max_retries=3)
    service.override = sequence(
        failing_with(503), failing_with(503), lambda request: httpx.Response(200, json={"checkpoint": None})
    )
    assert saver.get_tuple(config()) is None
    assert service.count("/checkpoints/get") == 3


async def test_503_twice_then_success_is_retried_async() -> None:
    service = FakeService()
    saver = make_saver(service, max_retries=3)
    service.override = sequence(failing_with(502), failing_with(504), lambda request: httpx.Response(204))
    await saver.adelete_thread("t1")
    assert service.count("/threads/delete") == 3
    await saver.aclose()


def database_timeout(request: httpx.Request) -> httpx.Response:
    """The service's own 504: its database cancelled the statement (statement_timeout)."""
    body = {
        "detail": "the database cancelled the statement: canceling statement due to statement timeout",
        "code": DATABASE_TIMEOUT,
    }
    return httpx.Response(504, json=body, headers={"X-Request-ID": "req-7"})


def test_the_services_database_timeout_is_raised_at_once_not_retried() -> None:
    service = FakeService()
    saver = make_saver(service, max_retries=3)
    service.override = database_timeout
    with pytest.raises(DatabaseTimeoutError) as info:
        saver.list(config()).__next__()
    assert service.count("/checkpoints/list") == 1
    assert info.value.status_code == 504 and info.value.request_id == "req-7"
    assert "statement timeout" in str(info.value)


async def test_the_services_database_timeout_is_raised_at_once_not_retried_async() -> None:
    service = FakeService()
    saver = make_saver(service, max_retries=3)
    service.override = database_timeout
    with pytest.raises(DatabaseTimeoutError):
        await saver.aget_tuple(config())
    assert service.count("/checkpoints/get") == 1
    await saver.aclose()


def test_a_504_without_the_services_code_is_a_proxys_and_retried() -> None:
    service = FakeService()
    saver = make_saver(service, max_retries=3)
    gateway = lambda request: httpx.Response(504, text="<html>504 Gateway Time-out</html>")  # noqa: E731
    service.override = sequence(
        gateway, failing_with(504), lambda request: httpx.Response(200, json={"checkpoint": None})
    )
    assert saver.get_tuple(config()) is None
    assert service.count("/checkpoints/get") == 3


def test_retries_stop_at_max_retries_with_growing_delays(monkeypatch: pytest.MonkeyPatch) -> None:
    delays: list[float] = []
    monkeypatch.setattr("reducing_saver.client._http.time.sleep", delays.append)
    service = FakeService()
    saver = make_saver(service, max_retries=3, backoff=0.1, retry_unavailable_for=0)
    service.override = failing_with(503)
    with pytest.raises(ServerUnavailableError):
        saver.get_tuple(config())
    assert service.count("/checkpoints/get") == 4
    assert len(delays) == 3
    for attempt, delay in enumerate(delays):
        assert 0.1 * 2**attempt * 0.5 <= delay <= 0.1 * 2**attempt


class FakeClock:
    """``time.monotonic`` and ``time.sleep`` of the client: sleeping moves the clock."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.delays: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, delay: float) -> None:
        self.delays.append(delay)
        self.now += delay


def test_503_is_retried_for_the_time_budget_past_max_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    # A database restart answers 503 for seconds: three retries a few tenths of a second apart would
    # give up long before it is back.
    clock = FakeClock()
    monkeypatch.setattr("reducing_saver.client._http.time", clock)
    service = FakeService()
    saver = make_saver(service, max_retries=3, backoff=0.1, retry_unavailable_for=20.0)
    service.override = failing_with(503)
    with pytest.raises(ServerUnavailableError):
        saver.get_tuple(config())
    assert service.count("/checkpoints/get") > 10
    assert sum(clock.delays) <= 20.0
    assert sum(clock.delays) > 20.0 - 2.0  # stops only when the next wait would pass the budget
    assert max(clock.delays) <= 2.0
    # Within the budget, the call goes through once the service answers again.
    clock.delays.clear()
    answers = [*[failing_with(503)] * 12, lambda request: httpx.Response(200, json={"checkpoint": None})]
    service.override = sequence(*answers)
    assert saver.get_tuple(config()) is None
    assert len(clock.delays) == 12


@pytest.mark.parametrize(
    "exc",
    [
        httpx.ConnectError("[Errno 111] Connection refused"),
        httpx.ReadError("[Errno 104] Connection reset by peer"),
        httpx.RemoteProtocolError("Server disconnected without sending a response."),
    ],
)
def test_a_restarting_service_is_retried_for_the_time_budget(
    exc: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A restart refuses connections, and resets those it had, for seconds: as long as a 503.
    clock = FakeClock()
    monkeypatch.setattr("reducing_saver.client._http.time", clock)
    service = FakeService()
    saver = make_saver(service, max_retries=3, backoff=0.1, retry_unavailable_for=20.0)
    service.override = raising(exc)
    with pytest.raises(ServerUnavailableError):
        saver.get_tuple(config())
    assert service.count("/checkpoints/get") > 10
    assert 20.0 - 2.0 < sum(clock.delays) <= 20.0 and max(clock.delays) <= 2.0


def test_the_time_budget_applies_to_503_only(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr("reducing_saver.client._http.time", clock)
    service = FakeService()
    saver = make_saver(service, max_retries=2, retry_unavailable_for=60.0)
    service.override = failing_with(502)
    with pytest.raises(ServerUnavailableError):
        saver.get_tuple(config())
    assert service.count("/checkpoints/get") == 3


@pytest.mark.parametrize("api", ["sync", "async"])
async def test_retry_after_sets_a_floor_on_the_delay(api: str, monkeypatch: pytest.MonkeyPatch) -> None:
    delays: list[float] = []

    async def asleep(delay: float) -> None:
        delays.append(delay)

    monkeypatch.setattr("reducing_saver.client._http.time.sleep", delays.append)
    monkeypatch.setattr("reducing_saver.client._http.asyncio.sleep", asleep)
    service = FakeService()
    saver = make_saver(service, max_retries=3)
    service.override = sequence(
        lambda request: httpx.Response(503, headers={"Retry-After": "2"}),
        lambda request: httpx.Response(503, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}),
        lambda request: httpx.Response(200, json={"checkpoint": None}),
    )
    assert (saver.get_tuple(config()) if api == "sync" else await saver.aget_tuple(config())) is None
    assert delays == [2.0, 0.0]  # backoff=0: the header alone; a date is not parsed
    await saver.aclose()


def test_copy_thread_is_not_retried() -> None:
    service = FakeService(capabilities=["copy_thread"])
    saver = make_saver(service, max_retries=3)
    service.override = failing_with(503)
    with pytest.raises(ServerUnavailableError):
        saver.copy_thread("a", "b")
    assert service.count("/threads/copy") == 1


async def test_copy_thread_is_not_retried_async() -> None:
    service = FakeService(capabilities=["copy_thread"])
    saver = make_saver(service, max_retries=3)
    service.override = raising(httpx.ConnectError("connection refused"))
    with pytest.raises(ServerUnavailableError):
        await saver.acopy_thread("a", "b")
    assert service.count("/threads/copy") == 1
    await saver.aclose()


def test_connection_error_is_retried_then_raised() -> None:
    service = FakeService()
    saver = make_saver(service, max_retries=2, retry_unavailable_for=0)
    service.override = raising(httpx.ConnectError("connection refused"))
    with pytest.raises(ServerUnavailableError, match="could not reach the service") as info:
        saver.put_writes(config(checkpoint_id="c1"), [("x", 1)], "task")
    # The client's own transport error, mapped from httpx's at the transport boundary.
    assert isinstance(info.value.__cause__, transport_errors.ConnectError)
    assert isinstance(info.value.__cause__.__cause__, httpx.ConnectError)
    assert info.value.status_code is None
    assert service.count("/writes/put") == 3


async def test_connection_error_is_retried_then_raised_async() -> None:
    service = FakeService()
    saver = make_saver(service, max_retries=2, retry_unavailable_for=0)
    service.override = raising(httpx.RemoteProtocolError("Server disconnected without sending a response."))
    with pytest.raises(ServerUnavailableError):
        await saver.aget_tuple(config())
    assert service.count("/checkpoints/get") == 3
    await saver.aclose()


@pytest.mark.parametrize(
    "exc", [httpx.ReadTimeout("read timed out"), httpx.ConnectTimeout("connect timed out")]
)
def test_timeout_raises_request_timeout_error(exc: httpx.TimeoutException) -> None:
    service = FakeService()
    saver = make_saver(service, max_retries=3)
    service.override = raising(exc)
    with pytest.raises(RequestTimeoutError, match="did not answer in time") as info:
        saver.get_tuple(config())
    assert info.value.__cause__.__cause__ is exc
    assert service.count("/checkpoints/get") == 1


async def test_timeout_raises_request_timeout_error_async() -> None:
    service = FakeService()
    saver = make_saver(service)
    service.override = raising(httpx.WriteTimeout("write timed out"))
    with pytest.raises(RequestTimeoutError):
        await saver.aput(config(), make_checkpoint("c1", {}, {}), {}, {})
    await saver.aclose()


def test_connection_broken_while_sending_a_large_body_is_payload_too_large() -> None:
    service = FakeService()
    saver = make_saver(service, max_retries=3, retry_unavailable_for=0)
    service.override = raising(httpx.WriteError("[Errno 104] Connection reset by peer"))
    big = make_checkpoint("c1", {"blob": "x" * (2 * 1024 * 1024)}, {"blob": "1"})
    with pytest.raises(PayloadTooLargeError, match="closed the connection") as info:
        saver.put(config(), big, {}, {"blob": "1"})
    assert isinstance(info.value.__cause__, transport_errors.WriteError)
    assert service.count("/checkpoints/put") == 1
    # The same break on a small body is an ordinary connection failure, retried.
    with pytest.raises(ServerUnavailableError):
        saver.put(config(), make_checkpoint("c2", {}, {}), {}, {})
    assert service.count("/checkpoints/put") == 1 + 4


# -- capability variants ----------------------------------------------------------------------------


def test_no_capabilities_variant_overrides_only_the_base_methods() -> None:
    saver = make_saver(FakeService(capabilities=[]))
    assert type(saver) is RemoteReducingSaver
    assert DetectedCapabilities.from_instance(saver).detected == BASE_CAPABILITIES
    assert saver_capabilities(saver) == frozenset()
    assert type(saver).aget_delta_channel_history is BaseCheckpointSaver.aget_delta_channel_history


def test_all_capabilities_variant_overrides_exactly_those_methods() -> None:
    saver = make_saver(FakeService(capabilities=ALL_FOUR))
    assert isinstance(saver, RemoteReducingSaver)
    assert type(saver).__name__ == "RemoteReducingSaver"
    assert DetectedCapabilities.from_instance(saver).detected == ALL_CAPABILITIES
    assert saver_capabilities(saver) == frozenset(ALL_FOUR) == saver.capabilities
    assert type(saver).aget_delta_channel_history is not BaseCheckpointSaver.aget_delta_channel_history


def test_one_capability_variant_and_unknown_names_are_ignored() -> None:
    saver = make_saver(FakeService(capabilities=["prune", "ttl_sweeps_from_the_future"]))
    assert DetectedCapabilities.from_instance(saver).detected == BASE_CAPABILITIES | {Capability.PRUNE}
    assert saver.capabilities == frozenset({"prune"})


def test_optional_calls_send_their_bodies() -> None:
    service = FakeService(capabilities=ALL_FOUR)
    saver = make_saver(service)
    saver.copy_thread("src", "dst")
    saver.prune(["t1", "t2"], strategy="delete")
    saver.delete_for_runs(["r1"])
    assert service.bodies("/threads/copy") == [{"source_thread_id": "src", "target_thread_id": "dst"}]
    assert service.bodies("/threads/prune") == [{"thread_ids": ["t1", "t2"], "strategy": "delete"}]
    assert service.bodies("/runs/delete") == [{"run_ids": ["r1"]}]


async def test_delta_channel_history_decodes_writes_and_seed() -> None:
    service = FakeService(capabilities=["delta_channel_history"])
    saver = make_saver(service)
    message = AIMessage("hi", id="m1")
    answer = {
        "channels": {
            "messages": {
                "writes": [["task-1", "messages", typed([message])]],
                "seed": typed([HumanMessage("q")]),
            },
            "other": {"writes": []},
        }
    }
    service.override = lambda request: httpx.Response(200, json=answer)
    for history in (
        saver.get_delta_channel_history(config=config(checkpoint_id="c2"), channels=["messages", "other"]),
        await saver.aget_delta_channel_history(
            config=config(checkpoint_id="c2"), channels=["messages", "other"]
        ),
    ):
        assert history["messages"] == {
            "writes": [("task-1", "messages", [message])],
            "seed": [HumanMessage("q")],
        }
        assert history["other"] == {"writes": []}
    assert service.bodies("/checkpoints/delta-history")[0]["channels"] == ["messages", "other"]
    requests = len(service.requests)
    assert saver.get_delta_channel_history(config=config(), channels=[]) == {}
    assert len(service.requests) == requests
    await saver.aclose()


# -- API shape ----------------------------------------------------------------------------------------


def test_every_public_sync_method_has_an_async_twin_with_the_same_parameters() -> None:
    saver_type = type(make_saver(FakeService(capabilities=ALL_FOUR)))
    public = {
        name: getattr(saver_type, name)
        for name in dir(saver_type)
        if not name.startswith("_") and inspect.isfunction(getattr(saver_type, name))
    }
    sync_only = {"get_next_version", "with_allowlist"}  # local, no I/O
    sync_names = {name for name in public if f"a{name}" in public} | {
        name for name in public if not (name.startswith("a") and name[1:] in public)
    }
    sync_names -= sync_only
    assert {"get_tuple", "list", "put", "put_writes", "delete_thread", "copy_thread", "prune"} <= sync_names
    assert "get_delta_channel_history" in sync_names and "delete_for_runs" in sync_names
    for name in sorted(sync_names):
        twin = public.get(f"a{name}")
        assert twin is not None, f"{name} has no async twin"
        assert inspect.iscoroutinefunction(twin) or inspect.isasyncgenfunction(twin), name
        sync_params = list(inspect.signature(public[name]).parameters.values())
        async_params = list(inspect.signature(twin).parameters.values())
        assert sync_params == async_params, name


def test_public_surface_is_pinned() -> None:
    assert sorted(reducing_saver.client.__all__) == sorted(
        [
            "AuthenticationError",
            "BadRequestError",
            "CheckpointPrunedError",
            "ConflictError",
            "ConnectionSetupError",
            "DatabaseTimeoutError",
            "NotFoundError",
            "PayloadTooLargeError",
            "ReducingSaverError",
            "RemoteReducer",
            "RemoteReducingSaver",
            "RemoteStore",
            "RequestTimeoutError",
            "SafeJsonPlusSerializer",
            "ServerUnavailableError",
            "__version__",
            "decode_memory_value",
        ]
    )
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", reducing_saver.client.__version__)
    # Read once, in wire, for both sides.
    from reducing_saver.service.version import __version__ as service_version
    from reducing_saver.wire.version import __version__ as wire_version

    assert reducing_saver.client.__version__ is wire_version is service_version
    for error in (BadRequestError, AuthenticationError, PayloadTooLargeError, RequestTimeoutError):
        assert issubclass(error, ReducingSaverError)


def test_importing_the_client_imports_no_server_dependencies() -> None:
    code = (
        "import sys, reducing_saver.client\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('fastapi', 'starlette', 'uvicorn', 'psycopg', 'psycopg_pool', 'reducing_saver'))\n"
        "bad = [m for m in bad if not m.startswith(('reducing_saver.client', 'reducing_saver.wire')) and m != 'reducing_saver']\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr  # the child's assert names the modules it found


def test_reducer_describes_the_remote_config_and_blocks_a_second_reducer() -> None:
    from reducing_saver.reducer import MessageReducer, ReducingSaver

    saver = make_saver(FakeService())
    assert saver.reducer == RemoteReducer(
        max_messages=6,
        min_messages=4,
        max_tokens=None,
        target_tokens=None,
        preserve_first=True,
        cascade_tool_messages=True,
        start_on="human",
        namespace_key="memory_namespace",
    )
    assert (saver.backend, saver.messages_key, saver.server_version) == ("postgres", "messages", "0.1.0")
    with pytest.raises(ValueError, match="different reducer"):
        ReducingSaver(saver, MessageReducer(max_messages=10))


def test_with_allowlist_clones_without_a_request() -> None:
    service = FakeService(capabilities=["prune"])
    strict = JsonPlusSerializer(allowed_msgpack_modules=[("datetime", "datetime")])
    saver = make_saver(service, serde=strict)
    requests = len(service.requests)
    clone = saver.with_allowlist({("my_module", "MyType")})
    assert type(clone) is type(saver)
    assert clone is not saver and clone.serde is not saver.serde
    assert clone._http is saver._http
    assert len(service.requests) == requests


# -- versions -----------------------------------------------------------------------------------------


def test_get_next_version_is_local_monotonic_and_in_the_in_memory_format() -> None:
    service = FakeService()
    saver = make_saver(service)
    requests = len(service.requests)
    reference = InMemorySaver()
    versions = [saver.get_next_version(None, None)]
    for _ in range(200):
        versions.append(saver.get_next_version(versions[-1], None))
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    for previous, version in zip([None, *versions], versions, strict=False):
        assert re.fullmatch(r"\d{32}\.\d+\.\d+(e-\d+)?", version), version
        assert version.split(".")[0] == reference.get_next_version(previous, None).split(".")[0]
    assert saver.get_next_version(7, None).startswith(f"{8:032}.")
    assert len(service.requests) == requests


# -- the wire ------------------------------------------------------------------------------------------


MESSAGES_1 = [SystemMessage("be brief", id="s"), HumanMessage("what time is it?", id="h1")]
MESSAGES_2 = [
    *MESSAGES_1,
    AIMessage(
        "",
        id="a1",
        tool_calls=[{"name": "clock", "args": {"tz": "UTC"}, "id": "call-1", "type": "tool_call"}],
    ),
    ToolMessage("12:00", tool_call_id="call-1", id="t1"),
    AIMessage("It is noon.", id="a2"),
]
WHEN = datetime(2025, 5, 17, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize("backend", ["postgres", "memory", "sqlite"])
def test_put_sends_only_what_the_backend_stores(backend: str) -> None:
    service = FakeService(backend=backend)
    saver = make_saver(service)
    values = {"messages": MESSAGES_1, "count": 3, "name": "x", "ratio": 0.5, "flag": None, "items": ["a"]}
    checkpoint = make_checkpoint("c1", values, {ch: "1" for ch in values})
    saver.put(config(), checkpoint, {"source": "loop", "step": 1}, {"messages": "1", "count": "1"})
    sent = service.bodies("/checkpoints/put")[0]
    # InMemorySaver stores only channels in new_versions; PostgresSaver also keeps every primitive value
    # inline in each checkpoint row; SqliteSaver stores the whole checkpoint.
    expected = {
        "memory": {"messages", "count"},
        "postgres": {"messages", "count", "name", "ratio", "flag"},
        "sqlite": set(values),
    }[backend]
    assert set(sent["values"]) == expected
    assert sent["new_versions"] == {"messages": "1", "count": "1"}
    assert "channel_values" not in sent["checkpoint"]
    assert sent["checkpoint"]["channel_versions"] == checkpoint["channel_versions"]
    assert sent["metadata"] == {"source": "loop", "step": 1}


EVERY = {"messages", "count", "name", "ratio", "flag", "items"}


@pytest.mark.parametrize(
    ("backend", "stored_values", "expected"),
    [
        # What the service says wins over its backend's name (a new backend, a saver that changed).
        ("postgres", "all", EVERY),
        ("sqlite", "changed", {"messages", "count"}),
        ("sqlite", "changed_and_inline", {"messages", "count", "name", "ratio", "flag"}),
        ("another", "changed", {"messages", "count"}),
        # A rule this client does not know: every value travels (the service stores what it needs).
        ("memory", "a-newer-rule", EVERY),
        # No rule (a service before it said one) and a backend this client does not know: every value too.
        ("another", None, EVERY),
    ],
)
def test_put_sends_what_the_service_says_it_stores(
    backend: str, stored_values: str | None, expected: set
) -> None:
    service = FakeService(backend=backend)
    if stored_values is not None:
        service.info["stored_values"] = stored_values
    service.override = lambda request: httpx.Response(200, json={"config": config()})
    saver = make_saver(service)
    values = {"messages": MESSAGES_1, "count": 3, "name": "x", "ratio": 0.5, "flag": None, "items": ["a"]}
    checkpoint = make_checkpoint("c1", values, {ch: "1" for ch in values})
    saver.put(config(), checkpoint, {}, {"messages": "1", "count": "1"})
    assert set(service.bodies("/checkpoints/put")[0]["values"]) == expected


def test_inline_and_typed_values_on_the_wire() -> None:
    service = FakeService(backend="sqlite")
    saver = make_saver(service)
    values = {
        "s": "text",
        "i": 42,
        "f": 1.5,
        "b": True,
        "n": None,
        "nan": math.nan,
        "messages": MESSAGES_1,
        "set": {1, 2},
    }
    saver.put(config(), make_checkpoint("c1", values, {}), {}, {})
    sent = service.bodies("/checkpoints/put")[0]["values"]
    assert {k: sent[k] for k in ("s", "i", "f", "b", "n")} == {
        "s": "text",
        "i": 42,
        "f": 1.5,
        "b": True,
        "n": None,
    }
    for key in ("nan", "messages", "set"):
        assert set(sent[key]) == {"type", "data"}, key
    saver.put_writes(config(checkpoint_id="c1"), [("s", "text"), ("n", None)], "task-1", "path-1")
    writes = service.bodies("/writes/put")[0]
    assert writes["writes"] == [["s", typed("text")], ["n", typed(None)]]
    assert (writes["task_id"], writes["task_path"]) == ("task-1", "path-1")
    restored = saver.get_tuple(config()).checkpoint["channel_values"]
    assert math.isnan(restored.pop("nan"))
    assert restored == {k: v for k, v in values.items() if k != "nan"}


def test_config_is_forwarded_with_the_namespace_and_without_internals() -> None:
    service = FakeService()
    saver = make_saver(service)
    run_config = {
        "configurable": {
            "thread_id": "t1",
            "checkpoint_ns": "",
            "memory_namespace": ("users", 7),
            "user_id": "u1",
            "__pregel_send": print,
        },
        "metadata": {"run_name": "chat"},
    }
    saver.put(run_config, make_checkpoint("c1", {}, {}), {}, {})
    sent = service.bodies("/checkpoints/put")[0]["config"]
    assert sent == {
        "configurable": {
            "thread_id": "t1",
            "checkpoint_ns": "",
            "memory_namespace": ["users", "7"],
            "user_id": "u1",
        },
        "metadata": {"run_name": "chat"},
    }


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_put_get_round_trip_reproduces_messages_and_non_json_values(backend: str) -> None:
    service = FakeService(backend=backend)
    saver = make_saver(service)
    first = {"messages": MESSAGES_1, "tags": {"a", "b"}, "when": WHEN, "count": 1}
    saver.put(
        config(),
        make_checkpoint("c1", first, {ch: "1" for ch in first}),
        {"step": 0},
        {ch: "1" for ch in first},
    )
    assert saver.get_tuple(config(thread_id="other")) is None

    second = {**first, "messages": MESSAGES_2, "count": 2}
    versions = {"messages": "2", "tags": "1", "when": "1", "count": "2"}
    returned = saver.put(
        config(checkpoint_id="c1"),
        make_checkpoint("c2", second, versions),
        {"step": 1},
        {"messages": "2", "count": "2"},
    )
    assert returned == {"configurable": {"thread_id": "t1", "checkpoint_ns": "", "checkpoint_id": "c2"}}
    saver.put_writes(returned, [("messages", [AIMessage("later", id="a3")]), ("flag", None)], "task-1")

    got = saver.get_tuple(config())
    assert got is not None
    assert got.checkpoint["channel_values"] == second
    assert got.checkpoint["channel_values"]["messages"][2].tool_calls[0]["id"] == "call-1"
    assert got.checkpoint["channel_values"]["when"] == WHEN
    assert got.metadata == {"step": 1}
    assert got.parent_config == {
        "configurable": {"thread_id": "t1", "checkpoint_ns": "", "checkpoint_id": "c1"}
    }
    assert got.pending_writes == [
        ("task-1", "messages", [AIMessage("later", id="a3")]),
        ("task-1", "flag", None),
    ]
    older = saver.get_tuple(config(checkpoint_id="c1"))
    assert older is not None and older.checkpoint["channel_values"] == first

    listed = list(saver.list(config(), limit=10))
    assert [t.config["configurable"]["checkpoint_id"] for t in listed] == ["c2", "c1"]
    assert listed[0] == got


async def test_async_round_trip_and_list_match_sync() -> None:
    service = FakeService()
    saver = make_saver(service)
    values = {"messages": MESSAGES_2, "tags": {1, 2}}
    versions = {"messages": "1", "tags": "1"}
    await saver.aput(config(), make_checkpoint("c1", values, versions), {"step": -1}, versions)
    await saver.aput_writes(config(checkpoint_id="c1"), [("tags", {3})], "task-1", "p")
    got = await saver.aget_tuple(config())
    assert got is not None and got.checkpoint["channel_values"] == values
    assert got.pending_writes == [("task-1", "tags", {3})]
    listed = [
        t
        async for t in saver.alist(config(), filter={"step": -1}, before=config(checkpoint_id="c9"), limit=5)
    ]
    assert listed == list(
        saver.list(config(), filter={"step": -1}, before=config(checkpoint_id="c9"), limit=5)
    )
    body = service.bodies("/checkpoints/list")[0]
    assert body["filter"] == {"step": -1} and body["limit"] == 5
    assert body["before"]["configurable"]["checkpoint_id"] == "c9"
    await saver.adelete_thread("t1")
    assert await saver.aget_tuple(config()) is None
    await saver.aclose()


# -- headers, secrets, lifecycle ------------------------------------------------------------------------


def test_api_key_is_sent_and_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDUCING_SAVER_API_KEY", raising=False)
    service = FakeService()
    saver = make_saver(service, api_key="s3cret-key")
    assert all(r.headers["Authorization"] == "Bearer s3cret-key" for r in service.requests)
    assert service.requests[0].headers["User-Agent"] == f"reducing-saver/{reducing_saver.client.__version__}"
    assert "s3cret" not in repr(saver)
    service.override = failing_with(401, "invalid API key")
    with pytest.raises(AuthenticationError) as info:
        saver.get_tuple(config())
    assert "s3cret" not in str(info.value) and "s3cret" not in repr(info.value)


def test_api_key_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDUCING_SAVER_API_KEY", "from-env")
    service = FakeService()
    make_saver(service)
    assert service.requests[0].headers["Authorization"] == "Bearer from-env"
    monkeypatch.delenv("REDUCING_SAVER_API_KEY")
    service = FakeService()
    make_saver(service)
    assert "Authorization" not in service.requests[0].headers


def test_url_credentials_stay_out_of_repr() -> None:
    transport = httpx.MockTransport(FakeService())
    saver = RemoteReducingSaver("http://user:pa55word@reducing-saver.test:8000", transport=transport)
    assert "pa55word" not in repr(saver)
    assert "reducing-saver.test:8000" in repr(saver)


class ClosingTransport(httpx.MockTransport):
    """A mock transport that remembers being closed (sync and async)."""

    closed = aclosed = False

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.aclosed = True


def test_context_managers_close_the_transport() -> None:
    transport = ClosingTransport(FakeService())
    with RemoteReducingSaver("http://reducing-saver.test", transport=transport) as saver:
        saver.get_tuple(config())
    assert transport.closed
    with pytest.raises(RuntimeError, match="closed"):
        saver.get_tuple(config())


async def test_async_context_manager_closes_the_transports() -> None:
    service = FakeService()
    transport, async_transport = ClosingTransport(service), ClosingTransport(service)
    async with RemoteReducingSaver(
        "http://reducing-saver.test", transport=transport, async_transport=async_transport
    ) as saver:
        await saver.aget_tuple(config())
    assert transport.closed and async_transport.aclosed
    with pytest.raises(RuntimeError, match="closed"):
        await saver.aget_tuple(config())


# -- conformance through a loopback -----------------------------------------------------------------


class Loopback:
    """A mock service that decodes the wire and calls a real InMemorySaver, then encodes its answers.

    Proves the client's plumbing (configs, filters, ``before``, pending-write order, metadata merge,
    value types) with LangGraph's conformance suite, no server needed.
    """

    def __init__(self) -> None:
        self.inner = InMemorySaver()

    @staticmethod
    def _config(wire: dict[str, Any] | None) -> dict[str, Any] | None:
        if wire is None:
            return None
        return {**wire, "configurable": {"checkpoint_ns": "", **wire["configurable"]}}

    @staticmethod
    def _value(wire: Any) -> Any:
        value = channel_value_from_wire(wire, "value")
        return SERDE.loads_typed((value.type, value.data)) if isinstance(value, Blob) else value

    @staticmethod
    def _tuple(t: CheckpointTuple | None) -> dict[str, Any] | None:
        if t is None:
            return None
        return {
            "config": t.config,
            "checkpoint": {k: v for k, v in t.checkpoint.items() if k != "channel_values"},
            "values": {k: v if is_inline(v) else typed(v) for k, v in t.checkpoint["channel_values"].items()},
            "metadata": t.metadata,
            "parent_config": t.parent_config,
            "pending_writes": [[task, channel, typed(v)] for task, channel, v in t.pending_writes or []],
        }

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path.removeprefix("/v1")
        inner = self.inner
        if path == "/capabilities":
            info = FakeService(capabilities=saver_capabilities(inner), backend="memory").info
            return httpx.Response(200, json=info)
        body = orjson.loads(request.content)
        result: Any = None
        if path == "/checkpoints/get":
            result = {"checkpoint": self._tuple(inner.get_tuple(self._config(body["config"])))}
        elif path == "/checkpoints/list":
            found = inner.list(
                self._config(body["config"]),
                filter=body["filter"],
                before=self._config(body["before"]),
                limit=body["limit"],
            )
            result = {"checkpoints": [self._tuple(t) for t in found]}
        elif path == "/checkpoints/put":
            values = {k: self._value(v) for k, v in body["values"].items()}
            checkpoint = {**body["checkpoint"], "channel_values": values}
            stored = inner.put(
                self._config(body["config"]), checkpoint, body["metadata"], body["new_versions"]
            )
            result = {"config": stored}
        elif path == "/writes/put":
            writes = [(channel, self._value(v)) for channel, v in body["writes"]]
            inner.put_writes(self._config(body["config"]), writes, body["task_id"], body["task_path"])
        elif path == "/threads/delete":
            inner.delete_thread(body["thread_id"])
        elif path == "/checkpoints/delta-history":
            history = inner.get_delta_channel_history(
                config=self._config(body["config"]), channels=body["channels"]
            )
            result = {
                "channels": {
                    channel: {
                        "writes": [[task, ch, typed(v)] for task, ch, v in entry["writes"]],
                        **({"seed": typed(entry["seed"])} if "seed" in entry else {}),
                    }
                    for channel, entry in history.items()
                }
            }
        else:
            return httpx.Response(404, json={"detail": f"no route {path}"})
        return httpx.Response(204) if result is None else httpx.Response(200, content=orjson.dumps(result))


async def test_conformance_through_a_loopback_to_in_memory_saver() -> None:
    @checkpointer_test(name="RemoteReducingSaver over a loopback to InMemorySaver")
    async def remote() -> AsyncIterator[RemoteReducingSaver]:
        transport = httpx.MockTransport(Loopback())
        async with RemoteReducingSaver(URL, transport=transport, async_transport=transport) as saver:
            yield saver

    report = await validate(remote)
    failures = {name: result.failures for name, result in report.results.items() if result.failures}
    assert report.passed_all_base(), failures
    assert report.passed_all(), failures


@pytest.mark.parametrize("key", ["s3cret-key\n", "  s3cret-key\r\n", "\ts3cret-key "])
def test_api_key_surrounding_whitespace_is_stripped(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDUCING_SAVER_API_KEY", raising=False)
    service = FakeService()
    make_saver(service, api_key=key)
    assert service.requests[0].headers["Authorization"] == "Bearer s3cret-key"
    monkeypatch.setenv("REDUCING_SAVER_API_KEY", key)  # as a secret file's content reaches the environment
    service = FakeService()
    make_saver(service)
    assert service.requests[0].headers["Authorization"] == "Bearer s3cret-key"


@pytest.mark.parametrize(("source", "env"), [("api_key", False), ("REDUCING_SAVER_API_KEY", True)])
def test_api_key_with_an_inner_line_break_is_refused_without_showing_it(
    source: str, env: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REDUCING_SAVER_API_KEY", raising=False)
    service = FakeService()
    options: dict[str, Any] = {}
    if env:
        monkeypatch.setenv("REDUCING_SAVER_API_KEY", "s3cret\nkey")
    else:
        options["api_key"] = "s3cret\nkey"
    with pytest.raises(ValueError, match=source) as info:
        make_saver(service, **options)
    assert "s3cret" not in str(info.value)
    assert not service.requests


def test_a_header_value_http_cannot_carry_is_refused_by_name_without_showing_it() -> None:
    service = FakeService()
    with pytest.raises(ValueError, match="X-Token") as info:
        make_saver(service, headers={"X-Token": "s3cret\n"})
    assert "s3cret" not in str(info.value)
    assert not service.requests


def test_a_request_http_cannot_carry_is_no_outage_and_never_quoted() -> None:
    # What h11 raises for a header value it refuses; the constructor's checks make it unlikely, the
    # mapping keeps it out of messages and out of the outage class anyway.
    saver = make_saver(FakeService())
    exc = transport_errors.from_httpx(httpx.LocalProtocolError("Illegal header value b'Bearer s3cret\\n'"))
    error = saver._http._transport_error(reducing_saver.client._server_info.capabilities_call(), exc)
    assert type(error) is ReducingSaverError
    assert "s3cret" not in str(error) and "not valid HTTP" in str(error)


def test_constructor_waits_for_a_service_that_is_not_up_yet(caplog: pytest.LogCaptureFixture) -> None:
    service = FakeService()
    refused = raising(httpx.ConnectError("connection refused"))
    unavailable = failing_with(503, "starting")
    # More failures than max_retries allows: the constructor's patience is time, not a count.
    saver = make_saver(sequence(refused, unavailable, refused, refused, refused, service), max_retries=1)
    assert saver.backend == "postgres"
    assert "not up yet" in caplog.text


def test_constructor_gives_up_after_startup_timeout_naming_the_url_and_the_time() -> None:
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError) as info:
        make_saver(raising(httpx.ConnectError("connection refused")), startup_timeout=0.3, backoff=0.05)
    assert time.monotonic() - started < 2
    message = str(info.value)
    assert URL in message and "startup_timeout=0.3 s" in message and "ConnectError" in message


@pytest.mark.parametrize("value", [-1, float("nan")])
def test_startup_timeout_must_be_seconds(value: float) -> None:
    with pytest.raises(ValueError, match="startup_timeout"):
        make_saver(FakeService(), startup_timeout=value)
