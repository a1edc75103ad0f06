"""Threads and runs: delete, copy, prune, delete a run's checkpoints; TTL sweep status."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from reducing_saver.service.http import schemas
from reducing_saver.service.http.routes import ERRORS, ServiceDep
from reducing_saver.service.operations import saver as ops
from reducing_saver.service.ttl.sweeper import SweepStatus
from reducing_saver.wire import (
    RUNS_DELETE_PATH,
    SWEEPS_STATUS_PATH,
    THREAD_COPY_PATH,
    THREAD_DELETE_PATH,
    THREAD_PRUNE_PATH,
)

router = APIRouter(tags=["threads"])


@router.post(
    THREAD_DELETE_PATH,
    status_code=204,
    responses=ERRORS,
    summary="Delete every checkpoint and write of a thread.",
)
async def delete_thread(body: schemas.DeleteThreadBody, service: ServiceDep) -> Response:
    await service.call(ops.delete_thread, body)
    return Response(status_code=204)


@router.post(
    THREAD_COPY_PATH,
    status_code=204,
    responses=ERRORS,
    summary="Copy a thread's checkpoints and writes to another thread id.",
)
async def copy_thread(body: schemas.CopyThreadBody, service: ServiceDep) -> Response:
    await service.call(ops.copy_thread, body)
    return Response(status_code=204)


@router.post(
    THREAD_PRUNE_PATH,
    status_code=204,
    responses=ERRORS,
    summary="Prune threads: keep_latest keeps each namespace's head; delete removes all.",
)
async def prune(body: schemas.PruneBody, service: ServiceDep) -> Response:
    await service.call(ops.prune, body)
    return Response(status_code=204)


@router.post(
    RUNS_DELETE_PATH, status_code=204, responses=ERRORS, summary="Delete the checkpoints and writes of runs."
)
async def delete_for_runs(body: schemas.DeleteRunsBody, service: ServiceDep) -> Response:
    await service.call(ops.delete_for_runs, body)
    return Response(status_code=204)


@router.get(
    SWEEPS_STATUS_PATH,
    response_model=SweepStatus,
    summary="TTL sweeps: settings, this process's figures, and every sweeper's from the sweep log "
    "(with API keys: the caller's threads only).",
)
async def sweeps_status(service: ServiceDep) -> Any:
    return await service.blocking(ops.sweeps_status, service)
