"""HTTP proxies on loopback, in a thread: a reverse proxy serving a service under a path prefix, and a
forward proxy (absolute-form requests and ``CONNECT`` tunnels) as ``HTTP_PROXY`` names one.

Both record what they forwarded (``seen``), so a test can tell which requests went through them.
"""

from __future__ import annotations

import http.client
import http.server
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

#: Headers that belong to one hop and are not forwarded.
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authorization", "proxy-connection", "transfer-encoding"}
)


class _Forwarding(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    #: ``(method, target, headers) -> (host, port, path)`` to forward to, or ``None`` for a 404.
    route: Callable[[str, str, http.client.HTTPMessage], tuple[str, int, str] | None]
    seen: list[str]
    authorizations: list[str | None]

    def log_message(self, *args: object) -> None:
        pass

    def _forward(self) -> None:
        self.seen.append(f"{self.command} {self.path}")
        self.authorizations.append(self.headers.get("Authorization"))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        destination = self.route(self.command, self.path, self.headers)
        if destination is None:
            self._answer(
                404, b'{"detail": "not under the proxy\'s prefix"}', [("Content-Type", "application/json")]
            )
            return
        host, port, path = destination
        upstream = http.client.HTTPConnection(host, port, timeout=30)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            upstream.request(self.command, path, body, headers)
            answer = upstream.getresponse()
            content = answer.read()
            kept = [
                (k, v) for k, v in answer.getheaders() if k.lower() not in _HOP_BY_HOP | {"content-length"}
            ]
            self._answer(answer.status, content, kept)
        finally:
            upstream.close()

    def _answer(self, status: int, content: bytes, headers: list[tuple[str, str]]) -> None:
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    do_GET = do_POST = do_PUT = do_DELETE = _forward

    def do_CONNECT(self) -> None:
        self.seen.append(f"CONNECT {self.path}")
        self.authorizations.append(self.headers.get("Proxy-Authorization"))
        host, _, port = self.path.rpartition(":")
        try:
            upstream = socket.create_connection((host, int(port)), timeout=30)
        except OSError:
            self._answer(502, b"", [])
            return
        self.send_response(200, "Connection established")
        self.end_headers()
        self.close_connection = True
        pumps = [
            threading.Thread(target=_pump, args=(self.connection, upstream), daemon=True),
            threading.Thread(target=_pump, args=(upstream, self.connection), daemon=True),
        ]
        for pump in pumps:
            pump.start()
        for pump in pumps:
            pump.join()
        upstream.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class RunningProxy:
    def __init__(self, server: http.server.ThreadingHTTPServer, handler: type[_Forwarding]) -> None:
        self.port = server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        #: ``"METHOD target"`` of every request forwarded, and its ``Authorization`` header.
        self.seen = handler.seen
        self.authorizations = handler.authorizations


@contextmanager
def _serve(
    route: Callable[[str, str, http.client.HTTPMessage], tuple[str, int, str] | None],
) -> Iterator[RunningProxy]:
    handler = type(
        "Handler", (_Forwarding,), {"route": staticmethod(route), "seen": [], "authorizations": []}
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield RunningProxy(server, handler)
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def reverse_proxy(upstream: str, prefix: str) -> Iterator[RunningProxy]:
    """Serve ``upstream`` (``http://host:port``) under ``prefix`` (``"/rs"``), stripping it; other paths 404."""
    parts = urlsplit(upstream)

    def route(method: str, target: str, headers: http.client.HTTPMessage) -> tuple[str, int, str] | None:
        if not target.startswith(prefix + "/"):
            return None
        return parts.hostname or "", parts.port or 80, target[len(prefix) :]

    with _serve(route) as proxy:
        yield proxy


@contextmanager
def forward_proxy() -> Iterator[RunningProxy]:
    """A forward proxy: absolute-form requests (``POST http://host:port/path``) and ``CONNECT`` tunnels."""

    def route(method: str, target: str, headers: http.client.HTTPMessage) -> tuple[str, int, str] | None:
        parts = urlsplit(target)
        if parts.scheme != "http":
            return None
        return parts.hostname or "", parts.port or 80, parts.path + (f"?{parts.query}" if parts.query else "")

    with _serve(route) as proxy:
        yield proxy
