"""The FastAPI application: the whole LangGraph saver API over HTTP, reduced centrally.

``create_app(settings)`` builds an app whose lifespan opens the backend once (``state.Service``). A
request passes, outermost first: request id, access log and metrics (``observability``); the API key,
tenant and caps (``auth``); the body size limit and the JSON body guard (``guard``);
the per-step routes (``hotpath``, the front of the app). Everything else reaches FastAPI's own stack and
the routes of ``routes/``. Both the hot path and the routes call the operations of
``operations/saver.py``, which reach the database only in worker threads, and map errors through ``errors``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reducing_saver.service.configuration.settings import FLAGS_ENV, Settings
from reducing_saver.service.http import auth, guard
from reducing_saver.service.http.errors import ANSWERED, error_answer, error_body, headers_for
from reducing_saver.service.http.hotpath import ROUTES, HotPath
from reducing_saver.service.http.observability import (
    ObservabilityMiddleware,
    ServiceMetrics,
    configure_logging,
)
from reducing_saver.service.http.routes import (
    ORJSONResponse,
    checkpoints,
    extraction,
    health,
    storage,
    store,
    summaries,
    threads,
)
from reducing_saver.service.state import Service
from reducing_saver.service.storage import StorageError
from reducing_saver.service.version import __version__
from reducing_saver.wire import METRICS_PATH

if TYPE_CHECKING:
    from fastapi.telemetry import TelemetryConfig  # recent FastAPI; an older one takes telemetry= as an extra

logger = logging.getLogger("reducing_saver.service")


class ServiceApp(FastAPI):
    """A FastAPI app with a pipeline of ASGI middleware (``outer_middleware``, outermost first) in front
    of FastAPI's own middleware stack.

    The service's middleware (request ids and metrics, auth, size and shape checks, the hot path) is
    pure ASGI and handles its own errors; putting it outside FastAPI's error, exception and routing
    layers keeps those off the per-step calls.
    """

    outer_middleware: list[tuple[type, dict[str, Any]]] = []
    #: Why the service refused to start (a ``StorageError``: one line for an operator), once it has.
    refusal: str | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await super().__call__(scope, receive, send)
            return

        async def send_refusal(message: Message) -> None:
            # Starlette reports a failed start-up with the traceback; a refusal is one line instead (the
            # command line prints it, so the server logs nothing of its own).
            if message["type"] == "lifespan.startup.failed" and self.refusal is not None:
                message = {**message, "message": ""}
            await send(message)

        await super().__call__(scope, receive, send_refusal)

    def build_middleware_stack(self) -> ASGIApp:
        app = super().build_middleware_stack()
        for cls, options in reversed(self.outer_middleware):
            app = cls(app, **options)
        return app


#: Where the documentation pages' scripts and styles are served from: the package ``fastapi-offline``
#: ships Swagger UI 5 and ReDoc 2 (FastAPI's pages load them from a CDN, so they stay blank offline).
DOCS_ASSETS_URL = "/docs/assets"
DOCS_ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")
DOCS_PATHS = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
#: FastAPI's native OpenTelemetry, off.
NO_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False, "auto_configure": False}


def _docs_assets_folder() -> str:
    import fastapi_offline

    return str(Path(fastapi_offline.__file__).parent / "static")


def _add_docs(app: FastAPI) -> None:
    """``/docs`` (Swagger UI) and ``/redoc`` with every script, style and icon served by the service, and
    nothing fetched from elsewhere: no CDN, no Google fonts, no swagger.io validator badge. They and
    ``/openapi.json`` need no API key unless ``docs_public`` is off (``create_app`` decides)."""
    assets = DOCS_ASSETS_URL
    app.mount(assets, StaticFiles(directory=_docs_assets_folder()), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url="/docs/oauth2-redirect",
            swagger_js_url=f"{assets}/swagger-ui-bundle.js",
            swagger_css_url=f"{assets}/swagger-ui.css",
            swagger_favicon_url=f"{assets}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url="/openapi.json",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{assets}/redoc.standalone.js",
            redoc_favicon_url=f"{assets}/favicon.png",
            with_google_fonts=False,
        )


async def _answer_error(request: Request, exc: Exception) -> Response:
    """FastAPI's exception handler: the same table as the hot path's."""
    answer = error_answer(exc)
    if answer is None:
        logger.error("request failed", exc_info=exc)
        answer = (500, "internal server error")
    status, detail = answer
    headers = {name.decode(): value.decode() for name, value in headers_for(status)}
    return Response(
        error_body(detail, status), status_code=status, media_type="application/json", headers=headers
    )


def create_app(
    settings: Settings | None = None, *, on_prune: list[Callable[..., Any]] | None = None
) -> ServiceApp:
    """Build the service app.

    Args:
        settings: The settings; read from the environment when omitted.
        on_prune: Extra reducer hooks (for embedding and tests), called with the pruned messages as
            ``model_dump()`` dicts and the namespace.
    """
    settings = settings or Settings()
    service = Service(settings, on_prune, metrics=ServiceMetrics)

    @asynccontextmanager
    async def lifespan(app: ServiceApp) -> AsyncIterator[None]:
        try:
            await run_in_threadpool(service.open)
        except StorageError as exc:  # the database is unfit (unreachable, read-only, behind a pooler...)
            app.refusal = str(exc)
            if os.environ.get(FLAGS_ENV) is not None:  # a worker process of `serve --workers N`: it logs it
                logger.error("reducing-saver: %s", exc)
            raise
        try:
            yield
        finally:
            # uvicorn sends the lifespan shutdown once in-flight requests are done (or the grace is over).
            await run_in_threadpool(service.close)

    app = ServiceApp(
        title="reducing-saver",
        version=__version__,
        summary="LangGraph checkpoints over HTTP; every stored checkpoint keeps a bounded window of messages.",
        lifespan=lifespan,
        default_response_class=ORJSONResponse,
        # Replaced by _add_docs: the same pages, with their assets served from the package.
        docs_url=None,
        redoc_url=None,
        # The service reports through /metrics and its logs. FastAPI's own OpenTelemetry spans and metrics
        # would otherwise look up the global providers on every request, per-step calls included.
        telemetry=NO_TELEMETRY,
    )
    app.state.service = service
    docs = frozenset(DOCS_PATHS) | frozenset(f"{DOCS_ASSETS_URL}/{name}" for name in DOCS_ASSETS)
    public = (
        auth.PUBLIC_PATHS
        | ({METRICS_PATH} if settings.metrics_public else set())
        | (docs if settings.docs_public else set())
    )
    limits = settings.limits
    routers = (
        health.router,
        checkpoints.router,
        threads.router,
        storage.router,
        extraction.router,
        summaries.router,
        store.router,
    )
    paths = (
        frozenset(route.path for router in routers for route in router.routes if isinstance(route, Route))
        | docs
    )
    app.outer_middleware = [
        # Request id, access log and count for everything, refusals included.
        (ObservabilityMiddleware, {"metrics": service.metrics, "paths": paths}),
        # A request without a valid key is refused before its body is read.
        (
            auth.AuthMiddleware,
            {
                "keys": service.api_keys,
                "limits": limits,
                "public": frozenset(public),
                "metrics_keys": settings.metrics_key_set,
                "serves": auth.route_matcher([route for router in routers for route in router.routes]),
            },
        ),
        (guard.BodySizeLimit, {"limit": settings.max_body_bytes}),
        # JSON bodies that are not UTF-8, nest too deep or repeat a key get 422; msgpack bodies go to the
        # per-step routes only (which check them as they decode), elsewhere 415.
        (
            guard.BodyGuard,
            {"limits": limits, "msgpack_paths": frozenset(ROUTES), "big_int_paths": store.BIG_INT_PATHS},
        ),
        # The per-step routes, without FastAPI's routing (their FastAPI twins document them).
        (HotPath, {"service": service}),
    ]
    for error in ANSWERED:
        app.add_exception_handler(error, _answer_error)
    for router in routers:
        app.include_router(router)
    _add_docs(app)
    if service.api_keys is not None or settings.metrics_key_set is not None:
        auth.document_auth(
            app, public, tenants=service.api_keys is not None, metrics=settings.metrics_key_set is not None
        )
    return app


def app_from_env() -> ServiceApp:
    """uvicorn factory: ``uvicorn --factory reducing_saver.service.http.app:app_from_env``."""
    settings = Settings(**json.loads(os.environ.get(FLAGS_ENV) or "{}"))
    configure_logging(settings)
    return create_app(settings)
