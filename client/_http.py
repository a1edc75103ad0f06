"""The connection to one service (:class:`Http`): the URL, headers, the one retry policy, transport errors
turned into the user's errors; the only code of the client doing I/O, through a transport (``_transport``).

A call (``_calls.Call``) goes out through ``Http.send`` or ``Http.asend``: a sync method of the saver or
the store and its async twin differ in that line.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any, TypedDict, TypeVar

import httpx

from reducing_saver.client._aiohttp import AiohttpTransport
from reducing_saver.client._calls import Call, finish
from reducing_saver.client._errors import (
    ConnectionSetupError,
    PayloadTooLargeError,
    ReducingSaverError,
    RequestTimeoutError,
    ServerUnavailableError,
    is_database_timeout,
)
from reducing_saver.client._setup import authorization, check_headers, environment_proxy, unfixable_cause
from reducing_saver.client._stdlib_http import ConnectionPool
from reducing_saver.client._transport import (
    Answer,
    AsyncHttpxTransport,
    AsyncTransport,
    ConnectTimeout,
    HttpxTransport,
    LocalProtocolError,
    NetworkError,
    ReadError,
    RemoteProtocolError,
    Request,
    TimeoutException,
    Transport,
    TransportError,
    WriteError,
)
from reducing_saver.wire import JSON, MSGPACK
from reducing_saver.wire.version import __version__

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = httpx.Timeout(30.0, connect=5.0)
#: Answers that mean "try again": a proxy or load balancer found no healthy service.
RETRY_STATUSES = frozenset({502, 503, 504})
#: A connection that breaks while a body this large is being sent is most likely a 413: the service
#: answers an oversized body before reading it and closes the connection, which the client sees as a reset.
LARGE_BODY = 1024 * 1024
MAX_BACKOFF = 10.0
#: The longest pause between the attempts of a start-up request (``startup_budget``).
MAX_STARTUP_BACKOFF = 2.0
#: How long an idempotent call answered 503 keeps being retried, by default: a database restart or
#: failover (the service answers 503 naming the database while it lasts) outlasts ``max_retries``
#: retries a few tenths of a second apart.
RETRY_UNAVAILABLE_FOR = 30.0
#: The longest wait between two retries under that time budget, so a call goes through soon after the
#: service can serve again.
UNAVAILABLE_MAX_DELAY = 2.0
#: Connections per saver (sync and async each): at most ``MAX_CONNECTIONS`` at once; the sync pool keeps
#: at most ``MAX_IDLE_CONNECTIONS`` idle ones, each for ``KEEPALIVE_EXPIRY`` s (httpx's defaults).
MAX_CONNECTIONS = 100
MAX_IDLE_CONNECTIONS = 20
KEEPALIVE_EXPIRY = 5.0

T = TypeVar("T")


def _broke_large_upload(call: Call[Any], exc: TransportError) -> bool:
    return (
        isinstance(exc, (WriteError, ReadError, RemoteProtocolError))
        and call.body is not None
        and len(call.body) > LARGE_BODY
    )


def _retry_after(answer: Answer) -> float:
    try:
        return min(max(float(answer.headers.get("retry-after", 0)), 0.0), MAX_BACKOFF)
    except ValueError:  # an HTTP date: not worth parsing for a floor
        return 0.0


class ConnectionOptions(TypedDict, total=False):
    """How ``RemoteReducingSaver`` and ``RemoteStore`` reach the service: the keyword arguments their
    constructors and ``aopen`` share (the defaults are :class:`Http`'s)."""

    #: Sent as ``Authorization: Bearer <api_key>``; default: ``REDUCING_SAVER_API_KEY``.
    api_key: str | None
    #: Per-request timeout, seconds or ``httpx.Timeout``; ``None`` is refused. Default 30 s (5 s to connect).
    timeout: httpx.Timeout | float
    #: Retries of an idempotent call after a connection error or a 502/503/504. Default 3.
    max_retries: int
    #: First retry delay in seconds, doubled per retry (capped at 10 s), with jitter. Default 0.1.
    backoff: float
    #: How long a 503 or a refused/reset connection keeps being retried past ``max_retries``. Default 30 s.
    retry_unavailable_for: float
    #: Extra headers sent with every request.
    headers: Mapping[str, str] | None
    #: httpx transport for sync calls instead of ``http.client``.
    transport: httpx.BaseTransport | None
    #: httpx transport for async calls instead of aiohttp.
    async_transport: httpx.AsyncBaseTransport | None
    #: Read ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY``/``NO_PROXY``, as httpx does. Default ``True``.
    trust_env: bool


def open_http(url: str, owner: str, options: ConnectionOptions) -> Http:
    """The connection for ``owner`` (``"RemoteStore"``...), refusing an option it does not know by name."""
    unknown = sorted(set(options) - ConnectionOptions.__annotations__.keys())
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    return Http(url, owner=owner, **options)


class Http:
    """The connection to one service: headers, timeout, retries, error mapping; the only code doing I/O."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        max_retries: int = 3,
        backoff: float = 0.1,
        retry_unavailable_for: float = RETRY_UNAVAILABLE_FOR,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
        owner: str = "RemoteReducingSaver",
        trust_env: bool = True,
    ) -> None:
        #: The class using this connection, for messages.
        self.owner = owner
        parsed = httpx.URL(url)
        if parsed.scheme not in ("http", "https"):
            raise ValueError(
                f"{owner} needs the service's http:// or https:// URL, "
                f"got a {parsed.scheme!r} URL (the database URL belongs in the service's settings, "
                "not in the client)"
            )
        if timeout is None:
            raise ValueError("timeout=None would let a call wait forever; pass seconds or an httpx.Timeout")
        if max_retries < 0 or backoff < 0 or retry_unavailable_for < 0:
            raise ValueError("max_retries, backoff and retry_unavailable_for must not be negative")
        #: The URL without credentials, for messages and repr.
        self.url = str(parsed.copy_with(username=None, password=None))
        self.max_retries = max_retries
        self.backoff = backoff
        self.retry_unavailable_for = retry_unavailable_for
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        check_headers(headers or {})
        all_headers = {
            "User-Agent": f"reducing-saver/{__version__}",
            "Accept": JSON,
            "Content-Type": JSON,
            **(headers or {}),
        }
        auth = authorization(parsed, api_key, headers)
        if auth is not None:
            all_headers["Authorization"] = auth
        if parsed.userinfo:
            parsed = parsed.copy_with(username=None, password=None)
        if parsed.query or parsed.fragment:
            raise ValueError(f"the service's URL must not hold a query or fragment, got {self.url!r}")
        #: The base URL's path without its last "/" (``""``, or the prefix a reverse proxy serves the
        #: service under): every API path goes below it.
        self._prefix = parsed.raw_path.decode("ascii").rstrip("/")
        self._base = parsed
        #: For https: what both built-in transports verify with, as ``httpx.HTTPTransport()`` does by
        #: default (certifi's CA bundle, or ``SSL_CERT_FILE``/``SSL_CERT_DIR`` when set), built once.
        self._ssl_context: ssl.SSLContext | None = None
        if parsed.scheme == "https" and (transport is None or async_transport is None):
            self._ssl_context = httpx.create_ssl_context()
            self._ssl_context.set_alpn_protocols(["http/1.1"])
        #: The proxy the built-in transports go through (``HTTP_PROXY``...), or ``None``.
        self._proxy = environment_proxy(parsed) if trust_env else None
        self._proxy_text = None if self._proxy is None else str(self._proxy)
        #: By ``Call.msgpack``: the headers of a JSON call and of a msgpack one.
        self._headers = (all_headers, {**all_headers, "Accept": MSGPACK, "Content-Type": MSGPACK})
        #: Requests by ``(path, msgpack)``, built once: only the body changes from call to call.
        self._requests: dict[tuple[str, bool], Request] = {}
        # Sync calls go through the standard library's http.client, pooled by _stdlib_http: httpx's
        # transport (httpcore and h11, pure Python) costs over twice its CPU per request, and
        # httpx.Client's per-request work (URL merging, cookies, redirects, auth flows) more again
        # (benchmarks/http_clients.py). A transport the caller passes is used as it is, through httpx.
        self._sync: Transport
        if transport is not None:
            self._sync = HttpxTransport(transport, self.timeout)
        else:
            self._sync = ConnectionPool(
                parsed,
                self.timeout,
                proxy=self._proxy,
                ssl_context=self._ssl_context,
                max_connections=MAX_CONNECTIONS,
                max_idle=MAX_IDLE_CONNECTIONS,
                keepalive_expiry=KEEPALIVE_EXPIRY,
            )
        self._async: AsyncTransport
        if async_transport is not None:
            self._async = AsyncHttpxTransport(async_transport, self.timeout)
        else:
            self._async = AiohttpTransport(
                self.timeout,
                max_connections=MAX_CONNECTIONS,
                ssl_context=self._ssl_context,
                proxy=None if self._proxy is None else str(self._proxy),
            )
        self._closed = False

    @property
    def _pool(self) -> ConnectionPool | None:
        """The sync connection pool, when calls go through ``http.client``."""
        return self._sync if isinstance(self._sync, ConnectionPool) else None

    def _request(self, call: Call[Any]) -> Request:
        """``call`` as a transport sends it: the base URL's own path (a reverse proxy's prefix) comes first."""
        request = self._requests.get((call.path, call.msgpack))
        if request is None:
            url = self._base.copy_with(raw_path=(self._prefix + call.path).encode("ascii"))
            request = Request(
                call.method, str(url), url.raw_path.decode("ascii"), self._headers[call.msgpack], None
            )
            self._requests[call.path, call.msgpack] = request
        if call.headers:
            return request._replace(
                method=call.method, body=call.body, headers={**request.headers, **call.headers}
            )
        return request._replace(method=call.method, body=call.body)

    def _exchange(self, call: Call[Any]) -> Answer:
        if self._closed:
            raise RuntimeError(f"this {self.owner} is closed")
        return self._sync.exchange(self._request(call))

    async def _aexchange(self, call: Call[Any]) -> Answer:
        if self._closed:
            raise RuntimeError(f"this {self.owner} is closed")
        return await self._async.exchange(self._request(call))

    def send(self, call: Call[T], *, startup_budget: float | None = None) -> T:
        """Send ``call`` and parse its answer, retried as :meth:`_delay` decides.

        Args:
            startup_budget: At start-up (the capabilities request): retry while the service cannot be
                reached or answers 502/503/504 for this many seconds, not ``max_retries`` times.

        Raises:
            ReducingSaverError: A subclass naming what failed.
        """
        started = time.monotonic()
        for attempt in itertools.count():
            try:
                outcome: Answer | TransportError = self._exchange(call)
            except TransportError as exc:
                outcome = exc
            delay = self._delay(call, attempt, outcome, started, startup_budget)
            if delay is None:
                return self._final(call, outcome)
            time.sleep(delay)
        raise AssertionError("unreachable")

    async def asend(self, call: Call[T], *, startup_budget: float | None = None) -> T:
        """Async :meth:`send`: the same attempts, through the async transport."""
        started = time.monotonic()
        for attempt in itertools.count():
            try:
                outcome: Answer | TransportError = await self._aexchange(call)
            except TransportError as exc:
                outcome = exc
            delay = self._delay(call, attempt, outcome, started, startup_budget)
            if delay is None:
                return self._final(call, outcome)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _final(self, call: Call[T], outcome: Answer | TransportError) -> T:
        if isinstance(outcome, TransportError):
            raise self._transport_error(call, outcome) from outcome
        return finish(call, outcome, self.url)

    def _delay(
        self,
        call: Call[Any],
        attempt: int,
        outcome: Answer | TransportError,
        started: float,
        startup_budget: float | None,
    ) -> float | None:
        """The retry policy, in one place: seconds to wait before the next attempt, ``None`` if final."""
        if startup_budget is None:
            return self._retry_delay(call, attempt, outcome, started)
        return self._startup_delay(call, outcome, attempt + 1, started, startup_budget)

    def _startup_delay(
        self,
        call: Call[Any],
        outcome: Answer | TransportError,
        attempt: int,
        started: float,
        budget: float,
    ) -> float | None:
        """Seconds to wait before asking again at start-up; ``None`` when ``outcome`` is final.

        Unlike after a call, the number of attempts is bounded by time, not ``max_retries``: a service
        that is restarting or not started yet comes up within seconds to a minute. A refused connect or
        one that timed out sent nothing, so it is always safe to try again.

        Raises:
            ServerUnavailableError: Once ``budget`` is spent, naming the URL, the budget and the last error.
        """
        if isinstance(outcome, Answer):
            if outcome.status not in RETRY_STATUSES:
                return None
            reason = f"{outcome.status} {httpx.codes.get_reason_phrase(outcome.status)}"
        elif isinstance(outcome, (NetworkError, RemoteProtocolError, ConnectTimeout)):
            if unfixable_cause(outcome):
                return None
            reason = f"{type(outcome).__name__}: {outcome}"
        else:  # a read timeout, a request HTTP cannot carry: final
            return None
        elapsed = time.monotonic() - started
        remaining = budget - elapsed
        if remaining <= 0:
            raise ServerUnavailableError(
                f"{call.method} {call.path}: the service at {self.url} could not be reached within "
                f"startup_timeout={budget:g} s ({attempt} attempt(s) over {elapsed:.1f} s; last: {reason})"
            )
        delay = min(max(self.backoff, 0.05) * 2.0 ** (attempt - 1), MAX_STARTUP_BACKOFF, remaining)
        delay *= random.uniform(0.8, 1.0)
        logger.warning(
            "%s %s: %s; the service at %s is not up yet, asking again in %.2fs (%.0f s of %g s left)",
            *(call.method, call.path, reason, self.url, delay, remaining, budget),
        )
        return delay

    def _retry_delay(
        self, call: Call[Any], attempt: int, outcome: Answer | Exception, started: float
    ) -> float | None:
        """Seconds to wait before retrying ``call``, or ``None`` when ``outcome`` is final.

        An idempotent call is retried ``max_retries`` times after a connection error or a 502/503/504
        (but not the service's own 504 for a statement its database cancelled: that would take as long
        again, :class:`DatabaseTimeoutError`); past those, a 503 (the service or its database cannot serve *now*) or a refused, reset or
        broken connection (the service is restarting) is retried on, at most ``UNAVAILABLE_MAX_DELAY``
        apart, while the retry would start within ``retry_unavailable_for`` seconds of the first
        attempt. A connection that retrying cannot fix (:func:`unfixable_cause`) is final at once.
        ``max_retries=0`` turns retries off altogether.
        """
        if not call.idempotent or not self.max_retries:
            return None
        floor = 0.0
        if isinstance(outcome, Answer):
            if outcome.status not in RETRY_STATUSES or is_database_timeout(outcome.status, outcome.content):
                return None
            reason = f"{outcome.status} {httpx.codes.get_reason_phrase(outcome.status)}"
            floor = _retry_after(outcome)
            restarting = outcome.status == 503
        elif isinstance(outcome, (NetworkError, RemoteProtocolError)):
            if _broke_large_upload(call, outcome) or unfixable_cause(outcome):
                return None
            reason = type(outcome).__name__
            # Refused, reset or closed mid-answer: what a service that is restarting does.
            restarting = True
        else:
            return None
        delay = max(min(self.backoff * 2.0**attempt, MAX_BACKOFF) * random.uniform(0.5, 1.0), floor)
        if attempt < self.max_retries:
            budget = f"retry {attempt + 1} of {self.max_retries}"
        elif restarting:
            delay = min(delay, max(UNAVAILABLE_MAX_DELAY, floor))
            elapsed = time.monotonic() - started
            if elapsed + delay > self.retry_unavailable_for:
                return None
            budget = f"retrying for up to {self.retry_unavailable_for:g} s ({elapsed:.1f} s so far)"
        else:
            return None
        logger.warning("%s %s: %s; %s in %.2fs", call.method, call.path, reason, budget, delay)
        return delay

    def _transport_error(self, call: Call[Any], exc: TransportError) -> ReducingSaverError:
        where = f"{call.method} {call.path}"
        cause = unfixable_cause(exc)
        if cause:
            return ConnectionSetupError(f"{where}: cannot connect to {self.url}: {cause}")
        if isinstance(exc, TimeoutException):
            return RequestTimeoutError(
                f"{where}: the service at {self.url} did not answer in time "
                f"({type(exc).__name__}; {self.timeout})"
            )
        if _broke_large_upload(call, exc):
            assert call.body is not None
            return PayloadTooLargeError(
                f"{where}: the service closed the connection while receiving a {len(call.body)}-byte body; "
                "the likely cause is a body over the service's request size limit (413)"
            )
        if isinstance(exc, LocalProtocolError):
            # Not an outage: this side built a request HTTP cannot carry. The HTTP library's text quotes the
            # offending header value, which may be a credential, so it stays out of the message.
            return ReducingSaverError(
                f"{where}: the request to {self.url} is not valid HTTP ({type(exc).__name__}; a header "
                "value holds a character HTTP forbids; values are not shown)"
            )
        return ServerUnavailableError(
            f"{where}: could not reach the service at {self.url} ({type(exc).__name__}: {exc})"
        )

    def close(self) -> None:
        self._closed = True
        self._sync.close()

    async def aclose(self) -> None:
        self._closed = True
        await self._async.aclose()
        self._sync.close()


async def off_the_loop(build: Callable[[], T], *, aiohttp_too: bool) -> T:
    """``build()`` in a worker thread: a client's set-up reads files (the TLS context loads the CA bundle),
    and so does importing aiohttp (``aiohttp_too``), which the first async call would otherwise do on the
    loop. For ``aopen`` of the saver and the store, under blocking-call detectors such as Agent Server's."""

    def run() -> T:
        if aiohttp_too:
            import aiohttp  # noqa: F401
        return build()

    return await asyncio.get_running_loop().run_in_executor(None, run)
