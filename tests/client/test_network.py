"""The client in real networks: restarts, wrong URLs, path prefixes, credentials, redirects, proxies.

Each test runs the real service under uvicorn (or a real socket that plays the part) and both the sync
(http.client) and async (aiohttp) transports.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import threading
import time

import orjson
import pytest

from reducing_saver.client import (
    ConnectionSetupError,
    ReducingSaverError,
    RemoteReducingSaver,
    RemoteStore,
    ServerUnavailableError,
)
from reducing_saver.client._calls import Call
from reducing_saver.client._http import Http
from tests.support.chat import build_chat_graph, human
from tests.support.http_app import run_app, self_signed_certificate
from tests.support.http_proxy import forward_proxy, reverse_proxy
from tests.support.server import free_port, run_service

pytestmark = pytest.mark.e2e


def test_agents_outlive_a_service_restart(tmp_path):
    """A service killed and started again on its port 2.5 s later costs the running agents no turn."""
    port = free_port()
    database = f"sqlite:///{tmp_path}/restart.sqlite"
    errors: list[BaseException] = []
    turns = {"sync": 0, "async": 0}
    stop = threading.Event()

    def sync_agent(url: str) -> None:
        try:
            with RemoteReducingSaver(url) as saver:
                graph = build_chat_graph(saver, prefix="sync", length=50)
                config = {"configurable": {"thread_id": "restart-sync"}}
                while not stop.is_set():
                    graph.invoke({"messages": [human(turns["sync"], "sync", 50)]}, config)
                    turns["sync"] += 1
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    def async_agent(url: str) -> None:
        async def run() -> None:
            async with await RemoteReducingSaver.aopen(url) as saver:
                graph = build_chat_graph(saver, prefix="async", length=50)
                config = {"configurable": {"thread_id": "restart-async"}}
                while not stop.is_set():
                    await graph.ainvoke({"messages": [human(turns["async"], "async", 50)]}, config)
                    turns["async"] += 1

        try:
            asyncio.run(run())
        except BaseException as exc:
            errors.append(exc)

    with run_service(tmp_path, "--database", database, port=port) as first:
        agents = [
            threading.Thread(target=sync_agent, args=(first.url,)),
            threading.Thread(target=async_agent, args=(first.url,)),
        ]
        for agent in agents:
            agent.start()
        deadline = time.monotonic() + 30
        while min(turns.values()) < 1 and not errors and time.monotonic() < deadline:
            time.sleep(0.05)  # each agent is mid-conversation
        first.process.kill()  # no goodbye: open connections are reset, new ones refused
        first.process.wait()
    before = dict(turns)
    time.sleep(2.5)
    with run_service(tmp_path, "--database", database, port=port):
        deadline = time.monotonic() + 30
        while (
            time.monotonic() < deadline
            and not errors
            and min(turns["sync"] - before["sync"], turns["async"] - before["async"]) < 3
        ):
            time.sleep(0.1)
        stop.set()
        for agent in agents:
            agent.join(30)
    assert not errors, errors
    assert before["sync"] > 0 and before["async"] > 0, before
    assert turns["sync"] - before["sync"] >= 3 and turns["async"] - before["async"] >= 3, (before, turns)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with run_service(tmp_path_factory.mktemp("network"), "--database", "memory://") as process:
        yield process


@pytest.fixture(scope="module")
def self_signed_url(tmp_path_factory):
    """An https URL whose certificate is self-signed (no CA this machine trusts signed it)."""
    folder = tmp_path_factory.mktemp("tls")
    key, cert = self_signed_certificate(folder)
    with run_app(folder, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), scheme="https") as url:
        yield url


def _open(api: str, url: str, **options):
    if api == "sync":
        return RemoteReducingSaver(url, **options)

    async def aopen():
        return await RemoteReducingSaver.aopen(url, **options)

    return asyncio.run(aopen())


@pytest.mark.parametrize("api", ["sync", "async"])
@pytest.mark.parametrize(
    ("mistake", "cause"),
    [
        ("unknown host", "no such host"),
        ("https to plain HTTP", r"plain HTTP, not TLS \(WRONG_VERSION_NUMBER\): use an http:// URL"),
        ("certificate", "TLS certificate does not verify"),
    ],
)
def test_a_url_mistake_fails_at_once_naming_its_cause(
    service, self_signed_url, api, mistake, cause, monkeypatch
):
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    url = {
        "unknown host": "http://no-such-host.invalid:8080",
        "https to plain HTTP": service.url.replace("http://", "https://"),
        "certificate": self_signed_url,
    }[mistake]
    started = time.monotonic()
    with pytest.raises(ConnectionSetupError, match=cause) as info:
        _open(api, url)  # the default startup_timeout: 30 s
    assert time.monotonic() - started < 3
    assert "\n" not in str(info.value) and url in str(info.value)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_base_url_with_a_path_prefix_keeps_it(service, api):
    """Behind a reverse proxy that serves the service under ``/rs/``, every request goes below ``/rs``."""
    config = {"configurable": {"thread_id": f"prefix-{api}", "checkpoint_ns": ""}}
    with reverse_proxy(service.url, "/rs") as proxy:
        url = f"{proxy.url}/rs/"

        async def calls() -> None:
            saver = _open(api, url) if api == "sync" else await RemoteReducingSaver.aopen(url)
            store = RemoteStore(url)
            graph = build_chat_graph(saver, prefix=f"prefix-{api}", length=50)
            if api == "sync":
                graph.invoke({"messages": [human(0, "p", 50)]}, config)
                assert len(saver.get_tuple(config).checkpoint["channel_values"]["messages"]) == 2
                store.put(("notes",), "k", {"v": api})
                assert store.get(("notes",), "k").value == {"v": api}
                saver.close()
                store.close()
            else:
                await graph.ainvoke({"messages": [human(0, "p", 50)]}, config)
                assert len((await saver.aget_tuple(config)).checkpoint["channel_values"]["messages"]) == 2
                await store.aput(("notes",), "k", {"v": api})
                assert (await store.aget(("notes",), "k")).value == {"v": api}
                await saver.aclose()
                await store.aclose()

        asyncio.run(calls())
    paths = {line.split()[1] for line in proxy.seen}
    assert paths >= {
        "/rs/v1/capabilities",
        "/rs/v1/checkpoints/get",
        "/rs/v1/checkpoints/put",
        "/rs/store/batch",
    }
    assert all(path.startswith("/rs/") for path in paths), paths


@pytest.mark.parametrize("api", ["sync", "async"])
def test_credentials_in_the_url_are_sent_as_basic_auth(service, api):
    """``http://user:pw@host``: Basic auth on every request, sync and async alike (a proxy that asks for it)."""
    with reverse_proxy(service.url, "/rs") as proxy:
        url = proxy.url.replace("http://", "http://agent:p%40ss@") + "/rs"
        saver = _open(api, url)
        assert "p%40ss" not in repr(saver) and "agent" not in repr(saver)
        if api == "sync":
            assert saver.get_tuple({"configurable": {"thread_id": "basic", "checkpoint_ns": ""}}) is None
            saver.close()
        else:

            async def call() -> None:
                assert (
                    await saver.aget_tuple({"configurable": {"thread_id": "basic", "checkpoint_ns": ""}})
                    is None
                )
                await saver.aclose()

            asyncio.run(call())
    expected = "Basic " + base64.b64encode(b"agent:p@ss").decode()
    assert proxy.authorizations == [expected, expected]


@pytest.mark.parametrize("api", ["sync", "async"])
@pytest.mark.parametrize("other", ["api_key", "Authorization header"])
def test_credentials_in_the_url_and_another_authorization_are_refused(service, api, other):
    url = service.url.replace("http://", "http://agent:pw@")
    options = {"api_key": "key"} if other == "api_key" else {"headers": {"authorization": "Bearer x"}}
    with pytest.raises(ValueError, match="credentials .*user:password@.* and "):
        _open(api, url, **options)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_redirect_is_an_error_naming_its_location(service, api):
    """A 307 to another origin is never followed (the body and the API key would go there)."""
    location = f"{service.url}/v1/capabilities"

    class Redirecting(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(307)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ReducingSaverError, match="307") as info:
            _open(api, f"http://127.0.0.1:{server.server_address[1]}", api_key="secret")
    finally:
        server.shutdown()
        server.server_close()
    message = str(info.value)
    assert f"redirect to {location}" in message and "does not follow redirects" in message
    assert info.value.status_code == 307 and "\n" not in message


@pytest.mark.parametrize("owner", ["RemoteReducingSaver", "RemoteStore"])
def test_a_closed_client_says_which_one_is_closed(service, owner):
    async def calls() -> None:
        if owner == "RemoteStore":
            client = RemoteStore(service.url)
            sync_call, async_call = (lambda: client.get(("a",), "k")), (lambda: client.aget(("a",), "k"))
        else:
            client = RemoteReducingSaver(service.url)
            config = {"configurable": {"thread_id": "closed", "checkpoint_ns": ""}}
            sync_call, async_call = (lambda: client.get_tuple(config)), (lambda: client.aget_tuple(config))
        await client.aclose()
        with pytest.raises(RuntimeError, match=f"^this {owner} is closed$"):
            sync_call()
        with pytest.raises(RuntimeError, match=f"^this {owner} is closed$"):
            await async_call()

    asyncio.run(calls())


def test_aopen_outlasts_a_service_that_starts_later(tmp_path):
    """``aopen`` waits for a service that is still starting, as the constructor does (startup_timeout)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    outcome: dict = {}

    async def open_and_call() -> None:
        started = time.monotonic()
        async with await RemoteReducingSaver.aopen(url) as saver:  # the default startup_timeout
            outcome["seconds"] = time.monotonic() - started
            outcome["stored"] = await saver.aget_tuple(
                {"configurable": {"thread_id": "late", "checkpoint_ns": ""}}
            )

    def agent() -> None:
        try:
            asyncio.run(open_and_call())
        except Exception as exc:  # reported by the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=agent)
    thread.start()
    time.sleep(3)
    assert thread.is_alive(), outcome
    with run_service(tmp_path, "--database", "memory://", port=port):
        thread.join(60)
    assert "error" not in outcome, outcome
    assert outcome["seconds"] > 3 and outcome["stored"] is None


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_short_startup_timeout_fails_naming_the_url_and_the_time(api):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError) as info:
        _open(api, url, startup_timeout=1.0)
    assert 1.0 <= time.monotonic() - started < 3
    assert url in str(info.value) and "startup_timeout=1 s" in str(info.value)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_http_proxy_from_the_environment_is_used_unless_no_proxy_or_trust_env_false(
    service, api, monkeypatch
):
    """As an httpx client does by default: HTTP_PROXY carries the calls, NO_PROXY and trust_env=False don't."""
    config = {"configurable": {"thread_id": f"proxied-{api}", "checkpoint_ns": ""}}

    def call(**options) -> None:
        saver = _open(api, service.url, **options)
        if api == "sync":
            assert saver.get_tuple(config) is None
            saver.close()
        else:

            async def aget() -> None:
                assert await saver.aget_tuple(config) is None
                await saver.aclose()

            asyncio.run(aget())

    with forward_proxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.setenv("NO_PROXY", "")  # the test suite's own "*" would exempt every host
        call()
        through = [line for line in proxy.seen if line.endswith("/v1/checkpoints/get")]
        assert through == [f"POST {service.url}/v1/checkpoints/get"]  # absolute-form, as proxies expect
        seen = len(proxy.seen)
        call(trust_env=False)
        monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
        call()
        assert len(proxy.seen) == seen


@pytest.mark.parametrize("api", ["sync", "async"])
def test_https_goes_through_the_proxy_in_a_connect_tunnel(tmp_path, api, monkeypatch):
    """HTTPS_PROXY: a CONNECT tunnel, TLS to the service inside it (the proxy sees no plain text)."""
    key, cert = self_signed_certificate(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trusted by both transports
    call = Call("POST", "/echo", orjson.dumps({"token": "tunnelled"}), True, lambda body: body)
    with run_app(tmp_path, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), scheme="https") as url:
        with forward_proxy() as proxy:
            monkeypatch.setenv("HTTPS_PROXY", proxy.url.replace("http://", "http://user:secret@"))
            monkeypatch.setenv("NO_PROXY", "")
            http = Http(
                url,
                api_key=None,
                timeout=5,
                max_retries=0,
                backoff=0,
                headers=None,
                transport=None,
                async_transport=None,
            )
            if api == "sync":
                answer = http.send(call)
                http.close()
            else:

                async def asend():
                    try:
                        return await http.asend(call)
                    finally:
                        await http.aclose()

                answer = asyncio.run(asend())
    assert answer["token"] == "tunnelled" and answer["path"] == "/echo"
    assert proxy.seen == [f"CONNECT {url.removeprefix('https://')}"]
    assert proxy.authorizations == ["Basic " + base64.b64encode(b"user:secret").decode()]
