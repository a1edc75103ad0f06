"""Small pieces the service's pure-ASGI middleware share."""

from __future__ import annotations

from starlette.types import Receive

#: Content types read as msgpack (the first is the one the client sends).
MSGPACK_TYPES = frozenset({b"application/msgpack", b"application/x-msgpack"})


def is_msgpack(content_type: bytes | None) -> bool:
    """True for a ``Content-Type`` header value naming msgpack (parameters and case ignored)."""
    return content_type is not None and content_type.split(b";", 1)[0].strip().lower() in MSGPACK_TYPES


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or ``None`` when the client disconnected before sending it all."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)
