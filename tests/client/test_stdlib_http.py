"""The sync client's http.client pool (client/_stdlib_http.py), through ``Http``, against real servers.

uvicorn serves a bare app (tests/support/http_app.py) that names the client port of each request's
connection, so a test sees which requests shared a connection.
"""

from __future__ import annotations

import http.server
import logging
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from reducing_saver.client import RequestTimeoutError, ServerUnavailableError
from reducing_saver.client import _transport as transport_errors
from reducing_saver.client._calls import Call
from reducing_saver.client._http import Http
from reducing_saver.client._stdlib_http import ConnectionPool
from tests.support.http_app import run_app, self_signed_certificate
from tests.support.server import free_port

pytestmark = pytest.mark.e2e


def _http(url: str, **options) -> Http:
    settings = {"timeout": 5, "max_retries": 0, "backoff": 0.01, "retry_unavailable_for": 0, "headers": None}
    settings |= options
    return Http(url, api_key=None, transport=None, async_transport=None, **settings)


def _call(path: str = "/echo", token: object = None) -> Call[dict]:
    return Call("POST", path, orjson.dumps({"token": token}), True, lambda body: body)


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    with run_app(tmp_path_factory.mktemp("http-app")) as url:
        yield url


def test_threads_share_the_pool_and_never_a_connection(app_url):
    http = _http(app_url)
    threads, calls = 8, 40

    def work(worker: int) -> list[tuple[object, object]]:
        tokens = [f"{worker}-{n}" for n in range(calls)]
        return [(token, http.send(_call(token=token))["token"]) for token in tokens]

    with ThreadPoolExecutor(threads) as pool:
        results = [pair for pairs in pool.map(work, range(threads)) for pair in pairs]
    assert len(results) == threads * calls
    assert all(sent == answered for sent, answered in results)
    assert 1 <= http._pool.idle_count() <= threads
    http.close()
    assert http._pool.idle_count() == 0
    with pytest.raises(RuntimeError, match="is closed"):
        http.send(_call())


def test_requests_past_max_connections_wait_for_the_pool_timeout(app_url):
    http = _http(app_url, timeout=httpx.Timeout(5, pool=0.2))
    # A pool of two, as Http builds its own of MAX_CONNECTIONS (100).
    http._sync = ConnectionPool(
        httpx.URL(app_url), http.timeout, max_connections=2, max_idle=2, keepalive_expiry=5
    )
    with ThreadPoolExecutor(3) as pool:
        outcomes = list(pool.map(lambda _: _outcome(http, _call("/slow?1")), range(3)))
    assert sorted(outcomes) == ["PoolTimeout", "ok", "ok"]
    http.close()


def _outcome(http: Http, call: Call) -> str:
    try:
        http._exchange(call)
    except transport_errors.TransportError as exc:
        return type(exc).__name__
    return "ok"


def test_a_connection_is_reused_and_one_the_server_closes_is_not(app_url):
    http = _http(app_url)
    first, second = (http.send(_call())["port"] for _ in range(2))
    assert first == second and http._pool.idle_count() == 1

    closing = [http.send(_call("/close"))["port"] for _ in range(2)]
    # The pooled connection served the first and was closed after it; the second needed a new one.
    assert closing[0] == first and closing[1] != first
    assert http._pool.idle_count() == 0
    http.close()


def test_a_connection_the_server_closed_while_idle_does_not_fail_a_call(tmp_path, caplog):
    with run_app(tmp_path, "--timeout-keep-alive", "1") as url:
        http = _http(url)  # max_retries=0: a stale connection would fail the call
        first = http.send(_call())["port"]
        time.sleep(1.5)  # uvicorn closes the idle connection after 1 s
        with caplog.at_level(logging.WARNING, logger="reducing_saver.client._http"):
            second = http.send(_call())["port"]
        assert second != first and not caplog.records  # a new connection, not a retry
        http.close()


def test_a_reused_connection_closed_under_a_request_is_retried_when_the_call_may_be():
    """The race the check before reuse cannot close: the server reads the request, then closes unanswered."""
    answered: list[int] = []

    class AnswersOncePerConnection(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        served = 0

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.served += 1
            if self.served > 1:
                self.close_connection = True  # drop the second request of a connection unanswered
                return
            answered.append(self.client_address[1])
            body = b'{"token": null}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), AnswersOncePerConnection)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        once = _http(url)
        once.send(_call())
        with pytest.raises(transport_errors.RemoteProtocolError):
            once._exchange(_call())
        once.close()

        retrying = _http(url, max_retries=1)
        retrying.send(_call())
        retrying.send(_call())  # the reused connection fails; the retry goes out on a fresh one
        assert len(set(answered)) == 3

        not_idempotent = Call("POST", "/copy", b"{}", False, lambda body: body)
        with pytest.raises(ServerUnavailableError, match="RemoteProtocolError"):
            retrying.send(not_idempotent)  # may have run: not sent again
        retrying.close()
    finally:
        server.shutdown()
        server.server_close()


def test_a_read_timeout_is_a_read_timeout(app_url):
    slow = _http(app_url, timeout=httpx.Timeout(5, read=0.3), max_retries=2)
    with pytest.raises(transport_errors.ReadTimeout):
        slow._exchange(_call("/slow?1"))
    with pytest.raises(RequestTimeoutError, match="did not answer in time"):
        slow.send(_call("/slow?1"))  # not retried: the call may have run
    assert slow._pool.idle_count() == 0  # a connection whose answer is still due is not reused
    assert slow.send(_call("/slow?0", token="on time"))["token"] == "on time"
    slow.close()


def test_a_refused_connection_is_a_connect_error():
    http = _http(f"http://127.0.0.1:{free_port()}", max_retries=2)
    with pytest.raises(transport_errors.ConnectError):
        http._exchange(_call())
    with pytest.raises(ServerUnavailableError, match="could not reach .*ConnectError"):
        http.send(_call())
    http.close()


def test_a_connect_that_hangs_is_a_connect_timeout():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        # Fill the accept queue, which nobody empties: the kernel drops further SYNs.
        fillers = []
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        time.sleep(0.2)
        http = _http(f"http://127.0.0.1:{port}", timeout=httpx.Timeout(5, connect=0.3))
        try:
            with pytest.raises(transport_errors.ConnectTimeout):
                http._exchange(_call())
            with pytest.raises(RequestTimeoutError, match="did not answer in time"):
                http.send(_call())
        finally:
            http.close()
            for filler in fillers:
                filler.close()


def test_a_header_name_http_cannot_carry_is_refused_before_anything_is_sent():
    # http.client would send it, and the server answer 400; h11 used to refuse it at send time.
    with pytest.raises(ValueError, match="'Bad Name'"):
        _http("http://127.0.0.1:1", headers={"Bad Name": "value"})


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
    key, cert = self_signed_certificate(folder)
    with run_app(folder, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), scheme="https") as url:
        yield url, cert


def test_https_verifies_the_certificate_as_httpx_does(self_signed, monkeypatch):
    url, cert = self_signed
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    errors = {}
    for name, transport in (("stdlib", None), ("httpx", httpx.HTTPTransport())):
        http = Http(
            url,
            api_key=None,
            headers=None,
            transport=transport,
            async_transport=None,
            timeout=5,
            max_retries=0,
            backoff=0.01,
        )
        with pytest.raises(ServerUnavailableError, match="CERTIFICATE_VERIFY_FAILED") as info:
            http.send(_call())
        errors[name] = type(info.value.__cause__)
        http.close()
    # Each stack's failure becomes the same error of the client's, at the transport boundary.
    assert errors["stdlib"] is errors["httpx"] is transport_errors.ConnectError

    # As with httpx's default transport, SSL_CERT_FILE names the CA bundle to trust instead of certifi's.
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    http = _http(url)
    ports = {http.send(_call(token=n))["port"] for n in range(3)}
    assert len(ports) == 1  # one TLS connection, kept alive
    http.close()
