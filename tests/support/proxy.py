"""A TCP proxy a test can cut: a database outage without touching the real (shared) server.

The service is given the proxy's port as its database. :meth:`TcpProxy.cut` closes every connection it
carries and closes each new one at once (a client sees "server closed the connection unexpectedly", as
when PostgreSQL stops); :meth:`TcpProxy.hang` keeps every connection open but silent, and accepts new
ones without an answer (a network partition: statements and connection attempts wait, nothing fails);
:meth:`TcpProxy.restore` forwards again.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target`` in threads, until cut.

    Args:
        target: ``(host, port)`` to forward to.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._cut = threading.Event()
        self._hung = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)
        self._thread.start()

    def url(self, database_url: str) -> str:
        """``database_url`` with its host and port replaced by the proxy's."""
        head, _, rest = database_url.partition("@")
        _, _, path = rest.partition("/")
        return f"{head}@127.0.0.1:{self.port}/{path}"

    def cut(self) -> None:
        """Close every forwarded connection, and every new one as soon as it is accepted."""
        self._cut.set()
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for sock in sockets:
            _close(sock)

    def hang(self) -> None:
        """Forward nothing, close nothing: bytes sent either way are dropped, new connections wait."""
        self._hung.set()

    def restore(self, *, close_hung: bool = True) -> None:
        """Forward new connections again.

        Args:
            close_hung: Close the connections a hang left mid-stream (a server that restarted). With
                ``False`` they stay open and silent for good, as packets a partition dropped never arrive.
        """
        if self._hung.is_set():
            if close_hung:
                self.cut()
            self._hung.clear()
        self._cut.clear()

    def close(self) -> None:
        self._closed.set()
        self.cut()
        _close(self._listener)
        self._thread.join(5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._cut.is_set():
                _close(client)
                continue
            if self._hung.is_set():
                with self._lock:
                    self._sockets.add(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._sockets.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if not self._hung.is_set():
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with self._lock:
                    self._sockets.discard(sock)
                _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


@contextmanager
def tcp_proxy(target: tuple[str, int]) -> Iterator[TcpProxy]:
    proxy = TcpProxy(target)
    try:
        yield proxy
    finally:
        proxy.close()
