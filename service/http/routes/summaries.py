"""Running summaries: the batches whose summary failed every attempt, and sending them back."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from reducing_saver.service.http import schemas
from reducing_saver.service.http.routes import ERRORS, ServiceDep
from reducing_saver.service.operations import saver as ops
from reducing_saver.wire import SUMMARY_DEAD_PATH, SUMMARY_RETRY_DEAD_PATH

router = APIRouter(tags=["summaries"])

_OFF: dict[int | str, dict[str, Any]] = {
    404: {"model": schemas.ErrorBody, "description": "Running summaries are off (no --summarizer)."}
}


@router.get(
    SUMMARY_DEAD_PATH,
    response_model=schemas.DeadSummaryStepsResponse,
    responses={**ERRORS, **_OFF},
    summary="Summary batches that failed every attempt, oldest first (404 without --summarizer).",
)
async def dead_steps(service: ServiceDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> Any:
    return await service.blocking(ops.summary_dead_steps, service, limit)


@router.post(
    SUMMARY_RETRY_DEAD_PATH,
    response_model=schemas.SummaryRetryDeadResponse,
    responses={**ERRORS, **_OFF},
    summary="Send every dead summary batch back to the summarizer (404 without --summarizer).",
)
async def retry_dead(service: ServiceDep) -> Any:
    return await service.blocking(ops.summary_retry_dead, service)
