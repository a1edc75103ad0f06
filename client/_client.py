"""RemoteReducingSaver: a LangGraph checkpointer that stores through the reducing-saver service.

Every decision that is not I/O is shared between the sync and async paths: a saver method builds a
``_Call`` (HTTP method, path, JSON body, whether it may be retried, and the parser of the answer), and
``_Http.send`` / ``_Http.asend`` only send it through a transport (``_transport``: one ``exchange``
method), retry it and map failures to ``ReducingSaverError``s. A sync method and its async twin differ
in their ``send`` line.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import os
import random
import re
import socket
import ssl
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from importlib import metadata as importlib_metadata
from typing import Any, Generic, Self, TypedDict, TypeVar, Unpack
from urllib.parse import quote

import httpx
import orjson
import ormsgpack
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.types import _DeltaSnapshot

from reducing_saver.client._errors import (
    ConnectionSetupError,
    PayloadTooLargeError,
    ReducingSaverError,
    RequestTimeoutError,
    ServerUnavailableError,
    error_from_response,
    is_database_timeout,
)
from reducing_saver.client._serde import SafeJsonPlusSerializer
from reducing_saver.client._aiohttp import AiohttpTransport
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
from reducing_saver.wire import (
    CAPABILITIES_PATH,
    DELTA_HISTORY_PATH,
    GET_PATH,
    JSON,
    LIST_PATH,
    PUT_PATH,
    RUNS_DELETE_PATH,
    THREAD_COPY_PATH,
    THREAD_DELETE_PATH,
    THREAD_PRUNE_PATH,
    WRITES_PATH,
    MSGPACK,
    STORAGE_PATH,
    THREAD_STORAGE_PATH,
    Blob,
    WireError,
    channel_value_from_wire,
    checkpoint_fields,
    config_to_wire,
    int_to_wire,
    ints_from_wire,
    ints_to_wire,
    is_inline,
    json_default,
    json_loads,
    msgpack_default,
)
from reducing_saver.wire import bodies
from reducing_saver.wire.capabilities import OPTIONAL_CAPABILITIES, with_capabilities

try:
    __version__ = importlib_metadata.version("reducing-saver")
except importlib_metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

logger = logging.getLogger(__name__)

API_KEY_ENV = "REDUCING_SAVER_API_KEY"
DEFAULT_TIMEOUT = httpx.Timeout(30.0, connect=5.0)
#: Answers that mean "try again": a proxy or load balancer found no healthy service.
RETRY_STATUSES = frozenset({502, 503, 504})
#: A connection that breaks while a body this large is being sent is most likely a 413: the service
#: answers an oversized body before reading it and closes the connection, which the client sees as a reset.
LARGE_BODY = 1024 * 1024
MAX_BACKOFF = 10.0
#: How long the constructor keeps asking a service that cannot be reached (a replica restarting, a
#: service started after its agents), and the longest pause between its attempts.
DEFAULT_STARTUP_TIMEOUT = 30.0
MAX_STARTUP_BACKOFF = 2.0
#: How long an idempotent call answered 503 keeps being retried, by default: a database restart or
#: failover (the service answers 503 naming the database while it lasts) outlasts ``max_retries``
#: retries a few tenths of a second apart.
RETRY_UNAVAILABLE_FOR = 30.0
#: The longest wait between two retries under that time budget, so a call goes through soon after the
#: service can serve again.
UNAVAILABLE_MAX_DELAY = 2.0
#: Connections per saver (sync and async each): at most ``max_connections`` at once; the sync pool keeps
#: at most ``max_keepalive_connections`` idle ones, each for ``keepalive_expiry`` s.
LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20)
#: Backends whose saver reads a channel's value only when the channel is in ``new_versions``. PostgresSaver
#: does so for blobs, but keeps primitive values inline in every checkpoint row: those always travel.
SPARSE_BACKENDS = frozenset({"postgres", "memory"})
INLINE_IN_EVERY_ROW = frozenset({"postgres"})
#: Threads the client remembers having told about an unwindowed DeltaChannel (forgotten all at once past it).
NOTICED_THREADS = 10_000
_ABSENT = object()
#: ``body_format`` values: the per-step calls' bodies (other calls are always JSON).
BODY_FORMAT_NAMES = {"msgpack": MSGPACK, "json": JSON}

T = TypeVar("T")


# -- what the service says about itself -----------------------------------------------------------


@dataclass(frozen=True)
class RemoteReducer:
    """The reducer the service applies, as ``GET /v1/capabilities`` describes it (read-only).

    A ``RemoteReducingSaver`` always carries one, so wrapping it in a local ``ReducingSaver`` (which
    would reduce, and deliver pruned messages, a second time) raises ``ValueError``.
    """

    max_messages: int | None
    min_messages: int | None
    max_tokens: int | None
    target_tokens: int | None
    preserve_first: bool
    cascade_tool_messages: bool
    start_on: str | None
    namespace_key: str


@dataclass(frozen=True)
class _ServerInfo:
    capabilities: frozenset[str]
    backend: str
    messages_key: str
    reducer: RemoteReducer
    version: str
    #: Content types the per-step routes accept (a service older than msgpack bodies: JSON only).
    body_formats: frozenset[str]
    #: The most checkpoints one list answer holds; ``None`` from a service that does not say (one that
    #: answers a list without a limit in full).
    max_list_limit: int | None


def _parse_server_info(body: Any) -> _ServerInfo:
    advertised = body["capabilities"]
    unknown = sorted(set(advertised) - OPTIONAL_CAPABILITIES.keys())
    if unknown:  # a newer service; its extra capabilities stay unused
        logger.info("ignoring capabilities this client does not know: %s", unknown)
    reducer = body["reducer"]
    return _ServerInfo(
        capabilities=frozenset(name for name in advertised if name in OPTIONAL_CAPABILITIES),
        backend=body["backend"],
        messages_key=body["messages_key"],
        reducer=RemoteReducer(**{f.name: reducer[f.name] for f in fields(RemoteReducer)}),
        version=body["version"],
        body_formats=frozenset(body.get("body_formats") or (JSON,)),
        max_list_limit=_list_page_size(body.get("limits")),
    )


def _list_page_size(limits: Any) -> int | None:
    cap = limits.get("max_list_limit") if isinstance(limits, Mapping) else None
    return cap if type(cap) is int and cap > 0 else None


# -- calls: everything about a request except sending it ------------------------------------------


@dataclass(frozen=True, slots=True)
class _Call(Generic[T]):
    method: str
    path: str
    body: bytes | None
    idempotent: bool
    #: Turns the decoded answer (``None`` for an empty one) into the result.
    parse: Callable[[Any], T]
    #: The body is msgpack (else JSON).
    msgpack: bool = False


def _no_content(body: Any) -> None:
    return None


def _as_given(body: Any) -> Any:
    return body


def _post(
    path: str,
    body: Mapping[str, Any],
    parse: Callable[[Any], T],
    *,
    idempotent: bool = True,
    msgpack: bool = False,
) -> _Call[T]:
    """A POST whose ``body`` may hold :class:`Blob` values (base64 in JSON, ``bin`` in msgpack)."""
    if msgpack:
        content = ormsgpack.packb(body, default=msgpack_default)
        return _Call("POST", path, content, idempotent, parse, msgpack=True)
    return _Call("POST", path, orjson.dumps(body, default=json_default), idempotent, parse)


def _capabilities_call() -> _Call[_ServerInfo]:
    return _Call("GET", CAPABILITIES_PATH, None, True, _parse_server_info)


def _stored_inline(value: Any) -> bool:
    """What PostgresSaver keeps inline in every checkpoint row: None, str, int (of any size), float, bool."""
    return is_inline(value) or type(value) is int


def _parse_put(body: Any) -> RunnableConfig:
    return body["config"]


def _loads(answer: Answer) -> Any:
    """The answer's body, decoded by its content type (msgpack only when the call asked for it)."""
    if not answer.content:
        return None
    if answer.headers.get("content-type", "").startswith(MSGPACK):
        return ormsgpack.unpackb(answer.content)
    return json_loads(answer.content)  # ints beyond 64 bits exactly: store values PostgreSQL keeps


# -- I/O --------------------------------------------------------------------------------------------


def _broke_large_upload(call: _Call[Any], exc: TransportError) -> bool:
    return (
        isinstance(exc, (WriteError, ReadError, RemoteProtocolError))
        and call.body is not None
        and len(call.body) > LARGE_BODY
    )


#: ``getaddrinfo`` errors that say the name does not exist (a temporary failure, ``EAI_AGAIN``, may pass).
_NO_SUCH_HOST = frozenset(
    getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA", "EAI_FAIL") if hasattr(socket, name)
)


def unfixable_cause(exc: BaseException) -> str | None:
    """What makes a connection fail whatever the service does (one line), or ``None``.

    An unknown host, ``https://`` against a service that speaks plain HTTP, and a TLS certificate that
    does not verify are mistakes of the URL or of the set-up: waiting for the service cannot fix them,
    so no retry (nor ``startup_timeout``) waits on them. Looks through the chain of causes that
    ``http.client``, aiohttp and httpx transports leave (``__cause__``, aiohttp's ``os_error`` and
    ``certificate_error``).
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        # aiohttp's wrappers subclass the ssl errors without their attributes: theirs are further down.
        if isinstance(current, ssl.SSLCertVerificationError) and hasattr(current, "verify_message"):
            return (
                f"its TLS certificate does not verify (CERTIFICATE_VERIFY_FAILED: {current.verify_message}); "
                "to trust a CA of your own, set SSL_CERT_FILE"
            )
        if isinstance(current, ssl.SSLError) and getattr(current, "reason", None) == "WRONG_VERSION_NUMBER":
            return "the service answers in plain HTTP, not TLS (WRONG_VERSION_NUMBER): use an http:// URL"
        if isinstance(current, socket.gaierror) and current.errno in _NO_SUCH_HOST:
            return f"no such host ({current.strerror})"
        pending += [
            current.__cause__,
            current.__context__,
            getattr(current, "os_error", None),
            getattr(current, "certificate_error", None),
        ]
    return None


def _retry_after(answer: Answer) -> float:
    try:
        return min(max(float(answer.headers.get("retry-after", 0)), 0.0), MAX_BACKOFF)
    except ValueError:  # an HTTP date: not worth parsing for a floor
        return 0.0


def _redirect_error(call: _Call[Any], answer: Answer, url: str) -> ReducingSaverError:
    """A redirect is never followed (the body and the credentials would go where it says): an error."""
    status = f"{answer.status} {httpx.codes.get_reason_phrase(answer.status)}".strip()
    return ReducingSaverError(
        f"{call.method} {call.path}: {url} answered {status}, a redirect to "
        f"{answer.headers.get('location', '(no Location)')}; the client does not follow redirects: "
        "give it the URL of the service itself",
        status_code=answer.status,
        request_id=answer.headers.get("x-request-id"),
    )


def _finish(call: _Call[T], answer: Answer, url: str) -> T:
    if 300 <= answer.status < 400:
        raise _redirect_error(call, answer, url)
    if not 200 <= answer.status < 300:
        response = httpx.Response(answer.status, headers=answer.headers.items(), content=answer.content)
        raise error_from_response(response, method=call.method, path=call.path)
    try:
        body = _loads(answer)
        if body is None and call.parse is not _no_content:
            raise WireError("body", "the answer is empty")
    except (orjson.JSONDecodeError, ormsgpack.MsgpackDecodeError, WireError) as exc:
        raise _not_the_api(call, answer, exc) from exc
    try:
        return call.parse(body)
    except KeyError as exc:
        raise _not_the_api(call, answer, exc) from exc
    except WireError as exc:  # the answer has the API's shape; a value in it is not readable here
        raise ReducingSaverError(
            f"{call.method} {call.path}: the answer holds a value this client cannot read ({exc})",
            status_code=answer.status,
            request_id=answer.headers.get("x-request-id"),
        ) from exc


def _not_the_api(call: _Call[Any], answer: Answer, exc: Exception) -> ReducingSaverError:
    return ReducingSaverError(
        f"{call.method} {call.path}: the answer does not follow the reducing-saver API "
        f"({type(exc).__name__}: {exc}); is the URL that of a reducing-saver service?",
        status_code=answer.status,
        request_id=answer.headers.get("x-request-id"),
    )


#: What an HTTP header value may hold (RFC 9110 field-vchar and inner spaces); h11 (under an httpx
#: transport) refuses anything else at send time with an error that quotes the value.
_HEADER_VALUE = re.compile(r"[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*")
#: What an HTTP header name may be (an RFC 9110 token). http.client sends some names that are not (one
#: holding a space), which the server then refuses with a 400.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def _clean_api_key(api_key: str | None) -> str | None:
    """The API key to send: the argument, else ``REDUCING_SAVER_API_KEY``, without surrounding whitespace.

    A key read from a secret file usually ends with a newline, which is not part of the key; it is
    stripped. A key that still holds a character no header may carry is refused here, naming where it
    came from but never the key (http.client or h11 would refuse it on the first request, quoting it).
    """
    source = "api_key"
    if api_key is None:
        api_key, source = os.environ.get(API_KEY_ENV), API_KEY_ENV
    if api_key is None:
        return None
    api_key = api_key.strip()
    if api_key and not _HEADER_VALUE.fullmatch(api_key):
        raise ValueError(
            f"{source} holds a character an HTTP header cannot carry (a control character, an inner line "
            "break or a non-ASCII character); the key is not shown"
        )
    return api_key


def environment_proxy(url: httpx.URL) -> httpx.URL | None:
    """The proxy the environment names for ``url``, as httpx's ``trust_env`` reads it, or ``None``.

    ``HTTPS_PROXY``/``HTTP_PROXY`` by the URL's scheme, else ``ALL_PROXY`` (upper or lower case);
    ``NO_PROXY`` (host names, domains, ``*``) leaves hosts out. The proxy must be an ``http://`` URL
    (credentials in it are sent as ``Proxy-Authorization``); ``https://`` targets go through a
    ``CONNECT`` tunnel, ``http://`` ones as absolute-form requests.

    Raises:
        ValueError: If the variable names a proxy of another scheme (``socks5://``, ``https://``).
    """
    proxies = urllib.request.getproxies_environment()
    name, proxy = url.scheme, proxies.get(url.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass_environment(url.host, proxies):
        return None
    if "://" not in proxy:  # "proxy:3128", as curl and httpx accept it
        proxy = f"http://{proxy}"
    parsed = httpx.URL(proxy)
    if parsed.scheme != "http":
        raise ValueError(
            f"the environment's proxy for {name}:// URLs is a {parsed.scheme}:// URL; the client speaks to "
            "http:// proxies only (pass trust_env=False to ignore HTTP_PROXY/HTTPS_PROXY/ALL_PROXY)"
        )
    return parsed


def _basic_auth(url: httpx.URL, api_key: str | None, headers: Mapping[str, str] | None) -> str:
    """The ``Authorization`` header for the credentials of ``http://user:password@host``.

    Both transports send them, as Basic auth (for a reverse proxy that asks for it). A request carries
    one ``Authorization`` header, so credentials in the URL together with an API key or an
    ``Authorization`` header of ``headers`` are refused, naming both.
    """
    other = "an api_key (or REDUCING_SAVER_API_KEY)" if api_key else None
    if any(name.lower() == "authorization" for name in headers or ()):
        other = "headers['Authorization']"
    if other:
        raise ValueError(
            f"the URL holds credentials (user:password@, sent as Basic auth) and {other} is given: a "
            "request carries one Authorization header; keep one of them"
        )
    credentials = f"{url.username}:{url.password}".encode()
    return "Basic " + base64.b64encode(credentials).decode("ascii")


class ConnectionOptions(TypedDict, total=False):
    """How ``RemoteReducingSaver`` and ``RemoteStore`` reach the service: the keyword arguments their
    constructors and ``aopen`` share (the defaults are :class:`_Http`'s)."""

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


def open_http(url: str, owner: str, options: ConnectionOptions) -> _Http:
    """The connection for ``owner`` (``"RemoteStore"``...), refusing an option it does not know by name."""
    unknown = sorted(set(options) - ConnectionOptions.__annotations__.keys())
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    return _Http(url, owner=owner, **options)


class _Http:
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
                "RemoteReducingSaver needs the service's http:// or https:// URL, "
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
        all_headers = {
            "User-Agent": f"reducing-saver/{__version__}",
            "Accept": JSON,
            "Content-Type": JSON,
            **(headers or {}),
        }
        for name, value in (headers or {}).items():
            if not _HEADER_NAME.fullmatch(name):
                raise ValueError(f"headers[{name!r}]: not a valid HTTP header name")
            # Refused here, by name: at send time http.client, h11 or aiohttp would quote the value, maybe a
            # secret.
            if value and not _HEADER_VALUE.fullmatch(value):
                raise ValueError(
                    f"headers[{name!r}] holds a character an HTTP header cannot carry (a control character, "
                    "a line break or a non-ASCII character); the value is not shown"
                )
        api_key = _clean_api_key(api_key)
        if api_key:
            all_headers["Authorization"] = f"Bearer {api_key}"
        if parsed.userinfo:
            all_headers["Authorization"] = _basic_auth(parsed, api_key, headers)
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
        #: By ``_Call.msgpack``: the headers of a JSON call and of a msgpack one.
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
                max_connections=LIMITS.max_connections,
                max_idle=LIMITS.max_keepalive_connections,
                keepalive_expiry=LIMITS.keepalive_expiry,
            )
        self._async: AsyncTransport
        if async_transport is not None:
            self._async = AsyncHttpxTransport(async_transport, self.timeout)
        else:
            self._async = AiohttpTransport(
                self.timeout,
                max_connections=LIMITS.max_connections,
                ssl_context=self._ssl_context,
                proxy=None if self._proxy is None else str(self._proxy),
            )
        self._closed = False

    @property
    def _pool(self) -> ConnectionPool | None:
        """The sync connection pool, when calls go through ``http.client``."""
        return self._sync if isinstance(self._sync, ConnectionPool) else None

    def _request(self, call: _Call[Any]) -> Request:
        """``call`` as a transport sends it: the base URL's own path (a reverse proxy's prefix) comes first."""
        request = self._requests.get((call.path, call.msgpack))
        if request is None:
            url = self._base.copy_with(raw_path=(self._prefix + call.path).encode("ascii"))
            request = Request(
                call.method, str(url), url.raw_path.decode("ascii"), self._headers[call.msgpack], None
            )
            self._requests[call.path, call.msgpack] = request
        return request._replace(method=call.method, body=call.body)

    def _exchange(self, call: _Call[Any]) -> Answer:
        if self._closed:
            raise RuntimeError(f"this {self.owner} is closed")
        return self._sync.exchange(self._request(call))

    async def _aexchange(self, call: _Call[Any]) -> Answer:
        if self._closed:
            raise RuntimeError(f"this {self.owner} is closed")
        return await self._async.exchange(self._request(call))

    def send(self, call: _Call[T], *, startup_budget: float | None = None) -> T:
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

    async def asend(self, call: _Call[T], *, startup_budget: float | None = None) -> T:
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

    def _final(self, call: _Call[T], outcome: Answer | TransportError) -> T:
        if isinstance(outcome, TransportError):
            raise self._transport_error(call, outcome) from outcome
        return _finish(call, outcome, self.url)

    def _delay(
        self,
        call: _Call[Any],
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
        call: _Call[Any],
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
        delay = min(max(self.backoff, 0.05) * 2 ** (attempt - 1), MAX_STARTUP_BACKOFF, remaining)
        delay *= random.uniform(0.8, 1.0)
        logger.warning(
            "%s %s: %s; the service at %s is not up yet, asking again in %.2fs (%.0f s of %g s left)",
            *(call.method, call.path, reason, self.url, delay, remaining, budget),
        )
        return delay

    def _retry_delay(
        self, call: _Call[Any], attempt: int, outcome: Answer | Exception, started: float
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
        delay = max(min(self.backoff * 2**attempt, MAX_BACKOFF) * random.uniform(0.5, 1.0), floor)
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

    def _transport_error(self, call: _Call[Any], exc: TransportError) -> ReducingSaverError:
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


# -- the saver --------------------------------------------------------------------------------------


def _check_saver_options(body_format: str, startup_timeout: float) -> None:
    if body_format not in BODY_FORMAT_NAMES:
        raise ValueError(f"body_format must be one of {sorted(BODY_FORMAT_NAMES)}, got {body_format!r}")
    if not startup_timeout >= 0:
        raise ValueError(f"startup_timeout must be seconds, 0 or more, got {startup_timeout!r}")


class RemoteReducingSaver(BaseCheckpointSaver[str]):
    """A LangGraph checkpointer backed by a reducing-saver service; use it where you would use PostgresSaver.

    The service keeps every stored checkpoint's messages channel to a bounded window; this client only
    (de)serializes with its ``serde`` and talks HTTP. The constructor asks the service for its
    capabilities (blocking; for up to ``startup_timeout`` seconds while the service is down) and returns an instance of the class variant that has exactly
    the optional methods the service's backend supports (``copy_thread``, ``delete_for_runs``, ``prune``,
    ``get_delta_channel_history`` and their async twins), so capability probes see the truth.

    Sync calls share a thread-safe pool of kept-alive ``http.client`` connections (the standard
    library's); async calls one aiohttp session per event loop, created on first use and closed when that
    loop shuts down (``benchmarks/http_clients.py`` shows why: httpx's client layers, and for sync calls
    its transport too, cost more CPU than the request). Close with ``close()``/``aclose()`` or use
    ``with``/``async with``.

    Args:
        url: The service's base URL, e.g. ``"http://reducing-saver:8000"``.
        api_key: Sent as ``Authorization: Bearer <api_key>``; defaults to the ``REDUCING_SAVER_API_KEY``
            environment variable. Surrounding whitespace (a secret file's trailing newline) is stripped;
            a key holding any other character a header cannot carry raises ``ValueError`` naming the
            parameter or variable. Never shown in ``repr`` or in error messages.
        timeout: Per-request timeout (seconds or ``httpx.Timeout``); ``None`` is refused.
        serde: Serializer for channel and write values, e.g. an ``EncryptedSerializer`` (the service then
            stores bytes it cannot read, and cannot reduce them). Defaults to ``SafeJsonPlusSerializer``:
            ``JsonPlusSerializer``'s bytes, read without importing or calling what a stored value names
            unless it is one of LangGraph's safe types or a pydantic model, dataclass, Enum or namedtuple
            loaded in this process.
        max_retries: Retries of an idempotent call after a connection error or a 502/503/504.
            ``copy_thread`` is never retried, and timeouts are not (the call may have run; the time
            budget is spent). A ``Retry-After`` header sets a floor on the delay.
        backoff: First retry delay in seconds; doubled per retry (capped at 10 s), with jitter.
        retry_unavailable_for: Seconds during which an idempotent call answered 503 (the service or
            its database is unavailable: a database restart, a failover) or whose connection was
            refused or reset (the service is restarting) keeps being retried after its
            ``max_retries`` retries (unless that is 0), at most 2 s apart; counted from the call's first
            attempt. ``0`` leaves only ``max_retries``. Past it the call raises
            ``ServerUnavailableError``.
        headers: Extra headers sent with every request.
        transport: httpx transport for sync calls instead of ``http.client`` (tests pass
            ``httpx.MockTransport``; ``httpx.HTTPTransport(verify=...)`` trusts a CA of your own).
        async_transport: httpx transport for async calls instead of aiohttp.
        body_format: ``"msgpack"`` (default) sends the per-step calls (``get_tuple``, ``put``,
            ``put_writes``) as ``application/msgpack``, their values' bytes as they are; ``"json"``
            sends them as JSON with base64 values, as every other call is. A service that does not
            offer msgpack is spoken to in JSON.
        startup_timeout: How long, in seconds, the constructor (and ``aopen``) keeps asking for the
            service's capabilities while it cannot be reached or answers 502/503/504 (a replica
            restarting, an agent started before its service), pausing ``backoff`` doubled per attempt,
            at most 2 s. ``0``: one attempt. Default 30. An unknown host, ``https://`` against a
            plain-HTTP service or a certificate that does not verify fails at once
            (``ConnectionSetupError``).
        trust_env: Go through the proxy ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` name, unless
            ``NO_PROXY`` exempts the host, as an httpx client does by default. ``False`` ignores them.

    A path in ``url`` (``http://host/rs/``) prefixes every request; credentials in it
    (``http://user:pw@host``) are sent as Basic auth (refused together with ``api_key``); a redirect
    is reported, never followed (``docs/client.md`` says how the client behaves on a network).

    Attributes:
        reducer: The service's reducer configuration (``RemoteReducer``), never ``None``.
        backend: The service's storage backend: ``"postgres"``, ``"sqlite"`` or ``"memory"``.
        messages_key: The channel the service reduces.
        capabilities: The optional capabilities of this instance's class.
        server_version: The service's version.
        max_list_limit: The most checkpoints the service answers to one list request (``list`` pages
            past it), or ``None`` for a service that does not say.
        body_format: The per-step calls' content type: ``"application/msgpack"`` or ``"application/json"``.

    Raises:
        ValueError: If ``url`` is not an http(s) URL, an option is out of range, or the API key or a
            value of ``headers`` holds a character a header cannot carry (named, never shown).
        ServerUnavailableError: If the service could not be reached within ``startup_timeout``; the
            message names the URL and how long the constructor tried.
        ReducingSaverError: If the capabilities request fails otherwise (a subclass names the reason).
    """

    capabilities: frozenset[str] = frozenset()
    #: The content type of the per-step calls' bodies, as agreed with the service.
    body_format: str
    reducer: RemoteReducer
    backend: str
    messages_key: str
    server_version: str
    max_list_limit: int | None
    _http: _Http

    # The class of the instance depends on the service's answer, so construction happens here.
    def __new__(
        cls,
        url: str,
        *,
        serde: SerializerProtocol | None = None,
        body_format: str = "msgpack",
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        **options: Unpack[ConnectionOptions],
    ) -> Self:
        _check_saver_options(body_format, startup_timeout)
        http = open_http(url, cls.__name__, options)
        try:
            info = http.send(_capabilities_call(), startup_budget=startup_timeout)
        except BaseException:
            http.close()
            raise
        return cls._from_server_info(http, info, serde=serde, body_format=body_format)

    @classmethod
    async def aopen(
        cls,
        url: str,
        *,
        serde: SerializerProtocol | None = None,
        body_format: str = "msgpack",
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        **options: Unpack[ConnectionOptions],
    ) -> Self:
        """Open a saver from async code without blocking the event loop; the arguments are the constructor's.

        The constructor's capabilities request is sent through the async transport (aiohttp, or
        ``async_transport``), retried for ``startup_timeout`` seconds as the constructor does, and the
        set-up that reads files (TLS certificates, importing aiohttp) runs in a worker thread, so a
        blocking-call detector such as LangGraph Agent Server's finds nothing.

        Raises:
            ValueError: If ``url`` is not an http(s) URL or an option is out of range.
            ServerUnavailableError: If the service could not be reached within ``startup_timeout``.
            ReducingSaverError: If the capabilities request fails otherwise (a subclass names the reason).
        """
        _check_saver_options(body_format, startup_timeout)
        http = await off_the_loop(
            lambda: open_http(url, cls.__name__, options), aiohttp_too=options.get("async_transport") is None
        )
        try:
            info = await http.asend(_capabilities_call(), startup_budget=startup_timeout)
        except BaseException:
            await http.aclose()
            raise
        return cls._from_server_info(http, info, serde=serde, body_format=body_format)

    @classmethod
    def _from_server_info(
        cls, http: _Http, info: _ServerInfo, *, serde: SerializerProtocol | None, body_format: str
    ) -> Self:
        """The instance of the class variant carrying exactly the service's capabilities (no I/O)."""
        self = object.__new__(with_capabilities(cls, info.capabilities, _MIXINS))
        BaseCheckpointSaver.__init__(self, serde=serde if serde is not None else SafeJsonPlusSerializer())
        self._http = http
        self.reducer = info.reducer
        self.backend = info.backend
        self.messages_key = info.messages_key
        self.server_version = info.version
        self.max_list_limit = info.max_list_limit
        wanted = BODY_FORMAT_NAMES[body_format]
        self.body_format = wanted if wanted in info.body_formats else JSON
        self._msgpack = self.body_format == MSGPACK
        self._noticed: set[tuple[str, str]] = set()
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Everything is set up by ``__new__`` (see the class docstring for the arguments)."""

    def __copy__(self) -> Self:
        # BaseCheckpointSaver.with_allowlist copies the saver; the copy shares the connection pools.
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        return clone

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self._http.url!r}, backend={self.backend!r}, "
            f"capabilities={sorted(self.capabilities)})"
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def close(self) -> None:
        """Close the sync connection pool (in async code use ``aclose``, which closes both)."""
        self._http.close()

    async def aclose(self) -> None:
        """Close the async and sync connection pools."""
        await self._http.aclose()

    def get_next_version(self, current: str | float | None, channel: None) -> str:
        """The next channel version, computed locally in the format of ``PostgresSaver``/``InMemorySaver``."""
        if current is None:
            n = 0
        elif isinstance(current, str):
            n = int(current.split(".", 1)[0])
        else:
            n = int(current)
        return f"{n + 1:032}.{random.random():016}"

    # -- encoding and decoding, shared by sync and async --------------------------------------------

    def _config(self, config: RunnableConfig | None) -> dict | None:
        return config_to_wire(config, namespace_key=self.reducer.namespace_key)

    def _encode_value(self, value: Any) -> Any:
        if is_inline(value):
            return value
        # An int beyond 64 bits has a wire form of its own (the serde's msgpack cannot write one).
        return int_to_wire(value) or Blob(*self.serde.dumps_typed(value))

    def _decode_value(self, value: Any, field: str) -> Any:
        # channel_value_from_wire turns the wire form of a big int into the int, without the serde.
        decoded = channel_value_from_wire(value, field)
        return self.serde.loads_typed((decoded.type, decoded.data)) if isinstance(decoded, Blob) else decoded

    def _decode_writes(self, writes: Sequence[Sequence[Any]], field: str) -> list[tuple[str, str, Any]]:
        return [
            (task_id, channel, self._decode_value(value, f"{field}[{i}]"))
            for i, (task_id, channel, value) in enumerate(writes)
        ]

    def _decode_tuple(self, wire: Mapping[str, Any]) -> CheckpointTuple:
        checkpoint = {
            **wire["checkpoint"],
            "channel_values": {
                channel: self._decode_value(value, f"values.{channel}")
                for channel, value in wire["values"].items()
            },
        }
        return CheckpointTuple(
            config=wire["config"],
            checkpoint=checkpoint,  # type: ignore[arg-type]
            metadata=ints_from_wire(wire["metadata"], "metadata"),
            parent_config=wire.get("parent_config"),
            pending_writes=self._decode_writes(wire.get("pending_writes") or [], "pending_writes"),
        )

    def _parse_get(self, body: Any) -> CheckpointTuple | None:
        wire = body["checkpoint"]
        return None if wire is None else self._decode_tuple(wire)

    def _parse_list(self, body: Any) -> list[CheckpointTuple]:
        return [self._decode_tuple(wire) for wire in body["checkpoints"]]

    # -- calls, shared by sync and async ------------------------------------------------------------

    def _get_tuple_call(self, config: RunnableConfig) -> _Call[CheckpointTuple | None]:
        body = bodies.GetCheckpointBody(config=self._config(config))
        return _post(GET_PATH, body, self._parse_get, msgpack=self._msgpack)

    def _list_call(
        self,
        config: RunnableConfig | None,
        filter: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
    ) -> _Call[list[CheckpointTuple]]:
        body = bodies.ListCheckpointsBody(
            config=self._config(config), filter=filter, before=self._config(before), limit=limit
        )
        return _post(LIST_PATH, body, self._parse_list)

    def _list_page(
        self,
        config: RunnableConfig | None,
        filter: dict[str, Any] | None,
        before: RunnableConfig | None,
        remaining: int | None,
    ) -> tuple[_Call[list[CheckpointTuple]], int | None]:
        """The call for the next page of a list, and the page's size (``None``: the answer is all there is).

        A page holds at most the service's ``max_list_limit`` checkpoints; ``remaining`` is what is left
        of the caller's ``limit`` (``None``: no limit). A service that does not say its cap gets the
        caller's request as it is.
        """
        cap = self.max_list_limit
        if cap is None:
            return self._list_call(config, filter, before, remaining), None
        size = cap if remaining is None else min(cap, remaining)
        return self._list_call(config, filter, before, size), size

    @staticmethod
    def _next_page(
        page: list[CheckpointTuple], size: int | None, remaining: int | None
    ) -> tuple[bool, int | None, RunnableConfig | None]:
        """``(more, remaining, before)`` after ``page``: the next page starts below its last checkpoint."""
        if remaining is not None:
            remaining -= len(page)
        if size is None or len(page) < size or not page or (remaining is not None and remaining <= 0):
            return False, remaining, None
        return True, remaining, page[-1].config

    def _put_call(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> _Call[RunnableConfig]:
        values = checkpoint["channel_values"]
        if self.messages_key in new_versions:
            self._notice_unwindowed(config, values.get(self.messages_key, _ABSENT))
        if self.backend in SPARSE_BACKENDS:  # send only what the backend will store
            keep_inline = self.backend in INLINE_IN_EVERY_ROW
            values = {
                channel: value
                for channel, value in values.items()
                if channel in new_versions or (keep_inline and _stored_inline(value))
            }
        body = bodies.PutCheckpointBody(
            config=self._config(config),
            checkpoint=checkpoint_fields(checkpoint),
            values={channel: self._encode_value(value) for channel, value in values.items()},
            metadata=ints_to_wire(metadata),
            new_versions=new_versions,
        )
        return _post(PUT_PATH, body, _parse_put, msgpack=self._msgpack)

    def _notice_unwindowed(self, config: RunnableConfig, value: Any) -> None:
        """Log once per thread (and namespace) that the service's window cannot apply to its messages
        channel: a DeltaChannel (absent from the checkpoint, or a snapshot) is rebuilt from its writes, so
        the service stores it as written."""
        if value is not _ABSENT and not isinstance(value, _DeltaSnapshot):
            return
        reducer = self.reducer
        window = (
            f"max_messages={reducer.max_messages}" if reducer.max_messages else
            f"max_tokens={reducer.max_tokens}" if reducer.max_tokens else None
        )
        configurable = config.get("configurable") or {}
        thread = (str(configurable.get("thread_id")), str(configurable.get("checkpoint_ns") or ""))
        if window is None or thread in self._noticed:
            return
        if len(self._noticed) >= NOTICED_THREADS:
            self._noticed.clear()
        self._noticed.add(thread)
        logger.info(
            "thread %r: channel %r is a DeltaChannel, rebuilt from its writes; the service's window (%s) "
            "does not apply to it: it is stored as written, and the messages the agent removes reach "
            "long-term memory (docs/memory.md)",
            thread[0],
            self.messages_key,
            window,
        )

    def _put_writes_call(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str
    ) -> _Call[None]:
        body = bodies.PutWritesBody(
            config=self._config(config),
            writes=[
                [channel, int_to_wire(value) or Blob(*self.serde.dumps_typed(value))]
                for channel, value in writes
            ],
            task_id=task_id,
            task_path=task_path,
        )
        return _post(WRITES_PATH, body, _no_content, msgpack=self._msgpack)

    def _delete_thread_call(self, thread_id: str) -> _Call[None]:
        return _post(THREAD_DELETE_PATH, bodies.DeleteThreadBody(thread_id=str(thread_id)), _no_content)

    # -- the required saver API ---------------------------------------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """Fetch the checkpoint ``config`` names (the latest of its thread without a ``checkpoint_id``).

        Returns:
            The checkpoint tuple, or ``None`` when the service has no such checkpoint.

        Raises:
            CheckpointPrunedError: If the service's ``--keep-checkpoints`` deleted that checkpoint (``list``
                of it, and a ``put`` naming it as parent, raise it too).
            ReducingSaverError: A subclass naming what failed.
        """
        return self._http.send(self._get_tuple_call(config))

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """Yield matching checkpoints, newest first.

        The service answers at most ``max_list_limit`` checkpoints a request (``GET /v1/capabilities``),
        so a list without ``limit``, or with a larger one, is fetched in pages, each starting below the
        last checkpoint of the one before (``before``); every page is requested when the one before it
        has been consumed.

        Raises:
            ReducingSaverError: A subclass naming what failed.
        """
        remaining = limit
        while True:
            call, size = self._list_page(config, filter, before, remaining)
            page = self._http.send(call)
            yield from page
            more, remaining, before = self._next_page(page, size, remaining)
            if not more:
                return

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Store a checkpoint; the service reduces its messages channel first.

        Returns:
            The config of the stored checkpoint.

        Raises:
            ReducingSaverError: A subclass naming what failed.
        """
        return self._http.send(self._put_call(config, checkpoint, metadata, new_versions))

    def put_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        """Store a task's pending writes for the checkpoint ``config`` names.

        Raises:
            ReducingSaverError: A subclass naming what failed.
        """
        self._http.send(self._put_writes_call(config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint and write of a thread.

        Raises:
            ReducingSaverError: A subclass naming what failed.
        """
        self._http.send(self._delete_thread_call(thread_id))

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """Async ``get_tuple``."""
        return await self._http.asend(self._get_tuple_call(config))

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """Async ``list`` (in pages, as ``list``)."""
        remaining = limit
        while True:
            call, size = self._list_page(config, filter, before, remaining)
            page = await self._http.asend(call)
            for item in page:
                yield item
            more, remaining, before = self._next_page(page, size, remaining)
            if not more:
                return

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Async ``put``."""
        return await self._http.asend(self._put_call(config, checkpoint, metadata, new_versions))

    async def aput_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        """Async ``put_writes``."""
        await self._http.asend(self._put_writes_call(config, writes, task_id, task_path))

    async def adelete_thread(self, thread_id: str) -> None:
        """Async ``delete_thread``."""
        await self._http.asend(self._delete_thread_call(thread_id))

    # -- storage you can see ------------------------------------------------------------------------

    @staticmethod
    def _storage_call(thread_id: str) -> _Call[dict[str, Any]]:
        path = THREAD_STORAGE_PATH.format(thread_id=quote(str(thread_id), safe=""))
        return _Call("GET", path, None, True, _as_given)

    @staticmethod
    def _storage_summary_call(top: int) -> _Call[dict[str, Any]]:
        return _Call("GET", f"{STORAGE_PATH}?top={int(top)}", None, True, _as_given)

    def storage(self, thread_id: str) -> dict[str, Any]:
        """What a thread holds: bytes in checkpoints, blobs, writes, outbox and store, checkpoints kept, and
        the bytes a plain ``add_messages`` saver would hold (``plain_estimate``); see docs/storage.md.

        Raises:
            NotFoundError: If the service has no checkpoint of the thread (with API keys: of the caller's).
            ReducingSaverError: A subclass naming what else failed.
        """
        return self._http.send(self._storage_call(thread_id))

    def storage_summary(self, *, top: int = 10) -> dict[str, Any]:
        """The caller's threads added up (with API keys: the tenant's), and the ``top`` largest (1 to 100).

        Raises:
            ReducingSaverError: A subclass naming what failed.
        """
        return self._http.send(self._storage_summary_call(top))

    async def astorage(self, thread_id: str) -> dict[str, Any]:
        """Async ``storage``."""
        return await self._http.asend(self._storage_call(thread_id))

    async def astorage_summary(self, *, top: int = 10) -> dict[str, Any]:
        """Async ``storage_summary``."""
        return await self._http.asend(self._storage_summary_call(top))


# -- optional capabilities: mixed in only when the service's backend has them ----------------------


class _CopyThread:
    _http: _Http

    @staticmethod
    def _copy_thread_call(source_thread_id: str, target_thread_id: str) -> _Call[None]:
        body = bodies.CopyThreadBody(source_thread_id=str(source_thread_id), target_thread_id=str(target_thread_id))
        # Not idempotent: a retry after a lost answer could copy twice.
        return _post(THREAD_COPY_PATH, body, _no_content, idempotent=False)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint and write of one thread to another (never retried).

        Raises:
            ReducingSaverError: A subclass naming what failed.
        """
        self._http.send(self._copy_thread_call(source_thread_id, target_thread_id))

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Async ``copy_thread``."""
        await self._http.asend(self._copy_thread_call(source_thread_id, target_thread_id))


class _DeleteForRuns:
    _http: _Http

    @staticmethod
    def _delete_for_runs_call(run_ids: Sequence[str]) -> _Call[None]:
        body = bodies.DeleteRunsBody(run_ids=[str(run_id) for run_id in run_ids])
        return _post(RUNS_DELETE_PATH, body, _no_content)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints and writes of the given runs.

        Raises:
            ReducingSaverError: A subclass naming what failed.
        """
        self._http.send(self._delete_for_runs_call(run_ids))

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Async ``delete_for_runs``."""
        await self._http.asend(self._delete_for_runs_call(run_ids))


class _Prune:
    _http: _Http

    @staticmethod
    def _prune_call(thread_ids: Sequence[str], strategy: str) -> _Call[None]:
        body = bodies.PruneBody(thread_ids=[str(thread_id) for thread_id in thread_ids], strategy=strategy)
        return _post(THREAD_PRUNE_PATH, body, _no_content)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Prune threads: ``"keep_latest"`` keeps each namespace's newest checkpoint, ``"delete"`` all.

        Raises:
            BadRequestError: If the service refuses the strategy or a thread (e.g. one using a DeltaChannel).
            ReducingSaverError: A subclass naming what else failed.
        """
        self._http.send(self._prune_call(thread_ids, strategy))

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Async ``prune``."""
        await self._http.asend(self._prune_call(thread_ids, strategy))


class _DeltaChannelHistory:
    _http: _Http
    _config: Callable[[RunnableConfig | None], dict | None]
    _decode_value: Callable[[Any, str], Any]
    _decode_writes: Callable[[Sequence[Sequence[Any]], str], list[tuple[str, str, Any]]]

    def _delta_history_call(
        self, config: RunnableConfig, channels: Sequence[str]
    ) -> _Call[Mapping[str, DeltaChannelHistory]]:
        body = bodies.DeltaHistoryBody(config=self._config(config), channels=list(channels))
        return _post(DELTA_HISTORY_PATH, body, self._parse_delta_history)

    def _parse_delta_history(self, body: Any) -> dict[str, DeltaChannelHistory]:
        result: dict[str, DeltaChannelHistory] = {}
        for channel, entry in body["channels"].items():
            history = DeltaChannelHistory(writes=self._decode_writes(entry["writes"], f"{channel}.writes"))
            if "seed" in entry:
                history["seed"] = self._decode_value(entry["seed"], f"{channel}.seed")
            result[channel] = history
        return result

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        """Per channel, the writes along ``config``'s ancestor chain and the nearest stored value (beta).

        Raises:
            ReducingSaverError: A subclass naming what failed.
        """
        if not channels:
            return {}
        return self._http.send(self._delta_history_call(config, channels))

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        """Async ``get_delta_channel_history``."""
        if not channels:
            return {}
        return await self._http.asend(self._delta_history_call(config, channels))


_MIXINS: dict[str, type] = {
    "copy_thread": _CopyThread,
    "delete_for_runs": _DeleteForRuns,
    "prune": _Prune,
    "delta_channel_history": _DeltaChannelHistory,
}
