"""Probes and metrics: ``/healthz``, ``/readyz``, ``/metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from reducing_saver.service.errors import Unavailable
from reducing_saver.service.http.routes import ERRORS, ServiceDep
from reducing_saver.service.storage import DatabaseUnavailable
from reducing_saver.wire import HEALTH_PATH, METRICS_PATH, READY_PATH

router = APIRouter(tags=["health"])

#: How long ``/readyz`` lets the database take to answer (a kubelet probe's timeout is a few seconds).
READY_TIMEOUT_SECONDS = 2.0


@router.get(HEALTH_PATH, summary="The process is alive.")
async def healthz() -> dict[str, str]:
    # On the event loop, which never waits on the database: it answers while the database hangs.
    return {"status": "ok"}


@router.get(
    READY_PATH,
    summary=f"The database answers: the checkpoint table is readable within {READY_TIMEOUT_SECONDS:g} s, and "
    "the server accepts writes.",
    responses={503: ERRORS[503]},
)
async def readyz(service: ServiceDep) -> dict[str, str]:
    backend = service.backend
    if backend is None:
        raise Unavailable("the service is starting or stopping")
    try:
        await service.blocking(backend.ready, READY_TIMEOUT_SECONDS, timeout=READY_TIMEOUT_SECONDS + 0.5)
    except Unavailable:
        raise Unavailable(f"database not ready: no answer within {READY_TIMEOUT_SECONDS:g} s") from None
    except DatabaseUnavailable as exc:  # unreachable, or it accepts no writes (a standby, a failover)
        raise Unavailable(f"database not ready: {exc}") from None
    except Exception as exc:
        raise Unavailable(f"database not ready: {type(exc).__name__}") from None
    return {"status": "ready"}


@router.get(
    METRICS_PATH,
    summary="Prometheus metrics (of every worker, added up, with --workers N). Answers at once: the "
    "outbox figures read from the database carry their age (reducing_saver_outbox_status_age_seconds).",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text exposition format."}},
)
async def metrics(request: Request, service: ServiceDep) -> Response:
    # The outbox figures come from the database: read in a worker thread, waited for only briefly.
    await service.metrics.refresh(service.background)
    body, content_type = service.metrics.render(request.headers.get("accept"))
    return Response(body, media_type=content_type)
