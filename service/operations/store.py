"""The long-term memory store over HTTP: LangGraph store operations, checked and scoped to the tenant.

Every store route (Agent Server's ``/store/...`` routes and ``POST /store/batch``) turns its body into
LangGraph ``Op``s, and :func:`run_batch` checks them (:func:`check_op`: the caps and what a store
would refuse, as 422 naming the field), maps them into the tenant's subtree (:class:`StoreScope`), runs
them as one ``store.batch`` in a worker thread, and maps the results back. So the semantics are those
of the backend's store (``PostgresStore``, ``SqliteStore``, ``InMemoryStore``), whichever route is used.

Tenancy: with API keys, a tenant's namespace ``ns`` is stored as ``("tenants", tenant, *ns)``, where the
extraction deliverer writes that tenant's memories. Every namespace, search prefix and list condition
is put under that prefix, and answers lose it, so a tenant reads and writes its namespaces unprefixed
and nothing it sends reaches another tenant's items: a search prefix or list condition always starts
with the tenant's labels; a suffix condition is matched within them (a prefix of wildcards as long as
the suffix keeps it off the tenant labels); ``max_depth`` counts the tenant's own labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import orjson
from langgraph.store.base import (
    GetOp,
    Item,
    ListNamespacesOp,
    MatchCondition,
    Op,
    PutOp,
    SearchItem,
    SearchOp,
)

from reducing_saver.reducer import validate_namespace
from reducing_saver.service import security
from reducing_saver.service.encryption import sealer_for
from reducing_saver.service.encryption.records import sealed_store
from reducing_saver.service.errors import BadRequest, Unavailable
from reducing_saver.service.storage import backend_module
from reducing_saver.wire import bodies, json_dumps

if TYPE_CHECKING:
    from reducing_saver.service.state import Service

#: Largest value of one item, as JSON bytes.
MAX_VALUE_BYTES = 1024 * 1024
#: Most labels of a namespace, prefix or match condition (the tenant's own labels).
MAX_NAMESPACE_DEPTH = 16
#: Longest namespace label or key, in characters.
MAX_LABEL_LENGTH = 256
#: Largest ``limit`` of a search or a namespace listing.
MAX_STORE_LIMIT = 1000
#: Largest ``offset`` of a search or a namespace listing.
MAX_STORE_OFFSET = 100_000
#: Most operations in one ``POST /store/batch``.
MAX_BATCH_OPS = 1000
#: Longest semantic search query, in characters.
MAX_QUERY_LENGTH = 10_000
# What a search or a namespace listing that leaves its paging out gets: Agent Server's defaults (and
# BaseStore.search's and list_namespaces'). The request bodies' schemas show them (http/schemas.py).
#: ``limit`` of a search.
SEARCH_LIMIT = 10
#: ``limit`` of a namespace listing.
LIST_NAMESPACES_LIMIT = 100
#: ``offset`` of either: from the first.
DEFAULT_OFFSET = 0
_FILTER_OPS = frozenset({"$eq", "$ne", "$gt", "$gte", "$lt", "$lte"})


# -- checks ---------------------------------------------------------------------------------------


def check_labels(
    labels: Sequence[Any], field: str, *, store_rules: bool, wildcards: bool = False
) -> tuple[str, ...]:
    """``labels`` as a tuple, or 422 naming ``field``: the caps, and (``store_rules``) what a store refuses
    in a stored namespace."""
    labels = tuple(labels)
    if len(labels) > MAX_NAMESPACE_DEPTH:
        raise BadRequest(f"{field}: {len(labels)} labels is more than the limit of {MAX_NAMESPACE_DEPTH}")
    for index, label in enumerate(labels):
        if not isinstance(label, str):
            raise BadRequest(f"{field}[{index}]: a label must be a string, got {type(label).__name__}")
        if len(label) > MAX_LABEL_LENGTH:
            raise BadRequest(
                f"{field}[{index}]: {len(label)} characters is more than the limit of {MAX_LABEL_LENGTH}"
            )
        if not label:
            raise BadRequest(f"{field}[{index}]: a label cannot be empty")
        if "." in label or "\x00" in label:
            what = "'.'" if "." in label else "a NUL character"
            raise BadRequest(
                f"{field}[{index}]: label {label!r} contains {what}, which LangGraph stores refuse"
            )
    if store_rules:
        try:
            validate_namespace(labels)
        except ValueError as exc:
            raise BadRequest(f"{field}: {exc}") from None
    return labels


def _check_key(key: Any, field: str) -> str:
    if not isinstance(key, str):
        raise BadRequest(f"{field}: the key must be a string, got {type(key).__name__}")
    if not key:
        raise BadRequest(f"{field}: the key cannot be empty")
    if "\x00" in key:
        raise BadRequest(f"{field}: the key contains a NUL character (U+0000), which PostgreSQL refuses")
    if len(key) > MAX_LABEL_LENGTH:
        raise BadRequest(f"{field}: {len(key)} characters is more than the limit of {MAX_LABEL_LENGTH}")
    return key


def _check_window(limit: int, offset: int, field: str) -> None:
    if not 0 <= limit <= MAX_STORE_LIMIT:
        raise BadRequest(f"{field}.limit: {limit} is outside 0..{MAX_STORE_LIMIT}")
    if not 0 <= offset <= MAX_STORE_OFFSET:
        raise BadRequest(f"{field}.offset: {offset} is outside 0..{MAX_STORE_OFFSET}")


def _check_filter(filter: Any, field: str) -> None:
    if filter is None:
        return
    if not isinstance(filter, dict):
        raise BadRequest(f"{field}.filter: must be an object, got {type(filter).__name__}")
    try:
        orjson.dumps(filter)
    except TypeError as exc:  # PostgresStore writes filter values with orjson
        raise BadRequest(f"{field}.filter: not JSON a store can compare ({exc})") from None
    try:
        security.check_filter_keys(filter, f"{field}.filter")
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    for key, condition in filter.items():
        if isinstance(condition, dict) and any(name.startswith("$") for name in condition):
            unknown = sorted(set(condition) - _FILTER_OPS)
            if unknown:
                raise BadRequest(
                    f"{field}.filter.{key}: unsupported operator(s) {unknown}; use {sorted(_FILTER_OPS)}"
                )


def _check_backend_rules(op: Op, field: str, rules: Any) -> None:
    """422 for what this backend's store would misread: a nested object in a search filter (read as
    operators), a TTL that is not whole minutes where the store keeps whole minutes."""
    if isinstance(op, SearchOp) and op.filter and not rules.STORE_NESTED_FILTERS:
        for key, condition in op.filter.items():
            if isinstance(condition, dict) and not all(name.startswith("$") for name in condition):
                raise BadRequest(
                    f"{field}.filter.{key}: nested objects are not supported as filter values by this "
                    f"backend's store, which reads an object's keys as operators ({sorted(_FILTER_OPS)})"
                )
    whole_minutes = rules.STORE_TTL_WHOLE_MINUTES
    if isinstance(op, PutOp) and whole_minutes and op.ttl is not None and op.ttl != int(op.ttl):
        raise BadRequest(
            f"{field}.ttl: {op.ttl:g} minutes; this backend's store keeps TTLs in whole minutes (a "
            "refreshing read would round it), so give a whole number of minutes"
        )


def check_op(op: Op, field: str, *, big_ints: bool = True) -> None:
    """Raise 422 (naming ``field``) for an operation over a cap or one the store would refuse.

    ``big_ints``: the store keeps ints beyond 64 bits in values (PostgresStore's JSONB and InMemoryStore
    do; SqliteStore writes with orjson, which cannot). No store compares them in a filter.
    """
    if isinstance(op, GetOp):
        check_labels(op.namespace, f"{field}.namespace", store_rules=False)
        _check_key(op.key, f"{field}.key")
    elif isinstance(op, PutOp):
        check_labels(op.namespace, f"{field}.namespace", store_rules=True)
        _check_key(op.key, f"{field}.key")
        if op.value is not None:
            if not isinstance(op.value, dict):
                raise BadRequest(f"{field}.value: must be an object, got {type(op.value).__name__}")
            try:
                dumped = orjson.dumps(op.value)
            except TypeError as exc:
                if "64-bit" not in str(exc):
                    raise BadRequest(f"{field}.value: not JSON ({exc})") from None
                if not big_ints:
                    raise BadRequest(
                        f"{field}.value: holds an int beyond 64 bits, which this backend's store cannot "
                        "keep (PostgreSQL's and the in-memory store can)"
                    ) from None
                try:
                    dumped = json_dumps(op.value)
                except ValueError as err:  # more digits than Python writes
                    raise BadRequest(f"{field}.value: {err}") from None
            if len(dumped) > MAX_VALUE_BYTES:
                raise BadRequest(
                    f"{field}.value: {len(dumped)} bytes of JSON is more than the limit of {MAX_VALUE_BYTES}"
                )
            if b"\\u0000" in dumped:
                raise BadRequest(
                    f"{field}.value: contains a NUL character (U+0000), which PostgreSQL refuses"
                )
        if op.index not in (None, False) and (
            not isinstance(op.index, list) or not all(isinstance(path, str) for path in op.index)
        ):
            raise BadRequest(f"{field}.index: must be false, null or a list of field paths")
        if op.ttl is not None and (not isinstance(op.ttl, (int, float)) or op.ttl <= 0):
            raise BadRequest(f"{field}.ttl: must be a positive number of minutes or null")
    elif isinstance(op, SearchOp):
        check_labels(op.namespace_prefix, f"{field}.namespace_prefix", store_rules=False)
        _check_filter(op.filter, field)
        _check_window(op.limit, op.offset, field)
        if op.query is not None and len(op.query) > MAX_QUERY_LENGTH:
            raise BadRequest(f"{field}.query: {len(op.query)} characters is more than {MAX_QUERY_LENGTH}")
    elif isinstance(op, ListNamespacesOp):
        for index, condition in enumerate(op.match_conditions or ()):
            if condition.match_type not in ("prefix", "suffix"):
                raise BadRequest(f"{field}.match_conditions[{index}].match_type: use 'prefix' or 'suffix'")
            check_labels(condition.path, f"{field}.match_conditions[{index}].path", store_rules=False)
        if op.max_depth is not None and not 1 <= op.max_depth <= MAX_NAMESPACE_DEPTH:
            raise BadRequest(f"{field}.max_depth: {op.max_depth} is outside 1..{MAX_NAMESPACE_DEPTH}")
        _check_window(op.limit, op.offset, field)


# -- tenancy ----------------------------------------------------------------------------------------


class StoreScope:
    """Maps one tenant's store operations into its subtree and their results back out.

    Built on :class:`~reducing_saver.service.security.TenantScope`'s ``namespace()``/``unnamespace()``;
    ``StoreScope(TenantScope(None))`` (single-tenant mode) maps nothing.
    """

    def __init__(self, scope: security.TenantScope) -> None:
        self.scope = scope
        self.prefix = scope.namespace_prefix or ()

    def op_in(self, op: Op) -> Op:
        if not self.prefix:
            return op
        ns = self.scope.namespace
        if isinstance(op, GetOp):
            return GetOp(ns(op.namespace), op.key, op.refresh_ttl)
        if isinstance(op, PutOp):
            return PutOp(ns(op.namespace), op.key, op.value, op.index, op.ttl)
        if isinstance(op, SearchOp):
            return SearchOp(ns(op.namespace_prefix), op.filter, op.limit, op.offset, op.query, op.refresh_ttl)
        if isinstance(op, ListNamespacesOp):
            conditions = list(op.match_conditions or ())
            # The suffix conditions must match within the tenant's labels: require at least as many.
            own = max((len(c.path) for c in conditions if c.match_type == "suffix"), default=0)
            scoped = [MatchCondition("prefix", (*self.prefix, *("*",) * own))]
            scoped += [
                MatchCondition("prefix", ns(c.path)) if c.match_type == "prefix" else c for c in conditions
            ]
            depth = None if op.max_depth is None else op.max_depth + len(self.prefix)
            return ListNamespacesOp(tuple(scoped), depth, op.limit, op.offset)
        raise TypeError(f"unknown store operation {type(op).__name__}")

    def namespace_out(self, namespace: Sequence[str]) -> tuple[str, ...]:
        return tuple(self.scope.unnamespace(namespace))

    def result_out(self, op: Op, result: Any) -> Any:
        if isinstance(op, GetOp):
            return None if result is None else item_json(result, self)
        if isinstance(op, SearchOp):
            return [item_json(item, self) for item in result]
        if isinstance(op, ListNamespacesOp):
            return [list(self.namespace_out(namespace)) for namespace in result]
        return None


def _time(value: datetime | str) -> str:
    return value.isoformat() if isinstance(value, datetime) else str(value)


def item_json(item: Item, scope: StoreScope) -> bodies.StoreItemBody:
    """An item as Agent Server answers it (``score`` on search results only)."""
    answer = bodies.StoreItemBody(
        namespace=list(scope.namespace_out(item.namespace)),
        key=item.key,
        value=item.value,
        created_at=_time(item.created_at),
        updated_at=_time(item.updated_at),
    )
    if isinstance(item, SearchItem):
        answer["score"] = item.score
    return answer


# -- running ---------------------------------------------------------------------------------------


def store_scope(service: Service) -> StoreScope:
    """The request's store scope (call it on the event loop or in a thread carrying the request's context)."""
    return StoreScope(security.TenantScope.for_request(service.tenant_mode))


def check_ops(
    ops: Sequence[Op], field: str, ttl_config: Any, rules: Any = None, *, big_ints: bool = True
) -> None:
    """422 for the first operation over a cap or refused by the service's store configuration.

    ``rules``: the backend's package (``STORE_NESTED_FILTERS``, ``STORE_TTL_WHOLE_MINUTES``);
    ``big_ints``: see :func:`check_op`.
    """
    if len(ops) > MAX_BATCH_OPS:
        raise BadRequest(f"{field}: {len(ops)} operations is more than the limit of {MAX_BATCH_OPS}")
    for index, op in enumerate(ops):
        name = field if len(ops) == 1 and field != "ops" else f"{field}[{index}]"
        check_op(op, name, big_ints=big_ints)
        if rules is not None:
            _check_backend_rules(op, name, rules)
        if isinstance(op, PutOp) and op.ttl is not None and not ttl_config:
            raise BadRequest(
                f"{name}.ttl: this service's store keeps items forever (start it with --store-ttl)"
            )


def with_ttl_defaults(ops: Sequence[Op], ttl_config: dict[str, Any] | None) -> list[Op]:
    """``ops`` with the store's TTL settings filled in where a client left them open (``None``), as Agent
    Server does: a put gets ``default_ttl``; a get or search refreshes TTLs per ``refresh_on_read``."""
    default_ttl = (ttl_config or {}).get("default_ttl")
    refresh = bool((ttl_config or {}).get("refresh_on_read", True))
    out: list[Op] = []
    for op in ops:
        if isinstance(op, PutOp) and op.ttl is None and op.value is not None and default_ttl is not None:
            op = PutOp(op.namespace, op.key, op.value, op.index, default_ttl)
        elif isinstance(op, GetOp) and op.refresh_ttl is None:
            op = GetOp(op.namespace, op.key, refresh)
        elif isinstance(op, SearchOp) and op.refresh_ttl is None:
            op = SearchOp(op.namespace_prefix, op.filter, op.limit, op.offset, op.query, refresh)
        out.append(op)
    return out


def run_batch(service: Service, scope: StoreScope, ops: Sequence[Op], field: str = "ops") -> list[Any]:
    """Check ``ops`` (422 naming ``field``), run them as one ``store.batch`` in the tenant's subtree, and
    return the results as JSON values (blocking: call it through ``Service.blocking``)."""
    backend = service.backend
    if backend is None:
        raise Unavailable("the service is starting or stopping")
    store = sealed_store(backend.store(), sealer_for(service.settings, tenant_mode=service.tenant_mode))
    ttl_config = getattr(store, "ttl_config", None)
    check_ops(
        ops,
        field,
        ttl_config,
        backend_module(service.settings.database),
        big_ints=service.backend_kind != "sqlite",
    )
    ops = with_ttl_defaults(ops, ttl_config)
    scoped = [scope.op_in(op) for op in ops]
    try:
        results = store.batch(scoped)
    except (TypeError, ValueError) as exc:
        # InMemoryStore compares filter values in Python: a string against a number raises.
        if any(isinstance(op, SearchOp) and op.filter for op in ops):
            raise BadRequest(f"{field}: a filter compares values of different types ({exc})") from None
        raise
    return [scope.result_out(op, result) for op, result in zip(ops, results, strict=True)]


# -- the wire form of the batch route --------------------------------------------------------------


def get_op(namespace: tuple[str, ...], key: str, refresh_ttl: bool | None) -> GetOp:
    """A ``GetOp`` whose ``refresh_ttl`` may be left open: ``None`` until :func:`with_ttl_defaults` gives it
    the store's ``refresh_on_read``, as Agent Server does (LangGraph's ``BaseStore`` resolves it before it
    builds an op, so its ops type the field ``bool``)."""
    return GetOp(namespace, key, refresh_ttl)  # type: ignore[arg-type]  # LangGraph's annotation has no open value


def search_op(
    namespace_prefix: tuple[str, ...],
    filter: dict[str, Any] | None,
    limit: int,
    offset: int,
    query: str | None,
    refresh_ttl: bool | None,
) -> SearchOp:
    """A ``SearchOp`` whose ``refresh_ttl`` may be left open (``None``), as :func:`get_op`'s."""
    return SearchOp(namespace_prefix, filter, limit, offset, query, refresh_ttl)  # type: ignore[arg-type]  # as get_op's


def op_from_json(
    entry: bodies.GetOpBody | bodies.PutOpBody | bodies.SearchOpBody | bodies.ListNamespacesOpBody,
) -> Op:
    """One entry of ``POST /store/batch``'s ``ops`` (the schema has checked its shape)."""
    if entry["op"] == "get":
        return get_op(tuple(entry["namespace"]), entry["key"], entry.get("refresh_ttl"))
    if entry["op"] == "put":
        return PutOp(
            tuple(entry["namespace"]), entry["key"], entry.get("value"), entry.get("index"), entry.get("ttl")
        )
    if entry["op"] == "search":
        return search_op(
            tuple(entry.get("namespace_prefix") or ()),
            entry.get("filter"),
            entry.get("limit", SEARCH_LIMIT),
            entry.get("offset", DEFAULT_OFFSET),
            entry.get("query"),
            entry.get("refresh_ttl"),
        )
    conditions = tuple(
        MatchCondition(c["match_type"], tuple(c["path"])) for c in entry.get("match_conditions") or ()
    )
    return ListNamespacesOp(
        conditions,
        entry.get("max_depth"),
        entry.get("limit", LIST_NAMESPACES_LIMIT),
        entry.get("offset", DEFAULT_OFFSET),
    )
