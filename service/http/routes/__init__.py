"""The FastAPI routes, one module per resource; every route calls an operation of ``service/operations/saver.py``.

The per-step routes' FastAPI twins (``checkpoints.py``) document them in OpenAPI and share their
operations; the hot path answers those requests first (``service/http/hotpath.py``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from reducing_saver.service.errors import Untransportable
from reducing_saver.service.http import schemas
from reducing_saver.service.state import Service
from reducing_saver.wire import MSGPACK, json_dumps


class ORJSONResponse(JSONResponse):
    """JSON by orjson; :class:`~reducing_saver.wire.Blob` values become ``{"type", "data": base64}``, and
    ints beyond 64 bits (store values PostgreSQL's JSONB reads back) exact numbers (``wire.json_dumps``)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        try:
            return json_dumps(content)
        except (TypeError, ValueError) as exc:  # the operations give every value a wire form: it fails alone
            raise Untransportable(f"the answer holds a value that cannot travel ({exc})") from exc


async def _service(request: Request) -> Service:
    return request.app.state.service


#: The app's :class:`Service`, as a route parameter.
ServiceDep = Annotated[Service, Depends(_service)]

#: The error answers every route documents.
ERRORS: dict[int | str, dict[str, Any]] = {
    413: {"model": schemas.ErrorBody, "description": "Body larger than max_body_bytes."},
    422: {"model": schemas.ErrorBody, "description": "A field is missing, of the wrong type, or refused."},
    503: {
        "model": schemas.ErrorBody,
        "description": "The database is unavailable: unreachable, accepting no writes (a standby, a "
        "failover), or no saver or connection within db_timeout_seconds.",
    },
    504: {
        "model": schemas.ErrorBody,
        "description": "The database cancelled a statement that ran past a limit set on it (statement_timeout, "
        "lock_timeout); the body's code is database_timeout.",
    },
}


def msgpack_too(request: str, answer: str | None = None) -> dict[str, Any]:
    """OpenAPI: the route also takes an ``application/msgpack`` body (and then answers in msgpack)."""
    extra: dict[str, Any] = {
        "requestBody": {"content": {MSGPACK: {"schema": {"$ref": f"#/components/schemas/{request}"}}}}
    }
    if answer is not None:
        schema = {"$ref": f"#/components/schemas/{answer}"}
        extra["responses"] = {"200": {"content": {MSGPACK: {"schema": schema}}}}
    return extra
