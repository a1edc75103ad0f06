"""A call: everything about one request except sending it, and how its answer becomes a result or an error.

``RemoteReducingSaver`` and ``RemoteStore`` build :class:`Call` s; ``_http.Http`` sends them and hands
the answer to :func:`finish`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
import orjson
import ormsgpack

from reducing_saver.client._errors import ReducingSaverError, error_from_response
from reducing_saver.client._transport import Answer
from reducing_saver.wire import MSGPACK, WireError, json_default, json_loads, msgpack_default

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    method: str
    path: str
    body: bytes | None
    idempotent: bool
    #: Turns the decoded answer (``None`` for an empty one) into the result.
    parse: Callable[[Any], T]
    #: The body is msgpack (else JSON).
    msgpack: bool = False
    #: Headers of this call only, added to the client's.
    headers: Mapping[str, str] | None = None


def no_content(body: Any) -> None:
    return None


def as_given(body: Any) -> Any:
    return body


def post(
    path: str,
    body: Mapping[str, Any],
    parse: Callable[[Any], T],
    *,
    idempotent: bool = True,
    msgpack: bool = False,
    headers: Mapping[str, str] | None = None,
) -> Call[T]:
    """A POST whose ``body`` may hold :class:`Blob` values (base64 in JSON, ``bin`` in msgpack)."""
    if msgpack:
        content = ormsgpack.packb(body, default=msgpack_default)
        return Call("POST", path, content, idempotent, parse, msgpack=True, headers=headers)
    return Call("POST", path, orjson.dumps(body, default=json_default), idempotent, parse, headers=headers)


def _loads(answer: Answer) -> Any:
    """The answer's body, decoded by its content type (msgpack only when the call asked for it)."""
    if not answer.content:
        return None
    if answer.headers.get("content-type", "").startswith(MSGPACK):
        return ormsgpack.unpackb(answer.content)
    return json_loads(answer.content)  # ints beyond 64 bits exactly: store values PostgreSQL keeps


def _redirect_error(call: Call[Any], answer: Answer, url: str) -> ReducingSaverError:
    """A redirect is never followed (the body and the credentials would go where it says): an error."""
    status = f"{answer.status} {httpx.codes.get_reason_phrase(answer.status)}".strip()
    return ReducingSaverError(
        f"{call.method} {call.path}: {url} answered {status}, a redirect to "
        f"{answer.headers.get('location', '(no Location)')}; the client does not follow redirects: "
        "give it the URL of the service itself",
        status_code=answer.status,
        request_id=answer.headers.get("x-request-id"),
    )


def finish(call: Call[T], answer: Answer, url: str) -> T:
    """The result of ``call`` from the service's ``answer``.

    Raises:
        ReducingSaverError: A subclass for an error status (``error_from_response``); the root class for
            a redirect or an answer that is not the API's.
    """
    if 300 <= answer.status < 400:
        raise _redirect_error(call, answer, url)
    if not 200 <= answer.status < 300:
        response = httpx.Response(answer.status, headers=list(answer.headers.items()), content=answer.content)
        raise error_from_response(response, method=call.method, path=call.path)
    try:
        body = _loads(answer)
        if body is None and call.parse is not no_content:
            raise WireError("body", "the answer is empty")
    except (orjson.JSONDecodeError, ormsgpack.MsgpackDecodeError, WireError) as exc:
        raise _not_the_api(call, answer, exc) from exc
    try:
        return call.parse(body)
    except KeyError as exc:
        raise _not_the_api(call, answer, exc) from exc
    except WireError as exc:  # the answer has the API's shape; a value in it is not readable here
        raise ReducingSaverError(
            f"{call.method} {call.path}: the answer holds a value this client cannot read ({exc})",
            status_code=answer.status,
            request_id=answer.headers.get("x-request-id"),
        ) from exc


def _not_the_api(call: Call[Any], answer: Answer, exc: Exception) -> ReducingSaverError:
    return ReducingSaverError(
        f"{call.method} {call.path}: the answer does not follow the reducing-saver API "
        f"({type(exc).__name__}: {exc}); is the URL that of a reducing-saver service?",
        status_code=answer.status,
        request_id=answer.headers.get("x-request-id"),
    )
