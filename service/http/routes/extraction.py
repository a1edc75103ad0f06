"""Long-term memory: the extraction outbox's figures, its dead letters, and re-driving them."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from reducing_saver.service.http import schemas
from reducing_saver.service.http.routes import ServiceDep
from reducing_saver.service.operations import saver as ops
from reducing_saver.wire import DEAD_LETTERS_PATH, EXTRACTION_STATUS_PATH, RETRY_DEAD_PATH

router = APIRouter(tags=["memory"])


@router.get(
    EXTRACTION_STATUS_PATH,
    response_model=schemas.ExtractionStatus,
    summary="Pruned messages pending, in flight, delivered and dead-lettered; oldest pending age; running "
    "summaries' batches.",
)
async def extraction_status(service: ServiceDep) -> Any:
    return await service.blocking(ops.extraction_status, service)


@router.get(
    DEAD_LETTERS_PATH,
    response_model=schemas.DeadLettersResponse,
    summary="Messages whose extraction failed every attempt, oldest first.",
)
async def dead_letters(service: ServiceDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> Any:
    return await service.blocking(ops.dead_letters, service, limit)


@router.post(
    RETRY_DEAD_PATH,
    response_model=schemas.RetryDeadResponse,
    summary="Put every dead letter back in the queue for another round of attempts.",
)
async def retry_dead(service: ServiceDep) -> Any:
    return await service.blocking(ops.retry_dead, service)
