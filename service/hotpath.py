"""The per-step routes without FastAPI's routing and dependency machinery.

A LangGraph turn makes one ``get_tuple``, about three ``put`` and two ``put_writes`` calls, one after
another, so every microsecond the service spends on them shows in the agent's turn time. ``HotPath`` is
an ASGI middleware that answers exactly those three routes itself: it reads the body, validates it with
the same pydantic models the OpenAPI document describes (straight from JSON bytes), calls the saver and
encodes the answer with orjson. Errors have FastAPI's shapes. Every other request, and these routes'
documentation, stays with FastAPI.

By default the call runs on the event loop itself, as a sync worker would run it: a worker-thread hop
costs more CPU than a ``get_tuple`` on PostgreSQL, and the process answers one call at a time, so
concurrency comes from worker processes (``--workers``). With ``offload=True`` (``--offload-calls``)
each call runs in a worker thread instead, so one process has several database calls in flight.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import HTTPException
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from reducing_saver.service.asgi import read_body
from reducing_saver.service.messages_codec import UnsafeMessagesError

logger = logging.getLogger("reducing_saver.service")

#: (request model, operation(service, body) -> payload or None, success status)
Route = tuple[type[BaseModel], Callable[[Any, Any], Any], int]


class HotPath:
    """Answer the routes in ``routes`` (by exact path, POST only); pass everything else on."""

    def __init__(self, app: ASGIApp, routes: dict[str, Route], service: Any, *, offload: bool = False) -> None:
        self.app = app
        self.routes = {path: (TypeAdapter(model), op, status) for path, (model, op, status) in routes.items()}
        self.service = service
        self.offload = offload

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        raw = await read_body(receive)
        if raw is None:
            return
        if self.offload:
            status, body = await run_in_threadpool(self._handle, route, raw)
        else:
            status, body = self._handle(route, raw)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _handle(self, route: tuple[TypeAdapter, Callable[[Any, Any], Any], int], raw: bytes) -> tuple[int, bytes]:
        adapter, op, ok = route
        try:
            payload = op(self.service, adapter.validate_json(raw))
        except ValidationError as exc:
            errors = [{**error, "loc": ["body", *error["loc"]]} for error in exc.errors(include_url=False)]
            try:
                return 422, orjson.dumps({"detail": errors}, default=str)
            except TypeError:  # an echoed input orjson cannot encode (an int beyond 64 bits): was a 500
                return 422, json.dumps({"detail": errors}, default=str).encode()
        except HTTPException as exc:
            return exc.status_code, orjson.dumps({"detail": exc.detail})
        except UnsafeMessagesError as exc:
            return 422, orjson.dumps({"detail": str(exc)})
        except NotImplementedError as exc:
            return 409, orjson.dumps({"detail": str(exc) or "not supported by this backend"})
        except Exception:
            logger.exception("request failed")
            return 500, orjson.dumps({"detail": "internal server error"})
        return ok, b"" if payload is None else orjson.dumps(payload)
