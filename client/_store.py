"""RemoteStore: a LangGraph ``BaseStore`` whose items live in the reducing-saver service's store.

``batch``/``abatch`` send the operations whole to ``POST /store/batch``; the service checks them, maps
them into the tenant's namespaces and runs them as one ``batch`` of its backend's store (PostgresStore,
SqliteStore, InMemoryStore), so results, deduplication and ordering are that store's. Every convenience
method of ``BaseStore`` (``get``, ``put``, ``delete``, ``search``, ``list_namespaces`` and their async
twins) goes through them. The transport, retries, errors and API key are those of
``RemoteReducingSaver`` (``_http.Http``).

Construction sends no request, but it is not free of blocking work: for an ``https://`` URL the sync
client builds an SSL context (it reads the CA bundle), and the first async call imports aiohttp (which
builds its own).
``RemoteStore.aopen`` does both in a worker thread, for code running on an event loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, Self, Unpack, cast

from langgraph.store.base import (
    BaseStore,
    GetOp,
    Item,
    ListNamespacesOp,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
    _validate_namespace_labels,
)

from reducing_saver.client._calls import Call
from reducing_saver.client._errors import BadRequestError
from reducing_saver.client._http import ConnectionOptions, off_the_loop, open_http
from reducing_saver.wire import STORE_BATCH_PATH, bodies, json_dumps, unwritable


def _op_json(
    op: Op,
) -> bodies.GetOpBody | bodies.PutOpBody | bodies.SearchOpBody | bodies.ListNamespacesOpBody:
    if isinstance(op, GetOp):
        return bodies.GetOpBody(
            op="get", namespace=list(op.namespace), key=op.key, refresh_ttl=op.refresh_ttl
        )
    if isinstance(op, PutOp):
        value = None if op.value is None else dict(op.value)
        body = bodies.PutOpBody(op="put", namespace=list(op.namespace), key=op.key, value=value)
        if op.index is not None:
            body["index"] = op.index if op.index is False else list(op.index)
        if op.ttl is not None:
            body["ttl"] = op.ttl
        return body
    if isinstance(op, SearchOp):
        return bodies.SearchOpBody(
            op="search",
            namespace_prefix=list(op.namespace_prefix),
            filter=op.filter,
            limit=op.limit,
            offset=op.offset,
            query=op.query,
            refresh_ttl=op.refresh_ttl,
        )
    if isinstance(op, ListNamespacesOp):
        return bodies.ListNamespacesOpBody(
            op="list_namespaces",
            match_conditions=[
                bodies.MatchConditionBody(match_type=c.match_type, path=list(c.path))
                for c in op.match_conditions or ()
            ],
            max_depth=op.max_depth,
            limit=op.limit,
            offset=op.offset,
        )
    raise TypeError(f"RemoteStore cannot send a {type(op).__name__}")


def _item(body: bodies.StoreItemBody, *, search: bool) -> Item:
    namespace, key, value = tuple(body["namespace"]), body["key"], body["value"]
    created_at = datetime.fromisoformat(body["created_at"])
    updated_at = datetime.fromisoformat(body["updated_at"])
    if search:
        return SearchItem(namespace, key, value, created_at, updated_at, score=body.get("score"))
    return Item(namespace=namespace, key=key, value=value, created_at=created_at, updated_at=updated_at)


def _result(op: Op, body: Any) -> Result:
    if isinstance(op, GetOp):
        return None if body is None else _item(body, search=False)
    if isinstance(op, SearchOp):
        return [_item(item, search=True) for item in body]
    if isinstance(op, ListNamespacesOp):
        return [tuple(namespace) for namespace in body]
    return None


def _batch_body(ops: list[Op]) -> bytes:
    """The batch's JSON: values as they are, ints beyond 64 bits included (``wire.json_dumps``).

    Raises:
        BadRequestError: Naming the field, for NaN or an infinity (JSON has neither; a JSON writer would
            change them to null, silently) or an int too long to write. Nothing is sent.
    """
    for index, op in enumerate(ops):
        if isinstance(op, PutOp) and op.value is not None:
            problem = unwritable(op.value, f"ops[{index}].value")
        elif isinstance(op, SearchOp) and op.filter:
            problem = unwritable(op.filter, f"ops[{index}].filter")
        else:
            continue
        if problem is not None:
            where, why = problem
            raise BadRequestError(
                f"{where}: {why}, so it cannot be stored unchanged (PostgresStore refuses NaN and infinities "
                "too); store it as a string"
            )
    return json_dumps(bodies.StoreBatchBody(ops=[_op_json(op) for op in ops]))


def _batch_call(ops: list[Op]) -> Call[list[Result]]:
    def parse(body: Any) -> list[Result]:
        results = body["results"]
        if len(results) != len(ops):
            raise KeyError(f"{len(results)} results for {len(ops)} operations")
        return [_result(op, result) for op, result in zip(ops, results, strict=True)]

    content = _batch_body(ops)
    # A batch of reads is idempotent; so is one of puts (the same values again). Every batch may retry.
    return Call("POST", STORE_BATCH_PATH, content, True, parse)


class RemoteStore(BaseStore):
    """A LangGraph store backed by a reducing-saver service; use it where you would use PostgresStore.

    ``builder.compile(checkpointer=RemoteReducingSaver(url), store=RemoteStore(url))``: nodes reach it
    through ``get_store()`` or ``runtime.store``, and find the memories the service extracted from pruned
    messages under the namespaces it documents. With API keys, the service keeps a tenant's items apart
    from every other tenant's; the namespaces a tenant sees are its own, unprefixed.

    Semantic search (``search(..., query=...)``) and TTLs are the service's settings (``--store-index``,
    ``--store-ttl``): embedding happens in the service. A put without ``ttl`` gets the service's default
    TTL, if any; ``ttl`` on a service without ``--store-ttl`` is refused (``BadRequestError``).

    Values travel as JSON, numbers included as they are: an int beyond 64 bits travels exactly and reads
    back as an int (PostgreSQL's JSONB also reads a float such as ``1e20`` back as the int
    100000000000000000000, as a stock ``PostgresStore`` gives it). NaN and infinities, which JSON cannot
    carry, raise ``BadRequestError`` before anything is sent; so does an int beyond 64 bits when the
    service's store cannot keep it (SQLite).

    The constructor sends no request (a wrong URL or key shows on the first call), but for an ``https://``
    URL it reads the CA bundle for the sync client's SSL context; from async code, open it with
    :meth:`aopen`.

    Args:
        url: The service's base URL, e.g. ``"http://reducing-saver:8000"``.
        api_key: Sent as ``Authorization: Bearer <api_key>``; defaults to ``REDUCING_SAVER_API_KEY``.
        timeout: Per-request timeout (seconds or ``httpx.Timeout``); ``None`` is refused.
        max_retries: Retries after a connection error or a 502/503/504.
        backoff: First retry delay in seconds; doubled per retry (capped at 10 s), with jitter.
        retry_unavailable_for: Past those retries, how long a 503 (the service or its database cannot
            serve now) is retried on, in seconds from the first attempt, as ``RemoteReducingSaver`` does.
        headers: Extra headers sent with every request.
        transport: httpx transport for sync calls instead of ``http.client`` (tests pass
            ``httpx.MockTransport``).
        async_transport: httpx transport for async calls instead of aiohttp.
        trust_env: Go through the proxy ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` name, unless
            ``NO_PROXY`` exempts the host, as an httpx client does by default. ``False`` ignores them.

    A path in ``url`` (``http://host/rs/``) prefixes every request; credentials in it
    (``http://user:pw@host``) are sent as Basic auth; a redirect is reported, never followed
    (``docs/client.md`` says how the client behaves on a network).

    Raises:
        ValueError: If ``url`` is not an http(s) URL or an option is out of range.
    """

    # The service decides: it refuses a TTL when it has none configured.
    supports_ttl = True

    def __init__(self, url: str, **options: Unpack[ConnectionOptions]) -> None:
        self._http = open_http(url, type(self).__name__, options)

    @classmethod
    async def aopen(cls, url: str, **options: Unpack[ConnectionOptions]) -> Self:
        """Open a store from async code without blocking the event loop; the arguments are the constructor's.

        The constructor runs in a worker thread (its SSL context reads the CA bundle), and so does the
        import of aiohttp that the first async call would otherwise make on the loop. Like the
        constructor, it sends no request.

        Raises:
            ValueError: If ``url`` is not an http(s) URL or an option is out of range.
        """
        return await off_the_loop(
            lambda: cls(url, **options), aiohttp_too=options.get("async_transport") is None
        )

    @property
    def url(self) -> str:
        return self._http.url

    def __repr__(self) -> str:
        return f"RemoteStore({self._http.url!r})"

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Run ``ops`` in the service's store as one batch (one request); results in order."""
        ops = list(ops)
        return self._http.send(_batch_call(ops)) if ops else []

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """Run ``ops`` in the service's store as one batch (one request); results in order."""
        ops = list(ops)
        return await self._http.asend(_batch_call(ops)) if ops else []

    # get and search leave ``refresh_ttl=None`` open for the service, which applies its store's
    # ``refresh_on_read`` (BaseStore's versions would decide ``True`` here, knowing no TTL settings).

    def get(self, namespace: tuple[str, ...], key: str, *, refresh_ttl: bool | None = None) -> Item | None:
        """The item at ``namespace``/``key``, or ``None``."""
        _validate_namespace_labels(namespace)
        op = GetOp(namespace, str(key), refresh_ttl)  # type: ignore[arg-type]  # None: the service decides
        return cast(Item | None, self.batch([op])[0])

    async def aget(
        self, namespace: tuple[str, ...], key: str, *, refresh_ttl: bool | None = None
    ) -> Item | None:
        """The item at ``namespace``/``key``, or ``None``."""
        _validate_namespace_labels(namespace)
        op = GetOp(namespace, str(key), refresh_ttl)  # type: ignore[arg-type]  # None: the service decides
        return cast(Item | None, (await self.abatch([op]))[0])

    def search(
        self,
        namespace_prefix: tuple[str, ...],
        /,
        *,
        query: str | None = None,
        filter: dict[str, Any] | None = None,
        limit: int = 10,
        offset: int = 0,
        refresh_ttl: bool | None = None,
    ) -> list[SearchItem]:
        """Items under ``namespace_prefix``, filtered by value, ranked by ``query`` (the service embeds)."""
        _validate_namespace_labels(namespace_prefix)
        op = SearchOp(namespace_prefix, filter, limit, offset, query, refresh_ttl)  # type: ignore[arg-type]
        return cast(list[SearchItem], self.batch([op])[0])

    async def asearch(
        self,
        namespace_prefix: tuple[str, ...],
        /,
        *,
        query: str | None = None,
        filter: dict[str, Any] | None = None,
        limit: int = 10,
        offset: int = 0,
        refresh_ttl: bool | None = None,
    ) -> list[SearchItem]:
        """Items under ``namespace_prefix``, filtered by value, ranked by ``query`` (the service embeds)."""
        _validate_namespace_labels(namespace_prefix)
        op = SearchOp(namespace_prefix, filter, limit, offset, query, refresh_ttl)  # type: ignore[arg-type]
        return cast(list[SearchItem], (await self.abatch([op]))[0])

    def close(self) -> None:
        self._http.close()

    async def aclose(self) -> None:
        await self._http.aclose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
