"""The sync client's HTTP: the standard library's ``http.client`` over a pool of kept-alive connections.

Why not httpx's transport, which the sync client used before: httpcore and h11 are pure Python and cost
more CPU per request than the request's own work. ``python -m benchmarks.http_clients`` sends the same
4 KB POST to a bare ASGI app under uvicorn through each HTTP layer the client could use; in one run, per
request (wall time / client CPU): ``httpx.HTTPTransport`` 208 / 183 µs, a urllib3 pool 197 / 161 µs,
one kept-alive ``http.client.HTTPConnection`` 111 / 70 µs, and this module's pool of them 121 / 84 µs.
``http.client`` does the protocol; this module only pools its connections, applies the timeouts and
names failures.

The pool, shared by the threads that call the saver (LangGraph's sync loop calls it from several):

* a request takes the most recently used idle connection, or opens one; a connection serves one request
  at a time and goes back to the pool once its answer has been read whole;
* at most ``max_connections`` requests are in flight at once (a request past them waits for one to end,
  for the pool timeout at most: then ``PoolTimeout``), as with httpx's transport;
* at most ``max_idle`` connections stay idle (the oldest goes first); one the server asked to close
  (``Connection: close``, HTTP/1.0) or whose request broke is closed, never pooled;
* before reuse, a connection idle for longer than ``keepalive_expiry``, or whose socket is readable
  while idle (the server closed it, as uvicorn does after its keep-alive timeout, or sent something unasked),
  is closed and the next one tried.

Failures are raised as the client's transport errors (``_transport``), named as httpx's transport
names them: ``ConnectTimeout``/``ConnectError`` while connecting (TLS handshake included: a
certificate that does not verify is a ``ConnectError``), ``WriteTimeout`` while sending,
``ReadTimeout`` while waiting for or reading the answer, ``RemoteProtocolError`` for a connection closed
before a complete answer or an answer that is not HTTP, ``ReadError``/``WriteError`` for other socket
errors, ``LocalProtocolError`` for a request HTTP cannot carry. A reused connection that the server
closes while the request is on its way (the check before reuse narrows that to a race) therefore fails
with a ``RemoteProtocolError``, ``ReadError`` or ``WriteError``, which the client retries for an
idempotent call and reports for another: the server may have received the request, so whether sending
it again is safe is the call's to decide, not this module's.
"""

from __future__ import annotations

import base64
import http.client
import select
import socket
import ssl
import threading
import time
from collections.abc import Mapping

import httpx

from reducing_saver.client._transport import (
    Answer,
    ConnectError,
    ConnectTimeout,
    LocalProtocolError,
    PoolTimeout,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    Request,
    WriteError,
    WriteTimeout,
)


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read (data, or the peer's close) right now."""
    if hasattr(select, "poll"):  # select.select fails on descriptors past FD_SETSIZE
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([sock], [], [], 0)[0])


class ConnectionPool:
    """Kept-alive ``http.client`` connections to one origin (``http://`` or ``https://``), thread-safe."""

    def __init__(
        self,
        url: httpx.URL,
        timeout: httpx.Timeout,
        *,
        max_connections: int | None = None,
        max_idle: int,
        keepalive_expiry: float | None,
        proxy: httpx.URL | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._host = url.raw_host.decode("ascii")
        self._port = url.port
        #: Through an http:// proxy: an ``https://`` origin in a ``CONNECT`` tunnel, an ``http://`` one by
        #: absolute-form requests (the target is the whole URL), with ``Proxy-Authorization`` when the
        #: proxy's URL holds credentials.
        self._proxy = proxy
        self._target_origin = ""
        self._proxy_headers: dict[str, str] = {}
        if proxy is not None:
            if proxy.userinfo:
                credentials = f"{proxy.username}:{proxy.password}".encode()
                self._proxy_headers["Proxy-Authorization"] = "Basic " + base64.b64encode(credentials).decode()
            if url.scheme == "http":
                self._target_origin = f"http://{url.netloc.decode('ascii')}"
        #: For https: what ``httpx.HTTPTransport()`` verifies with by default (certifi's CA bundle, or
        #: ``SSL_CERT_FILE``/``SSL_CERT_DIR`` when set), built once (it reads the bundle).
        self._ssl_context: ssl.SSLContext | None = None
        if url.scheme == "https":
            self._ssl_context = ssl_context or httpx.create_ssl_context()
            self._ssl_context.set_alpn_protocols(["http/1.1"])
        self._timeout = timeout
        self._max_idle = max_idle
        self._keepalive_expiry = keepalive_expiry
        self._lock = threading.Lock()
        self._in_flight = threading.BoundedSemaphore(max_connections) if max_connections else None
        #: Idle connections and when each went idle, the most recently used last.
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._closed = False

    def exchange(self, request: Request) -> Answer:
        """Send one request and read its answer whole; raises the client's ``TransportError``s."""
        status, headers, content = self.request(request.method, request.target, request.body, request.headers)
        return Answer(status, headers, content)

    def request(
        self, method: str, target: str, body: bytes | None, headers: Mapping[str, str]
    ) -> tuple[int, httpx.Headers, bytes]:
        """Send one request, return ``(status, headers, body)``; raises the client's ``TransportError``s."""
        if self._in_flight is None:
            return self._request(method, target, body, headers)
        if not self._in_flight.acquire(timeout=self._timeout.pool):
            raise PoolTimeout(f"no connection free within {self._timeout.pool} s")
        try:
            return self._request(method, target, body, headers)
        finally:
            self._in_flight.release()

    def _request(
        self, method: str, target: str, body: bytes | None, headers: Mapping[str, str]
    ) -> tuple[int, httpx.Headers, bytes]:
        connection = self._take_idle() or self._connect()
        try:
            status, answer_headers, content, reusable = self._exchange(
                connection, method, target, body, headers
            )
        except BaseException:
            connection.close()
            raise
        if reusable:
            self._put_back(connection)
        else:
            connection.close()
        return status, answer_headers, content

    def close(self) -> None:
        """Close the idle connections; one in use is closed when its request ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection, _ in idle:
            connection.close()

    def idle_count(self) -> int:
        with self._lock:
            return len(self._idle)

    # -- the pool ----------------------------------------------------------------------------------

    def _take_idle(self) -> http.client.HTTPConnection | None:
        while True:
            with self._lock:
                if not self._idle:
                    return None
                connection, idle_since = self._idle.pop()
            expired = (
                self._keepalive_expiry is not None and time.monotonic() - idle_since > self._keepalive_expiry
            )
            if not expired and connection.sock is not None and not _readable(connection.sock):
                return connection
            connection.close()

    def _put_back(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            if self._closed:
                surplus = connection
            else:
                self._idle.append((connection, time.monotonic()))
                if len(self._idle) <= self._max_idle:
                    return
                surplus = self._idle.pop(0)[0]
        surplus.close()

    def _connect(self) -> http.client.HTTPConnection:
        timeout = self._timeout.connect
        connection: http.client.HTTPConnection
        host, port = self._host, self._port
        if self._proxy is not None:
            host, port = self._proxy.raw_host.decode("ascii"), self._proxy.port or 80
        if self._ssl_context is None:
            connection = http.client.HTTPConnection(host, port, timeout=timeout)
        else:
            connection = http.client.HTTPSConnection(host, port, timeout=timeout, context=self._ssl_context)
            if self._proxy is not None:
                connection.set_tunnel(self._host, self._port or 443, headers=self._proxy_headers)
        try:
            connection.connect()  # TCP, and the TLS handshake for https, within the connect timeout
        except TimeoutError as exc:
            connection.close()
            raise ConnectTimeout(f"connecting took longer than {timeout} s ({exc})") from exc
        except OSError as exc:  # refused, unreachable, no such host, a certificate that does not verify
            connection.close()
            raise ConnectError(str(exc)) from exc
        return connection

    # -- one exchange ------------------------------------------------------------------------------

    def _exchange(
        self,
        connection: http.client.HTTPConnection,
        method: str,
        target: str,
        body: bytes | None,
        headers: Mapping[str, str],
    ) -> tuple[int, httpx.Headers, bytes, bool]:
        sock = connection.sock
        assert sock is not None
        sock.settimeout(self._timeout.write)
        write_error: OSError | None = None
        if self._target_origin:
            target = self._target_origin + target
            headers = {**headers, **self._proxy_headers}
        try:
            connection.request(method, target, body, headers)
        except TimeoutError as exc:
            raise WriteTimeout(f"sending the request took longer than {self._timeout.write} s") from exc
        except OSError as exc:
            # A server may answer before reading the whole body (a 413) and close the connection: read
            # its answer before calling this a failure, as httpcore does.
            write_error = exc
        except (ValueError, http.client.HTTPException) as exc:  # a header or target http.client refuses
            raise LocalProtocolError(str(exc)) from exc
        sock.settimeout(self._timeout.read)
        try:
            response = connection.getresponse()
            content = response.read()
        except TimeoutError as exc:
            raise ReadTimeout(f"no answer within {self._timeout.read} s") from exc
        except (OSError, http.client.HTTPException) as exc:
            if write_error is not None:
                raise WriteError(str(write_error)) from write_error
            # Closed before a whole answer (RemoteDisconnected, IncompleteRead), or not an HTTP answer.
            if isinstance(exc, http.client.HTTPException):
                raise RemoteProtocolError(f"{type(exc).__name__}: {exc}") from exc
            raise ReadError(str(exc)) from exc
        reusable = write_error is None and not response.will_close
        return response.status, httpx.Headers(response.getheaders()), content, reusable
