"""``BodyGuard``: JSON bodies that are not UTF-8, nest too deep or repeat a key get 422 before anything
parses them for real; msgpack bodies go to the per-step routes only."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reducing_saver.service.http.asgi import is_msgpack, read_body
from reducing_saver.service.http.errors import send_error
from reducing_saver.service.security.bodies import json_body_problem
from reducing_saver.service.security.limits import Limits


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
                    await send_error(send, 400, "Content-Length is not a number")
                    return
                if declared > self.limit:
                    await send_error(send, 413, self._too_large())
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
            await send_error(send, 413, self._too_large())

    def _too_large(self) -> str:
        return f"request body is larger than the limit of {self.limit} bytes (setting max_body_bytes)"


class _BodyTooLarge(Exception):
    pass


class BodyGuard:
    """Refuse JSON bodies that are not UTF-8, nest too deep, or repeat a key, with 422, before parsing.

    Runs inside the body size limit. It parses with orjson (fast, refuses invalid UTF-8), walks the
    containers of the result once for depth, the number of object keys and huge numbers, and counts
    ``":`` in the raw bytes: in compact JSON every key has one, so equal counts prove there is no
    duplicate; only when they differ does an exact check run (``security/bodies.py``). The body is then
    replayed unchanged.

    Ints beyond 64 bits are refused, except on the paths in ``big_int_paths`` (the store's puts, whose values
    PostgreSQL keeps exactly).

    An ``application/msgpack`` body passes untouched to the paths in ``msgpack_paths`` (whose handler
    checks it as it decodes: ``service/http/msgpack_body.py``); any other path answers it 415.
    """

    def __init__(
        self,
        app: ASGIApp,
        limits: Limits,
        msgpack_paths: frozenset[str] = frozenset(),
        big_int_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.limits = limits
        self.msgpack_paths = msgpack_paths
        self.big_int_paths = big_int_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH", "DELETE"):
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-type":
                if is_msgpack(value):
                    if scope["path"] in self.msgpack_paths:
                        await self.app(scope, receive, send)
                    else:
                        await send_error(send, 415, self._msgpack_elsewhere())
                    return
                break
        body = await read_body(receive)
        if body is None:
            return
        problem = self.problem(body, big_ints=scope["path"] in self.big_int_paths) if body else None
        if problem is not None:
            await send_error(send, 422, [{"type": "body_refused", "loc": ["body"], "msg": problem}])
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def problem(self, body: bytes, *, big_ints: bool = False) -> str | None:
        """Why ``body`` is refused, or ``None`` (``big_ints``: the route takes ints beyond 64 bits)."""
        return json_body_problem(body, self.limits.max_nesting_depth, big_ints=big_ints)

    def _msgpack_elsewhere(self) -> str:
        paths = ", ".join(sorted(self.msgpack_paths)) or "no path"
        return f"application/msgpack bodies are accepted on {paths}; send this request as application/json"
