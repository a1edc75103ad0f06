"""The per-step routes without FastAPI's routing and dependency machinery.

A LangGraph turn makes one ``get_tuple``, about three ``put`` and two ``put_writes`` calls, one after
another, so every microsecond the service spends on them shows in the agent's turn time. ``HotPath`` is
an ASGI middleware that answers exactly those three routes itself: it reads the body, validates it with
the same pydantic models the OpenAPI document describes (straight from JSON bytes, or from the plain
values of an ``application/msgpack`` body: see ``msgpack_body``), calls the saver and encodes the answer
in the request's format (orjson or ormsgpack). Errors are JSON, in FastAPI's shapes. Every other
request, and these routes' documentation, stays with FastAPI.

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
import ormsgpack
import psycopg
from fastapi import HTTPException
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from reducing_saver.client._wire import JSON, MSGPACK, json_default, msgpack_default
from reducing_saver.service import msgpack_body, security
from reducing_saver.service.asgi import is_msgpack, read_body
from reducing_saver.service.backends import refused_value
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
        msgpack = False
        for name, value in scope["headers"]:
            if name == b"content-type":
                msgpack = is_msgpack(value)
                break
        if self.offload:
            status, content_type, body = await run_in_threadpool(self._handle, route, raw, msgpack)
        else:
            status, content_type, body = self._handle(route, raw, msgpack)
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _handle(
        self, route: tuple[TypeAdapter, Callable[[Any, Any], Any], int], raw: bytes, msgpack: bool
    ) -> tuple[int, bytes, bytes]:
        """``(status, content type, body)`` of the answer to one call."""
        adapter, op, ok = route
        try:
            if msgpack:
                body = adapter.validate_python(msgpack_body.decode(raw, security.current_limits()))
            else:
                body = adapter.validate_json(raw)
            payload = op(self.service, body)
        except msgpack_body.MsgpackBodyError as exc:
            refused = [{"type": "body_refused", "loc": ["body"], "msg": str(exc)}]
            return 422, _JSON, orjson.dumps({"detail": refused})
        except ValidationError as exc:
            errors = [{**error, "loc": ["body", *error["loc"]]} for error in exc.errors(include_url=False)]
            try:
                return 422, _JSON, orjson.dumps({"detail": errors}, default=str)
            except TypeError:  # an echoed input orjson cannot encode (an int beyond 64 bits): was a 500
                return 422, _JSON, json.dumps({"detail": errors}, default=str).encode()
        except HTTPException as exc:
            return exc.status_code, _JSON, orjson.dumps({"detail": exc.detail})
        except UnsafeMessagesError as exc:
            return 422, _JSON, orjson.dumps({"detail": str(exc)})
        except NotImplementedError as exc:
            return 409, _JSON, orjson.dumps({"detail": str(exc) or "not supported by this backend"})
        except psycopg.DataError as exc:
            return 422, _JSON, orjson.dumps({"detail": refused_value(exc)})
        except Exception:
            logger.exception("request failed")
            return 500, _JSON, orjson.dumps({"detail": "internal server error"})
        if payload is None:
            return ok, _JSON, b""
        if msgpack:
            return ok, _MSGPACK, ormsgpack.packb(payload, default=msgpack_default)
        return ok, _JSON, orjson.dumps(payload, default=json_default)


_JSON, _MSGPACK = JSON.encode(), MSGPACK.encode()
