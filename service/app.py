"""The FastAPI application: the whole LangGraph saver API over HTTP, reduced centrally.

``create_app(settings)`` builds an app whose lifespan opens the backend once. Saver calls are
blocking (PostgresSaver, SqliteSaver), so the routes are plain functions that FastAPI runs in its
thread pool; the backend lends each call a saver of its own.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

import orjson
import psycopg
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointTuple
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reducing_saver.client._wire import (
    BODY_FORMATS,
    MSGPACK,
    Blob,
    WireError,
    base64_from_wire,
    is_inline,
    json_default,
)
from reducing_saver.service import schemas, security
from reducing_saver.service.backends import Backend, open_backend, refused_value
from reducing_saver.service.hotpath import HotPath
from reducing_saver.service.imports import import_callable
from reducing_saver.service.memory import Memory, store_namespace
from reducing_saver.service.messages_codec import SafeMessagesCodec, UnsafeMessagesError, to_message
from reducing_saver.service.observability import ObservabilityMiddleware, ServiceMetrics, configure_logging
from reducing_saver.service.reducer import MessageReducer
from reducing_saver.service.savers import ThreadNotEmptyError
from reducing_saver.service.settings import Settings
from reducing_saver.service.sweeper import InvalidTTLError, Sweeper, SweepStatus, open_sweeper

logger = logging.getLogger("reducing_saver.service")

try:
    __version__ = version("reducing-saver")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0"


class ORJSONResponse(JSONResponse):
    """JSON by orjson; :class:`Blob` values become ``{"type", "data": base64}``."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, default=json_default)


# -- wire conversion ------------------------------------------------------------------------------


def _wire_value(value: Any) -> Any:
    """A stored value as it travels: a primitive inline, a :class:`Blob` left for the body's encoder."""
    if isinstance(value, Blob) or is_inline(value):
        return value
    raise TypeError(f"stored value of type {type(value).__name__} cannot travel")


def _from_wire(value: Any, field: str) -> Any:
    if isinstance(value, schemas.TypedValue):
        if isinstance(value.data, bytes):  # a msgpack body's bin
            return Blob(value.type, value.data)
        try:
            return Blob(value.type, base64_from_wire(value.data, f"{field}.data"))
        except WireError as exc:
            raise HTTPException(422, str(exc)) from None
    return value


def _tuple_out(item: CheckpointTuple) -> dict[str, Any]:
    checkpoint = dict(item.checkpoint)
    values = checkpoint.pop("channel_values", None) or {}
    return {
        "config": item.config,
        "checkpoint": checkpoint,
        "values": {channel: _wire_value(value) for channel, value in values.items()},
        "metadata": item.metadata,
        "parent_config": item.parent_config,
        "pending_writes": [
            [task_id, channel, _wire_value(value)] for task_id, channel, value in item.pending_writes or ()
        ],
    }


def _run_config(config: schemas.RunConfig, *, need_thread: bool = True) -> RunnableConfig:
    configurable = dict(config.configurable)
    thread_id = configurable.get("thread_id")
    if need_thread and (thread_id is None or thread_id == ""):
        raise HTTPException(422, "config.configurable.thread_id is required")
    if thread_id is not None:
        configurable["thread_id"] = str(thread_id)
    checkpoint_ns = configurable.get("checkpoint_ns")
    if checkpoint_ns is None:
        configurable["checkpoint_ns"] = ""
    elif not isinstance(checkpoint_ns, str):
        raise HTTPException(422, "config.configurable.checkpoint_ns must be a string")
    run_config: RunnableConfig = {"configurable": configurable}
    if config.metadata:
        run_config["metadata"] = dict(config.metadata)
    return run_config


def _msgpack_too(request: str, answer: str | None = None) -> dict[str, Any]:
    """OpenAPI: the route also takes an ``application/msgpack`` body (and then answers in msgpack)."""
    extra: dict[str, Any] = {
        "requestBody": {"content": {MSGPACK: {"schema": {"$ref": f"#/components/schemas/{request}"}}}}
    }
    if answer is not None:
        schema = {"$ref": f"#/components/schemas/{answer}"}
        extra["responses"] = {"200": {"content": {MSGPACK: {"schema": schema}}}}
    return extra


# -- the per-step operations (shared by the FastAPI routes and the hot path) ---------------------


def _scope(service: Service) -> security.TenantScope:
    """The request's tenant scope (identity without API keys); see service/security.py."""
    return security.TenantScope.for_request(service.api_keys is not None)


def get_checkpoint_op(service: Service, body: schemas.GetCheckpointRequest) -> dict[str, Any]:
    scope = _scope(service)
    config = scope.config_in(_run_config(body.config), service.settings.namespace_key)
    with service.open_backend().borrow() as saver:
        item = saver.get_tuple(config)
    return {"checkpoint": scope.tuple_out(_tuple_out(item)) if item else None}


def put_checkpoint_op(service: Service, body: schemas.PutCheckpointRequest) -> dict[str, Any]:
    scope = _scope(service)
    config = _run_config(body.config)
    messages_key = service.settings.messages_key
    values = {channel: _from_wire(value, f"values.{channel}") for channel, value in body.values.items()}
    if messages_key in body.new_versions:
        # Decided now, not when the extractor meets it: a namespace the store refuses would never deliver.
        try:
            store_namespace(config, service.settings.namespace_key)
        except ValueError as exc:
            raise HTTPException(422, f"config.configurable.{service.settings.namespace_key}: {exc}") from None
        value = values.get(messages_key)
        if isinstance(value, Blob):
            try:
                security.check_messages_value(value.type, value.data, f"values.{messages_key}")
            except ValueError as exc:
                raise HTTPException(422, str(exc)) from None
    config = scope.config_in(config, service.settings.namespace_key, namespace=messages_key in body.new_versions)
    backend = service.open_backend()
    if service.sweeper is not None:  # before the write, so a TTL sweep of this thread skips it (sweeper.py)
        try:
            service.sweeper.touch(config)
        except InvalidTTLError as exc:
            raise HTTPException(422, str(exc)) from None
    checkpoint = body.checkpoint.model_dump()
    checkpoint["channel_values"] = values
    with backend.borrow() as saver:
        next_config = saver.put(config, checkpoint, body.metadata, body.new_versions)
    return {"config": scope.config_out(next_config)}


def put_writes_op(service: Service, body: schemas.PutWritesRequest) -> None:
    config = _scope(service).config_in(_run_config(body.config), service.settings.namespace_key)
    if not config["configurable"].get("checkpoint_id"):
        raise HTTPException(422, "config.configurable.checkpoint_id is required for writes")
    writes = [
        (channel, _from_wire(value, f"writes[{index}]")) for index, (channel, value) in enumerate(body.writes)
    ]
    with service.open_backend().borrow() as saver:
        saver.put_writes(config, writes, body.task_id, body.task_path)


# -- request size ---------------------------------------------------------------------------------


class BodySizeLimit:
    """Answer 413 to bodies over ``limit`` bytes, before the app parses anything."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await self._reject(send, 400, "Content-Length is not a number")
                    return
                if declared > self.limit:
                    await self._reject(send, 413, self._too_large())
                    return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._reject(send, 413, self._too_large())

    def _too_large(self) -> str:
        return f"request body is larger than the limit of {self.limit} bytes (setting max_body_bytes)"

    @staticmethod
    async def _reject(send: Send, status: int, detail: str) -> None:
        body = orjson.dumps({"detail": detail})
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass


# -- the app --------------------------------------------------------------------------------------


def _message_hooks(paths: list[str], codec: SafeMessagesCodec) -> list[Callable[..., Any]]:
    """Operator hooks get the pruned messages as LangChain objects (or dicts for custom classes)."""
    hooks = []
    for path in paths:
        hook = import_callable(path, "on_prune hook")

        def call(messages: list[Any], namespace: tuple[str, ...], hook: Callable[..., Any] = hook) -> Any:
            return hook([to_message(m) for m in messages], namespace)

        hooks.append(call)
    return hooks


class ServiceApp(FastAPI):
    """A FastAPI app with a pipeline of ASGI middleware (``outer_middleware``, outermost first) in front
    of FastAPI's own middleware stack.

    The service's middleware (request ids and metrics, auth, size and shape checks, the hot path) is
    pure ASGI and handles its own errors; putting it outside FastAPI's error, exception and routing
    layers keeps those off the per-step calls.
    """

    outer_middleware: list[tuple[type, dict[str, Any]]] = []

    def build_middleware_stack(self) -> ASGIApp:
        app = super().build_middleware_stack()
        for cls, options in reversed(self.outer_middleware):
            app = cls(app, **options)
        return app


class Service:
    """What the routes share: settings, the reducer, the codec, the metrics, the backend and memory."""

    def __init__(self, settings: Settings, extra_hooks: list[Callable[..., Any]] | None = None) -> None:
        self.settings = settings
        #: API key digests and tenants; None in single-tenant mode (no key configured).
        self.api_keys = security.load_api_keys(settings)
        self.codec = SafeMessagesCodec(settings.allowed_message_classes)
        self.metrics = ServiceMetrics(self.codec)
        hooks = [*_message_hooks(settings.on_prune, self.codec), *(extra_hooks or []), self.metrics.count_delivered]
        self.reducer = MessageReducer(settings.reducer_config(on_prune=hooks))
        self.backend: Backend | None = None
        self.memory: Memory | None = None
        self.sweeper: Sweeper | None = None

    def open(self) -> Backend:
        backend = open_backend(self.settings, self.reducer, self.metrics.measuring(), self._record_pruned)
        self.memory = Memory(self.settings, pool=backend.pool)
        if self.settings.extract:
            self.memory.start()
        # Before the backend is served: every put notes its thread's write in the TTL ledger.
        self.sweeper = open_sweeper(
            self.settings, backend=backend, recorder=self.memory.outbox, registry=self.metrics.registry
        )
        if self.settings.sweep:
            self.sweeper.start()
        self.backend = backend
        self.metrics.watch(backend, self.memory.outbox)
        return backend

    def _record_pruned(self, pruned: list[Any], namespace: tuple[str, ...], config: Any, checkpoint: Any) -> None:
        assert self.memory is not None, "the backend records only while the service is open"
        self.memory.record(pruned, namespace, config, checkpoint)

    def open_backend(self) -> Backend:
        """The backend, or 503 while the service starts or stops."""
        backend = self.backend
        if backend is None:
            raise HTTPException(503, "the service is starting or stopping")
        return backend

    def close(self) -> None:
        backend, self.backend = self.backend, None
        if self.sweeper is not None:
            self.sweeper.close(self.settings.shutdown_grace_seconds)
            self.sweeper = None
        if self.memory is not None:
            self.memory.close(self.settings.shutdown_grace_seconds)
            self.memory = None
        if backend is not None:
            self.metrics.watch(None)
            backend.close()


def _memory(service: Service) -> Memory:
    if service.memory is None:
        raise HTTPException(503, "the service is starting or stopping")
    return service.memory


def _dead_letter(entry: Any) -> dict[str, Any]:
    return {
        "namespace": list(entry.namespace),
        "key": entry.key,
        "thread_id": entry.thread_id,
        "attempts": entry.attempts,
        "last_error": entry.last_error,
        "pruned_at": entry.pruned_at.isoformat(),
    }


async def get_service(request: Request) -> Service:
    return request.app.state.service


async def get_backend(request: Request) -> Backend:
    return request.app.state.service.open_backend()


ServiceDep = Annotated[Service, Depends(get_service)]
BackendDep = Annotated[Backend, Depends(get_backend)]

_ERRORS = {
    413: {"model": schemas.ErrorResponse, "description": "Body larger than max_body_bytes."},
    422: {"model": schemas.ErrorResponse, "description": "A field is missing, of the wrong type, or refused."},
    503: {"model": schemas.ErrorResponse, "description": "The database is unreachable."},
}


def create_app(settings: Settings | None = None, *, on_prune: list[Callable[..., Any]] | None = None) -> FastAPI:
    """Build the service app.

    Args:
        settings: The settings; read from the environment when omitted.
        on_prune: Extra reducer hooks (for embedding and tests), called with the pruned messages as
            ``model_dump()`` dicts and the namespace.
    """
    settings = settings or Settings()
    service = Service(settings, on_prune)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backend = service.open()
        logger.info("backend %s ready (%d savers)", backend.kind, backend.size)
        try:
            yield
        finally:
            # uvicorn sends the lifespan shutdown once in-flight requests are done (or the grace is over).
            service.close()
            logger.info("backend %s closed; shutdown complete", backend.kind)

    app = ServiceApp(
        title="reducing-saver",
        version=__version__,
        summary="LangGraph checkpoints over HTTP; every stored checkpoint keeps a bounded window of messages.",
        lifespan=lifespan,
        default_response_class=ORJSONResponse,
    )
    app.state.service = service
    # The request pipeline, outermost first. It runs before FastAPI's own stack (error pages, exception
    # handlers, routing), which only the routes the hot path does not answer reach.
    limits = security.Limits.from_settings(settings)
    public = security.PUBLIC_PATHS | ({"/metrics"} if settings.metrics_public else set())
    hot_routes = {
        "/v1/checkpoints/get": (schemas.GetCheckpointRequest, get_checkpoint_op, 200),
        "/v1/checkpoints/put": (schemas.PutCheckpointRequest, put_checkpoint_op, 200),
        "/v1/writes/put": (schemas.PutWritesRequest, put_writes_op, 204),
    }
    app.outer_middleware = [
        # Request id, access log and count for everything, refusals included.
        (ObservabilityMiddleware, {"metrics": service.metrics}),
        # A request without a valid key is refused before its body is read.
        (security.AuthMiddleware, {"keys": service.api_keys, "limits": limits, "public": frozenset(public)}),
        (BodySizeLimit, {"limit": settings.max_body_bytes}),
        # JSON bodies that are not UTF-8, nest too deep or repeat a key get 422; msgpack bodies go to the
        # per-step routes only (which check them as they decode), elsewhere 415.
        (security.BodyGuard, {"limits": limits, "msgpack_paths": frozenset(hot_routes)}),
        # The per-step routes, without FastAPI's routing (their FastAPI twins below document them).
        (HotPath, {"routes": hot_routes, "service": service, "offload": settings.offload_calls}),
    ]

    @app.exception_handler(UnsafeMessagesError)
    async def _unsafe(request: Request, exc: UnsafeMessagesError) -> Response:
        return ORJSONResponse({"detail": str(exc)}, status_code=422)

    @app.exception_handler(ThreadNotEmptyError)
    async def _target_exists(request: Request, exc: ThreadNotEmptyError) -> Response:
        return ORJSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(psycopg.DataError)
    async def _refused_value(request: Request, exc: psycopg.DataError) -> Response:
        return ORJSONResponse({"detail": refused_value(exc)}, status_code=422)

    @app.exception_handler(NotImplementedError)
    async def _unsupported(request: Request, exc: NotImplementedError) -> Response:
        return ORJSONResponse({"detail": str(exc) or "not supported by this backend"}, status_code=409)

    @app.get("/healthz", tags=["health"], summary="The process is alive.")
    async def healthz() -> dict[str, str]:  # on the event loop: a liveness probe needs no thread
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], summary="The database answers.", responses={503: _ERRORS[503]})
    def readyz(backend: BackendDep) -> dict[str, str]:
        try:
            backend.ready()
        except Exception as exc:
            raise HTTPException(503, f"database not reachable: {type(exc).__name__}") from None
        return {"status": "ready"}

    @app.get(
        "/metrics",
        tags=["health"],
        summary="Prometheus metrics of this worker process.",
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text exposition format."}},
    )
    async def metrics(request: Request) -> Response:
        body, content_type = service.metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/v1/capabilities", tags=["saver"], response_model=schemas.CapabilitiesResponse)
    def capabilities(service: ServiceDep, backend: BackendDep) -> Any:
        """The backend's optional capabilities and the reducer's configuration."""
        config = service.reducer.config
        return {
            "capabilities": sorted(backend.capabilities),
            "backend": backend.kind,
            "messages_key": settings.messages_key,
            "reducer": {
                "max_messages": config.max_messages,
                "min_messages": config.count_target,
                "max_tokens": config.max_tokens,
                "target_tokens": config.token_target,
                "preserve_first": config.preserve_first,
                "cascade_tool_messages": config.cascade_tool_messages,
                "start_on": config.start_on,
                "namespace_key": config.namespace_key,
            },
            "version": __version__,
            "body_formats": list(BODY_FORMATS),
        }

    @app.post(
        "/v1/checkpoints/get",
        tags=["saver"],
        response_model=schemas.GetCheckpointResponse,
        responses=_ERRORS,
        summary="Get a checkpoint tuple (latest, or by checkpoint_id) of a thread and namespace.",
        openapi_extra=_msgpack_too("GetCheckpointRequest", "GetCheckpointResponse"),
    )
    def get_checkpoint(body: schemas.GetCheckpointRequest, service: ServiceDep) -> Any:
        return ORJSONResponse(get_checkpoint_op(service, body))

    @app.post(
        "/v1/checkpoints/list",
        tags=["saver"],
        response_model=schemas.ListCheckpointsResponse,
        responses=_ERRORS,
        summary="List checkpoints, newest first, filtered by thread, metadata, before and limit.",
    )
    def list_checkpoints(body: schemas.ListCheckpointsRequest, service: ServiceDep, backend: BackendDep) -> Any:
        scope = _scope(service)
        # A config without a thread id used to reach the saver and fail there (500): a config names a thread.
        config = _run_config(body.config) if body.config else None
        before = _run_config(body.before, need_thread=False) if body.before else None
        if config is not None:
            config = scope.config_in(config, settings.namespace_key)
        with backend.borrow() as saver:
            found = security.list_checkpoints(
                saver, backend.kind, scope, config, filter=body.filter, before=before, limit=body.limit
            )
            items = [scope.tuple_out(_tuple_out(item)) for item in found]
        return ORJSONResponse({"checkpoints": items})

    @app.post(
        "/v1/checkpoints/put",
        tags=["saver"],
        response_model=schemas.PutCheckpointResponse,
        responses=_ERRORS,
        summary="Store a checkpoint; its messages channel is cut to the reducer's window.",
        openapi_extra=_msgpack_too("PutCheckpointRequest", "PutCheckpointResponse"),
    )
    def put_checkpoint(body: schemas.PutCheckpointRequest, service: ServiceDep) -> Any:
        return ORJSONResponse(put_checkpoint_op(service, body))

    @app.post(
        "/v1/writes/put",
        tags=["saver"],
        status_code=204,
        responses=_ERRORS,
        summary="Store a task's pending writes (idempotent per task_id and index).",
        openapi_extra=_msgpack_too("PutWritesRequest"),
    )
    def put_writes(body: schemas.PutWritesRequest, service: ServiceDep) -> Response:
        put_writes_op(service, body)
        return Response(status_code=204)

    @app.post("/v1/threads/delete", tags=["threads"], status_code=204, responses=_ERRORS,
              summary="Delete every checkpoint and write of a thread.")
    def delete_thread(body: schemas.DeleteThreadRequest, service: ServiceDep, backend: BackendDep) -> Response:
        thread_id = _scope(service).thread(body.thread_id)
        if settings.extract_on_delete and service.sweeper is not None:
            service.sweeper.delete_extracting(thread_id)  # its window goes to long-term memory first
            return Response(status_code=204)
        with backend.borrow() as saver:
            saver.delete_thread(thread_id)
        return Response(status_code=204)

    @app.post("/v1/threads/copy", tags=["threads"], status_code=204, responses=_ERRORS,
              summary="Copy a thread's checkpoints and writes to another thread id .")
    def copy_thread(body: schemas.CopyThreadRequest, service: ServiceDep, backend: BackendDep) -> Response:
        if body.source_thread_id == body.target_thread_id:  # was a ValueError from the saver: a 500
            raise HTTPException(422, f"target_thread_id: the same thread as source_thread_id ({body.source_thread_id!r})")
        scope = _scope(service)
        if service.sweeper is not None:  # the copy is the target's write: its TTL age starts now
            service.sweeper.copied(scope.thread(body.source_thread_id), scope.thread(body.target_thread_id))
        with backend.borrow() as saver:
            try:
                saver.copy_thread(scope.thread(body.source_thread_id), scope.thread(body.target_thread_id))
            except ThreadNotEmptyError:
                raise ThreadNotEmptyError(body.target_thread_id) from None
        return Response(status_code=204)

    @app.post("/v1/threads/prune", tags=["threads"], status_code=204, responses=_ERRORS,
              summary="Prune threads: keep_latest keeps each namespace's head; delete removes all.")
    def prune(body: schemas.PruneRequest, service: ServiceDep, backend: BackendDep) -> Response:
        scope = _scope(service)
        with backend.borrow() as saver:
            try:
                saver.prune(scope.threads(body.thread_ids), strategy=body.strategy)
            except NotImplementedError as exc:
                raise NotImplementedError(scope.text(str(exc))) from None
        return Response(status_code=204)

    @app.post("/v1/runs/delete", tags=["threads"], status_code=204, responses=_ERRORS,
              summary="Delete the checkpoints and writes of runs.")
    def delete_for_runs(body: schemas.DeleteRunsRequest, service: ServiceDep, backend: BackendDep) -> Response:
        scope = _scope(service)
        with backend.borrow() as saver:
            if scope.tenant is None:
                saver.delete_for_runs(body.run_ids)
            else:  # only this tenant's threads (the service's savers take a thread-id prefix)
                saver.inner.delete_for_runs(body.run_ids, thread_id_prefix=scope.prefix)
        return Response(status_code=204)

    @app.get("/v1/sweeps/status", tags=["threads"], response_model=SweepStatus,
             summary="TTL sweeps: settings, this process's figures, and every sweeper's from the sweep log.")
    def sweeps_status(service: ServiceDep) -> Any:
        if service.sweeper is None:
            raise HTTPException(503, "the service is starting or stopping")
        return service.sweeper.status()

    @app.get("/v1/extraction/status", tags=["memory"], response_model=schemas.ExtractionStatus,
             summary="Pruned messages pending, in flight, delivered and dead-lettered; oldest pending age.")
    def extraction_status(service: ServiceDep) -> Any:
        return _memory(service).outbox.status(namespace_prefix=_scope(service).namespace_prefix)

    @app.get("/v1/extraction/dead-letters", tags=["memory"], response_model=schemas.DeadLettersResponse,
             summary="Messages whose extraction failed every attempt, oldest first.")
    def dead_letters(service: ServiceDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> Any:
        scope = _scope(service)
        entries = _memory(service).outbox.dead_letters(limit, namespace_prefix=scope.namespace_prefix)
        return {
            "dead_letters": [
                {**_dead_letter(entry), "namespace": scope.unnamespace(entry.namespace)} for entry in entries
            ]
        }

    @app.post("/v1/extraction/retry-dead", tags=["memory"], response_model=schemas.RetryDeadResponse,
              summary="Put every dead letter back in the queue for another round of attempts.")
    def retry_dead(service: ServiceDep) -> Any:
        return {"requeued": _memory(service).outbox.retry_dead(namespace_prefix=_scope(service).namespace_prefix)}

    @app.post(
        "/v1/checkpoints/delta-history",
        tags=["saver"],
        response_model=schemas.DeltaHistoryResponse,
        responses=_ERRORS,
        summary="Per-channel writes and seed along a checkpoint's ancestors.",
    )
    def delta_history(body: schemas.DeltaHistoryRequest, service: ServiceDep, backend: BackendDep) -> Any:
        config = _scope(service).config_in(_run_config(body.config), settings.namespace_key)
        with backend.borrow() as saver:
            history = saver.get_delta_channel_history(config=config, channels=body.channels)
        channels = {}
        for channel, entry in history.items():
            out: dict[str, Any] = {
                "writes": [[task_id, ch, _wire_value(value)] for task_id, ch, value in entry["writes"]]
            }
            if "seed" in entry:
                out["seed"] = _wire_value(entry["seed"])
            channels[channel] = out
        return ORJSONResponse({"channels": channels})

    if service.api_keys is not None:
        security.document_auth(app, public)
    return app


def app_from_env() -> FastAPI:
    """uvicorn factory: ``uvicorn --factory reducing_saver.service.app:app_from_env``."""
    settings = Settings()
    configure_logging(settings)
    return create_app(settings)
