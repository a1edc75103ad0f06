"""Small pieces the service's pure-ASGI middleware share."""

from __future__ import annotations

from starlette.types import Receive


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
