"""Storage you can see: what a thread holds, and the caller's threads added up (docs/storage.md)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query

from reducing_saver.service import security
from reducing_saver.service.errors import BadRequest
from reducing_saver.service.http import schemas
from reducing_saver.service.http.routes import ERRORS, ServiceDep
from reducing_saver.service.operations import saver as ops
from reducing_saver.wire import STORAGE_PATH, THREAD_STORAGE_PATH

router = APIRouter(tags=["storage"])

_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": schemas.ErrorBody, "description": "The caller has no thread of that id."}
}
_BAD_ID: dict[int | str, dict[str, Any]] = {
    422: {
        "model": schemas.ErrorBody,
        "description": "The thread id breaks the rule of every route: control characters (NUL included), "
        "'/' or '\\', '.' or '..', more than max_thread_id_length characters.",
    }
}


@router.get(
    # ``:path``: a thread id may hold ``/`` (sent percent-encoded, decoded before routing).
    THREAD_STORAGE_PATH.replace("{thread_id}", "{thread_id:path}"),
    response_model=schemas.ThreadStorageResponse,
    responses={**ERRORS, **_NOT_FOUND, **_BAD_ID},
    summary="What one thread holds: bytes in checkpoints, blobs, writes, outbox and store, checkpoints "
    "kept, and the bytes a plain add_messages saver would hold (with API keys: the caller's threads only).",
)
async def thread_storage(
    thread_id: Annotated[str, Path(description="The thread id (the rule every route applies).")],
    service: ServiceDep,
) -> Any:
    try:
        security.check_thread_id(thread_id)  # what a put of that id gets, before any database work
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return await service.blocking(ops.thread_storage, service, thread_id)


@router.get(
    STORAGE_PATH,
    response_model=schemas.StorageSummaryResponse,
    responses=ERRORS,
    summary="Every thread of the caller added up (with API keys: the tenant's; without: the database's), "
    "and the largest threads.",
)
async def storage_summary(
    service: ServiceDep,
    top: Annotated[
        int, Query(ge=1, le=schemas.MAX_STORAGE_TOP, description="How many of the largest threads to list.")
    ] = 10,
) -> Any:
    return await service.blocking(ops.storage_summary, service, top)
