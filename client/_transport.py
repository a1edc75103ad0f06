"""Transports: what sends one request to the service and brings its answer back, and nothing else.

A transport is one method, as in httpx (``_transports/base.py``): ``exchange(request) -> Answer`` (async:
``await exchange(request)``), plus ``close``/``aclose``. The client above it (``_http.Http``) decides
everything else: URLs, headers, retries, which errors a user sees. Three stacks implement it:

* ``_stdlib_http.ConnectionPool``: sync, the standard library's ``http.client`` over kept-alive connections
  (the default for sync calls);
* ``_aiohttp.AiohttpTransport``: async, one aiohttp session per event loop (the default for async calls);
* :class:`HttpxTransport` / :class:`AsyncHttpxTransport`: any httpx transport a caller passes
  (``transport=``, ``async_transport=``: ``httpx.MockTransport`` in tests, ``httpx.HTTPTransport(verify=...)``).

A transport raises only the errors below; a foreign library's error is mapped where it enters, most specific
match first, and kept as ``__cause__``::

    TransportError
    ├── TimeoutException      ConnectTimeout, ReadTimeout, WriteTimeout, PoolTimeout
    ├── NetworkError          ConnectError, ReadError, WriteError
    ├── RemoteProtocolError   the connection closed before a whole answer, or an answer that is not HTTP
    └── LocalProtocolError    a request HTTP cannot carry (the message may quote a header: never shown)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol

import httpx


class TransportError(Exception):
    """A request that got no HTTP answer (the root of the transport errors)."""


class TimeoutException(TransportError):
    pass


class ConnectTimeout(TimeoutException):
    pass


class ReadTimeout(TimeoutException):
    pass


class WriteTimeout(TimeoutException):
    pass


class PoolTimeout(TimeoutException):
    pass


class NetworkError(TransportError):
    pass


class ConnectError(NetworkError):
    pass


class ReadError(NetworkError):
    pass


class WriteError(NetworkError):
    pass


class RemoteProtocolError(TransportError):
    pass


class LocalProtocolError(TransportError):
    pass


class Request(NamedTuple):
    """One request: built once per path and content type by the client, sent as it is by a transport."""

    method: str
    #: The whole URL (for aiohttp and httpx).
    url: str
    #: The path and query, the prefix included (for ``http.client``, which knows its origin).
    target: str
    headers: Mapping[str, str]
    body: bytes | None


class Answer(NamedTuple):
    """The service's answer, whichever library carried it; the default transports build no httpx objects."""

    status: int
    #: Case-insensitive: ``httpx.Headers``, or aiohttp's ``CIMultiDictProxy``.
    headers: Mapping[str, str]
    content: bytes


class Transport(Protocol):
    """A sync transport."""

    def exchange(self, request: Request) -> Answer: ...

    def close(self) -> None: ...


class AsyncTransport(Protocol):
    """An async transport."""

    async def exchange(self, request: Request) -> Answer: ...

    async def aclose(self) -> None: ...


#: httpx's errors and ours, most specific first.
_FROM_HTTPX: dict[type[Exception], type[TransportError]] = {
    httpx.ConnectTimeout: ConnectTimeout,
    httpx.ReadTimeout: ReadTimeout,
    httpx.WriteTimeout: WriteTimeout,
    httpx.PoolTimeout: PoolTimeout,
    httpx.TimeoutException: TimeoutException,
    httpx.ConnectError: ConnectError,
    httpx.ReadError: ReadError,
    httpx.WriteError: WriteError,
    httpx.NetworkError: NetworkError,
    httpx.RemoteProtocolError: RemoteProtocolError,
    httpx.LocalProtocolError: LocalProtocolError,
    httpx.TransportError: TransportError,
}


def from_httpx(exc: httpx.TransportError) -> TransportError:
    """Our error for an httpx transport error (the first, most specific, class it is an instance of)."""
    for httpx_class, ours in _FROM_HTTPX.items():
        if isinstance(exc, httpx_class):
            return ours(str(exc))
    return TransportError(str(exc))


def _httpx_request(request: Request, timeout: httpx.Timeout) -> httpx.Request:
    return httpx.Request(
        request.method,
        request.url,
        headers=request.headers,
        content=request.body,
        extensions={"timeout": timeout.as_dict()},
    )


class HttpxTransport:
    """A sync httpx transport (``httpx.BaseTransport``) as a transport of this client."""

    def __init__(self, transport: httpx.BaseTransport, timeout: httpx.Timeout) -> None:
        self._transport = transport
        self._timeout = timeout

    def exchange(self, request: Request) -> Answer:
        try:
            response = self._transport.handle_request(_httpx_request(request, self._timeout))
            try:
                content = response.read()
            finally:
                response.close()
        except httpx.TransportError as exc:
            raise from_httpx(exc) from exc
        return Answer(response.status_code, response.headers, content)

    def close(self) -> None:
        self._transport.close()


class AsyncHttpxTransport:
    """An async httpx transport (``httpx.AsyncBaseTransport``) as a transport of this client."""

    def __init__(self, transport: httpx.AsyncBaseTransport, timeout: httpx.Timeout) -> None:
        self._transport = transport
        self._timeout = timeout

    async def exchange(self, request: Request) -> Answer:
        try:
            response = await self._transport.handle_async_request(_httpx_request(request, self._timeout))
            try:
                content = await response.aread()
            finally:
                await response.aclose()
        except httpx.TransportError as exc:
            raise from_httpx(exc) from exc
        return Answer(response.status_code, response.headers, content)

    async def aclose(self) -> None:
        await self._transport.aclose()
