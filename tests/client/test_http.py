"""The client's real I/O (http.client for sync, aiohttp for async) against a real uvicorn process.

tests/client/test_stdlib_http.py tests the sync path's connection pool on its own.
"""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from langgraph.checkpoint.base import empty_checkpoint

from reducing_saver.client import (
    BadRequestError,
    PayloadTooLargeError,
    RemoteReducingSaver,
    RequestTimeoutError,
    ServerUnavailableError,
)
from tests.support.chat import build_chat_graph, human
from tests.support.server import free_port, run_service

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    folder = tmp_path_factory.mktemp("client-http")
    with run_service(folder, "--database", "memory://", "--max-body-bytes", str(256 * 1024)) as process:
        yield process


def _checkpoint(value: object) -> dict:
    checkpoint = empty_checkpoint()
    checkpoint["channel_values"] = {"blob": value}
    checkpoint["channel_versions"] = {"blob": "1"}
    return checkpoint


CONFIG = {"configurable": {"thread_id": "http", "checkpoint_ns": ""}}


@pytest.mark.parametrize("body_format", ["msgpack", "json"])
@pytest.mark.parametrize("api", ["sync", "async"])
def test_round_trip_and_errors(service, api, body_format):
    saver = RemoteReducingSaver(service.url, max_retries=0, body_format=body_format)
    assert saver.body_format == f"application/{body_format}"

    async def calls():
        put = saver.put if api == "sync" else saver.aput
        get = saver.get_tuple if api == "sync" else saver.aget_tuple
        run = (lambda f, *a: f(*a)) if api == "sync" else None

        async def call(f, *args):
            return f(*args) if run else await f(*args)

        await call(put, CONFIG, _checkpoint({"a", "set"}), {"step": 1}, {"blob": "1"})
        stored = await call(get, CONFIG)
        assert stored.checkpoint["channel_values"]["blob"] == {"a", "set"}
        with pytest.raises(PayloadTooLargeError):
            await call(put, CONFIG, _checkpoint(b"x" * (512 * 1024)), {}, {"blob": "2"})
        with pytest.raises(BadRequestError, match="thread_id") as info:
            await call(get, {"configurable": {"checkpoint_ns": ""}})
        assert info.value.status_code == 422 and info.value.request_id

    asyncio.run(calls())
    asyncio.run(saver.aclose())


def test_async_sessions_follow_the_event_loop(service):
    saver = RemoteReducingSaver(service.url)
    for _ in range(3):  # each asyncio.run is a new loop; a stale session would fail here
        assert (
            asyncio.run(saver.aget_tuple({"configurable": {"thread_id": "none", "checkpoint_ns": ""}}))
            is None
        )
    saver.close()


@pytest.mark.parametrize("api", ["sync", "async"])
def test_connection_refused_is_server_unavailable(service, api):
    saver = RemoteReducingSaver(service.url)
    saver.close()  # the capabilities request's connection
    saver._http = type(saver._http)(
        f"http://127.0.0.1:{free_port()}",
        api_key=None,
        timeout=5,
        max_retries=2,
        backoff=0.01,
        retry_unavailable_for=0,
        headers=None,
        transport=None,
        async_transport=None,
    )  # nothing listens there
    with pytest.raises(ServerUnavailableError, match="could not reach"):
        if api == "sync":
            saver.get_tuple(CONFIG)
        else:
            asyncio.run(saver.aget_tuple(CONFIG))
    saver.close()


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_silent_server_times_out(api):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        saver = object.__new__(RemoteReducingSaver)
        from reducing_saver.client._http import Http

        saver._http = Http(
            f"http://127.0.0.1:{port}",
            api_key=None,
            timeout=0.3,
            max_retries=3,
            backoff=0.01,
            headers=None,
            transport=None,
            async_transport=None,
        )
        call = RemoteReducingSaver._delete_thread_call(saver, "t")
        with pytest.raises(RequestTimeoutError, match="did not answer in time"):
            if api == "sync":
                saver._http.send(call)
            else:
                asyncio.run(saver._http.asend(call))
        saver._http.close()


def test_the_constructor_outlasts_a_service_that_starts_later(tmp_path):
    """An agent started before its service (or while a replica restarts) waits for it."""
    import threading
    import time

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    outcome: dict = {}

    def construct() -> None:
        started = time.monotonic()
        try:
            outcome["saver"] = RemoteReducingSaver(url)  # the default startup_timeout
        except Exception as exc:  # reported below, with the time it took
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - started

    agent = threading.Thread(target=construct)
    agent.start()
    time.sleep(4)  # longer than the constructor used to try
    assert agent.is_alive(), outcome
    with run_service(tmp_path, "--database", "memory://", port=port):
        agent.join(timeout=60)
        assert "error" not in outcome, outcome
        saver = outcome["saver"]
        assert saver.get_tuple(CONFIG) is None
        saver.close()
    assert outcome["seconds"] > 4


def test_a_short_startup_timeout_fails_naming_the_url_and_the_time():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ServerUnavailableError) as info:
        RemoteReducingSaver(url, startup_timeout=1.0)
    assert url in str(info.value) and "startup_timeout=1 s" in str(info.value)


def test_a_sync_turn_goes_through_http_client_and_a_given_transport_through_httpx(service, monkeypatch):
    calls = []
    handle_request = httpx.HTTPTransport.handle_request

    def counted(self, request):
        calls.append(request.url.path)
        return handle_request(self, request)

    monkeypatch.setattr(httpx.HTTPTransport, "handle_request", counted)
    config = {"configurable": {"thread_id": "stdlib-turns"}}
    with RemoteReducingSaver(service.url) as saver:
        graph = build_chat_graph(saver, prefix="stdlib", with_tools=True)  # tools run in threads
        for turn in range(3):
            graph.invoke({"messages": [human(turn, "stdlib")]}, config)
        assert graph.get_state(config).values["messages"][-1].id == "stdlib-ai-0002"
    assert calls == []

    with RemoteReducingSaver(service.url, transport=httpx.HTTPTransport()) as saver:
        assert saver.get_tuple(config).checkpoint["id"]
    assert calls == ["/v1/capabilities", "/v1/checkpoints/get"]


def test_sync_calls_from_many_threads_at_once(service):
    saver = RemoteReducingSaver(service.url, max_retries=0)

    def work(worker: int) -> None:
        config = {"configurable": {"thread_id": f"threads-{worker}", "checkpoint_ns": ""}}
        for step in range(1, 16):
            checkpoint = empty_checkpoint()
            checkpoint["channel_values"] = {"blob": f"{worker}-{step}"}
            checkpoint["channel_versions"] = {"blob": str(step)}
            saver.put(config, checkpoint, {"step": step}, {"blob": str(step)})
            stored = saver.get_tuple(config)
            assert stored.checkpoint["channel_values"]["blob"] == f"{worker}-{step}"
            assert stored.metadata["step"] == step

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))  # re-raises a worker's failure
    saver.close()


def test_a_restarted_service_does_not_fail_the_next_sync_call(tmp_path):
    """The pooled connection dies with the first process; the next call must not find out the hard way."""
    port = free_port()
    with run_service(tmp_path, "--database", "memory://", port=port) as first:
        saver = RemoteReducingSaver(first.url, max_retries=0)
        assert saver.get_tuple(CONFIG) is None
    with run_service(tmp_path, "--database", "memory://", port=port):
        assert saver.get_tuple(CONFIG) is None
    saver.close()
