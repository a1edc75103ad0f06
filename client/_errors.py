"""Exceptions raised by ``RemoteReducingSaver``.

Every error the client raises on purpose derives from one root::

    ReducingSaverError            any failure talking to the service
    ├── BadRequestError           400, 422: the service refused the request's content (or, with no
    │                             status, the client refused to send it: a store value JSON cannot carry)
    ├── AuthenticationError       401, 403: missing, wrong or insufficient API key
    ├── NotFoundError             404
    │   └── CheckpointPrunedError 410: the checkpoint named was deleted by keeping each thread's last
    │                             checkpoints (--keep-checkpoints): time travel to it, or a put on it
    ├── ConflictError             409
    ├── PayloadTooLargeError      413, or the service closed the connection while a large body was sent
    ├── ServerUnavailableError    5xx, or the service could not be reached
    │   └── ConnectionSetupError  the URL cannot reach it, whatever it does: unknown host, https://
    │                             against plain HTTP, a certificate that does not verify (never retried)
    ├── DatabaseTimeoutError      504 with code database_timeout: the service's database cancelled a
    │                             statement past its statement_timeout or lock_timeout (never retried)
    └── RequestTimeoutError       no answer within the configured timeout

Other statuses (405, 429, ...) raise ``ReducingSaverError`` itself; a redirect (3xx) is never followed
and raises it too, naming the ``Location``. An error of a request that got no answer keeps the
transport's error (``client._transport``: ``ConnectError``, ``ReadTimeout``...) as ``__cause__``, and
that one the HTTP library's (http.client's, aiohttp's or httpx's). ``status_code`` is ``None`` when the service never answered;
``request_id`` is the response's ``X-Request-ID`` header, when it had one.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from reducing_saver.wire import DATABASE_TIMEOUT

#: Longest slice of a non-JSON error body quoted in a message.
_MAX_BODY_QUOTE = 300


class ReducingSaverError(Exception):
    """Root of every error raised by ``RemoteReducingSaver``.

    Args:
        message: What went wrong, for a human.
        status_code: The HTTP status the service answered with, or ``None`` when it did not answer.
        request_id: The service's ``X-Request-ID`` for the failed request, when it sent one.
    """

    def __init__(
        self, message: str, *, status_code: int | None = None, request_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.request_id = request_id


class BadRequestError(ReducingSaverError):
    """The service refused the request's content (400 or 422); the message carries its reasons.

    ``status_code`` is ``None`` when the client refused it before sending (``RemoteStore``: NaN, an
    infinity, or an int too long to write, in a value).
    """


class AuthenticationError(ReducingSaverError):
    """The service refused the credentials (401) or the access (403)."""


class NotFoundError(ReducingSaverError):
    """The service has no such resource or route (404)."""


class CheckpointPrunedError(NotFoundError):
    """The checkpoint a call named was deleted by the service's keep-checkpoints policy (410).

    Raised by ``get_tuple`` and ``list`` of that checkpoint (LangGraph's ``get_state``,
    ``get_state_history``, ``invoke`` and ``update_state`` from it), and by a ``put`` naming it as parent:
    a stock saver would answer "no such checkpoint" and LangGraph would start from an empty state.
    """


class ConflictError(ReducingSaverError):
    """The request conflicts with the stored state (409)."""


class PayloadTooLargeError(ReducingSaverError):
    """The request body exceeds the service's size limit (413, or a connection closed mid-upload)."""


class ServerUnavailableError(ReducingSaverError):
    """The service failed (5xx) or could not be reached."""


class ConnectionSetupError(ServerUnavailableError):
    """No connection can be made to the URL, whatever the service does (an unknown host, ``https://``
    against a plain-HTTP service, a TLS certificate that does not verify); never retried."""


class RequestTimeoutError(ReducingSaverError):
    """The service did not answer within the timeout."""


class DatabaseTimeoutError(ReducingSaverError):
    """The service's database cancelled a statement of the call: it ran past a limit set on the database
    (``statement_timeout``, or ``lock_timeout`` waiting for a lock). Not an outage: the same call is likely
    to take as long again, so the client does not retry it; ask for less (a smaller ``limit``), or have the
    limit raised for the service's role. A 504 without the service's ``code`` (from a proxy in front of it)
    stays a retried ``ServerUnavailableError``."""


_BY_STATUS: dict[int, type[ReducingSaverError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: AuthenticationError,
    404: NotFoundError,
    410: CheckpointPrunedError,
    409: ConflictError,
    413: PayloadTooLargeError,
    422: BadRequestError,
}


def error_code(content: bytes) -> str | None:
    """The ``code`` of a JSON error body (``wire.bodies.ErrorBody``), or ``None``."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    code = body.get("code") if isinstance(body, dict) else None
    return code if isinstance(code, str) else None


def is_database_timeout(status_code: int, content: bytes) -> bool:
    """Whether an answer is the service's own 504 for a statement its database cancelled."""
    return status_code == 504 and error_code(content) == DATABASE_TIMEOUT


def error_class(status_code: int) -> type[ReducingSaverError]:
    """The exception class for an HTTP error status."""
    if status_code in _BY_STATUS:
        return _BY_STATUS[status_code]
    if status_code >= 500:
        return ServerUnavailableError
    return ReducingSaverError


def render_detail(detail: Any) -> str:
    """FastAPI's ``detail`` as one line: a string as it is, pydantic errors as ``loc: msg`` items."""
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list) and all(isinstance(item, dict) for item in detail):
        items = []
        for item in detail:
            loc = ".".join(str(part) for part in item.get("loc") or ())
            msg = str(item.get("msg", item))
            items.append(f"{loc}: {msg}" if loc else msg)
        return "; ".join(items)
    return orjson.dumps(detail).decode()


def _describe_body(response: httpx.Response) -> str:
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        text = response.text.strip()
        if len(text) > _MAX_BODY_QUOTE:
            text = text[:_MAX_BODY_QUOTE] + "..."
        return text or response.reason_phrase
    if isinstance(body, dict) and "detail" in body:
        return render_detail(body["detail"])
    return render_detail(body)


def error_from_response(response: httpx.Response, *, method: str, path: str) -> ReducingSaverError:
    """The exception for a non-2xx response (shared by the sync and async paths)."""
    status = response.status_code
    request_id = response.headers.get("x-request-id")
    message = f"{method} {path} failed with {status} {response.reason_phrase}: {_describe_body(response)}"
    if request_id:
        message += f" (request id {request_id})"
    cls = DatabaseTimeoutError if is_database_timeout(status, response.content) else error_class(status)
    return cls(message, status_code=status, request_id=request_id)


__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "CheckpointPrunedError",
    "ConflictError",
    "ConnectionSetupError",
    "DatabaseTimeoutError",
    "NotFoundError",
    "PayloadTooLargeError",
    "ReducingSaverError",
    "RequestTimeoutError",
    "ServerUnavailableError",
    "error_class",
    "error_code",
    "error_from_response",
    "is_database_timeout",
    "render_detail",
]
