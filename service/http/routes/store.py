"""The long-term memory store: LangGraph Agent Server's store routes, and one batch route.

``/store/items`` (PUT, GET, DELETE), ``/store/items/search`` and ``/store/namespaces`` take and answer
what Agent Server does, so ``langgraph_sdk``'s ``client.store`` works against the service unchanged.
``POST /store/batch`` carries a ``BaseStore.batch`` call whole (``reducing_saver.client.RemoteStore``).
Every route runs ``store_ops.run_batch`` in a worker thread.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import Response
from langgraph.store.base import ListNamespacesOp, MatchCondition, PutOp

from reducing_saver.service.errors import BadRequest
from reducing_saver.service.http.routes import ERRORS, ServiceDep
from reducing_saver.service.http.schemas import (
    DeleteItemBody,
    ListNamespacesAnswer,
    ListNamespacesBody,
    PutItemBody,
    SearchItemsAnswer,
    SearchItemsBody,
    StoreBatchAnswer,
    StoreBatchBody,
    StoreItemBody,
)
from reducing_saver.service.operations import store as store_ops
from reducing_saver.service.state import Service
from reducing_saver.wire import (
    STORE_BATCH_PATH,
    STORE_ITEMS_PATH,
    STORE_NAMESPACES_PATH,
    STORE_SEARCH_PATH,
    bodies,
)

router = APIRouter(tags=["store"])
#: The routes that put values, which may hold ints beyond 64 bits (``operations/store.py`` decides per backend).
BIG_INT_PATHS = frozenset({STORE_ITEMS_PATH, STORE_BATCH_PATH})

#: Seconds a store call may take when it embeds (--store-index): an embedding provider answers slower
#: than a database.
EMBEDDING_TIMEOUT = 60.0


async def _run(service: Service, ops: list[Any], field: str) -> list[Any]:
    scope = store_ops.store_scope(service)
    timeout = (
        max(EMBEDDING_TIMEOUT, service.settings.db_timeout_seconds) if service.settings.store_index else None
    )
    return await service.blocking(store_ops.run_batch, service, scope, ops, field, timeout=timeout)


@router.put(STORE_ITEMS_PATH, status_code=204, responses=ERRORS, summary="Store or replace an item.")
async def put_item(body: PutItemBody, service: ServiceDep) -> Response:
    op = PutOp(tuple(body["namespace"]), body["key"], body["value"], body["index"], body["ttl"])
    await _run(service, [op], "body")
    return Response(status_code=204)


@router.get(
    STORE_ITEMS_PATH,
    response_model=None,
    responses={**ERRORS, 200: {"model": StoreItemBody | None, "description": "The item, or null."}},
    summary="Read an item (null if none).",
)
async def get_item(
    service: ServiceDep,
    key: Annotated[str, Query()],
    namespace: Annotated[str, Query(description="Labels joined by '.'.")] = "",
    refresh_ttl: Annotated[bool | None, Query()] = None,
) -> Any:
    labels = tuple(namespace.split(".")) if namespace else ()
    if not labels:
        raise BadRequest("query.namespace: give at least one label (labels joined by '.')")
    (item,) = await _run(service, [store_ops.get_op(labels, key, refresh_ttl)], "query")
    return item


@router.delete(STORE_ITEMS_PATH, status_code=204, responses=ERRORS, summary="Delete an item.")
async def delete_item(body: DeleteItemBody, service: ServiceDep) -> Response:
    await _run(service, [PutOp(tuple(body["namespace"]), body["key"], None)], "body")
    return Response(status_code=204)


@router.api_route(
    STORE_ITEMS_PATH, methods=["POST", "PATCH", "OPTIONS", "HEAD", "TRACE"], include_in_schema=False
)
async def other_methods() -> Response:
    """405 naming every method of /store/items (three routes share the path; each alone would name one)."""
    return Response(status_code=405, headers={"Allow": "GET, PUT, DELETE"})


@router.post(
    STORE_SEARCH_PATH,
    response_model=SearchItemsAnswer,
    responses=ERRORS,
    summary="Items under a namespace prefix: filtered by value, or ranked by a semantic query.",
)
async def search_items(body: SearchItemsBody, service: ServiceDep) -> Any:
    op = store_ops.search_op(
        tuple(body["namespace_prefix"]),
        body["filter"],
        body["limit"],
        body["offset"],
        body["query"],
        body["refresh_ttl"],
    )
    (items,) = await _run(service, [op], "body")
    return bodies.SearchItemsAnswer(items=items)


@router.post(
    STORE_NAMESPACES_PATH,
    response_model=ListNamespacesAnswer,
    responses=ERRORS,
    summary="Namespaces holding items, by prefix and suffix ('*' matches any label), cut at max_depth.",
)
async def list_namespaces(body: ListNamespacesBody, service: ServiceDep) -> Any:
    conditions = []
    if body["prefix"]:
        conditions.append(MatchCondition("prefix", tuple(body["prefix"])))
    if body["suffix"]:
        conditions.append(MatchCondition("suffix", tuple(body["suffix"])))
    op = ListNamespacesOp(tuple(conditions), body["max_depth"], body["limit"], body["offset"])
    (namespaces,) = await _run(service, [op], "body")
    return bodies.ListNamespacesAnswer(namespaces=namespaces)


@router.post(
    STORE_BATCH_PATH,
    response_model=StoreBatchAnswer,
    responses=ERRORS,
    summary="Run BaseStore.batch: get, put (value null deletes), search and list_namespaces operations.",
)
async def batch(body: StoreBatchBody, service: ServiceDep) -> Any:
    ops = [store_ops.op_from_json(entry) for entry in body["ops"]]
    return bodies.StoreBatchAnswer(results=await _run(service, ops, "ops"))
