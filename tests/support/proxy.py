"""A TCP proxy a test can cut: a database outage without touching the real (shared) server.

The service is given the proxy's port as its database. :meth:`TcpProxy.cut` closes every connection it
carries and closes each new one at once (a client sees "server closed the connection unexpectedly", as
when PostgreSQL stops); :meth:`TcpProxy.hang` keeps every connection open but silent, and accepts new
ones without an answer (a network partition: statements and connection attempts wait, nothing fails);
:meth:`TcpProxy.restore` forwards again. With ``idle_cut`` it closes every connection that carried nothing
either way for that many seconds, as a load balancer or NAT gateway with an idle timeout does.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target`` in threads, until cut.

    Args:
        target: ``(host, port)`` to forward to.
        idle_cut: Close a connection idle (no byte either way) for this many seconds; ``None``: never.
    """

    def __init__(self, target: tuple[str, int], *, idle_cut: float | None = None) -> None:
        self.target = target
        self.idle_cut = idle_cut
        #: Connections closed for being idle (``idle_cut``).
        self.idle_cuts = 0
        #: (client, upstream) -> when a byte last went through, either way.
        self._last_active: dict[tuple[socket.socket, socket.socket], float] = {}
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._cut = threading.Event()
        self._hung = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)
        self._thread.start()
        if idle_cut is not None:
            threading.Thread(target=self._cut_idle, name="tcp-proxy-idle", daemon=True).start()

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
            pair = (client, upstream)
            with self._lock:
                self._sockets.update(pair)
                self._last_active[pair] = time.monotonic()
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink, pair), daemon=True).start()

    def _cut_idle(self) -> None:
        assert self.idle_cut is not None
        while not self._closed.wait(0.05):
            now = time.monotonic()
            with self._lock:
                idle = [pair for pair, last in self._last_active.items() if now - last >= self.idle_cut]
                for pair in idle:
                    del self._last_active[pair]
                    self._sockets.difference_update(pair)
                self.idle_cuts += len(idle)
            for pair in idle:
                for sock in pair:
                    _close(sock)

    def _pump(
        self, source: socket.socket, sink: socket.socket, pair: tuple[socket.socket, socket.socket]
    ) -> None:
        try:
            while data := source.recv(65536):
                with self._lock:
                    if pair in self._last_active:
                        self._last_active[pair] = time.monotonic()
                if not self._hung.is_set():
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._last_active.pop(pair, None)
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
def tcp_proxy(target: tuple[str, int], *, idle_cut: float | None = None) -> Iterator[TcpProxy]:
    proxy = TcpProxy(target, idle_cut=idle_cut)
    try:
        yield proxy
    finally:
        proxy.close()
