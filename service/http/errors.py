"""The one table that maps the service's errors (``service/errors.py``), and what the layers below raise,
to statuses.

Operations raise domain errors (:class:`ServiceError` subclasses) or let the storage errors of the layers
they call propagate (each backend turns its driver's errors into ``ValueRefused`` and
``DatabaseUnavailable``, ``storage/<backend>/errors.py``). :func:`error_answer` turns any of them into
``(status, detail)`` for the hot path and the FastAPI handler alike; :func:`send_error` is the one raw-ASGI
JSON error writer. docs/http-api.md ("Which error gives which status") lists the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from starlette.types import Send

from reducing_saver.service.encryption import StoredDataError
from reducing_saver.service.errors import (
    BadRequest,
    Conflict,
    NotFound,
    ServiceError,
    Unauthorized,
    Unavailable,
    Untransportable,
)
from reducing_saver.service.messages_codec import UnsafeMessagesError
from reducing_saver.service.storage import DatabaseTimeout, DatabaseUnavailable, SaversBusy, ValueRefused
from reducing_saver.service.storage.lifecycle import CheckpointPrunedError, ThreadNotEmptyError
from reducing_saver.wire import ERROR_CODES, WireError
from reducing_saver.wire.bodies import ErrorBody

#: The status of each of the service's own errors (``service/errors.py``); any other is a 500.
STATUSES: dict[type[ServiceError], int] = {
    BadRequest: 422,
    Unauthorized: 401,
    NotFound: 404,
    Conflict: 409,
    Untransportable: 500,
    Unavailable: 503,
}

#: Headers a status carries besides the content type.
_HEADERS: dict[int, list[tuple[bytes, bytes]]] = {
    401: [(b"www-authenticate", b'Bearer realm="reducing-saver"')]
}


def error_answer(exc: BaseException) -> tuple[int, Any] | None:
    """``(status, detail)`` for an error, or ``None`` for an unexpected one (a 500, to be logged)."""
    if isinstance(exc, ServiceError):
        status = next((STATUSES[kind] for kind in type(exc).__mro__ if kind in STATUSES), 500)
        return status, exc.detail
    if isinstance(exc, (UnsafeMessagesError, WireError)):
        return 422, str(exc)
    if isinstance(exc, ValueRefused):
        return 422, str(exc)
    if isinstance(exc, ThreadNotEmptyError):
        return 409, str(exc)
    if isinstance(exc, CheckpointPrunedError):
        return 410, str(exc)
    if isinstance(exc, StoredDataError):
        from reducing_saver.service.security.tenancy import TenantScope, current_tenant

        return 500, TenantScope(current_tenant()).text(str(exc))  # the tenant's own thread ids
    if isinstance(exc, NotImplementedError):
        return 409, str(exc) or "not supported by this backend"
    if isinstance(exc, (SaversBusy, DatabaseUnavailable)):
        return 503, str(exc)
    if isinstance(exc, DatabaseTimeout):
        return 504, str(exc)
    return None


#: The error classes :func:`error_answer` may map (FastAPI gets a handler for each; anything else is a 500).
ANSWERED: tuple[type[Exception], ...] = (
    ServiceError,
    UnsafeMessagesError,
    WireError,
    ValueRefused,
    ThreadNotEmptyError,
    CheckpointPrunedError,
    StoredDataError,
    NotImplementedError,
    SaversBusy,
    DatabaseUnavailable,
    DatabaseTimeout,
)


def headers_for(status: int) -> list[tuple[bytes, bytes]]:
    """Extra headers of an error answer with ``status``."""
    return _HEADERS.get(status, [])


def error_body(detail: Any, status: int | None = None) -> bytes:
    """``{"detail": ...}`` as JSON (FastAPI's error shape), with the ``code`` of ``status`` where it has one
    (``wire.ERROR_CODES``); values orjson cannot write become text."""
    body = ErrorBody(detail=detail)
    if status in ERROR_CODES:
        body["code"] = ERROR_CODES[status]
    try:
        return orjson.dumps(body)
    except TypeError:  # an echoed input orjson cannot encode (an int beyond 64 bits, say)
        import json

        return json.dumps(body, default=str).encode()


async def send_error(
    send: Send, status: int, detail: Any, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """Answer a raw ASGI request with a JSON error (the middlewares and the hot path)."""
    body = error_body(detail, status)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers_for(status),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
