"""The front of the app: the per-step routes, answered without FastAPI's routing and dependencies.

A LangGraph turn makes one ``get_tuple``, about three ``put`` and two ``put_writes`` calls, one after
another, so every microsecond the service spends on them shows in the agent's turn time. ``HotPath`` is
the innermost of the service's ASGI middleware and answers exactly those three routes: it reads the
body, validates it as the wire body the OpenAPI document describes (``schemas.validated``: straight from
JSON bytes, or from the plain values of an ``application/msgpack`` body, see ``msgpack_body``), runs the
operation of ``service/operations/saver.py`` in a worker thread with a saver (``Service.call``: the event loop never
waits on the database), and encodes the answer in the request's format. Errors go through the one table
of ``service/http/errors.py``. Every other request, and these routes' documentation, goes on to FastAPI.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import orjson
import ormsgpack
from pydantic import TypeAdapter, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from reducing_saver.service import security
from reducing_saver.service.http import msgpack_body, schemas
from reducing_saver.service.http.asgi import is_msgpack, read_body
from reducing_saver.service.http.errors import error_answer, send_error
from reducing_saver.service.operations import saver as ops
from reducing_saver.service.state import Service
from reducing_saver.wire import (
    GET_PATH,
    JSON,
    MSGPACK,
    PARENT_MESSAGES_HEADER,
    PARENT_MESSAGES_KEPT,
    PUT_PATH,
    WRITES_PATH,
    json_default,
    msgpack_default,
)

logger = logging.getLogger("reducing_saver.service")

#: (request body, operation(service, saver, body) -> payload or None, success status)
Route = tuple[Any, Callable[[Any, Any, Any], Any], int]

#: The per-step routes and their operations.
ROUTES: dict[str, Route] = {
    GET_PATH: (schemas.GetCheckpointBody, ops.get_checkpoint, 200),
    PUT_PATH: (schemas.PutCheckpointBody, ops.put_checkpoint, 200),
    WRITES_PATH: (schemas.PutWritesBody, ops.put_writes, 204),
}

_JSON, _MSGPACK = JSON.encode(), MSGPACK.encode()
#: ASGI gives header names in lower case.
_PARENT_MESSAGES, _KEPT = PARENT_MESSAGES_HEADER.lower().encode(), PARENT_MESSAGES_KEPT.encode()
_put_checkpoint_kept = functools.partial(ops.put_checkpoint, parent_messages_kept=True)


class HotPath:
    """Answer the routes of :data:`ROUTES` (by exact path, POST only); pass everything else on."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app = app
        self.routes = {path: (TypeAdapter(model), op, status) for path, (model, op, status) in ROUTES.items()}
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (
            self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        )
        if route is None:
            await self.app(scope, receive, send)
            return
        raw = await read_body(receive)
        if raw is None:
            return
        msgpack = kept = False
        for name, value in scope["headers"]:
            if name == b"content-type":
                msgpack = is_msgpack(value)
            elif name == _PARENT_MESSAGES and value == _KEPT:
                kept = True
        adapter, op, ok = route
        if kept and op is ops.put_checkpoint:
            op = _put_checkpoint_kept
        try:
            if msgpack:
                body = adapter.validate_python(msgpack_body.decode(raw, security.current_limits()))
            else:
                body = adapter.validate_json(raw)
            payload = await self.service.call(op, body)
        except msgpack_body.MsgpackBodyError as exc:
            await send_error(send, 422, [{"type": "body_refused", "loc": ["body"], "msg": str(exc)}])
            return
        except ValidationError as exc:
            errors = [{**error, "loc": ["body", *error["loc"]]} for error in exc.errors(include_url=False)]
            await send_error(send, 422, errors)
            return
        except Exception as exc:
            answer = error_answer(exc)
            if answer is None:
                logger.exception("request failed")
                answer = (500, "internal server error")
            await send_error(send, *answer)
            return
        try:
            if payload is None:
                content_type, body_bytes = _JSON, b""
            elif msgpack:
                content_type, body_bytes = _MSGPACK, ormsgpack.packb(payload, default=msgpack_default)
            else:
                content_type, body_bytes = _JSON, orjson.dumps(payload, default=json_default)
        except TypeError as exc:  # the operations give every value a wire form; this call fails alone
            logger.exception("answer cannot be encoded")
            await send_error(send, 500, f"the answer holds a value that cannot travel ({exc})")
            return
        headers = [(b"content-type", content_type), (b"content-length", str(len(body_bytes)).encode())]
        await send({"type": "http.response.start", "status": ok, "headers": headers})
        await send({"type": "http.response.body", "body": body_bytes})
