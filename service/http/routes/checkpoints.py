"""The saver API: capabilities, checkpoints (get, list, put), pending writes, DeltaChannel history."""

from __future__ import annotations

import functools
from typing import Annotated, Any

from fastapi import APIRouter, Header
from fastapi.responses import Response

from reducing_saver.service.http import schemas
from reducing_saver.service.http.routes import ERRORS, ORJSONResponse, ServiceDep, msgpack_too
from reducing_saver.service.operations import saver as ops
from reducing_saver.wire import (
    CAPABILITIES_PATH,
    DELTA_HISTORY_PATH,
    GET_PATH,
    LIST_PATH,
    PARENT_MESSAGES_HEADER,
    PARENT_MESSAGES_KEPT,
    PUT_PATH,
    WRITES_PATH,
)

router = APIRouter(tags=["saver"])


@router.get(CAPABILITIES_PATH, response_model=schemas.CapabilitiesAnswer)
async def capabilities(service: ServiceDep) -> Any:
    """The backend's optional capabilities and the reducer's configuration."""
    return ops.capabilities(service)


# The per-step routes: the hot path answers them before FastAPI; these twins document them and share
# their operations.


@router.post(
    GET_PATH,
    response_model=schemas.GetCheckpointAnswer,
    responses=ERRORS,
    summary="Get a checkpoint tuple (latest, or by checkpoint_id) of a thread and namespace.",
    openapi_extra=msgpack_too("GetCheckpointBody", "GetCheckpointAnswer"),
)
async def get_checkpoint(body: schemas.GetCheckpointBody, service: ServiceDep) -> Any:
    return ORJSONResponse(await service.call(ops.get_checkpoint, body))


@router.post(
    PUT_PATH,
    response_model=schemas.PutCheckpointAnswer,
    responses=ERRORS,
    summary="Store a checkpoint; its messages channel is cut to the reducer's window.",
    openapi_extra=msgpack_too("PutCheckpointBody", "PutCheckpointAnswer"),
)
async def put_checkpoint(
    body: schemas.PutCheckpointBody,
    service: ServiceDep,
    parent_messages: Annotated[
        str | None,
        Header(
            alias=PARENT_MESSAGES_HEADER,
            description="`kept`: every message of the parent checkpoint's messages list is in this put's "
            "list (the agent removed none in the step), so the service need not read the parent to find "
            "removals for long-term memory. A hint about the caller's own thread: a false one keeps the "
            "messages the agent removed out of that thread's memory. Any other value is ignored.",
        ),
    ] = None,
) -> Any:
    kept = parent_messages == PARENT_MESSAGES_KEPT
    return ORJSONResponse(
        await service.call(functools.partial(ops.put_checkpoint, parent_messages_kept=kept), body)
    )


@router.post(
    WRITES_PATH,
    status_code=204,
    responses=ERRORS,
    summary="Store a task's pending writes (idempotent per task_id and index).",
    openapi_extra=msgpack_too("PutWritesBody"),
)
async def put_writes(body: schemas.PutWritesBody, service: ServiceDep) -> Response:
    await service.call(ops.put_writes, body)
    return Response(status_code=204)


@router.post(
    LIST_PATH,
    response_model=schemas.ListCheckpointsAnswer,
    responses=ERRORS,
    summary="List checkpoints, newest first, filtered by thread, metadata, before and limit.",
)
async def list_checkpoints(body: schemas.ListCheckpointsBody, service: ServiceDep) -> Any:
    return ORJSONResponse(await service.call(ops.list_checkpoints, body))


@router.post(
    DELTA_HISTORY_PATH,
    response_model=schemas.DeltaHistoryAnswer,
    responses=ERRORS,
    summary="Per-channel writes and seed along a checkpoint's ancestors.",
)
async def delta_history(body: schemas.DeltaHistoryBody, service: ServiceDep) -> Any:
    return ORJSONResponse(await service.call(ops.delta_history, body))
