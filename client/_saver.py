"""RemoteReducingSaver: a LangGraph checkpointer that stores through the reducing-saver service.

Every decision that is not I/O is shared between the sync and async paths: a saver method builds a
``Call`` (``_calls``: HTTP method, path, body, whether it may be retried, the parser of the answer), and
``Http.send`` / ``Http.asend`` (``_http``) only send it, retry it and map failures to
``ReducingSaverError``s. A sync method and its async twin differ in their ``send`` line. The optional
capabilities are mixed in from ``_optional``.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Self, Unpack

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from reducing_saver.client._http import ConnectionOptions, Http, off_the_loop, open_http
from reducing_saver.client._optional import MIXINS
from reducing_saver.client._saver_calls import ParentLists, SaverCalls
from reducing_saver.client._serde import SafeJsonPlusSerializer
from reducing_saver.client._server_info import RemoteReducer, ServerInfo, capabilities_call
from reducing_saver.wire import JSON, MSGPACK
from reducing_saver.wire.capabilities import with_capabilities

#: How long the constructor keeps asking a service that cannot be reached (a replica restarting, a
#: service started after its agents).
DEFAULT_STARTUP_TIMEOUT = 30.0
#: ``body_format`` values: the per-step calls' bodies (other calls are always JSON).
BODY_FORMAT_NAMES = {"msgpack": MSGPACK, "json": JSON}


def _check_saver_options(body_format: str, startup_timeout: float) -> None:
    if body_format not in BODY_FORMAT_NAMES:
        raise ValueError(f"body_format must be one of {sorted(BODY_FORMAT_NAMES)}, got {body_format!r}")
    if not startup_timeout >= 0:
        raise ValueError(f"startup_timeout must be seconds, 0 or more, got {startup_timeout!r}")


class RemoteReducingSaver(SaverCalls, BaseCheckpointSaver[str]):
    """A LangGraph checkpointer backed by a reducing-saver service; use it where you would use PostgresSaver.

    The service keeps every stored checkpoint's messages channel to a bounded window; this client only
    (de)serializes with its ``serde`` and talks HTTP. The constructor asks the service for its
    capabilities (blocking; for up to ``startup_timeout`` seconds while the service is down) and returns
    an instance of the class variant that has exactly the optional methods the service's backend
    supports (``copy_thread``, ``delete_for_runs``, ``prune``, ``get_delta_channel_history`` and their
    async twins), so capability probes see the truth. A ``put`` sends only the channel values the
    backend stores (``stored_values`` in the capabilities; by the backend's name for a service that does
    not say).

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
    _http: Http

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
            info = http.send(capabilities_call(), startup_budget=startup_timeout)
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
            info = await http.asend(capabilities_call(), startup_budget=startup_timeout)
        except BaseException:
            await http.aclose()
            raise
        return cls._from_server_info(http, info, serde=serde, body_format=body_format)

    @classmethod
    def _from_server_info(
        cls, http: Http, info: ServerInfo, *, serde: SerializerProtocol | None, body_format: str
    ) -> Self:
        """The instance of the class variant carrying exactly the service's capabilities (no I/O)."""
        saver = object.__new__(with_capabilities(cls, info.capabilities, MIXINS))
        BaseCheckpointSaver.__init__(saver, serde=serde if serde is not None else SafeJsonPlusSerializer())
        saver._http = http
        saver.reducer = info.reducer
        saver.backend = info.backend
        saver.messages_key = info.messages_key
        saver.server_version = info.version
        saver.max_list_limit = info.max_list_limit
        saver._stored_values = info.stored_values
        wanted = BODY_FORMAT_NAMES[body_format]
        saver.body_format = wanted if wanted in info.body_formats else JSON
        saver._msgpack = saver.body_format == MSGPACK
        saver._noticed = set()
        saver._parent_lists = ParentLists()
        return saver

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
